"""The bucketed backend (gem-core's default on CPU) computes the reference function."""

import torch

from gem_core.attention.bucketed import BucketedAttention
from gem_core.testing import AttentionConformance


class TestBucketedConformance(AttentionConformance):
    registered_as = "bucketed"
    dtypes = (torch.float32, torch.bfloat16)
    max_examples = 25

    def make_backend(self):
        return BucketedAttention()


class TestBucketedFineBucketsConformance(AttentionConformance):
    """A growth close to 1 makes nearly one bucket per length: many small batched calls."""

    registered_as = "bucketed"

    dtypes = (torch.float32,)
    max_examples = 10

    def make_backend(self):
        return BucketedAttention(growth=1.01)
