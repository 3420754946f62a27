"""Repository-wide pytest set-up, loaded before any test module of any package."""

import os

import torch

# Triton kernels run in Triton's interpreter where there is no GPU; this must be decided before
# any module decorated with @triton.jit is imported (Triton reads it at import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
