"""The fused gated-norm kernels (interpreted on CPU) pass the norm conformance suite, with
gradients, through the registered ``triton`` norm backend."""

import torch

from gem_core.testing import NormConformance
from gem_kernels.norms.backend import TritonNorm


class TestTritonNormConformance(NormConformance):
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    max_rows = 20
    max_width = 70
    max_examples = 12

    def make_backend(self):
        return TritonNorm()
