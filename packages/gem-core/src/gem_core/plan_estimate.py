"""What ``gem plan`` asks of a strategy: the facts it measured, and the strategy's estimate.

``gem plan`` builds the configured model on the ``meta`` device, reads a batch of the configured
data and measures activations on a small CPU copy; it hands those facts (:class:`PlanFacts`) to
the layout's dense sharding, embedding sharding and activation-checkpointing strategies, each of
which answers with its own :class:`Estimate` from ``plan_estimate(facts, options)`` (see
:mod:`gem_core.contracts`), or None when it gives none. The plan only adds the estimates up; a
strategy without one is named in the plan, never guessed.

Conventions the built-in strategies share (and the helpers below implement): parameters,
gradients and optimizer state in float32 with AdamW's two moments (tables that stay parameters:
with the optimizer ``PlanFacts.table_optimizer`` names); bytes sent by one rank per
step with ring collectives, ``(n - 1) / n`` of the buffer per reduce-scatter or all-gather and
twice that per all-reduce.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

PARAMETERS = "parameters"
GRADIENTS = "gradients"
OPTIMIZER_STATE = "optimizer_state"
ACTIVATIONS = "activations"
MEMORY_CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER_STATE, ACTIVATIONS)
"""What each memory row of an estimate holds."""

FP32_BYTES = 4
ADAM_STATE_BYTES = 8
"""AdamW's two float32 moments per parameter."""

TABLE_STATE_BYTES = {"adamw": None, "rowwise_adagrad": FP32_BYTES, "sgd": 0}
"""Optimizer state per table row by table optimizer (``adamw``: per parameter, as
:data:`ADAM_STATE_BYTES`)."""

ID_BIAS_STATE_BYTES = {"fisher": FP32_BYTES, "constant": 0}
"""Optimizer state per offset of ``model.id_bias`` by ``model.id_bias_step`` (``fisher``: its
summed squared residual, :data:`gem_core.train.table_optimizer.FISHER`)."""


@attrs.frozen(kw_only=True)
class MoeLayerFacts:
    """One mixture-of-experts layer of the model (``moe_layers()`` of its interface)."""

    name: str
    """Qualified module name."""

    num_experts: int
    top_k: int
    capacity_factor: float
    """Its router's capacity factor (0: no drops)."""

    in_dim: int
    out_dim: int
    expert_parameters: int
    """Parameters of its routed experts (all of them; not the router or a shared expert)."""

    rows: float
    """Rows (tokens or samples) entering the layer per rank and step, in the forward."""


@attrs.frozen(kw_only=True)
class TableFacts:
    """One embedding table the data declares, and the lookups a request sends to it."""

    name: str
    num_embeddings: int
    dim: int
    pooled: bool
    """Pooled (a context feature's bag gives one vector) or not (one vector per id)."""

    vectors_per_request: float
    """Vectors one request looks up in it: one per id of a sequence feature, one per bag of a
    pooled one."""

    @property
    def parameters(self) -> int:
        return self.num_embeddings * self.dim


@attrs.frozen(kw_only=True)
class PlanFacts:
    """What ``gem plan`` measured, per rank and training step, for the strategies' estimates."""

    world_size: int
    """Data-parallel ranks (one per GPU)."""

    dense_parameters: int
    """Every parameter outside ``model.embeddings``, routed experts included."""

    moe_layers: tuple[MoeLayerFacts, ...] = ()
    tables: tuple[TableFacts, ...] = ()

    requests: float
    """Requests (samples) per rank per step."""

    tokens: float
    """History events per rank per step."""

    activations_per_token: float
    """Saved-activation bytes (float32) per history token, measured on a copy of the model with
    the layout's checkpointing policy applied."""

    activations_per_request: float
    """Saved-activation bytes (float32) per request beyond its tokens (candidates, heads)."""

    activation_element_bytes: int = 4
    """Bytes per activation element of the run (2 under a bf16 recipe)."""

    table_optimizer: str = attrs.field(default="adamw",
                                       validator=attrs.validators.in_(TABLE_STATE_BYTES))
    """How the tables train where they stay parameters of the model (``replicated``):
    ``adamw`` (the dense AdamW, two moments per parameter) or the row-wise optimizer of
    ``[model.embedding_optimizer]`` (``rowwise_adagrad``: one float per row; ``sgd``: none),
    in the dense step (``dense_tables = "same"``) or fused into the backward."""

    table_gradients: bool = True
    """Whether those tables keep a gradient tensor (a fused backward updates the rows it looked
    up and keeps none)."""

    id_bias_offsets: int = 0
    """Offsets of ``model.id_bias`` (one per id and task of its features), counted in
    ``dense_parameters`` too: held, reduced and sharded with the dense parameters, but stepped
    by their own rule, not by AdamW."""

    id_bias_state_bytes: int = attrs.field(
        default=0, validator=attrs.validators.in_(set(ID_BIAS_STATE_BYTES.values())))
    """Optimizer state per offset (:data:`ID_BIAS_STATE_BYTES` of ``model.id_bias_step``)."""

    @property
    def expert_parameters(self) -> int:
        return sum(layer.expert_parameters for layer in self.moe_layers)

    @property
    def embedding_parameters(self) -> int:
        return sum(table.parameters for table in self.tables)


