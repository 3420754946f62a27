"""``gem plan``: memory per rank and communication per step of a layout, before renting GPUs.

Parameters come from the configured model built on the ``meta`` device (no memory), so a
billion-row preset is planned on a laptop. The embedding tables are the ones the data's schema
declares (one per declared table, ``num_embeddings x embedding_dim``, with the event, candidate
and context features that index it): the plan reports each table's size, what a rank holds of
it and the all-to-all bytes of its lookups, from the ids per request that a real batch of the
data sends to it (multi-valued features send every id; context features one pooled vector per
bag).

Activations are measured, not guessed: a copy of the model with the same widths and depth but
small tables runs two real CPU batches of the preset's data (histories cut at two lengths) with
the chosen checkpointing policy, and the bytes autograd keeps are fitted as
``per_token * tokens + per_sample * samples``; the plan scales that fit to each rank's share of
the global batch (samples are requests, each with its candidates). Communication counts the
bytes one rank sends per step with ring collectives (``(n - 1) / n`` of the buffer per
reduce-scatter or all-gather, twice that per all-reduce).
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import torch

from gem_core.capabilities import FUSED_OPTIMIZER
from gem_core.config import GemConfig
from gem_core.contracts import require_strategy_model
from gem_core.distributed import ParallelContext
from gem_core.embedding import ReferenceEmbeddingBackend, check_fused_optimizer
from gem_core.model.building import build_checked, check_token_norm
from gem_core.model.features import FeatureLookup
from gem_core.model.id_bias import id_bias_parameters
from gem_core.model.summary import parameter_counts
from gem_core.norm import ReferenceNorm
from gem_core.plan_estimate import (
    ID_BIAS_STATE_BYTES,
    MEMORY_CATEGORIES,
    Estimate,
    MoeLayerFacts,
    PlanFacts,
    TableFacts,
    moe_all_to_all_bytes,
)
from gem_core.plugins import GemPlugins
from gem_core.registry import AutoContext
from gem_core.schema import EmbeddingTable, FeatureSchema
from gem_core.train.applied import config_as_source_applies
from gem_core.train.table_optimizer import check_id_bias_stepper, resolve_table_optimizer

GIB = 2**30
MEASURE_ROWS = 4096  # table rows of the activation-measuring copy
KINDS = ("dense_sharding", "activation_checkpointing", "embedding_sharding")
"""The strategies of a layout that give estimates, in the order the plan lists them."""

__all__ = ["GIB", "Layout", "data_profile", "measure_activations", "moe_all_to_all_bytes",
           "plan", "plan_facts"]


@attrs.frozen(kw_only=True)
class Layout:
    """How the job would be laid out."""

    gpus: int = attrs.field(validator=attrs.validators.ge(1))
    """Data-parallel ranks (one per GPU)."""

    gpu_memory_gib: float = attrs.field(validator=attrs.validators.gt(0))
    """Memory of one GPU."""

    dense: str = "fsdp2"
    """A registered dense sharding strategy; it gives its own estimate."""

    embedding: str = "torchrec"
    """A registered embedding sharding strategy (``replicated``: every rank holds every table;
    ``torchrec``: rows spread over the ranks, lookups exchanged with all-to-all)."""

    dense_options: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    """``[parallel.dense]`` options of the dense strategy."""

    embedding_options: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    """``[parallel.embedding]`` options of the embedding strategy."""

    hsdp_shard: int | None = None
    """Shortcut for the dense option ``dp_shard`` (``hsdp``: ranks per shard group; default
    all ranks, i.e. plain FSDP)."""

    ep_size: int | None = None
    """Shortcut for the dense option ``ep_size`` (``ep``, ``deepspeed-moe``: ranks per
    expert-parallel group; default all ranks)."""

    expert_fsdp: bool = False
    """Shortcut for the dense option ``expert_fsdp`` (``ep``: experts FSDP-sharded over their
    ``gpus / ep_size`` copies)."""

    activation_checkpointing: str = "none"
    """A registered activation-checkpointing policy (``none``, ``full``, ``selective``): the
    activations are measured with it applied, and it gives the activation estimate."""

    activation_bytes: int = attrs.field(default=4, validator=attrs.validators.in_((2, 4)))
    """Bytes per activation element (2 under a bf16 recipe)."""

    headroom: float = attrs.field(default=0.9, validator=[attrs.validators.gt(0),
                                                          attrs.validators.le(1)])
    """Share of GPU memory the plan may fill (the rest: allocator fragmentation, workspaces)."""


def dense_options(layout: Layout) -> dict[str, Any]:
    """The dense strategy's options: ``dense_options`` with the shortcuts that were given."""
    options = dict(layout.dense_options)
    if layout.hsdp_shard is not None:
        options["dp_shard"] = layout.hsdp_shard
    if layout.ep_size is not None:
        options["ep_size"] = layout.ep_size
    if layout.expert_fsdp:
        options["expert_fsdp"] = True
    return options


