"""Heavy-tailed sequence lengths, the distribution real user histories follow."""

from __future__ import annotations

import math

import numpy as np


def sample_lengths(
    batch_size: int, max_len: int, *, distribution: str = "zipf", zipf_a: float = 1.2,
    lognormal_sigma: float = 1.0, seed: int = 0,
) -> list[int]:
    """``batch_size`` lengths in ``[1, max_len]``.

    ``zipf``: Zipf(``zipf_a``) capped at ``max_len`` (most histories are short, a fat tail hits
    the cap). ``lognormal``: median ``max_len / 8``, log-standard-deviation ``lognormal_sigma``.
    """
    rng = np.random.default_rng(seed)
    if distribution == "zipf":
        raw = rng.zipf(zipf_a, size=batch_size)
    elif distribution == "lognormal":
        raw = rng.lognormal(mean=math.log(max(1.0, max_len / 8)), sigma=lognormal_sigma,
                            size=batch_size)
    else:
        raise ValueError(f"unknown length distribution {distribution!r}; use zipf or lognormal")
    return [int(n) for n in np.clip(np.round(raw), 1, max_len)]
