"""Multi-task heads: one logit per task, optionally combined entire-space (ESMM) for conversion.

Which and why: with ``multitask = "esmm"`` the conversion head models p(conversion | click) and
the model returns the logit of p(conversion) = p(click) * p(conversion | click). Conversions are
only observed after clicks, so a CVR model trained on clicked impressions alone is trained on a
different population than the one it serves (sample selection bias) and sees very few positives;
ESMM (Ma et al., SIGIR 2018) trains both factors on every impression through the product, which
the trainer's per-task BCE on impression labels does unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CLICK, CONVERSION = "click", "conversion"


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate at both ends (Maechler, 2012)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)),
                       torch.log1p(-torch.exp(x)))


def product_logit(logit_a: Tensor, logit_b: Tensor) -> Tensor:
    """The logit of ``sigmoid(a) * sigmoid(b)``, computed in log space.

    ``log p = logsigmoid(a) + logsigmoid(b)`` never underflows; ``logit = log p - log(1 - p)``.
    ``log p`` is kept a hair below 0 so that ``log(1 - p)`` stays finite when both factors
    saturate (the logit then caps near 16 in float32; a BCE target of 1 still has a gradient).
    """
    log_p = F.logsigmoid(logit_a) + F.logsigmoid(logit_b)
    log_p = log_p.clamp(max=-1e-7)
    return log_p - log1mexp(log_p)


def esmm_logits(logits: dict[str, Tensor], parent: str = CLICK,
                child: str = CONVERSION) -> dict[str, Tensor]:
    """Replace the child's logit (read as p(child | parent), e.g. p(conversion | click)) by that
    of p(parent) * p(child | parent); the parent's logit is unchanged."""
    out = dict(logits)
    out[child] = product_logit(logits[parent], logits[child])
    return out
