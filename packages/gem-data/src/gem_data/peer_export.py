"""The impressions of a ``synthetic-ads`` run as RecBole atomic files, for peer models.

A run of the ``synthetic-ads`` source with ``train.steps`` steps of ``train.batch_size``
requests trains on the training chunks ``0 .. steps - 1`` (one chunk of ``batch_size``
requests per step, whatever the number of ranks: ranks share each chunk) of the generator
seeded with ``data.options.data_seed``, or ``train.seed`` where that is -1; chunk ``i`` is the
generator's chunk ``train_start + i``. It evaluates on ``data.eval_rows`` requests of the eval
split, generated in the fixed chunks of :meth:`AdsLogGenerator.eval_chunks` (the split
:func:`gem_data.generator.achievable_ne` measures). :func:`export_peer_dataset` builds that
source (:class:`~gem_data.synthetic_source.SyntheticAdsSource`, so every default is the
trainer's) and writes the batches of its own training stream and eval split.

Every impression (one candidate of a request) is one row, in the order of the batches:
chunk by chunk, request by request, candidate by candidate. The columns (RecBole's
``name:type`` header, tab-separated, sequences space-separated)::

    user_id:token               the request's user
    item_id:token               the candidate's ad id (the raw signed 64-bit id, in decimal)
    <candidate feature>:token   its other single-valued attributes (advertiser, category)
    <candidate feature>:token_seq   its multi-valued ones (topics)
    <context feature>:token_seq     the request's multi-hot features (user_segment, context)
    dense_<j>:float             the request's dense features (the float32 value, exactly)
    item_id_list:token_seq      the ad ids of the last ``max_seq_len`` history events,
                                oldest first (RecBole's ``ITEM_ID_FIELD + LIST_SUFFIX``)
    <event feature>_list:token_seq  the same events' other attributes (advertiser, category,
                                action; a multi-valued one, topics, flattened event by event)
    <task>:float                the labels (click, conversion), 0.0 or 1.0

``<name>.train.inter`` holds the training impressions, ``<name>.test.inter`` the eval ones and
``<name>.valid.inter`` their first :data:`VALID_ROWS` (RecBole's benchmark mode reads three
files; nothing is selected on them). ``<name>.item`` has every ad that appears (candidate or
event) with its attributes, for models that look them up by item id (DIN, DIEN).
``eval_keys.npz`` holds the eval impressions' user ids and labels (exact, for metrics on the
peers' predictions, row for row), and ``manifest.json`` what was exported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import attrs
import numpy as np
import torch

from gem_core.batch import JaggedBatch
from gem_core.config import DataConfig
from gem_core.data.api import contiguous_balancer
from gem_core.jagged import Jagged
from gem_core.plugins import build_plugins
from gem_core.schema import FeatureSchema
from gem_data.synthetic_source import SyntheticAdsSource

FORMAT = "gem-peer-export/1"
ITEM_FIELD = "item_id"
USER_FIELD = "user_id"
LIST_SUFFIX = "_list"
VALID_ROWS = 256
"""Rows of ``<name>.valid.inter`` (the first eval impressions): RecBole's benchmark mode wants
a validation file; the peers runner does not evaluate on it."""


def peer_source(*, options: Mapping[str, Any], seed: int, eval_rows: int,
                max_seq_len: int) -> SyntheticAdsSource:
    """The ``synthetic-ads`` source of a run with these ``data.options``, ``train.seed``,
    ``data.eval_rows`` and ``data.max_seq_len``."""
    config = DataConfig(source="synthetic-ads", max_seq_len=max_seq_len, eval_rows=eval_rows,
                        options=dict(options))
    return build_plugins().data_source(config, seed=seed)


def _costs(batch: JaggedBatch) -> list[float]:
    return [1.0] * batch.batch_size


def train_batches(source: SyntheticAdsSource, *, steps: int,
                  batch_size: int) -> Iterator[JaggedBatch]:
    """The global batches of the first ``steps`` training steps, from the source's own stream
    (one process; with several ranks each rank trains on a share of the same batch)."""
    stream = source.train_stream(batch_size=batch_size, rank=0, world_size=1,
                                 balancer=contiguous_balancer, cost_fn=_costs)
    for _ in range(steps):
        yield next(stream)


def eval_batches(source: SyntheticAdsSource) -> Iterator[JaggedBatch]:
    """The eval split in the source's order, one batch per eval chunk."""
    yield from source.eval_batches(batch_size=max(source.config.generated_eval_rows, 1))


