"""The torch-sdpa backend passes the suite for softmax and refuses silu by name."""

import torch

from gem_core.testing import AttentionConformance
from gem_kernels.attention.sdpa_backend import TorchSdpaAttention


class TestTorchSdpaConformance(AttentionConformance):
    registered_as = "torch-sdpa"
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    normalizations = ("softmax",)
    max_examples = 15

    def make_backend(self):
        return TorchSdpaAttention()
