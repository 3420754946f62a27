"""Repository-wide pytest set-up, loaded before any test module of any package."""

import os

import torch

# Triton kernels run in Triton's interpreter where there is no GPU; this must be decided before
# any module decorated with @triton.jit is imported (Triton reads it at import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Property tests draw the same examples on every run (CI included): a run can no longer fail on
# an example no earlier run drew (hypothesis found `lpt_balancer([0.0, 0.0], 2)` that way on a
# fresh-clone CI run; the case now has a test of its own). Exploration with fresh examples:
# `pytest --hypothesis-profile=explore`.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile("ci")
