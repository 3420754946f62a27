"""The impressions of a trainer run as RecBole atomic files, for peer models.

A run trains on the first ``train.steps`` global batches of its data source's training stream
(``train.batch_size`` requests each, whatever the number of ranks: ranks share each batch) and
evaluates on the source's eval split (``data.eval_rows`` requests of it, or all of it where
``eval_rows`` is unset on a file-backed source). :func:`export_peer_dataset` builds the source
as the trainer does (``gem_core.plugins.build_plugins().data_source(data, seed=train.seed)``,
so every default and every data set's own value is the trainer's) and writes the batches of its
own training stream and eval split. For example:

- ``synthetic-ads``: training batch ``i`` is chunk ``train_start + i`` of the generator seeded
  with ``data.options.data_seed`` (``train.seed`` where that is -1); the eval split is
  ``data.eval_rows`` requests generated in the fixed chunks of
  :meth:`AdsLogGenerator.eval_chunks` (the split :func:`gem_data.generator.achievable_ne`
  measures, reported in the manifest).
- ``movielens-100k`` (and ``parquet``): the converted data set's training split, shuffled per
  epoch with ``train.seed`` (epochs follow one another when ``steps`` batches need more), and
  its time-held-out eval split in file order (whole where ``data.eval_rows`` is unset).

Every impression (one candidate of a request) is one row, in the order of the batches:
batch by batch, request by request, candidate by candidate. The columns (RecBole's
``name:type`` header, tab-separated, sequences space-separated)::

    user_id:token               the request's user (``batch.user_ids``)
    item_id:token               the candidate's item id (the item feature, see below: the raw
                                signed 64-bit id, in decimal)
    <candidate feature>:token   its other single-valued attributes (advertiser, category;
                                decade)
    <candidate feature>:token_seq   its multi-valued ones (topics; genres)
    candidate_numeric_<j>:float its numeric features (a Taobao-shaped log's price: the
                                float32 value, exactly), where the schema declares
                                ``candidate_numeric_dim``
    <context feature>:token_seq     the request's multi-hot features (user_segment, context;
                                age_bucket, gender, occupation). A context feature named
                                ``user_id`` (MovieLens's) is the request's user: it is the
                                ``user_id`` column (checked row by row), not written twice
    dense_<j>:float             the request's dense features (the float32 value, exactly)
    item_id_list:token_seq      the item ids of the last ``max_seq_len`` history events,
                                oldest first (RecBole's ``ITEM_ID_FIELD + LIST_SUFFIX``),
                                where the history has item ids (see below)
    <event feature>_list:token_seq  the same events' other attributes (advertiser, category,
                                action; rating, decade; a multi-valued one, topics or genres,
                                flattened event by event)
    <task>:float                the labels (click, conversion; like), 0.0 or 1.0

The **item feature** (RecBole's ``item_id``) is the schema's first candidate feature
(:func:`item_feature`): ``ad_id`` on ``synthetic-ads``, ``movie`` on ``movielens-100k``,
``adgroup_id`` on a Taobao-shaped log. It must be single-valued, else the export is refused.
The other features keep their names.

**The history's item ids.** Where the item feature is also an event feature (``synthetic-ads``,
``movielens-100k``), the history has item ids: ``item_id_list``, and the ``.item`` file below.
Where it is not (a Taobao-shaped log records the category and brand a user acted on, not the
ad: event features cate, brand, btag), the history has no item ids
(:func:`history_has_item_ids`): no ``item_id_list`` column and no ``.item`` file are written
(an item's attributes cannot be joined to events that do not name the item, and the models
that read the history as item ids, DIN and DIEN, cannot run on it; ``tools/peers.py`` refuses
them), while the other event features' ``<name>_list`` columns are (``cate_list``,
``brand_list``, ``btag_list``). The manifest says which: ``history_item_ids`` (true / false)
and ``item_list_field`` (``item_id_list`` / null).

``<name>.train.inter`` holds the training impressions, ``<name>.test.inter`` the eval ones and
``<name>.valid.inter`` their first :data:`VALID_ROWS` (RecBole's benchmark mode reads three
files; nothing is selected on them). ``<name>.item`` (only where the history has item ids) has
every item that appears (candidate or event) with the attributes candidates and events both
carry (the candidate features that are also event features), for models that look them up by
item id (DIN, DIEN).
``eval_keys.npz`` holds the eval impressions' user ids and labels (exact, for metrics on the
peers' predictions, row for row), and ``manifest.json`` what was exported: ``[data]`` as the
source applied it (source, path, order, options with every default, eval_rows, max_seq_len),
the training seed, steps and batch size, the RecBole fields, whether the history has item ids
(``history_item_ids``) and its event features, the columns (``candidate_numeric_columns``
naming the candidates' numeric ones), the counts and, where the source
has one (``synthetic-ads``), its data seed and achievable NE.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Sequence

import attrs
import numpy as np
import torch

from gem_core.batch import JaggedBatch
from gem_core.config import DataConfig
from gem_core.contracts import DataSource
from gem_core.data.api import contiguous_balancer
from gem_core.errors import GemConfigError, GemDataError
from gem_core.jagged import Jagged
from gem_core.plugins import build_plugins
from gem_core.schema import ContextFeature, FeatureSchema, SequenceFeature
from gem_data.generator import achievable_entries
from gem_data.synth_options import SynthOptions
from gem_data.synthetic_source import SyntheticAdsSource

FORMAT = "gem-peer-export/2"
"""Version 2: any data source; the manifest names the source's path and order and the RecBole
fields (``user_field``, ``item_field``, ``item_list_field``, ``item_feature``). Later exports
of this version add ``history_item_ids`` and ``event_features``; a manifest without them is of
an export that refused data without the history's item ids, so its history has them."""
ITEM_FIELD = "item_id"
USER_FIELD = "user_id"
LIST_SUFFIX = "_list"
ITEM_LIST_FIELD = ITEM_FIELD + LIST_SUFFIX
SYNTHETIC_ADS = "synthetic-ads"
CANDIDATE_NUMERIC_PREFIX = "candidate_numeric_"
VALID_ROWS = 256
"""Rows of ``<name>.valid.inter`` (the first eval impressions): RecBole's benchmark mode wants
a validation file; the peers runner does not evaluate on it."""


