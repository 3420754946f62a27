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

from typing import Any, Mapping, Sequence

import attrs
import torch

from gem_core.config import GemConfig
from gem_core.distributed import ParallelContext
from gem_core.embedding import EmbeddingTableConfig, ReferenceEmbeddingBackend
from gem_core.model.features import FeatureLookup
from gem_core.model.gem import build_model
from gem_core.model.summary import meta_model, parameter_counts
from gem_core.plugins import GemPlugins
from gem_core.schema import EmbeddingTable, FeatureSchema

GIB = 2**30
DENSE_STRATEGIES = ("ddp", "fsdp2", "hsdp", "deepspeed-zero1", "deepspeed-zero2",
                    "deepspeed-zero3", "ep")
EMBEDDING_STRATEGIES = ("replicated", "torchrec")
ADAM_STATE_BYTES = 8  # two fp32 moments per parameter
ROWWISE_ADAGRAD_STATE_ROWS = 4  # one fp32 accumulator per row (TorchRec's fused default)
MEASURE_ROWS = 4096  # table rows of the activation-measuring copy


@attrs.frozen(kw_only=True)
class Layout:
    """How the job would be laid out."""

    gpus: int = attrs.field(validator=attrs.validators.ge(1))
    """Data-parallel ranks (one per GPU)."""

    gpu_memory_gib: float = attrs.field(validator=attrs.validators.gt(0))
    """Memory of one GPU."""

    dense: str = attrs.field(default="fsdp2", validator=attrs.validators.in_(DENSE_STRATEGIES))
    """Dense sharding strategy."""

    embedding: str = attrs.field(default="torchrec",
                                 validator=attrs.validators.in_(EMBEDDING_STRATEGIES))
    """``replicated`` (every rank holds every table, dense gradients all-reduced) or
    ``torchrec`` (rows spread over the ranks, lookups exchanged with all-to-all, fused
    row-wise Adagrad)."""

    hsdp_shard: int | None = None
    """HSDP only: ranks per shard group (default: all ranks, i.e. plain FSDP)."""

    ep_size: int | None = None
    """``ep`` only: ranks per expert-parallel group (default: all ranks)."""

    expert_fsdp: bool = False
    """``ep`` only: experts FSDP-sharded over their ``gpus / ep_size`` copies."""

    activation_checkpointing: str = "none"
    """A registered activation-checkpointing policy (``none``, ``full``, ``selective``)."""

    activation_bytes: int = attrs.field(default=4, validator=attrs.validators.in_((2, 4)))
    """Bytes per activation element (2 under a bf16 recipe)."""

    headroom: float = attrs.field(default=0.9, validator=[attrs.validators.gt(0),
                                                          attrs.validators.le(1)])
    """Share of GPU memory the plan may fill (the rest: allocator fragmentation, workspaces)."""


def _dense_shards(layout: Layout) -> dict[str, int]:
    """Over how many ranks parameters, gradients and optimizer state are each divided."""
    n = layout.gpus
    shard = layout.hsdp_shard or n
    if layout.dense == "hsdp" and n % shard:
        raise ValueError(f"hsdp_shard {shard} does not divide {n} GPUs")
    return {
        "ddp": {"params": 1, "grads": 1, "optimizer": 1},
        "fsdp2": {"params": n, "grads": n, "optimizer": n},
        "hsdp": {"params": shard, "grads": shard, "optimizer": shard},
        "deepspeed-zero1": {"params": 1, "grads": 1, "optimizer": n},
        "deepspeed-zero2": {"params": 1, "grads": n, "optimizer": n},
        "deepspeed-zero3": {"params": n, "grads": n, "optimizer": n},
        # Non-expert parameters; the experts are planned apart (:func:`_expert_plan`).
        "ep": {"params": n, "grads": n, "optimizer": n},
    }[layout.dense]


def _dense_comm_bytes(layout: Layout, dense_params: int) -> int:
    n, size = layout.gpus, dense_params * 4
    if n == 1:
        return 0
    ring = (n - 1) / n
    if layout.dense == "ddp":
        return int(2 * ring * size)  # all-reduce of gradients
    if layout.dense in ("fsdp2", "deepspeed-zero3", "ep"):
        return int(3 * ring * size)  # all-gather forward and backward, reduce-scatter grads
    if layout.dense == "hsdp":
        shard = layout.hsdp_shard or n
        replicas = n // shard
        inner = 3 * (shard - 1) / shard * size
        outer = 2 * (replicas - 1) / replicas * size / shard if replicas > 1 else 0
        return int(inner + outer)
    return int(2 * ring * size)  # ZeRO-1/2: reduce-scatter grads, all-gather updated params


