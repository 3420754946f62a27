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
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch import Tensor, nn

from gem_core.model.cross_network import CrossNetworkInteraction
from gem_core.model.interaction import DotInteractionMLP
from gem_core.model.wukong import WukongInteraction
from gem_data.generator import AdsLogGenerator, PlantedChunk, normalized_entropy_of_probabilities
from gem_data.synth_options import SynthOptions

DIM = 32
HIDDEN = (128, 64)
NOISE_IDS = 1000


def impressions(chunk: PlantedChunk) -> tuple[Tensor, Tensor, Tensor, Tensor, np.ndarray]:
    """Per impression: context id, category id, ``dense[2]`` (a column), click, parity."""
    batch = chunk.batch
    owner = torch.repeat_interleave(torch.arange(batch.batch_size),
                                    batch.candidate_offsets.diff())
    return (batch.sparse["context"].values[owner], batch.candidate_ids["category"],
            batch.dense[owner, 2:3], batch.labels["click"], chunk.indicators[:, 0] > 0)


class Probe(nn.Module):
    def __init__(self, interaction: str, noise_tokens: int, num_contexts: int,
                 num_categories: int) -> None:
        super().__init__()
        self.noise_tokens = noise_tokens
        self.context = nn.Embedding(num_contexts, DIM)
        self.category = nn.Embedding(num_categories, DIM)
        self.dense = nn.Linear(1, DIM)
        self.noise = nn.Embedding(NOISE_IDS, DIM)
        tokens = 3 + noise_tokens
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

    def forward(self, context: Tensor, category: Tensor, dense: Tensor,
                generator: torch.Generator) -> Tensor:
        tokens = torch.stack([self.context(context), self.category(category),
                              self.dense(dense)], dim=1)
        if self.noise_tokens:
            ids = torch.randint(0, NOISE_IDS, (context.numel(), self.noise_tokens),
                                generator=generator)
            tokens = torch.cat([tokens, self.noise(ids)], dim=1)
        return self.head(self.interaction(tokens)).squeeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interaction", choices=("dot", "wukong", "cross"), required=True)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--noise-tokens", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0, help="data seed and model seed")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    options = SynthOptions(num_items=2000, num_users=5000, max_length=64, planted="cross")
    data = AdsLogGenerator(options, seed=args.seed)
    world = data.planted_world
    evals = [impressions(data.chunk_with_indicators(4096, split="eval", index=i))
             for i in range(2)]
    context, category, dense, click = (torch.cat([e[j] for e in evals]) for j in range(4))
    odd = np.concatenate([e[4] for e in evals])
    model = Probe(args.interaction, args.noise_tokens, world.context_bit.size,
                  world.category_bit.size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    noise = torch.Generator().manual_seed(args.seed + 1)
    loss_fn = nn.BCEWithLogitsLoss()
    # What knowing the parity alone gives: each side's own eval click rate (the probe's floor).
    rates = np.where(odd, click.numpy()[odd].mean(), click.numpy()[~odd].mean())
    print(f"interaction {args.interaction}, {args.noise_tokens} noise tokens, seed {args.seed}; "
          f"the parity alone reaches eval NE "
          f"{normalized_entropy_of_probabilities(rates, click.numpy()):.4f}")
    for step in range(1, args.steps + 1):
        c, k, d, y, _ = impressions(data.chunk_with_indicators(256, split="train", index=step))
        loss = loss_fn(model(c, k, d, noise), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % args.eval_every == 0:
            with torch.no_grad():
                p = torch.sigmoid(model(context, category, dense, noise)).double().numpy()
            ne = normalized_entropy_of_probabilities(p, click.numpy())
            print(f"step {step}: eval NE {ne:.4f}, mean prediction odd {p[odd].mean():.4f}, "
                  f"even {p[~odd].mean():.4f}", flush=True)


if __name__ == "__main__":
    main()