def peer_source(data: DataConfig, *, seed: int) -> DataSource:
    """The data source of a run with this ``[data]`` and ``train.seed``, built as the trainer
    builds it."""
    return build_plugins().data_source(data, seed=seed)


def applied_options(data: DataConfig) -> dict[str, Any]:
    """``data.options`` as the source applies them, every default filled in, without building
    the source (which may convert or read a data set): structured into the source's options
    class, and on ``synthetic-ads`` as :class:`~gem_data.synthetic_source.SyntheticAdsSource`
    resolves them (its generator's :class:`SynthOptions`, ``max_length`` 0 meaning
    ``data.max_seq_len``). Raises the registry's error on options the source does not take."""
    options = build_plugins().resolve("data", data.source, None, data.options).options
    if data.source == SYNTHETIC_ADS:
        return attrs.asdict(SynthOptions(**{**attrs.asdict(options, recurse=False),
                                            "max_length": options.max_length
                                            or data.max_seq_len}))
    if options is not None and attrs.has(type(options)):
        return attrs.asdict(options)
    return dict(data.options)


def _source_options(source: DataSource, data: DataConfig) -> dict[str, Any]:
    """The options the built source holds (``synthetic-ads``: its generator's, as always
    recorded), else :func:`applied_options`."""
    if isinstance(source, SyntheticAdsSource):
        return attrs.asdict(source.options)
    return applied_options(data)