def moe_all_to_all_bytes(rows: float, *, top_k: int, in_dim: int, out_dim: int, ep_size: int,
                         bytes_per_element: int = 4) -> float:
    """Bytes one rank sends to other ranks per MoE layer and training step under ``ep`` when
    routing is uniform and nothing is dropped: ``rows * top_k`` assignments, ``(ep - 1) / ep``
    of them to experts on other ranks; dispatch sends ``in_dim`` wide rows and combine
    ``out_dim`` wide ones, forward and again (as gradients) backward."""
    remote = rows * top_k * (ep_size - 1) / ep_size
    return 2 * remote * (in_dim + out_dim) * bytes_per_element


def _expert_plan(model: torch.nn.Module, layout: Layout, moe_rows: dict[str, dict[str, float]],
                 samples: float, tokens: float) -> dict[str, Any]:
    """Memory and communication of the routed experts under ``ep``: each rank of an expert
    group keeps ``1 / ep_size`` of every layer's experts (``expert_fsdp``: a ``1 / gpus``
    shard), their gradients are reduced over the ``gpus / ep_size`` copies, and every MoE layer
    exchanges its routed rows with all-to-all."""
    from gem_core.model.moe import moe_layers

    n = layout.gpus
    ep = layout.ep_size or n
    if n % ep:
        raise ValueError(f"ep_size {ep} does not divide {n} GPUs")
    copies = n // ep
    layers = moe_layers(model)
    expert_params = sum(p.numel() for _, layer in layers for p in layer.experts.parameters())
    held = expert_params / (n if layout.expert_fsdp else ep)
    group_bytes = expert_params * 4 / ep  # one expert group's share, fp32
    if copies == 1:
        reduce_bytes = 0.0
    elif layout.expert_fsdp:  # all-gather forward and backward, reduce-scatter gradients
        reduce_bytes = 3 * (copies - 1) / copies * group_bytes
    else:  # all-reduce of the gradients over the copies
        reduce_bytes = 2 * (copies - 1) / copies * group_bytes
    all_to_all = 0.0
    for name, layer in layers:
        fit = moe_rows[name]
        rows = fit["per_token"] * tokens + fit["per_sample"] * samples
        all_to_all += moe_all_to_all_bytes(rows, top_k=layer.top_k, in_dim=layer.experts.in_dim,
                                           out_dim=layer.experts.out_dim, ep_size=ep)
    return {"expert_parameters": expert_params, "params_held": held,
            "grad_reduce_bytes": reduce_bytes, "all_to_all_bytes": all_to_all,
            "ep_size": ep, "copies": copies}


