"""gem-core's own implementations, registered like any plugin's. Every ``load`` imports lazily."""

from __future__ import annotations

from gem_core import hookimpl
from gem_core.capabilities import (
    FUSED_OPTIMIZER,
    RELATIVE_BIAS,
    SILU,
    SOFTMAX,
    TABLE_OPTIMIZER,
    TORCH_COMPILE,
    TORCH_EXPORT,
)
from gem_core.contracts import ActivationCheckpointing, EmbeddingSharding
from gem_core.registry import AutoContext, ImplementationSpec, lazy


def _reference_attention():
    from gem_core.attention.reference import ReferenceAttention

    return ReferenceAttention()


def _bucketed_attention():
    from gem_core.attention.bucketed import BucketedAttention

    return BucketedAttention()


def _padded_attention():
    from gem_core.attention.padded import PaddedAttention

    return PaddedAttention()


@hookimpl
def gem_register_attention_backends(register) -> None:
    register(ImplementationSpec(
        name="reference", load=_reference_attention, dtypes=("float32", "bfloat16", "float16",
                                                              "float64"),
        capabilities=(SOFTMAX, SILU, RELATIVE_BIAS),
        description="one sample at a time with dense masks; the oracle for every backend",
    ))
    register(ImplementationSpec(
        name="bucketed", load=_bucketed_attention, dtypes=("float32", "bfloat16", "float16",
                                                            "float64"),
        capabilities=(SOFTMAX, SILU, RELATIVE_BIAS),
        description="pure PyTorch, batched over geometric length buckets (padding <= 1.25x)",
    ))
    register(ImplementationSpec(
        name="padded", load=_padded_attention, dtypes=("float32", "bfloat16", "float16",
                                                        "float64"),
        capabilities=(SOFTMAX, SILU, TORCH_EXPORT, TORCH_COMPILE),
        description="pure PyTorch padded to the batch maximum, no data-dependent control "
                    "flow: exports with torch.export (gem export-model's fallback)",
    ))


def _reference_norm():
    from gem_core.norm import ReferenceNorm

    return ReferenceNorm()


@hookimpl
def gem_register_norm_backends(register) -> None:
    register(ImplementationSpec(
        name="reference", load=_reference_norm,
        dtypes=("float32", "bfloat16", "float16", "float64"),
        description="gated LayerNorm/RMSNorm in PyTorch; the oracle for fused kernels",
    ))


def _reference_embedding():
    from gem_core.embedding import ReferenceEmbeddingBackend

    return ReferenceEmbeddingBackend()


def _reference_fused_embedding():
    from gem_core.embedding_fused import ReferenceFusedEmbeddingBackend

    return ReferenceFusedEmbeddingBackend()


@hookimpl
def gem_register_models(register) -> None:
    register(ImplementationSpec(
        name="gem", load=lazy("gem_core.model", "build_model"),
        description="GEM: sequence tower, PMA, target-aware attention, Wukong or dot "
                    "interaction, multi-task heads",
    ))


@hookimpl
def gem_register_embedding_backends(register) -> None:
    register(ImplementationSpec(
        name="reference", load=_reference_embedding,
        description="torch.nn.Embedding per table; embedding_bag for pooled features",
    ))
    register(ImplementationSpec(
        name="reference-fused", load=_reference_fused_embedding,
        dtypes=("float32", "bfloat16", "float16"),  # tables float32; lookups under autocast
        capabilities=(FUSED_OPTIMIZER,),
        description="reference's lookups with fbgemm-tbe's fused row-wise Adagrad / SGD step "
                    "in the backward, in PyTorch ([model.embedding_optimizer]; no FBGEMM)",
    ))


def _single_process():
    from gem_core.single_process import SingleProcess

    return SingleProcess()


@hookimpl
def gem_register_dense_sharding(register) -> None:
    register(ImplementationSpec(
        name="none", load=_single_process,
        capabilities=(TABLE_OPTIMIZER,),
        description="one process, no wrapping (the reference for every parallel strategy)",
    ))


class _Replicated(EmbeddingSharding):
    """Tables stay ordinary parameters, replicated and synchronised by the dense strategy."""

    def apply(self, model, *, ctx, options):
        return model

    def plan_estimate(self, facts, options):
        """Every rank holds every table with its gradients and optimizer state (AdamW's
        moments, or one float per row under row-wise Adagrad: ``facts.table_optimizer``); the
        gradients are all-reduced as dense ones."""
        from gem_core.plan_estimate import Estimate, table_memory, table_state_bytes
        n, embedding = facts.world_size, facts.embedding_parameters
        tables = {t.name: {"bytes_per_rank": table_state_bytes(facts, t),
                           "comm_bytes_per_rank_per_step":
                               int(2 * (n - 1) / n * t.parameters * 4) if n > 1 else 0}
                  for t in facts.tables}
        return Estimate(memory=table_memory(facts),
                        communication={"embedding": 2 * (n - 1) / n * embedding * 4
                                       if n > 1 else 0},
                        tables=tables)


@hookimpl
def gem_register_embedding_sharding(register) -> None:
    register(ImplementationSpec(
        name="replicated", load=_Replicated,
        description="every rank holds every table; gradients are reduced with the dense ones",
    ))


def _fp32():
    from gem_core.precision import Float32Recipe

    return Float32Recipe()


@hookimpl
def gem_register_precision_recipes(register) -> None:
    register(ImplementationSpec(name="fp32", load=_fp32, activation_dtype="float32",
                                description="float32 everywhere"))