def item_feature(schema: FeatureSchema) -> SequenceFeature:
    """The candidate feature that identifies the item (RecBole's ``item_id``): the schema's
    first candidate feature, which is the item id in the schemas of this trainer's sources
    (``ad_id``, ``movie``, ``adgroup_id``). Refused when it is multi-valued. Whether the history
    carries it too is :func:`history_has_item_ids`."""
    if not schema.candidate_features:
        raise GemDataError("the schema has no candidate features: nothing identifies the item")
    feature = schema.candidate_features[0]
    if feature.multi_valued:
        raise GemDataError(f"the first candidate feature {feature.name!r} is multi-valued; the "
                         "item id (RecBole's item_id) must be one id per candidate")
    return feature


def history_has_item_ids(schema: FeatureSchema) -> bool:
    """Whether the history carries the item feature (the first candidate feature is an event
    feature too): the export writes ``item_id_list`` and the ``.item`` file only then."""
    return item_feature(schema).name in {f.name for f in schema.event_features}


def item_attribute_features(schema: FeatureSchema) -> list[SequenceFeature]:
    """The ``.item`` file's features: the item feature and the other candidate features that
    events carry too (an item's attributes, wherever it appears). None where the history has
    no item ids: events that do not name their item give no item its attributes, and no
    ``.item`` file is written."""
    if not history_has_item_ids(schema):
        return []
    events = {f.name for f in schema.event_features}
    return [f for f in schema.candidate_features if f.name in events]


def written_context_features(schema: FeatureSchema) -> list[ContextFeature]:
    """The context features written as columns: all but one named like the user field (it is
    the request's user, written once as ``user_id``; :func:`impression_rows` checks it)."""
    return [f for f in schema.sparse_features if f.name != USER_FIELD]


def _costs(batch: JaggedBatch) -> list[float]:
    return [1.0] * batch.batch_size


def _passes(stream: Any) -> int | None:
    """Complete passes over the training data at the stream's position, or None where the
    stream has none (generated data): the trainer's reading of a stream position."""
    position = stream.state_dict()
    epoch = position.get("epoch") if isinstance(position, dict) else None
    return epoch if isinstance(epoch, int) else None


def train_batches(source: DataSource, *, steps: int, batch_size: int,
                  epochs: int = 0) -> Iterator[JaggedBatch]:
    """The global batches a run trains, from the source's own stream (one process; with several
    ranks each rank trains on a share of the same batch): the first ``steps`` (``train.steps``),
    or fewer where ``epochs`` (``train.epochs``) passes over a file-backed data set end first,
    the trainer's rule (``gem_core.train.run_end.epochs_done``: the run stops after the step
    whose batch completes the last pass; a batch runs on into the next pass). ``epochs`` 0, or
    a stream without passes (generated data): ``steps`` alone decides."""
    stream = source.train_stream(batch_size=batch_size, rank=0, world_size=1,
                                 balancer=contiguous_balancer, cost_fn=_costs)
    try:
        for _ in range(steps):
            yield next(stream)
            passes = _passes(stream) if epochs else None
            if passes is not None and passes >= epochs:
                return
    finally:
        stream.close()  # a file-backed stream reads ahead in a thread of its own


def eval_batches(source: DataSource, data: DataConfig) -> Iterator[JaggedBatch]:
    """The eval split in the source's order (its rows do not depend on the batch size): on
    ``synthetic-ads`` one batch per eval chunk."""
    applied = source.applied_config(data)
    yield from source.eval_batches(batch_size=max(applied.generated_eval_rows, 1))


@attrs.frozen(kw_only=True)
class Column:
    name: str
    type: str  # token, token_seq, float

    @property
    def header(self) -> str:
        return f"{self.name}:{self.type}"


def _field(schema: FeatureSchema):
    """The column name of a candidate or event feature: the item feature is ``item_id``."""
    item = item_feature(schema).name
    return lambda name: ITEM_FIELD if name == item else name


def _check_unique(columns: Sequence[Column], what: str) -> list[Column]:
    seen: set[str] = set()
    for column in columns:
        if column.name in seen:
            raise GemDataError(f"two {what} columns are named {column.name!r} (a feature named "
                             "like another, or like RecBole's user_id / item_id / "
                             "item_id_list); the export needs distinct names")
        seen.add(column.name)
    return list(columns)


