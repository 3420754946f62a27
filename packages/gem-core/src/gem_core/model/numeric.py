"""How the model reads the numbers of a batch (``model.numeric_scale``): the request's dense
features and the candidate's numeric features, before their projections.

Why: logs carry raw numbers (a price in yuan, a count of visits, a duration in seconds) whose
scale no one chose for a network. Projected as they are, one of them can dominate a token and
the gradients: a Taobao-shaped log's price (up to a few thousand) sent ``tiny``'s gradient norm
to 400 in its first steps. ``log`` reads each value as ``sign(x) * log(1 + |x|)``, DLRM's
``log(1 + x)`` for counts extended to negative values: no statistics to fit or carry (an exported
model reads raw numbers as the trainer did), monotone, the sign kept, and close to ``x`` for
the small, already scaled values of the bundled sources.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gem_core.config.model_schema import NUMERIC_SCALES


def signed_log(values: Tensor) -> Tensor:
    """``sign(x) * log(1 + |x|)``, elementwise."""
    return torch.sign(values) * torch.log1p(values.abs())


def scale_numbers(values: Tensor, kind: str) -> Tensor:
    """``values`` read as ``model.numeric_scale = kind`` says (one of :data:`NUMERIC_SCALES`)."""
    if kind == "log":
        return signed_log(values)
    if kind == "none":
        return values
    raise ValueError(f"numeric scale {kind!r}: expected one of {list(NUMERIC_SCALES)}")