class _MoeRows:
    """Rows entering each MoE layer during a forward (forward pre-hooks)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.rows: dict[str, int] = {}
        self._handles = [layer.register_forward_pre_hook(self._hook(name))
                         for name, layer in require_strategy_model(
                             model, "gem plan", "moe_layers").moe_layers()]

    def _hook(self, name: str):
        def record(module: torch.nn.Module, args: tuple) -> None:
            self.rows.setdefault(name, args[0].shape[0])  # the first forward (not a recompute)
        return record

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _measuring_schema(schema: FeatureSchema) -> FeatureSchema:
    """``schema`` with every table cut to at most :data:`MEASURE_ROWS` rows: activations do not
    depend on the tables' sizes. A cut ``dense`` table maps its raw ids ``modulo`` the new size
    (``hash`` and ``modulo`` tables already reduce any id to their rows). A ``managed`` table is
    measured as ``hash``: the reference backend it is measured on has no remapper, and which row
    an id gets changes no activation."""
    tables = []
    for table in schema.tables:
        if table.id_policy == "managed":
            table = EmbeddingTable(name=table.name, num_embeddings=table.num_embeddings,
                                   id_policy="hash")
        if table.num_embeddings > MEASURE_ROWS:
            policy = "modulo" if table.id_policy == "dense" else table.id_policy
            table = attrs.evolve(table, num_embeddings=MEASURE_ROWS, id_policy=policy)
        tables.append(table)
    return attrs.evolve(schema, tables=tuple(tables))


def configured_model(config: GemConfig, schema: FeatureSchema, plugins: GemPlugins
                     ) -> torch.nn.Module:
    """The config's model (``backends.model``) on the reference backends (on the device in
    effect: ``meta`` for sizes); ``config`` as the data source applies it
    (:func:`gem_core.train.applied.config_as_source_applies`)."""
    return build_checked(plugins.resolve("model", config.backends.model, None), config.model,
                         schema, attention=plugins.resolve("attention", "reference", None).impl,
                         embedding_backend=ReferenceEmbeddingBackend(), norm=ReferenceNorm())


def measure_activations(config: GemConfig, plugins: GemPlugins, policy: str,
                        lengths: tuple[int, int] = (32, 64), samples: int = 8
                        ) -> dict[str, float]:
    """Fit saved-activation bytes to ``per_token * tokens + per_sample * samples`` (samples are
    requests, with the data's candidates each) from two real batches of the configured data,
    histories cut at each of ``lengths``. ``config`` as given (each length's source applies it
    for the model it measures)."""
    from gem_parallel.bench_memory import saved_activation_bytes

    ctx = ParallelContext()
    points = []
    for length in lengths:
        # The measuring length is chosen here, so a data set's own max_seq_len must not replace
        # it (it would, where data_set_wins names the key: both batches would be alike and the
        # fit would put every byte on the tokens); a data set shorter than it still cuts it.
        data = attrs.evolve(config.data, max_seq_len=length, data_set_wins=tuple(
            key for key in config.data.data_set_wins if key != "max_seq_len"))
        source = plugins.data_source(data, seed=0)
        measured = config_as_source_applies(attrs.evolve(config, data=data), source)
        schema = _measuring_schema(source.schema)
        batch = next(iter(source.eval_batches(batch_size=samples)))
        torch.manual_seed(0)
        model = configured_model(measured, schema, plugins)
        resolved = plugins.resolve("activation_checkpointing", policy, None)
        model = resolved.impl.apply(model, ctx=ctx, options=resolved.options)
        counter = _MoeRows(model)
        points.append((batch.num_events, batch.batch_size,
                       saved_activation_bytes(model, batch, schema.tasks), counter.rows))
        counter.close()
    (t1, n1, m1, rows1), (t2, n2, m2, rows2) = points
    per_token, per_sample = _linear_fit((t1, n1, m1), (t2, n2, m2))
    # The same fit for the rows of each MoE layer: a sequence layer's grow with the tokens, a
    # Wukong layer's with the samples.
    moe_rows = {}
    for name in rows1:
        a, b = _linear_fit((t1, n1, rows1[name]), (t2, n2, rows2[name]))
        moe_rows[name] = {"per_token": a, "per_sample": b}
    return {"per_token": per_token, "per_sample": per_sample, "tokens": [t1, t2],
            "measured_bytes": [m1, m2], "moe_rows": moe_rows}


def _linear_fit(first: tuple[float, float, float], second: tuple[float, float, float]
                ) -> tuple[float, float]:
    """``(per_token, per_sample)`` through two ``(tokens, samples, value)`` points of the same
    number of samples."""
    (t1, n1, m1), (t2, _, m2) = first, second
    per_token = (m2 - m1) / (t2 - t1) if t2 != t1 else m2 / max(t2, 1)
    return per_token, max(m1 - per_token * t1, 0.0) / n1


def data_profile(config: GemConfig, plugins: GemPlugins, samples: int = 512) -> dict[str, Any]:
    """Per request of a batch of the configured data: mean history length, mean candidates, and
    the ids each feature key sends to its table (what the embedding lookups exchange)."""
    source = plugins.data_source(config.data, seed=0)
    batch = next(iter(source.eval_batches(batch_size=samples)))
    requests = max(batch.batch_size, 1)
    inputs = FeatureLookup(source.schema).inputs(batch)
    return {"mean_history_length": batch.num_events / requests,
            "mean_candidates": batch.num_candidates / requests,
            "ids_per_request": {key: jagged.values.numel() / requests
                                for key, jagged in inputs.items()}}


def table_training(config: GemConfig, layout: Layout, plugins: GemPlugins) -> dict[str, Any]:
    """How the layout trains tables that stay parameters (``PlanFacts.table_optimizer`` and
    ``table_gradients``): as the trainer decides it at start-up for these backends
    (:func:`gem_core.train.table_optimizer.resolve_table_optimizer`, which also refuses
    ``dense_tables = "same"`` where the layout cannot step rows), with a fused embedding backend
    stepping its rows in the backward. A fused backend is refused where the trainer refuses it
    (:func:`gem_core.embedding.check_fused_optimizer`: more than one GPU, or an embedding
    sharding that would replace its tables)."""
    options = config.model.embedding_optimizer
    name = config.backends.embedding
    if name == "auto":
        name, _ = plugins.default_for("embedding", AutoContext(device="cuda",
                                                               world_size=layout.gpus))
    embedding = plugins.registry("embedding").get(name)
    embedding_sharding = plugins.registry("embedding_sharding").get(layout.embedding)
    # The trainer's start-up check: a fused backend runs on one rank only, with its own tables.
    check_fused_optimizer(config.model, embedding=embedding,
                          embedding_sharding=embedding_sharding, world_size=layout.gpus)
    if FUSED_OPTIMIZER in embedding.capabilities:
        return {"table_optimizer": options.name, "table_gradients": False}
    resolved = resolve_table_optimizer(
        options, embedding=embedding, embedding_sharding=embedding_sharding,
        dense_sharding=plugins.registry("dense_sharding").get(layout.dense), plugins=plugins)
    return {"table_optimizer": "adamw" if resolved.dense_tables == "adamw" else resolved.name,
            "table_gradients": True}


def plan_facts(config: GemConfig, layout: Layout, plugins: GemPlugins) -> dict[str, Any]:
    """What the estimates start from: the model on ``meta`` (parameters, MoE layers, tables),
    a batch of the data (history length, candidates, ids per table) and the activations
    measured with the layout's checkpointing policy. ``facts`` is what strategies see."""
    n = layout.gpus
    check_token_norm(config.model, world_size=n)  # what gem train refuses at start-up
    check_id_bias_stepper(config.model,
                          dense_sharding=plugins.registry("dense_sharding").get(layout.dense),
                          plugins=plugins)
    source = plugins.data_source(config.data, seed=0)
    with torch.device("meta"):  # shapes only: a billion-row table costs nothing
        model = configured_model(config_as_source_applies(config, source), source.schema,
                                 plugins)
    # model.id_bias's offsets are dense parameters with a step (and state) of their own.
    counts = {**parameter_counts(model),
              "id_bias": sum(p.numel() for p in id_bias_parameters(model))}
    # The config as given: the measurement sets its own history lengths on [data] and applies
    # the result with each length's source.
    fit = measure_activations(config, plugins, layout.activation_checkpointing)
    samples = config.train.batch_size / n  # requests
    profile = data_profile(config, plugins)
    tokens = samples * profile["mean_history_length"]
    ids = profile["ids_per_request"]
    tables = tuple(TableFacts(
        name=t.name, num_embeddings=t.num_embeddings, dim=t.dim, pooled=t.pooling != "none",
        # Vectors crossing ranks per request: one per id of a sequence (unpooled) feature, one
        # per bag of a pooled (context) feature.
        vectors_per_request=sum(1.0 if t.pooling != "none" else ids.get(key, 0.0)
                                for key in t.features))
        for t in model.embeddings.table_configs.values())
    moe = []
    for name, layer in require_strategy_model(model, "gem plan", "moe_layers").moe_layers():
        rows = fit["moe_rows"][name]
        moe.append(MoeLayerFacts(
            name=name, num_experts=layer.num_experts, top_k=layer.top_k,
            capacity_factor=layer.router.capacity_factor, in_dim=layer.experts.in_dim,
            out_dim=layer.experts.out_dim,
            expert_parameters=sum(p.numel() for p in layer.experts.parameters()),
            rows=rows["per_token"] * tokens + rows["per_sample"] * samples))
    facts = PlanFacts(world_size=n, dense_parameters=counts["dense"], moe_layers=tuple(moe),
                      tables=tables, requests=samples, tokens=tokens,
                      activations_per_token=fit["per_token"],
                      activations_per_request=fit["per_sample"],
                      activation_element_bytes=layout.activation_bytes,
                      id_bias_offsets=counts["id_bias"],
                      id_bias_state_bytes=ID_BIAS_STATE_BYTES[config.model.id_bias_step],
                      **table_training(config, layout, plugins))
    policies = {t.name: t.id_policy for t in source.schema.tables}
    table_entries = {t.name: {
        "num_embeddings": t.num_embeddings, "dim": t.dim,
        "id_policy": policies.get(t.name, "dense"), "pooling": t.pooling,
        "features": list(t.features), "parameters": t.num_embeddings * t.dim,
        "bytes": t.num_embeddings * t.dim * 4,
        "lookups_per_request": facts.tables[i].vectors_per_request,
    } for i, t in enumerate(model.embeddings.table_configs.values())}
    return {"facts": facts, "parameters": counts, "activation_fit": fit, "profile": profile,
            "tables": table_entries}


def estimates(facts: PlanFacts, layout: Layout, plugins: GemPlugins
              ) -> dict[str, tuple[str, Estimate | None]]:
    """``{kind: (name, estimate or None)}`` of the layout's three strategies."""
    chosen = {"dense_sharding": (layout.dense, dense_options(layout)),
              "activation_checkpointing": (layout.activation_checkpointing, {}),
              "embedding_sharding": (layout.embedding, layout.embedding_options)}
    out: dict[str, tuple[str, Estimate | None]] = {}
    for kind in KINDS:
        name, options = chosen[kind]
        resolved = plugins.resolve(kind, name, None, options)
        out[kind] = (name, resolved.impl.plan_estimate(facts, resolved.options))
    return out


def plan(config: GemConfig, layout: Layout, plugins: GemPlugins) -> dict[str, Any]:
    """The per-rank memory and per-step communication of ``config`` under ``layout``: the sum
    of its strategies' estimates. A strategy that gives none is listed under ``no_estimate``
    and its share is missing from the totals (``complete`` is then False)."""
    gathered = plan_facts(config, layout, plugins)
    facts: PlanFacts = gathered["facts"]
    memory: dict[str, float] = {}
    by_category = dict.fromkeys(MEMORY_CATEGORIES, 0.0)
    communication: dict[str, float] = {}
    tables = gathered["tables"]
    details: dict[str, Any] = {}
    missing: list[str] = []
    for kind, (name, estimate) in estimates(facts, layout, plugins).items():
        if estimate is None:
            missing.append(f"{kind} {name!r} gives no estimate: its memory and traffic are not "
                           "in the totals")
            continue
        for row, value in estimate.memory.items():
            if row in memory:
                raise ValueError(f"{kind} {name!r} estimates memory row {row!r}, which another "
                                 "strategy of the layout already gave")
            memory[row] = value.bytes
            by_category[value.category] += value.bytes
        for traffic, value in estimate.communication.items():
            communication[traffic] = communication.get(traffic, 0) + value
        for table, figures in estimate.tables.items():
            tables[table].update(figures)
        details.update(estimate.details)
    total = sum(memory.values())
    budget = layout.gpu_memory_gib * GIB * layout.headroom
    profile = gathered["profile"]
    return {
        "preset": config.name,
        "layout": attrs.asdict(layout),
        "parameters": gathered["parameters"],
        "per_rank": {"samples": facts.requests,
                     "mean_history_length": profile["mean_history_length"],
                     "tokens": facts.tokens,
                     "candidates": facts.requests * profile["mean_candidates"]},
        "tables": tables,
        "memory_bytes_per_rank": {**{k: int(v) for k, v in memory.items()}, "total": int(total)},
        "memory_bytes_per_rank_by_category": {k: int(v) for k, v in by_category.items()},
        "fits": total <= budget,
        "complete": not missing,
        "no_estimate": missing,
        "budget_bytes": int(budget),
        "communication_bytes_per_rank_per_step": {k: int(v) for k, v in communication.items()},
        **details,
        "activation_fit": gathered["activation_fit"],
        "notes": ("activations measured on CPU with the reference attention backend (it keeps "
                  "each sample's score matrix, as a flash kernel does not) and scaled by "
                  "activation_bytes/4; parameters, gradients and Adam state in fp32, tables "
                  "that stay parameters with the optimizer that trains them (AdamW, or one "
                  "float per row under row-wise Adagrad)"),
    }
