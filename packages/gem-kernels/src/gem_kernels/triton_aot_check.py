"""Compile every Triton kernel of gem-kernels for an NVIDIA GPU without one (``python -m``).

CI has no GPU and runs the kernels in the interpreter, which accepts code the real compiler
rejects (and the other way round). Triton can lower a kernel all the way to a cubin on a CPU-only
machine with its bundled ptxas, so this catches GPU-only compile errors (types, shared memory)
before GPU time is spent. Must run without TRITON_INTERPRET (the kernels must be JITFunctions).
"""

from __future__ import annotations

import argparse
import os
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gem_kernels.attention import triton_kernels as kernels
from gem_kernels.norms import triton_kernels as norm_kernels

KERNELS = (
    kernels.jagged_attention_fwd_kernel,
    kernels.jagged_attention_bwd_dkdv_kernel,
    kernels.jagged_attention_bwd_dq_kernel,
)
_INT64_POINTERS = ("QOff", "KOff", "NT")
_FP32_POINTERS = ("LSE", "DELTA", "MEAN", "RSTD", "DW_PART", "DB_PART")


def _signature(fn, dtype: str, constexprs: dict) -> dict[str, str]:
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in _INT64_POINTERS:
            signature[name] = "*i64"
        elif name in _FP32_POINTERS:
            signature[name] = "*fp32"
        elif name[0].isupper():  # tensors are the capitalised arguments
            signature[name] = f"*{dtype}"
        elif name in ("scale", "eps"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    return signature


def compile_all(capability: int, variants: list[dict], head_dim: int, block: int) -> list[str]:
    """Compile every kernel in every variant; return one line per compiled kernel."""
    lines = []
    for variant in variants:
        dtype = variant.pop("dtype")
        constexprs = dict(variant, DOT_DTYPE=getattr(tl, {"bf16": "bfloat16", "fp16": "float16",
                                                           "fp32": "float32"}[dtype]),
                          PRECISION="ieee", BLOCK_M=block, BLOCK_N=block,
                          BLOCK_D=max(16, triton.next_power_of_2(head_dim)))
        for fn in KERNELS:
            compiled = triton.compile(
                ASTSource(fn, _signature(fn, dtype, constexprs), constexprs=constexprs),
                target=GPUTarget("cuda", capability, 32), options={"num_warps": 4},
            )
            lines.append(f"{fn.__name__} {dtype} {variant}: shared memory "
                         f"{compiled.metadata.shared} bytes")
    return lines


def compile_norms(capability: int, width: int) -> list[str]:
    """Compile the gated-norm kernels (LayerNorm and RMSNorm, with bias) in bf16."""
    lines = []
    for rms in (False, True):
        constexprs = dict(RMS=rms, HAS_BIAS=True, BLOCK_ROWS=16,
                          BLOCK_D=max(16, triton.next_power_of_2(width)))
        for fn in (norm_kernels.gated_norm_fwd_kernel, norm_kernels.gated_norm_bwd_kernel):
            compiled = triton.compile(
                ASTSource(fn, _signature(fn, "bf16", constexprs), constexprs=constexprs),
                target=GPUTarget("cuda", capability, 32), options={"num_warps": 4},
            )
            lines.append(f"{fn.__name__} bf16 RMS={rms}: shared memory "
                         f"{compiled.metadata.shared} bytes")
    return lines


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capability", type=int, default=90, help="sm_XX, 90 for H100/H200")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--all", action="store_true", help="every mask/normalisation variant")
    args = parser.parse_args(argv)
    variants = [dict(IS_SELF=True, CAUSAL=True, HAS_WINDOW=True, SILU=False, dtype="bf16")]
    if args.all:
        variants += [dict(IS_SELF=False, CAUSAL=False, HAS_WINDOW=False, SILU=True, dtype="fp16"),
                     dict(IS_SELF=True, CAUSAL=False, HAS_WINDOW=True, SILU=True, dtype="fp32")]
    for line in compile_all(args.capability, variants, args.head_dim, args.block):
        print(line)
    if args.all:
        for line in compile_norms(args.capability, width=1024):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