def _category(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if value not in MEMORY_CATEGORIES:
        raise ValueError(f"memory category must be one of {', '.join(MEMORY_CATEGORIES)}; "
                         f"got {value!r}")


@attrs.frozen
class MemoryRow:
    """Bytes per rank of one kind of thing a strategy keeps."""

    category: str = attrs.field(validator=_category)
    """One of :data:`MEMORY_CATEGORIES`."""

    bytes: float


@attrs.frozen(kw_only=True)
class Estimate:
    """A strategy's answer for one rank: memory by named row, bytes sent per step by named
    traffic, and figures of its own."""

    memory: Mapping[str, MemoryRow] = attrs.field(factory=dict)
    """Rows such as ``dense_params`` or ``embedding_optimizer``; row names are unique across the
    strategies of a layout (the plan refuses a clash)."""

    communication: Mapping[str, float] = attrs.field(factory=dict)
    """Bytes one rank sends per step, by traffic (``dense``, ``embedding``, ``moe_all_to_all``);
    traffic of the same name from two strategies adds up."""

    tables: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)
    """Embedding shardings: per declared table, what a rank holds of it and sends for it
    (``bytes_per_rank``, ``comm_bytes_per_rank_per_step``, ...)."""

    details: Mapping[str, Any] = attrs.field(factory=dict)
    """Anything else worth reporting (e.g. how the experts are split), placed in the plan at
    the top level under these keys."""


def ring_fraction(ranks: int) -> float:
    """The share of a buffer one rank sends in a ring reduce-scatter or all-gather."""
    return (ranks - 1) / ranks


def adam_memory(prefix: str, parameters: float, *, params_over: int = 1, grads_over: int = 1,
                optimizer_over: int = 1) -> dict[str, MemoryRow]:
    """``<prefix>_params``, ``_grads`` and ``_optimizer`` rows for ``parameters`` float32
    parameters trained with AdamW, each divided over the ranks that share it."""
    return {f"{prefix}_params": MemoryRow(PARAMETERS, parameters * FP32_BYTES / params_over),
            f"{prefix}_grads": MemoryRow(GRADIENTS, parameters * FP32_BYTES / grads_over),
            f"{prefix}_optimizer": MemoryRow(OPTIMIZER_STATE,
                                             parameters * ADAM_STATE_BYTES / optimizer_over)}


def dense_memory(facts: PlanFacts, parameters: float | None = None, *, params_over: int = 1,
                 grads_over: int = 1, optimizer_over: int = 1) -> dict[str, MemoryRow]:
    """:func:`adam_memory`'s ``dense_*`` rows for the dense optimizer's ``parameters``
    (default ``facts.dense_parameters``; a strategy that holds part of them elsewhere, such as
    experts, passes the rest), with the optimizer row of ``model.id_bias``'s offsets at their
    own state (:data:`ID_BIAS_STATE_BYTES`) instead of AdamW's two moments."""
    held = facts.dense_parameters if parameters is None else parameters
    if facts.id_bias_offsets > held:
        raise ValueError(f"{facts.id_bias_offsets} id_bias offsets among {held} dense parameters")
    rows = adam_memory("dense", held, params_over=params_over, grads_over=grads_over,
                       optimizer_over=optimizer_over)
    state = ((held - facts.id_bias_offsets) * ADAM_STATE_BYTES
             + facts.id_bias_offsets * facts.id_bias_state_bytes)
    rows["dense_optimizer"] = MemoryRow(OPTIMIZER_STATE, state / optimizer_over)
    return rows


def _table_bytes(facts: PlanFacts, table: TableFacts) -> tuple[int, int, int]:
    """Parameters, gradients and optimizer state of ``table`` held whole on a rank, trained as
    ``facts.table_optimizer`` says (the one place of these formulas)."""
    params = table.parameters * FP32_BYTES
    grads = params if facts.table_gradients else 0
    per_row = TABLE_STATE_BYTES[facts.table_optimizer]
    state = (table.parameters * ADAM_STATE_BYTES if per_row is None
             else table.num_embeddings * per_row)
    return params, grads, state


def table_memory(facts: PlanFacts) -> dict[str, MemoryRow]:
    """``embedding_params``, ``_grads`` and ``_optimizer`` rows for every table held whole on
    each rank."""
    params, grads, state = (sum(column) for column in
                            zip((0, 0, 0), *(_table_bytes(facts, t) for t in facts.tables)))
    return {"embedding_params": MemoryRow(PARAMETERS, params),
            "embedding_grads": MemoryRow(GRADIENTS, grads),
            "embedding_optimizer": MemoryRow(OPTIMIZER_STATE, state)}


def table_state_bytes(facts: PlanFacts, table: TableFacts) -> int:
    """Bytes of ``table``'s parameters, gradients and optimizer state held whole on a rank."""
    return sum(_table_bytes(facts, table))


def measured_activations(facts: PlanFacts) -> Estimate:
    """The activation row of a checkpointing policy whose effect the measurement captured (the
    plan measured with the policy applied): the fit at this rank's tokens and requests, scaled
    to the run's activation element size."""
    scale = facts.activation_element_bytes / 4
    return Estimate(memory={ACTIVATIONS: MemoryRow(ACTIVATIONS, scale * (
        facts.activations_per_token * facts.tokens
        + facts.activations_per_request * facts.requests))})


def moe_all_to_all_bytes(rows: float, *, top_k: int, in_dim: int, out_dim: int, ep_size: int,
                         bytes_per_element: int = 4) -> float:
    """Bytes one rank sends to other ranks per MoE layer and training step under expert
    parallelism when routing is uniform and nothing is dropped: ``rows * top_k`` assignments,
    ``(ep - 1) / ep`` of them to experts on other ranks; dispatch sends ``in_dim`` wide rows and
    combine ``out_dim`` wide ones, forward and again (as gradients) backward."""
    remote = rows * top_k * (ep_size - 1) / ep_size
    return 2 * remote * (in_dim + out_dim) * bytes_per_element
