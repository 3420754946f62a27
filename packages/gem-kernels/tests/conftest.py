# Must run before anything imports triton: triton decides at @triton.jit time whether a kernel is
# compiled or interpreted, and CI has no GPU, so the real kernels run in the interpreter here.
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
