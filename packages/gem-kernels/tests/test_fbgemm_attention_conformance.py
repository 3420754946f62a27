"""The fbgemm backend (FBGEMM's compiled jagged operators, CPU build) passes the suite."""

import pytest
import torch

pytest.importorskip("fbgemm_gpu")

from gem_core.attention.api import AttentionParams  # noqa: E402
from gem_core.testing import AttentionConformance  # noqa: E402
from gem_kernels.attention.fbgemm_backend import FbgemmAttention  # noqa: E402


class TestFbgemmConformance(AttentionConformance):
    registered_as = "fbgemm"
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    max_examples = 15

    def make_backend(self):
        return FbgemmAttention()


def test_float64_is_refused_by_name():
    q = torch.randn(3, 1, 16, dtype=torch.float64)
    offsets = torch.tensor([0, 3])
    with pytest.raises(TypeError, match="float64"):
        FbgemmAttention()(q, q, q, offsets, offsets, params=AttentionParams())