@attrs.frozen(kw_only=True)
class Column:
    name: str
    type: str  # token, token_seq, float

    @property
    def header(self) -> str:
        return f"{self.name}:{self.type}"


def peer_columns(schema: FeatureSchema) -> list[Column]:
    """The ``.inter`` columns for data of ``schema``, in file order."""
    def field(name: str) -> str:
        return ITEM_FIELD if name == "ad_id" else name

    columns = [Column(name=USER_FIELD, type="token")]
    for feature in schema.candidate_features:
        columns.append(Column(name=field(feature.name),
                              type="token_seq" if feature.multi_valued else "token"))
    columns += [Column(name=f.name, type="token_seq") for f in schema.sparse_features]
    columns += [Column(name=f"dense_{j}", type="float") for j in range(schema.num_dense)]
    columns += [Column(name=field(f.name) + LIST_SUFFIX, type="token_seq")
                for f in schema.event_features]
    columns += [Column(name=task, type="float") for task in schema.tasks]
    return columns


def item_columns(schema: FeatureSchema) -> list[Column]:
    """The ``.item`` columns: the candidate features (an ad's attributes)."""
    return [Column(name=ITEM_FIELD if f.name == "ad_id" else f.name,
                   type="token_seq" if f.multi_valued else "token")
            for f in schema.candidate_features]


def _ints(values: torch.Tensor) -> list[str]:
    return [str(v) for v in values.tolist()]


