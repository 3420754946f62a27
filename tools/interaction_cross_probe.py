"""Can an interaction module learn ``cross``'s three-way parity, and after how many steps?

    python tools/interaction_cross_probe.py --interaction dot --steps 3000 [--noise-tokens 10]

The ``cross`` kind of ``synthetic-ads`` (``gem_data.generator``) raises the click logit by
``cross_weight`` where an odd number of three hidden bits are 1: the request context's, the
candidate category's and ``[dense[2] > 0]``. No feature or pair of them carries any of it
(``test_planted.py::test_cross_needs_all_three_features``), so a model's gradient has no
low-order hint, and learning it is a search with a sudden onset, like a sparse parity's.

This probe isolates the interaction: three tokens (a context embedding, a category embedding,
a linear token of ``dense[2]``), optionally ``--noise-tokens`` tokens of random ids (what the
other tokens of a full model look like to the parity: inputs that say nothing about it), then
the trainer's own interaction module (``gem_core.model.interaction.DotInteractionMLP``,
``gem_core.model.wukong.WukongInteraction`` or ``gem_core.model.cross_network``'s DCN-V2 cross
network, at ``tiny``'s, ``tiny-gem``'s and ``model.cross_layers``' default sizes) and a logit.
It trains on the click labels of the generator's training chunks (256 requests a step, AdamW at
0.002, the presets' rate) and prints the eval NE and the mean prediction on odd and even parity
every ``--eval-every`` steps. An NE near 1 with equal odd/even means the parity is
not found yet; the first line gives the NE of knowing the parity alone (each side's own
eval click rate), the floor the probe can approach.

``--layout model`` gives the inputs as the trainer's model does: the category only inside the
candidate token (the sum of its ad, advertiser and category rows) and ``dense[2]`` only inside
the dense features' token(s) (``--dense``: ``linear``, one token of all, ``model.dense_tokens
= "one"``; ``per_feature``, a token each, ``"per_feature"``; ``mlp``, one token from a
two-layer MLP, DLRM's bottom MLP). The other dense features and the candidate's ids then carry
the generator's other click terms, so the NE can fall below the parity's floor without the
parity; the gap between the odd and even mean predictions says whether it was found.
"""

from __future__ import annotations

import argparse

import attrs
import numpy as np
import torch
from torch import Tensor, nn

from gem_core.config import load_config
from gem_core.config.model_schema import TOKEN_NORMS
from gem_core.model.cross_network import CrossNetworkInteraction
from gem_core.model.dense_tokens import PerFeatureDenseTokens
from gem_core.model.interaction import DotInteractionMLP
from gem_core.model.token_norm import token_norm as token_norm_module
from gem_core.model.wukong import WukongInteraction
from gem_core.train.optim import learning_rate
from gem_data.generator import AdsLogGenerator, PlantedChunk, normalized_entropy_of_probabilities
from gem_data.synth_options import SynthOptions

DIM = 32
HIDDEN = (128, 64)
NOISE_IDS = 1000
AD_ROWS = 1 << 17  # the ad ids are 64-bit; hashed into this many rows, as a table would


def impressions(chunk: PlantedChunk) -> tuple[Tensor, Tensor, Tensor, Tensor, np.ndarray]:
    """Per impression: context id, the candidate's (ad, advertiser, category) ids as columns,
    the request's dense features, click, parity."""
    batch = chunk.batch
    owner = torch.repeat_interleave(torch.arange(batch.batch_size),
                                    batch.candidate_offsets.diff())
    candidate = torch.stack([batch.candidate_ids[name]
                             for name in ("ad_id", "advertiser", "category")], dim=1)
    return (batch.sparse["context"].values[owner], candidate, batch.dense[owner],
            batch.labels["click"], chunk.indicators[:, 0] > 0)