class _NoCheckpointing(ActivationCheckpointing):
    """Every activation is stored for the backward."""

    def apply(self, model, *, ctx, options):
        return model

    def plan_estimate(self, facts, options):
        """The activations gem plan measured (nothing recomputed)."""
        from gem_core.plan_estimate import measured_activations

        return measured_activations(facts)


@hookimpl
def gem_register_activation_checkpointing(register) -> None:
    register(ImplementationSpec(name="none", load=_NoCheckpointing,
                                description="store every activation (no recomputation)"))


def _synthetic():
    from gem_core.data.synthetic import SyntheticSource

    return SyntheticSource


@hookimpl
def gem_register_data_sources(register) -> None:
    register(ImplementationSpec(
        name="synthetic", load=_synthetic,
        options=lazy("gem_core.data.synthetic", "SyntheticOptions"),
        description="small generated ads log with a planted candidate-x-history label model",
    ))


def _contiguous():
    from gem_core.data.api import contiguous_balancer

    return contiguous_balancer


@hookimpl
def gem_register_batch_balancers(register) -> None:
    register(ImplementationSpec(
        name="contiguous", load=_contiguous,
        description="equal-count contiguous slices, ignoring cost (what a naive loader does)",
    ))




@hookimpl
def gem_register_cli_commands(register) -> None:
    register(ImplementationSpec(name="plugins", load=lazy("gem_core.cli.plugins", "plugins"),
                                description="List every registered implementation by kind."))
    register(ImplementationSpec(name="train", load=lazy("gem_core.cli.train", "train"),
                                description="Train a GEM model and write a run directory."))
    register(ImplementationSpec(name="distill", load=lazy("gem_core.cli.distill", "distill"),
                                description="Train a student run from a teacher run "
                                            "(knowledge distillation, Student Adapter)."))
    register(ImplementationSpec(name="config", load=lazy("gem_core.cli.config", "config"),
                                description="Show presets and resolved configurations."))
    register(ImplementationSpec(name="report", load=lazy("gem_core.cli.report", "report"),
                                description="Plots and an HTML page for one run."))
    register(ImplementationSpec(name="runs", load=lazy("gem_core.cli.report", "runs"),
                                description="Compare several runs side by side."))
    register(ImplementationSpec(name="checkpoints",
                                load=lazy("gem_core.cli.checkpoints", "checkpoints"),
                                description="Verify a run's checkpoints against their digests."))
    register(ImplementationSpec(name="scaling", load=lazy("gem_core.cli.scaling", "scaling"),
                                description="NE against training FLOPs over a sweep of sizes"))
    register(ImplementationSpec(name="export-model",
                                load=lazy("gem_core.cli.export_model", "export_model"),
                                description="Export a trained run as torch.export programs "
                                            "for serving."))
    register(ImplementationSpec(name="export",
                                load=lazy("gem_core.cli.export_verify", "export"),
                                description="Verify an export directory against its "
                                            "manifest's digests."))
    register(ImplementationSpec(name="bench.serve",
                                load=lazy("gem_core.cli.bench_serve", "bench_serve"),
                                description="Candidates/s of the exported ranker on the cached "
                                            "user embedding against the full model per "
                                            "candidate."))
    register(ImplementationSpec(name="bench.compile",
                                load=lazy("gem_core.cli.bench_compile", "bench_compile"),
                                description="Training step time eager vs compiled "
                                            "(train.compile), and the compile time."))
    register(ImplementationSpec(name="bench.step",
                                load=lazy("gem_core.cli.bench_step", "bench_step"),
                                description="Training step time of the configured model "
                                            "against a peer configuration, side by side."))
    register(ImplementationSpec(name="bench.flops",
                                load=lazy("gem_core.cli.bench_flops", "bench_flops"),
                                description="Analytic FLOPs of the model next to "
                                            "FlopCounterMode's count."))
    register(ImplementationSpec(name="bench.requests",
                                load=lazy("gem_core.cli.bench_requests", "bench_requests"),
                                description="Impressions/s with K candidates per request "
                                            "against one per request."))


# `auto`: gem-core answers last, with its reference choices.

@hookimpl(trylast=True)
def gem_default_attention(context: AutoContext):
    if context.compile:
        return "padded", ("train.compile: no kernel plugin chose, and padded is gem-core's "
                          "backend that torch.compile traces whole")
    return "bucketed", "gem-core's fastest pure-PyTorch backend (no kernel plugin chose)"


@hookimpl(trylast=True)
def gem_default_norm(context: AutoContext):
    return "reference", "gem-core's gated norm (no plugin chose)"


@hookimpl(trylast=True)
def gem_default_embedding(context: AutoContext):
    return "reference", "gem-core's embedding backend (no plugin chose)"


@hookimpl(trylast=True)
def gem_default_dense_sharding(context: AutoContext):
    return "none", "a single process (no plugin chose)"


@hookimpl(trylast=True)
def gem_default_embedding_sharding(context: AutoContext):
    return "replicated", "tables replicated on every rank (no plugin chose)"


@hookimpl(trylast=True)
def gem_default_precision(context: AutoContext):
    return "fp32", "float32 is exact and runs everywhere (no plugin chose)"


@hookimpl(trylast=True)
def gem_default_activation_checkpointing(context: AutoContext):
    return "none", "no recomputation (no plugin chose)"


@hookimpl(trylast=True)
def gem_default_balancer(context: AutoContext):
    return "contiguous", "equal-count slices (no plugin chose)"
