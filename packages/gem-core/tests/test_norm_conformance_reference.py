"""gem-core's reference gated norm passes the suite (in float32 and bfloat16 against float64)."""

import torch

from gem_core.norm import ReferenceNorm
from gem_core.testing import NormConformance


class TestReferenceNorm(NormConformance):
    dtypes = (torch.float32, torch.bfloat16)

    def make_backend(self):
        return ReferenceNorm()