class _MoeRows:
    """Rows entering each MoE layer during a forward (forward pre-hooks)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from gem_core.model.moe import moe_layers

        self.rows: dict[str, int] = {}
        self._handles = [layer.register_forward_pre_hook(self._hook(name))
                         for name, layer in moe_layers(model)]

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


def measure_activations(config: GemConfig, plugins: GemPlugins, policy: str,
                        lengths: tuple[int, int] = (32, 64), samples: int = 8
                        ) -> dict[str, float]:
    """Fit saved-activation bytes to ``per_token * tokens + per_sample * samples`` (samples are
    requests, with the data's candidates each) from two real batches of the configured data,
    histories cut at each of ``lengths``."""
    from gem_parallel.bench_memory import saved_activation_bytes

    ctx = ParallelContext()
    points = []
    for length in lengths:
        data = attrs.evolve(config.data, max_seq_len=length)
        source = plugins.resolve("data", data.source, None).impl(data, seed=0)
        schema = _measuring_schema(source.schema)
        batch = next(iter(source.eval_batches(batch_size=samples)))
        torch.manual_seed(0)
        model = build_model(config.model, schema,
                            attention=plugins.resolve("attention", "reference", None).impl,
                            embedding_backend=ReferenceEmbeddingBackend())
        impl = plugins.resolve("activation_checkpointing", policy, None).impl
        model = impl.apply(model, ctx=ctx, options={})
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
    source = plugins.resolve("data", config.data.source, None).impl(config.data, seed=0)
    batch = next(iter(source.eval_batches(batch_size=samples)))
    requests = max(batch.batch_size, 1)
    inputs = FeatureLookup(source.schema).inputs(batch)
    return {"mean_history_length": batch.num_events / requests,
            "mean_candidates": batch.num_candidates / requests,
            "ids_per_request": {key: jagged.values.numel() / requests
                                for key, jagged in inputs.items()}}


def table_plan(schema: FeatureSchema, tables: Sequence[EmbeddingTableConfig], layout: Layout,
               ids_per_request: Mapping[str, float], requests: float) -> dict[str, dict[str, Any]]:
    """Per declared table: its size (``num_embeddings x dim``), the features that index it, and
    what one rank holds of it and sends for it per step."""
    n = layout.gpus
    policies = {t.name: t.id_policy for t in schema.tables}
    out: dict[str, dict[str, Any]] = {}
    for table in tables:
        params = table.num_embeddings * table.dim
        pooled = table.pooling != "none"
        # Vectors crossing ranks per request: one per id of a sequence (unpooled) feature, one
        # per bag of a pooled (context) feature.
        vectors = sum(1.0 if pooled else ids_per_request.get(key, 0.0) for key in table.features)
        entry: dict[str, Any] = {
            "num_embeddings": table.num_embeddings, "dim": table.dim,
            "id_policy": policies.get(table.name, "dense"),
            "pooling": table.pooling, "features": list(table.features),
            "parameters": params, "bytes": params * 4,
            "lookups_per_request": vectors,
        }
        if layout.embedding == "replicated":
            entry["bytes_per_rank"] = params * 4 * 2 + params * ADAM_STATE_BYTES
            entry["comm_bytes_per_rank_per_step"] = int(2 * (n - 1) / n * params * 4) if n > 1 \
                else 0
        else:
            state = table.num_embeddings * ROWWISE_ADAGRAD_STATE_ROWS
            # Spread evenly (row- or column-wise); a table-wise table sits whole on one rank.
            entry["bytes_per_rank"] = int((params * 4 + state) / n)
            entry["bytes_on_one_rank_if_table_wise"] = params * 4 + state
            entry["comm_bytes_per_rank_per_step"] = int(
                2 * (n - 1) / n * vectors * requests * table.dim * 4)
        out[table.name] = entry
    return out


def plan(config: GemConfig, layout: Layout, plugins: GemPlugins) -> dict[str, Any]:
    """The per-rank memory and per-step communication of ``config`` under ``layout``."""
    n = layout.gpus
    source = plugins.resolve("data", config.data.source, None).impl(config.data, seed=0)
    model = meta_model(config.model, source.schema)
    counts = parameter_counts(model)
    dense, embedding = counts["dense"], counts["embedding"]
    table_configs = list(model.embeddings.table_configs.values())
    rows = sum(t.num_embeddings for t in table_configs)
    shards = _dense_shards(layout)
    scale = layout.activation_bytes / 4
    fit = measure_activations(config, plugins, layout.activation_checkpointing)
    samples = config.train.batch_size / n  # requests
    profile = data_profile(config, plugins)
    mean_len = profile["mean_history_length"]
    tokens = samples * mean_len
    tables = table_plan(source.schema, table_configs, layout, profile["ids_per_request"], samples)
    experts = None
    if layout.dense == "ep":
        experts = _expert_plan(model, layout, fit["moe_rows"], samples, tokens)
        if not experts["expert_parameters"]:
            raise ValueError("the ep layout needs a model with MoE layers (model.moe.num_experts)")
        dense -= experts["expert_parameters"]  # the rest is FSDP2-sharded over all ranks
    memory = {
        "dense_params": dense * 4 / shards["params"],
        "dense_grads": dense * 4 / shards["grads"],
        "dense_optimizer": dense * ADAM_STATE_BYTES / shards["optimizer"],
        "activations": scale * (fit["per_token"] * tokens + fit["per_sample"] * samples),
    }
    if experts is not None:
        held = experts["params_held"]
        memory.update(expert_params=held * 4, expert_grads=held * 4,
                      expert_optimizer=held * ADAM_STATE_BYTES)
    if layout.embedding == "replicated":
        memory.update(embedding_params=embedding * 4, embedding_grads=embedding * 4,
                      embedding_optimizer=embedding * ADAM_STATE_BYTES)
        embedding_comm = 2 * (n - 1) / n * embedding * 4 if n > 1 else 0
    else:
        memory.update(embedding_params=embedding * 4 / n, embedding_grads=0,
                      embedding_optimizer=rows * ROWWISE_ADAGRAD_STATE_ROWS / n)
        # Lookups of this rank's requests go out to the table owners and their gradients come
        # back: forward and backward all-to-all of one vector per id of every event and
        # candidate feature and one per bag of every context feature (table_plan).
        embedding_comm = sum(t["comm_bytes_per_rank_per_step"] for t in tables.values())
    total = sum(memory.values())
    budget = layout.gpu_memory_gib * GIB * layout.headroom
    return {
        "preset": config.name,
        "layout": attrs.asdict(layout),
        "parameters": counts,
        "per_rank": {"samples": samples, "mean_history_length": mean_len, "tokens": tokens,
                     "candidates": samples * profile["mean_candidates"]},
        "tables": tables,
        "memory_bytes_per_rank": {**{k: int(v) for k, v in memory.items()}, "total": int(total)},
        "fits": total <= budget,
        "budget_bytes": int(budget),
        "communication_bytes_per_rank_per_step": {
            "dense": int(_dense_comm_bytes(layout, dense)
                         + (experts["grad_reduce_bytes"] if experts else 0)),
            "embedding": int(embedding_comm),
            **({"moe_all_to_all": int(experts["all_to_all_bytes"])} if experts else {}),
        },
        **({"experts": {k: (int(v) if isinstance(v, float) else v)
                        for k, v in experts.items()}} if experts else {}),
        "activation_fit": fit,
        "notes": ("activations measured on CPU with the reference attention backend (it keeps "
                  "each sample's score matrix, as a flash kernel does not) and scaled by "
                  "activation_bytes/4; parameters, gradients and Adam state in fp32"),
    }
