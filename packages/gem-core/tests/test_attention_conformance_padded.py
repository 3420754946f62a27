"""The padded backend (gem export-model's exportable fallback) computes the reference function."""

import torch

from gem_core.attention.padded import PaddedAttention
from gem_core.testing import AttentionConformance


class TestPaddedConformance(AttentionConformance):
    registered_as = "padded"
    dtypes = (torch.float32,)
    max_examples = 15

    def make_backend(self):
        return PaddedAttention()