class Probe(nn.Module):
    """The interaction over the parity's inputs, laid out as ``--layout`` says (``alone``: one
    token each; ``model``: as the trainer's model gives them, see the module docstring)."""

    def __init__(self, interaction: str, noise_tokens: int, layout: str, dense_layout: str,
                 num_contexts: int, num_categories: int, num_advertisers: int,
                 num_dense: int, loud_tokens: int = 0, loud_scale: float = 1.0,
                 token_norm: str = "none") -> None:
        super().__init__()
        self.noise_tokens = noise_tokens
        self.layout = layout
        self.context = nn.Embedding(num_contexts, DIM)
        self.category = nn.Embedding(num_categories, DIM)
        if layout == "model":  # the candidate token sums its ids' rows; one token of all dense
            self.ad = nn.Embedding(AD_ROWS, DIM)
            self.advertiser = nn.Embedding(num_advertisers, DIM)
        self.dense_layout = dense_layout
        if layout != "model":
            self.dense = nn.Linear(1, DIM)
        elif dense_layout == "linear":
            self.dense = nn.Linear(num_dense, DIM)
        elif dense_layout == "mlp":
            self.dense = nn.Sequential(nn.Linear(num_dense, 2 * DIM), nn.ReLU(),
                                       nn.Linear(2 * DIM, DIM))
        else:  # per_feature: a token of each dense feature
            self.dense = PerFeatureDenseTokens(num_dense, DIM)
        self.noise = nn.Embedding(NOISE_IDS, DIM)
        tokens = 2 + (num_dense if layout == "model" and dense_layout == "per_feature" else 1)
        tokens += noise_tokens
        self.loud = torch.ones(tokens, 1)
        self.loud[tokens - noise_tokens:][:loud_tokens] = loud_scale
        self.token_norm = token_norm_module(token_norm, tokens)
        if interaction == "dot":
            self.interaction = DotInteractionMLP(tokens, DIM, HIDDEN, 0.0)
        elif interaction == "wukong":
            self.interaction = WukongInteraction(tokens, DIM, layers=2, rank=8, fmb_tokens=8,
                                                 lcb_tokens=8, mlp_dim=256, hidden=HIDDEN,
                                                 dropout=0.0)
        else:
            self.interaction = CrossNetworkInteraction(tokens, DIM, layers=3, rank=0,
                                                       hidden=HIDDEN, dropout=0.0)
        self.head = nn.Linear(HIDDEN[-1], 1)

    def forward(self, context: Tensor, candidate: Tensor, dense: Tensor,
                generator: torch.Generator) -> Tensor:
        if self.layout == "model":
            item = (self.ad(candidate[:, 0] % AD_ROWS) + self.advertiser(candidate[:, 1])
                    + self.category(candidate[:, 2]))
            request = self.dense(dense)
            request = request if self.dense_layout == "per_feature" else request.unsqueeze(1)
        else:
            item, request = self.category(candidate[:, 2]), self.dense(dense[:, 2:3]).unsqueeze(1)
        tokens = torch.cat([torch.stack([self.context(context), item], dim=1), request], dim=1)
        if self.noise_tokens:
            ids = torch.randint(0, NOISE_IDS, (context.numel(), self.noise_tokens),
                                generator=generator)
            tokens = torch.cat([tokens, self.noise(ids)], dim=1)
        tokens = tokens * self.loud
        if self.token_norm is not None:
            tokens = self.token_norm(tokens)
        return self.head(self.interaction(tokens)).squeeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interaction", choices=("dot", "wukong", "cross"), required=True)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--noise-tokens", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0, help="data seed and model seed")
    parser.add_argument("--layout", choices=("alone", "model"), default="alone",
                        help="alone: a token of the category, one of dense[2]; model: the "
                             "candidate token sums its ad, advertiser and category rows, and "
                             "one linear token carries every dense feature")
    parser.add_argument("--dense", choices=("linear", "mlp", "per_feature"), default="linear",
                        help="with --layout model: the dense features as one linear token, "
                             "one token of a two-layer MLP, or a linear token each")
    parser.add_argument("--trainer-rates", action="store_true",
                        help="tiny's rates instead of its lr held constant: embedding rows at "
                             "train.embedding_lr_scale, the trainer's warm-up and cosine decay "
                             "over --steps")
    parser.add_argument("--loud-tokens", type=int, default=0,
                        help="this many of the noise tokens scaled by --loud-scale (inside "
                             "tiny the attribute-attention token's RMS is 5-6, the others' "
                             "0.06-1.3)")
    parser.add_argument("--loud-scale", type=float, default=6.0)
    parser.add_argument("--token-norm", choices=TOKEN_NORMS, default="none",
                        help="model.token_norm: each token scaled on its own")
    parser.add_argument("--clip", type=float, default=0.0,
                        help="clip the gradient norm to this (the presets' 1.0); 0: no clip")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    options = SynthOptions(num_items=2000, num_users=5000, max_length=64, planted="cross")
    data = AdsLogGenerator(options, seed=args.seed)
    world = data.planted_world
    evals = [impressions(data.chunk_with_indicators(4096, split="eval", index=i))
             for i in range(2)]
    context, candidate, dense, click = (torch.cat([e[j] for e in evals]) for j in range(4))
    odd = np.concatenate([e[4] for e in evals])
    if args.loud_tokens > args.noise_tokens:
        parser.error("--loud-tokens scales noise tokens: at most --noise-tokens")
    model = Probe(args.interaction, args.noise_tokens, args.layout, args.dense,
                  world.context_bit.size,
                  world.category_bit.size, options.num_advertisers, options.num_dense,
                  args.loud_tokens, args.loud_scale, args.token_norm)
    # --trainer-rates: tiny's own rates (its lr, warm-up and embedding scale) through the
    # trainer's schedule function; otherwise the preset's lr, constant, for every parameter.
    tiny = attrs.evolve(load_config(preset="tiny").train, steps=args.steps)
    tables = [p for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()]
    layers = [p for p in model.parameters() if all(p is not t for t in tables)]
    scale = tiny.embedding_lr_scale if args.trainer_rates else 1.0
    optimizer = torch.optim.AdamW([{"params": layers, "lr": tiny.lr},
                                   {"params": tables, "lr": tiny.lr * scale}])
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: learning_rate(tiny, step) / tiny.lr
        if args.trainer_rates else 1.0)
    noise = torch.Generator().manual_seed(args.seed + 1)
    loss_fn = nn.BCEWithLogitsLoss()
    # What knowing the parity alone gives: each side's own eval click rate (the probe's floor).
    rates = np.where(odd, click.numpy()[odd].mean(), click.numpy()[~odd].mean())
    print(f"interaction {args.interaction}, layout {args.layout}, dense {args.dense}, "
          f"{args.noise_tokens} noise "
          f"tokens ({args.loud_tokens} of them x{args.loud_scale}), token norm "
          f"{args.token_norm}, clip {args.clip or 'none'}, seed {args.seed}; "
          f"the parity alone reaches eval NE "
          f"{normalized_entropy_of_probabilities(rates, click.numpy()):.4f}")
    for step in range(1, args.steps + 1):
        c, k, d, y, _ = impressions(data.chunk_with_indicators(256, split="train", index=step))
        loss = loss_fn(model(c, k, d, noise), y)
        optimizer.zero_grad()
        loss.backward()
        if args.clip:
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        schedule.step()
        if step % args.eval_every == 0:
            model.eval()
            with torch.no_grad():
                p = torch.sigmoid(model(context, candidate, dense, noise)).double().numpy()
            model.train()
            ne = normalized_entropy_of_probabilities(p, click.numpy())
            print(f"step {step}: eval NE {ne:.4f}, mean prediction odd {p[odd].mean():.4f}, "
                  f"even {p[~odd].mean():.4f}", flush=True)


if __name__ == "__main__":
    main()
