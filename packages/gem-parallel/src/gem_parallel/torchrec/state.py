"""Checkpoint state of TorchRec-sharded tables: every table and its fused-optimizer state as
TorchRec's own ``ShardedTensor``s, so that torch.distributed.checkpoint (DCP) writes each rank's
shards only (no rank gathers a table) and, loading with another plan or number of ranks, reads
every new shard from the saved ones that overlap it (by offsets).

Names, relative to the collection (``model.embeddings``); the checkpointer puts the first under
``model.`` and the second under ``optimizer.state.``, where the replicated (reference) backend
keeps its weights and AdamW's state of them:

- ``tables.<table>.weight``: the whole table's shape, sharded as the plan put it; the local
  shards are views of FBGEMM TBE's weights, so DCP loads into them in place;
- ``tables.<table>.weight`` -> ``{<state>: ...}``: the fused optimizer's state of that table
  (row-wise Adagrad: ``momentum1``, one sum of squared gradients per row; SGD: none), also views
  of TBE's state.

What reshards: the weights, across any plan and number of ranks. Row-wise Adagrad's sums too,
when the table keeps whole rows in each shard (``table_wise``, ``row_wise``): one value per row,
wherever the row goes. A ``column_wise`` table keeps one sum per row *per column shard* (TorchRec
lays them out as ``rows x shards``), which means nothing for another number of column shards
(the whole-row sum is their mean, the other way round it is unknown): :func:`check_resume`
refuses that, naming the table and how to keep its layout.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from gem_core.errors import GemConfigError

LAYOUT_KIND = "torchrec"

ROW_STATE_OPTIMIZERS = ("rowwise_adagrad",)
"""Fused optimizers whose state is per row of each shard (see the module docstring)."""


def _modules(sharded: Any) -> Iterator[tuple[str, Any]]:
    """``(state-dict prefix, module)`` of TorchRec's sharded collections (bags, sequences)."""
    for prefix, module in (("embedding_bags.", sharded.ebc), ("embeddings.", sharded.ec)):
        if module is not None:
            yield prefix, module


def _sharded(value: Any, what: str) -> Any:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if not isinstance(value, ShardedTensor):
        # TorchRec gives DTensors only when asked to (output_dtensor), and plain tensors for
        # data_parallel tables, which this strategy does not offer.
        raise RuntimeError(f"{what} is a {type(value).__name__}, not TorchRec's ShardedTensor; "
                           "this checkpoint layout handles ShardedTensors only")
    return value


def table_weights(sharded: Any) -> dict[str, Any]:
    """Per table, its ``ShardedTensor`` from TorchRec's state dict (live views, every rank)."""
    weights = {}
    for prefix, module in _modules(sharded):
        for key, value in module.state_dict().items():
            if not (key.startswith(prefix) and key.endswith(".weight")):
                raise RuntimeError(f"unexpected entry {key!r} in TorchRec's state dict")
            table = key[len(prefix):-len(".weight")]
            weights[table] = _sharded(value, f"table {table!r}")
    return weights


def set_learning_rate(sharded: Any, lr: float) -> None:
    """The fused sparse optimizer's learning rate, from the next backward on. TorchRec's fused
    optimizers hand ``param_groups[0]["lr"]`` to the FBGEMM kernels in ``step()``, which
    updates nothing itself (the update ran inside the backward)."""
    for _, module in _modules(sharded):
        optimizer = module.fused_optimizer
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()


def optimizer_states(sharded: Any) -> dict[str, dict[str, Any]]:
    """Per table, the fused optimizer's state (``{"momentum1": ShardedTensor}`` for row-wise
    Adagrad; tables of a stateless optimizer have none)."""
    states: dict[str, dict[str, Any]] = {}
    for _, module in _modules(sharded):
        for values in module.fused_optimizer.state_dict()["state"].values():
            for key, value in values.items():
                # TorchRec names them "<table>.<state>" (EmbeddingFusedOptimizer).
                table, name = key.rsplit(".", 1)
                states.setdefault(table, {})[name] = _sharded(
                    value, f"sparse optimizer state {key!r}")
    return states


def checkpoint_state(sharded: Any) -> dict[str, dict[str, Any]]:
    """``{"model": {name: ShardedTensor}, "optimizer": {name: {state: ShardedTensor}}}`` with
    the names of the module docstring."""
    return {"model": {f"tables.{t}.weight": w for t, w in table_weights(sharded).items()},
            "optimizer": {f"tables.{t}.weight": s for t, s in optimizer_states(sharded).items()}}


def column_shards(plan: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """Per table, how many column shards the plan (:func:`describe_plan`'s) cuts it into."""
    return {table: len({s["offsets"][1] for s in info["shards"]}) or 1
            for table, info in plan.items()}


def layout(plan: Mapping[str, Mapping[str, Any]], optimizer: str) -> dict[str, Any]:
    """What a resume must agree on (plain data; the checkpointer records it with the step)."""
    return {"kind": LAYOUT_KIND, "optimizer": optimizer, "column_shards": column_shards(plan),
            "plan": {t: info["sharding_type"] for t, info in plan.items()}}


def check_resume(saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Refuse, with the reason and what to do, a checkpoint whose sparse optimizer state this
    layout cannot continue from. Weights reshard whatever the layouts."""
    if saved.get("kind") != LAYOUT_KIND:
        raise GemConfigError(f"the checkpoint's embedding tables were saved as "
                             f"{saved.get('kind')!r}, not as TorchRec shards; use --fresh")
    if saved["optimizer"] != current["optimizer"]:
        raise GemConfigError(
            f"the checkpoint's tables were trained by the fused {saved['optimizer']!r} and this "
            f"run's parallel.embedding.optimizer is {current['optimizer']!r}: that optimizer's "
            f"state does not carry over; set parallel.embedding.optimizer="
            f"'{saved['optimizer']}' or use --fresh")
    if current["optimizer"] not in ROW_STATE_OPTIMIZERS:
        return
    for table, now in current["column_shards"].items():
        before = saved["column_shards"].get(table, now)
        if before == now:
            continue
        keep = (f"a plan with {before} column shards (column_wise over {before} ranks)"
                if before > 1 else
                f"--set parallel.embedding.plan.{table}={saved['plan'].get(table, 'table_wise')}")
        raise GemConfigError(
            f"table {table!r}: row-wise Adagrad keeps one sum per row of each column shard; the "
            f"checkpoint's plan cut it into {before} column shard(s) "
            f"({saved['plan'].get(table)}) and this run's into {now} "
            f"({current['plan'].get(table)}), so its optimizer state has no meaning here; "
            f"resume with {keep}, or use --fresh")
