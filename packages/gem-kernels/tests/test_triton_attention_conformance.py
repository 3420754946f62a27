"""The Triton backend's real kernels, run by the interpreter on CPU, pass the conformance suite."""

import torch

from gem_core.testing import AttentionConformance
from gem_kernels.attention.triton_backend import TritonAttention

# The interpreter runs every program in numpy: blocks of 32 keep it near one second per case while
# drawn lengths (up to 2 blocks + 1) still cross block boundaries.
BLOCK = 32


class TestTritonConformance(AttentionConformance):
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    block_size = BLOCK
    max_tokens = 140
    max_batch = 3
    max_examples = 20

    def make_backend(self):
        return TritonAttention(block_m=BLOCK, block_n=BLOCK)


class TestTritonConformanceUnevenBlocks(AttentionConformance):
    """Query and key tiles of different sizes exercise the range arithmetic independently."""

    dtypes = (torch.float32,)
    block_size = 16
    max_tokens = 80
    max_batch = 2
    max_examples = 5

    def make_backend(self):
        return TritonAttention(block_m=16, block_n=32)