def _bags(ids: Jagged) -> list[str]:
    """One space-separated string per row of a jagged id tensor."""
    words = _ints(ids.values)
    offsets = ids.offsets.tolist()
    return [" ".join(words[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]


def _float(value: float) -> str:
    # repr of the float64 holding the float32 value: parses back to that value exactly.
    return repr(float(value))


def impression_rows(batch: JaggedBatch, schema: FeatureSchema, *,
                    max_seq_len: int) -> Iterator[list[str]]:
    """The ``.inter`` fields (:func:`peer_columns`) of every impression of ``batch``, in order."""
    requests = batch.batch_size
    seq_offsets = batch.seq_offsets.tolist()
    starts = [max(a, b - max_seq_len) for a, b in zip(seq_offsets[:-1], seq_offsets[1:])]
    ends = seq_offsets[1:]

    history: list[list[str]] = []  # per event feature, per request
    for feature in schema.event_features:
        ids = batch.event_ids[feature.name]
        if isinstance(ids, Jagged):  # multi-valued: every id of the kept events, in order
            words = _ints(ids.values)
            offsets = ids.offsets.tolist()
            history.append([" ".join(words[offsets[a]:offsets[b]])
                            for a, b in zip(starts, ends)])
        else:
            words = _ints(ids)
            history.append([" ".join(words[a:b]) for a, b in zip(starts, ends)])

    users = (_ints(batch.user_ids) if batch.user_ids is not None
             else [""] * requests)
    context = [_bags(batch.sparse[f.name]) for f in schema.sparse_features]
    dense = ([[_float(v) for v in row] for row in batch.dense.tolist()]
             if batch.dense is not None and schema.num_dense else [[] for _ in range(requests)])
    per_request = [[users[r], *(bag[r] for bag in context), *dense[r]]
                   for r in range(requests)]
    per_request_history = [[h[r] for h in history] for r in range(requests)]

    candidates: list[list[str]] = []
    for feature in schema.candidate_features:
        ids = batch.candidate_ids[feature.name]
        candidates.append(_bags(ids) if isinstance(ids, Jagged) else _ints(ids))
    labels = [[_float(v) for v in batch.labels[task].tolist()] for task in schema.tasks]

    cand_offsets = batch.candidate_offsets.tolist()
    for r in range(requests):
        request = per_request[r]
        for c in range(cand_offsets[r], cand_offsets[r + 1]):
            yield [request[0], *(column[c] for column in candidates), *request[1:],
                   *per_request_history[r], *(column[c] for column in labels)]


def _item_rows(batch: JaggedBatch, schema: FeatureSchema,
               items: dict[str, tuple[str, ...]]) -> None:
    """Adds every ad of ``batch`` (candidates and events) to ``items`` (ad id -> attributes),
    checking that an ad keeps its attributes."""
    for store in (batch.candidate_ids, batch.event_ids):
        columns = []
        for feature in schema.candidate_features:
            ids = store[feature.name]
            columns.append(_bags(ids) if isinstance(ids, Jagged) else _ints(ids))
        for row in zip(*columns):
            known = items.setdefault(row[0], row)
            if known != row:
                raise ValueError(f"ad {row[0]} has two sets of attributes: {known} and {row}")


def _write(path: Path, columns: Sequence[Column], rows) -> int:
    count = 0
    with path.open("w", encoding="utf-8", newline="\n") as f:
        f.write("\t".join(c.header for c in columns) + "\n")
        for row in rows:
            f.write("\t".join(row) + "\n")
            count += 1
    return count


def export_peer_dataset(out_dir: str | Path, *, options: Mapping[str, Any], seed: int,
                        steps: int, batch_size: int, eval_rows: int, max_seq_len: int,
                        name: str = "peers") -> dict[str, Any]:
    """Writes the training and eval impressions of a ``synthetic-ads`` run (``data.options``
    ``options``, ``train.seed`` ``seed``, ``train.steps`` ``steps``, ``train.batch_size``
    ``batch_size``, ``data.eval_rows``, ``data.max_seq_len``) to ``out_dir/<name>.*`` (see the
    module docstring) and returns the manifest (also written as ``manifest.json``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = peer_source(options=options, seed=seed, eval_rows=eval_rows,
                         max_seq_len=max_seq_len)
    schema = source.schema
    columns = peer_columns(schema)
    items: dict[str, tuple[str, ...]] = {}
    counts = {"train_requests": 0, "eval_requests": 0}

    def rows(batches: Iterator[JaggedBatch], split: str) -> Iterator[list[str]]:
        for batch in batches:
            counts[f"{split}_requests"] += batch.batch_size
            _item_rows(batch, schema, items)
            yield from impression_rows(batch, schema, max_seq_len=max_seq_len)

    train_rows = _write(out / f"{name}.train.inter", columns,
                        rows(train_batches(source, steps=steps, batch_size=batch_size), "train"))
    users: list[np.ndarray] = []
    labels: dict[str, list[np.ndarray]] = {task: [] for task in schema.tasks}

    def eval_rows_kept() -> Iterator[JaggedBatch]:
        for batch in eval_batches(source):
            users.append(batch.user_ids[batch.candidate_rows()].numpy())
            for task in schema.tasks:
                labels[task].append(batch.labels[task].numpy())
            yield batch

    test_path = out / f"{name}.test.inter"
    test_rows = _write(test_path, columns, rows(eval_rows_kept(), "eval"))
    with test_path.open(encoding="utf-8") as f:
        head = [next(f) for _ in range(min(test_rows, VALID_ROWS) + 1)]
    (out / f"{name}.valid.inter").write_text("".join(head), encoding="utf-8")
    _write(out / f"{name}.item", item_columns(schema), items.values())
    np.savez(out / "eval_keys.npz", user_ids=np.concatenate(users).astype(np.int64),
             **{task: np.concatenate(labels[task]).astype(np.float32)
                for task in schema.tasks})
    manifest = {
        "format": FORMAT,
        "name": name,
        "source": "synthetic-ads",
        "options": attrs.asdict(source.options),
        "options_given": dict(options),
        "seed": seed,
        "data_seed": source.seed,
        "steps": steps,
        "batch_size": batch_size,
        "eval_rows": eval_rows,
        "max_seq_len": max_seq_len,
        "tasks": list(schema.tasks),
        "columns": [c.header for c in columns],
        "item_columns": [c.header for c in item_columns(schema)],
        "multi_valued": [f.name for f in schema.candidate_features if f.multi_valued],
        "train_impressions": train_rows,
        "eval_impressions": test_rows,
        "valid_impressions": min(test_rows, VALID_ROWS),
        "items": len(items),
        **counts,
        "achievable_ne": source.achievable_ne(),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_atomic(path: str | Path) -> tuple[list[str], list[list[str]]]:
    """An atomic file's header (``name:type`` fields) and rows (lists of strings)."""
    with Path(path).open(encoding="utf-8") as f:
        header = f.readline().rstrip("\n").split("\t")
        rows = [line.rstrip("\n").split("\t") for line in f]
    return header, rows
