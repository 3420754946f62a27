"""A DCN-V2 cross network beside the interaction (``model.cross_branch``, DCN-V2's parallel
form): it reads some of the interaction's tokens through its own per-token scaling, and its
output goes through a head per task whose logit is added to the task's. It starts shut, so the
model starts as the interaction alone, in one of two ways (``opening``): ``gate``, its output
times a learned scalar that starts at zero; ``heads``, its heads start at zero.

Why two: behind a zero gate nothing in the branch but the gate has a gradient at the start (the
heads' and the network's are multiplied by the gate), so the branch opens through a product of
three factors; with zero heads the heads learn from the first step and the network once they
have moved, a product of two.

Why beside, and scaled: the interaction reads the tokens as the model has learnt to size them
(on MovieLens-100k the match tokens are 2-3 in RMS, the user features 0.1); a cross network
over the same tokens finds a product of quiet tokens (``synthetic-ads``' ``cross`` kind) only
once each has one size, and that rescaling costs NE where the loud ones carry the signal. Here
the interaction keeps its view and the crosses get theirs.

Why its own random stream: built from the global one, its initialisation would shift every
parameter built after it, and on one pass of MovieLens-100k that shift alone moved NE by up to
0.003 (a branch held shut; docs/results.md). From a stream of its own, a model with the branch
starts exactly as the model without it (the gate at zero makes the outputs equal too), so
what it adds is measured against the same start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from gem_core.config.model_schema import CROSS_BRANCH_OPENINGS
from gem_core.errors import GemConfigError
from gem_core.flops import linear_layer_flops
from gem_core.model.cross_network import CrossNetworkInteraction
from gem_core.model.token_norm import token_norm

if TYPE_CHECKING:
    from gem_core.config import ModelConfig
    from gem_core.schema import FeatureSchema

_log = logging.getLogger(__name__)

# The branch's random stream: the process's seed plus this.
_SEED_OFFSET = 0x5EED_C805


class CrossBranch(nn.Module):
    """A cross network over ``positions`` of the interaction's tokens, starting shut (``opening``),
    one logit per task."""

    def __init__(self, num_tokens: int, positions: list[int] | None, tasks: list[str], *,
                 norm: str, network: Callable[[int], CrossNetworkInteraction],
                 opening: str) -> None:
        """``positions``: which of the ``num_tokens`` tokens it crosses (None: all);
        ``network``: builds the cross network over that many tokens (the model's one builder
        of ``cross_*``); ``opening``: ``gate`` or ``heads`` (above)."""
        if opening not in CROSS_BRANCH_OPENINGS:
            raise ValueError(f"cross branch opening {opening!r}: expected one of "
                             f"{list(CROSS_BRANCH_OPENINGS)}")
        super().__init__()
        self.register_buffer("positions", None if positions is None else torch.tensor(positions),
                             persistent=False)
        crossed = num_tokens if positions is None else len(positions)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((torch.initial_seed() + _SEED_OFFSET) % 2**63)
            self.norm = token_norm(norm, crossed)
            self.network = network(crossed)
            self.heads = nn.ModuleDict({task: nn.Linear(self.network.out_dim, 1, bias=False)
                                        for task in tasks})
        # Drawn above either way, so the stream (and the network) is the same for both.
        if opening == "heads":
            for head in self.heads.values():
                nn.init.zeros_(head.weight)
        self.gate = nn.Parameter(torch.zeros(1)) if opening == "gate" else None

    def forward(self, tokens: Tensor) -> dict[str, Tensor]:
        """``tokens``: ``(N, num_tokens, dim)``, the interaction's input; per task ``(N,)``
        logits to add to the task's."""
        if self.positions is not None:
            tokens = tokens.index_select(1, self.positions)
        crossed = self.network(tokens if self.norm is None else self.norm(tokens))
        if self.gate is not None:
            crossed = self.gate * crossed
        return {task: head(crossed).squeeze(-1) for task, head in self.heads.items()}

    def flops(self, impressions: int) -> int:
        return self.network.flops(impressions) + linear_layer_flops(self.heads, impressions)


def cross_branch_skipped(config: ModelConfig, schema: FeatureSchema) -> list[int]:
    """Indices (in the schema's order) of the sparse features whose tokens the cross branch
    leaves out: those named by ``cross_branch_skip`` (each must be the data's) and those whose
    table has more than ``cross_branch_max_rows`` rows; logged, since the second depends on the
    data."""
    sparse = [feature.name for feature in schema.sparse_features]
    unknown = sorted(set(config.cross_branch_skip) - set(sparse))
    if unknown:
        raise GemConfigError(f"model.cross_branch_skip names {unknown}, which the data does not "
                             f"declare as sparse features; it declares {sparse}")
    limit = config.cross_branch_max_rows
    rows = {feature.name: schema.table(feature.table).num_embeddings
            for feature in schema.sparse_features}
    large = {name: count for name, count in rows.items() if 0 < limit < count}
    if large:
        _log.info("model.cross_branch_max_rows = %d: the cross branch leaves out %s", limit,
                  ", ".join(f"{name} ({rows} rows)" for name, rows in large.items()))
    return [index for index, name in enumerate(sparse)
            if name in config.cross_branch_skip or name in large]