def peer_columns(schema: FeatureSchema) -> list[Column]:
    """The ``.inter`` columns for data of ``schema``, in file order: one ``<name>_list`` per
    event feature (``item_id_list`` for the item feature, where the history has it)."""
    field = _field(schema)
    columns = [Column(name=USER_FIELD, type="token")]
    for feature in schema.candidate_features:
        columns.append(Column(name=field(feature.name),
                              type="token_seq" if feature.multi_valued else "token"))
    columns += [Column(name=name, type="float") for name in candidate_numeric_columns(schema)]
    columns += [Column(name=f.name, type="token_seq") for f in written_context_features(schema)]
    columns += [Column(name=f"dense_{j}", type="float") for j in range(schema.num_dense)]
    columns += [Column(name=field(f.name) + LIST_SUFFIX, type="token_seq")
                for f in schema.event_features]
    columns += [Column(name=task, type="float") for task in schema.tasks]
    return _check_unique(columns, ".inter")


def candidate_numeric_columns(schema: FeatureSchema) -> list[str]:
    """The ``.inter`` columns of the candidates' numeric features, one per
    ``candidate_numeric_dim``."""
    return [f"{CANDIDATE_NUMERIC_PREFIX}{j}" for j in range(schema.candidate_numeric_dim)]


def item_columns(schema: FeatureSchema) -> list[Column]:
    """The ``.item`` columns: the item id and its attributes (:func:`item_attribute_features`);
    none where the history has no item ids (no ``.item`` file)."""
    field = _field(schema)
    return _check_unique([Column(name=field(f.name),
                                 type="token_seq" if f.multi_valued else "token")
                          for f in item_attribute_features(schema)], ".item")


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


def _check_user_feature(batch: JaggedBatch, schema: FeatureSchema, users: list[str]) -> None:
    """A context feature named like the user field must be each request's user id (one id):
    it is written once, as ``user_id``."""
    if USER_FIELD not in {f.name for f in schema.sparse_features}:
        return
    bags = _bags(batch.sparse[USER_FIELD])
    for r, (bag, user) in enumerate(zip(bags, users)):
        if bag != user:
            raise GemDataError(f"request {r}: context feature {USER_FIELD!r} is [{bag}], not the "
                             f"request's user id {user} (batch.user_ids); it would be written "
                             f"as RecBole's {USER_FIELD} column, which is the user id")


def impression_rows(batch: JaggedBatch, schema: FeatureSchema, *,
                    max_seq_len: int) -> Iterator[list[str]]:
    """The ``.inter`` fields (:func:`peer_columns`) of every impression of ``batch``, in order.
    The batch must carry ``user_ids``."""
    if batch.user_ids is None:
        raise GemDataError("the batch carries no user_ids: RecBole's user_id column (and GAUC) "
                         "need them")
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

    users = _ints(batch.user_ids)
    _check_user_feature(batch, schema, users)
    context = [_bags(batch.sparse[f.name]) for f in written_context_features(schema)]
    dense = ([[_float(v) for v in row] for row in batch.dense.tolist()]
             if batch.dense is not None and schema.num_dense else [[] for _ in range(requests)])
    per_request = [[users[r], *(bag[r] for bag in context), *dense[r]]
                   for r in range(requests)]
    per_request_history = [[h[r] for h in history] for r in range(requests)]

    candidates: list[list[str]] = []
    for feature in schema.candidate_features:
        ids = batch.candidate_ids[feature.name]
        candidates.append(_bags(ids) if isinstance(ids, Jagged) else _ints(ids))
    if schema.candidate_numeric_dim:
        if batch.candidate_numeric is None:
            raise GemDataError(f"the schema declares candidate_numeric_dim = "
                               f"{schema.candidate_numeric_dim} but the batch carries no "
                               "candidate_numeric")
        candidates += [[_float(v) for v in column]
                       for column in batch.candidate_numeric.t().tolist()]
    labels = [[_float(v) for v in batch.labels[task].tolist()] for task in schema.tasks]

    cand_offsets = batch.candidate_offsets.tolist()
    for r in range(requests):
        request = per_request[r]
        for c in range(cand_offsets[r], cand_offsets[r + 1]):
            yield [request[0], *(column[c] for column in candidates), *request[1:],
                   *per_request_history[r], *(column[c] for column in labels)]


