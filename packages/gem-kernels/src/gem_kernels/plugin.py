"""gem-kernels's plugin module, named by its `gem` entry point. Registration only: no heavy imports.

Every ``load`` imports its module when a run (or ``gem bench``) selects it, so ``gem --help`` and
``gem plugins`` never import triton or fbgemm_gpu.
"""

from __future__ import annotations

import importlib.util

from gem_core import hookimpl
from gem_core.capabilities import FUSED_OPTIMIZER, RELATIVE_BIAS, SILU, SOFTMAX, TORCH_COMPILE
from gem_core.registry import AutoContext, ImplementationSpec

# torch_compile: under torch.compile the kernels are one custom op with a fake implementation.


def _load_triton():
    from gem_kernels.attention.triton_backend import TritonAttention

    return TritonAttention()


def _load_fbgemm():
    from gem_kernels.attention.fbgemm_backend import FbgemmAttention

    return FbgemmAttention()


def _load_torch_sdpa():
    from gem_kernels.attention.sdpa_backend import TorchSdpaAttention

    return TorchSdpaAttention()


def _load_blocked():
    from gem_kernels.attention.blocked_backend import BlockedAttention

    return BlockedAttention()


def _load_triton_norm():
    from gem_kernels.norms.backend import TritonNorm

    return TritonNorm()


def _load_fbgemm_tbe():
    from gem_kernels.embedding_tbe import FbgemmTbeEmbeddingBackend

    return FbgemmTbeEmbeddingBackend()


def _load_bench_attention():
    from gem_kernels.bench.cli import bench_attention

    return bench_attention


@hookimpl
def gem_register_attention_backends(register) -> None:
    register(ImplementationSpec(
        name="triton",
        load=_load_triton,
        requires=("triton",),
        # CPU tensors work only under TRITON_INTERPRET=1 (tests); a run on CPU must pick another.
        devices=("cuda",),
        dtypes=("float32", "bfloat16", "float16"),
        supports_backward=True,
        capabilities=(SOFTMAX, SILU, RELATIVE_BIAS, TORCH_COMPILE),
        description="Triton jagged attention kernels (fwd+bwd, block-skipping windows/causality)",
    ))
    register(ImplementationSpec(
        name="fbgemm",
        load=_load_fbgemm,
        requires=("fbgemm_gpu",),
        devices=("cpu", "cuda"),
        dtypes=("float32", "bfloat16", "float16"),
        supports_backward=True,
        capabilities=(SOFTMAX, SILU),
        description="FBGEMM compiled jagged operators (jagged_dense_bmm, jagged_to_padded_dense)",
    ))
    register(ImplementationSpec(
        name="torch-sdpa",
        load=_load_torch_sdpa,
        devices=("cpu", "cuda"),
        dtypes=("float32", "bfloat16", "float16"),
        supports_backward=True,
        capabilities=(SOFTMAX,),
        description="PyTorch fused SDPA per sample, unpadded",
    ))
    register(ImplementationSpec(
        name="blocked",
        load=_load_blocked,
        devices=("cpu", "cuda"),
        dtypes=("float32", "bfloat16", "float16"),
        supports_backward=True,
        # torch_compile: under torch.compile each call is one custom op (blocked_op) with a fake
        # implementation, every option included; its backward recomputes the forward.
        capabilities=(SOFTMAX, SILU, RELATIVE_BIAS, TORCH_COMPILE),
        description="block-sparse tiles over the packed stream, batched GEMMs (fast path on CPU)",
    ))


@hookimpl
def gem_register_norm_backends(register) -> None:
    register(ImplementationSpec(
        name="triton",
        load=_load_triton_norm,
        requires=("triton",),
        devices=("cuda",),  # CPU tensors only under TRITON_INTERPRET=1 (tests)
        dtypes=("float32", "bfloat16", "float16"),
        description="fused gated LayerNorm/RMSNorm (one Triton kernel forward, one backward)",
    ))


@hookimpl
def gem_register_embedding_backends(register) -> None:
    register(ImplementationSpec(
        name="fbgemm-tbe",
        load=_load_fbgemm_tbe,
        requires=("fbgemm_gpu",),
        devices=("cpu", "cuda"),
        dtypes=("float32", "bfloat16", "float16"),  # tables float32; lookups under autocast
        capabilities=(FUSED_OPTIMIZER,),
        description="FBGEMM table-batched embeddings (pooled and sequence) with a fused "
                    "row-wise Adagrad / SGD step in the backward ([model.embedding_optimizer])",
    ))


@hookimpl
def gem_default_norm(context: AutoContext):
    if context.device == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton", "CUDA device and triton is installed"
    return None


@hookimpl
def gem_register_cli_commands(register) -> None:
    register(ImplementationSpec(
        name="bench.attention",
        load=_load_bench_attention,
        description="time jagged attention backends against padded SDPA at Zipf lengths",
    ))


@hookimpl
def gem_default_attention(context: AutoContext):
    if context.device == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton", "CUDA device and triton is installed"
    if context.device == "cpu":
        # tiny's forward+backward (256 samples) took 11.1 s against 20.8 s for gem-core's
        # bucketed backend, interleaved on the same loaded 2-core machine; compiled, it is one
        # custom op per call and beats compiled padded (docs/perf.md).
        return "blocked", "CPU: batched tiles through the fused SDPA kernel, fastest measured"
    return None