def _item_rows(batch: JaggedBatch, schema: FeatureSchema,
               items: dict[str, tuple[str, ...]]) -> None:
    """Adds every item of ``batch`` (candidates and events) to ``items`` (item id ->
    attributes), checking that an item keeps its attributes. Where the history has no item
    ids: the candidates' item ids alone (counted, not written)."""
    if not history_has_item_ids(schema):
        for item in _ints(batch.candidate_ids[item_feature(schema).name]):
            items.setdefault(item, (item,))
        return
    features = item_attribute_features(schema)
    for store in (batch.candidate_ids, batch.event_ids):
        columns = []
        for feature in features:
            ids = store[feature.name]
            columns.append(_bags(ids) if isinstance(ids, Jagged) else _ints(ids))
        for row in zip(*columns):
            known = items.setdefault(row[0], row)
            if known != row:
                raise GemDataError(f"item {row[0]} has two sets of attributes: {known} and {row}")


def _write(path: Path, columns: Sequence[Column], rows) -> int:
    count = 0
    with path.open("w", encoding="utf-8", newline="\n") as f:
        f.write("\t".join(c.header for c in columns) + "\n")
        for row in rows:
            f.write("\t".join(row) + "\n")
            count += 1
    return count


def export_peer_dataset(out_dir: str | Path, *, data: DataConfig, seed: int, steps: int,
                        batch_size: int, epochs: int = 0, name: str = "peers") -> dict[str, Any]:
    """Writes the training and eval impressions of a run with ``[data]`` ``data``,
    ``train.seed`` ``seed``, ``train.steps`` ``steps``, ``train.batch_size`` ``batch_size`` and
    ``train.epochs`` ``epochs`` (0: ``steps`` alone decides; see :func:`train_batches`) to
    ``out_dir/<name>.*`` (see the module docstring) and returns the manifest (also written as
    ``manifest.json``). ``data`` is taken as a run's ``[data]`` section: where its
    ``data_set_wins`` names ``max_seq_len`` or ``eval_rows``, a file-backed data set's own
    values apply, as in a run; the manifest records the values applied, and as ``steps`` the
    steps such a run trains."""
    if data.order != "shuffled":
        raise GemConfigError(
            f"data.order = {data.order!r}: a time-ordered run evaluates window by window "
            "(progressive evaluation) and has no single eval split to export; export a "
            "data.order = 'shuffled' run")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = peer_source(data, seed=seed)
    applied = source.applied_config(data)
    schema = source.schema
    columns = peer_columns(schema)
    item = item_feature(schema)
    history_item_ids = history_has_item_ids(schema)
    max_seq_len = applied.max_seq_len
    items: dict[str, tuple[str, ...]] = {}
    counts = {"train_requests": 0, "eval_requests": 0}
    trained = {"steps": 0}

    def rows(batches: Iterator[JaggedBatch], split: str) -> Iterator[list[str]]:
        for batch in batches:
            if batch.user_ids is None:
                raise GemDataError(
                    f"data source {data.source!r}: its {split} batches carry no user_ids; the "
                    "peers need the request's user (RecBole's user_id, and GAUC groups eval "
                    "impressions by it)")
            counts[f"{split}_requests"] += batch.batch_size
            _item_rows(batch, schema, items)
            yield from impression_rows(batch, schema, max_seq_len=max_seq_len)

    def counted(batches: Iterator[JaggedBatch]) -> Iterator[JaggedBatch]:
        for batch in batches:
            trained["steps"] += 1
            yield batch

    train_rows = _write(out / f"{name}.train.inter", columns,
                        rows(counted(train_batches(source, steps=steps, batch_size=batch_size,
                                                   epochs=epochs)), "train"))
    users: list[np.ndarray] = []
    labels: dict[str, list[np.ndarray]] = {task: [] for task in schema.tasks}

    def eval_rows_kept() -> Iterator[JaggedBatch]:
        for batch in eval_batches(source, data):
            if batch.user_ids is not None:  # rows() refuses a batch without them
                users.append(batch.user_ids[batch.candidate_rows()].numpy())
            for task in schema.tasks:
                labels[task].append(batch.labels[task].numpy())
            yield batch

    test_path = out / f"{name}.test.inter"
    test_rows = _write(test_path, columns, rows(eval_rows_kept(), "eval"))
    with test_path.open(encoding="utf-8") as f:
        head = [next(f) for _ in range(min(test_rows, VALID_ROWS) + 1)]
    (out / f"{name}.valid.inter").write_text("".join(head), encoding="utf-8")
    item_file = out / f"{name}.item"
    if history_item_ids:
        _write(item_file, item_columns(schema), items.values())
    else:
        # An earlier export's .item in out_dir would describe other data.
        item_file.unlink(missing_ok=True)
    np.savez(out / "eval_keys.npz", user_ids=np.concatenate(users).astype(np.int64),
             **{task: np.concatenate(labels[task]).astype(np.float32)
                for task in schema.tasks})
    synthetic = isinstance(source, SyntheticAdsSource)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "name": name,
        "source": data.source,
        "path": applied.path,
        "order": applied.order,
        "options": _source_options(source, data),
        "options_given": dict(data.options),
        "data_given": attrs.asdict(data),  # [data] as given, before the source applied it
        "seed": seed,
        # synthetic-ads: the generator's seed (data.options.data_seed, else train.seed); other
        # sources shuffle with train.seed itself.
        **({"data_seed": source.seed} if synthetic else {}),
        "steps": trained["steps"],  # the steps a run trains: train.steps, or fewer by epochs
        "train_steps": steps,
        "train_epochs": epochs,
        "batch_size": batch_size,
        "eval_rows": applied.eval_rows,
        "max_seq_len": max_seq_len,
        "tasks": list(schema.tasks),
        "user_field": USER_FIELD,
        "item_field": ITEM_FIELD,
        # null where the history has no item ids (no item_id_list column: DIN, DIEN refused)
        "item_list_field": ITEM_LIST_FIELD if history_item_ids else None,
        "item_feature": item.name,
        "history_item_ids": history_item_ids,
        "event_features": [f.name for f in schema.event_features],
        "columns": [c.header for c in columns],
        "item_columns": [c.header for c in item_columns(schema)],
        "multi_valued": [f.name for f in schema.candidate_features if f.multi_valued],
        # the candidates' numeric features (a price): a peer reads them as it chooses
        "candidate_numeric_columns": candidate_numeric_columns(schema),
        "train_impressions": train_rows,
        "eval_impressions": test_rows,
        "valid_impressions": min(test_rows, VALID_ROWS),
        "items": len(items),  # candidates' and events' (without history item ids: candidates')
        **counts,
    }
    if synthetic:  # what the generating process allows on this eval split
        manifest.update(achievable_entries(source.achievable_figures()))
    text = json.dumps(manifest, indent=1)
    (out / "manifest.json").write_text(text + "\n")
    return json.loads(text)  # as a reader of manifest.json sees it (tuples as lists)


def read_atomic(path: str | Path) -> tuple[list[str], list[list[str]]]:
    """An atomic file's header (``name:type`` fields) and rows (lists of strings)."""
    with Path(path).open(encoding="utf-8") as f:
        header = f.readline().rstrip("\n").split("\t")
        rows = [line.rstrip("\n").split("\t") for line in f]
    return header, rows
