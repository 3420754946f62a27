"""The ``[import]`` table of a schema file (``gem data import``): which columns hold what, how
requests are keyed, how missing values, string categories and side tables are treated.

Read with the schema by :func:`read_schema_file`; every key is checked there against the schema,
so a typo or a contradiction stops the import before any log is read, naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from gem_core.config.validators import between

#: What the import does with a row whose feature has no value (``[import.features]``).
MISSING_POLICIES = ("error", "default", "drop")

#: How the text values of a table's features become 64-bit ids (``[import.strings]``).
STRING_POLICIES = ("hash", "vocabulary")

#: The logs a side table can join (``[[import.join]]``).
JOIN_LOGS = ("impressions", "events")

#: The log whose columns feed each kind of ``[import.features]`` / ``[import.columns]`` key.
KIND_LOG = {"event": "events", "candidate": "impressions", "sparse": "impressions",
            "dense": "impressions", "candidate_dense": "impressions"}

#: The kinds of ``[import.features]`` key that are numbers, not ids: a request's dense
#: features (``dense.<column>``) and a candidate's (``candidate_dense.<column>``).
NUMERIC_KINDS = ("dense", "candidate_dense")


@attrs.frozen(kw_only=True)
class FeatureImport:
    """One entry of ``[import.features]``: what the import does when a feature has no value."""

    missing: str = attrs.field(default="error",
                               validator=attrs.validators.in_(MISSING_POLICIES))
    """``error``: the import stops, naming file, row and column (the default). ``default``: the
    row gets :attr:`default` (a bag of that one id for multi-valued and context features).
    ``drop``: the row is left out (an event of an event feature, an impression of a candidate,
    context or dense feature; a request whose impressions are all dropped is left out). A
    missing value is a null or empty cell, an empty list, or a key not found in the feature's
    side table (``[[import.join]]``); null ids inside a list are removed (and counted), the list
    is missing when none is left; in a numeric column (``dense``, ``candidate_dense``) a NaN is
    missing too (under ``error`` it stops the import like a null; an infinite value always
    does). Every feature's counts are printed and recorded in the manifest's
    ``info.features``."""

    default: int | float | None = None
    """The value given under ``missing = "default"``: an id (for a table with ``[import.strings]``
    ``vocabulary``: 0, its reserved missing row, when not given; otherwise required), or a number
    for a dense or candidate dense feature (0.0 when not given)."""


def _features(value: Any) -> dict[str, FeatureImport]:
    from gem_core.config import structure

    return {key: item if isinstance(item, FeatureImport)
            else structure(FeatureImport, item, f"import.features.{key}")
            for key, item in dict(value).items()}


def _text_values(instance: Any, attribute: attrs.Attribute, value: dict) -> None:
    for key, item in value.items():
        if not isinstance(item, str):
            raise ValueError(f"{attribute.name}: {key!r} must name a column (a string), got "
                             f"{item!r}")


@attrs.frozen(kw_only=True)
class JoinOptions:
    """One ``[[import.join]]`` entry: a side table (ad or user attributes) joined into a log by
    key, whose columns become features."""

    file: str
    """The side table (Parquet or CSV); a relative path is relative to the schema file."""

    key: str
    """The side table's key column (integers or strings); a key that appears twice is an error
    naming the file and the key."""

    log: str = attrs.field(validator=attrs.validators.in_(JOIN_LOGS))
    """The log it joins: ``impressions`` (candidate, context, dense and candidate dense
    features) or ``events`` (event features)."""

    log_key: str | None = None
    """The joined log's column holding the key (default: the same name as :attr:`key`)."""

    features: dict[str, str] = attrs.field(factory=dict, validator=_text_values)
    """Which side-table column becomes which feature: keys ``candidate.<name>``,
    ``sparse.<name>``, ``dense.<column>``, ``candidate_dense.<column>`` (impressions) or
    ``event.<name>`` (events), values columns of the side table. A log row whose key is not in
    the side table follows each feature's ``missing`` policy."""

    @property
    def joined_column(self) -> str:
        return self.log_key or self.key


def _join(value: Any) -> tuple[JoinOptions, ...]:
    from gem_core.config import structure

    return tuple(item if isinstance(item, JoinOptions)
                 else structure(JoinOptions, item, f"import.join[{index}]")
                 for index, item in enumerate(value))


@attrs.frozen(kw_only=True)
class ImportOptions:
    """The ``[import]`` table of a schema file: which columns hold what."""

    user_column: str = "user_id"
    """Column of the user id, in both logs (integers or strings)."""

    request_column: str | None = None
    """Impression log column grouping impressions into requests (integers or strings). When
    neither it nor :attr:`request_columns` is given: ``request_id`` if the impression log has
    that column, else a request is **one user at one time** (the impressions with the same
    user and timestamp)."""

    request_columns: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """Columns whose values together key a request (``["user", "time_stamp", "session"]``),
    instead of :attr:`request_column`. A request's 64-bit id is derived from its key
    (:func:`gem_data.import_requests.request_ids`); two keys with one id stop the import."""

    timestamp_column: str = "timestamp"
    """Column of the time, in both logs: the request time (impressions of one request share
    it) and the event time."""

    columns: dict[str, str] = attrs.field(factory=dict)
    """Column of a feature whose column is not its name: keys ``event.<name>``,
    ``candidate.<name>``, ``label.<task>`` or ``sparse.<name>``, values column names."""

    dense_columns: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """Impression log columns of the ``num_dense`` dense request features, in order (the same
    on every impression of a request)."""

    candidate_dense_columns: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """Impression log columns of the candidate's numeric features (an ad's price, a bid), in
    order: one number per impression each, the schema's ``candidate_numeric_dim`` of them
    (independent of the history's ``seq_dense_dim``), written as floats per candidate and
    projected into the candidate's token by the model. A side table can give one:
    ``[[import.join]]`` with the key ``candidate_dense.<column>``; ``[import.features]``
    ``candidate_dense.<column>`` says what a missing value does."""

    strings: dict[str, str] = attrs.field(factory=dict)
    """Per table (by name), how text values of its features become ids: ``hash`` (a stable
    64-bit hash of the UTF-8 text, :func:`gem_data.import_strings.string_ids`) or
    ``vocabulary`` (ids 2, 3, ... in sorted order of the values seen at import; 0 is the
    missing row, 1 the out-of-vocabulary row). Under either, every value is taken as text (an
    integer as its decimal digits), so a CSV and a Parquet log give the same ids. Per table,
    not per column: the candidate's and the history's features of one table must agree."""

    features: dict[str, FeatureImport] = attrs.field(factory=dict, converter=_features)
    """Per feature (keys ``event.<name>``, ``candidate.<name>``, ``sparse.<name>``,
    ``dense.<column>``, ``candidate_dense.<column>``), what a missing value does
    (:class:`FeatureImport`)."""

    join: tuple[JoinOptions, ...] = attrs.field(default=(), converter=_join)
    """Side tables joined into the logs by key (:class:`JoinOptions`)."""

    delimiter: str = "|"
    """Separator of the ids of a multi-valued feature in a CSV cell (``"3|17|4"``)."""

    eval_fraction: float = attrs.field(default=0.1, validator=between(0.0, 0.9))
    """Latest share of requests (by request time) written as the eval split; 0: none (the
    ``parquet`` source then holds out trailing row groups). Requests of one time stay on one
    side, so the share written can differ (by less than half of the tied requests at the cut);
    the import reports it. Not used by ``gem data import --window``: a window's requests are
    all train (:mod:`gem_data.import_append`)."""

    time_floor: int = attrs.field(default=0, validator=attrs.validators.instance_of(int))
    """Earliest plausible time: a request or event before it stops the import, naming the row.
    The default, 0, is 1970-01-01 in seconds (a negative time is a placeholder or corrupt)."""

    def feature(self, key: str) -> FeatureImport:
        """The ``[import.features]`` entry of ``key`` (the default one when not given)."""
        return self.features.get(key, FeatureImport())


def read_schema_file(path: str | Path) -> tuple[Any, ImportOptions]:
    """The :class:`FeatureSchema` and :class:`ImportOptions` of a schema TOML file."""
    import tomllib

    from gem_core.config import structure
    from gem_core.errors import GemConfigError, GemDataError
    from gem_core.schema import schema_from_dict

    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise GemDataError(f"{path}: cannot read the schema file ({error})") from None
    section = data.pop("import", {})
    try:
        schema = schema_from_dict(data, where=str(path))  # its errors name the path
        options = structure(ImportOptions, section, "import")
    except (ValueError, GemConfigError) as error:
        message = str(error)
        raise GemDataError(message if message.startswith(str(path)) else f"{path}: {message}"
                           ) from None
    if schema.seq_dense_dim or schema.candidate_content or schema.user_embedding_dim:
        raise GemDataError(f"{path}: gem data import does not read content vectors or user "
                           "embeddings yet (seq_dense_dim, candidate_content, "
                           "user_embedding_dim must be 0)")
    _check_column_keys(path, schema, options)
    if len(options.dense_columns) != schema.num_dense:
        raise GemDataError(f"{path}: num_dense = {schema.num_dense} but import.dense_columns "
                           f"names {len(options.dense_columns)} columns")
    if len(options.candidate_dense_columns) != schema.candidate_numeric_dim:
        raise GemDataError(f"{path}: candidate_numeric_dim = {schema.candidate_numeric_dim} but "
                           f"import.candidate_dense_columns names "
                           f"{len(options.candidate_dense_columns)} columns")
    check_options(path, schema, options)
    # Side tables named relative to the schema file are found from anywhere.
    joins = tuple(attrs.evolve(j, file=str(path.parent / j.file))
                  if not Path(j.file).is_absolute() else j for j in options.join)
    return schema, attrs.evolve(options, join=joins)


def text_columns(schema: Any, options: ImportOptions, log: str) -> list[str]:
    """Columns a CSV ``log`` (``impressions`` or ``events``) reads as text, to be parsed
    exactly: keys and id features."""
    o = options
    joined = {key for join in o.join for key in join.features}
    keys = [o.user_column, o.request_column or "request_id",
            *(c for c in o.request_columns if c != o.timestamp_column)]
    keys += [j.joined_column for j in o.join if j.log == log]
    kinds = (("event", schema.event_features),) if log == "events" else \
        (("candidate", schema.candidate_features), ("sparse", schema.sparse_features))
    return keys + [o.columns.get(f"{kind}.{f.name}", f.name) for kind, features in kinds
                   for f in features if f"{kind}.{f.name}" not in joined]


def number_columns(schema: Any, options: ImportOptions, log: str) -> list[str]:
    """Columns of ``log`` read as numbers: the labels and the dense and candidate dense
    columns (impressions)."""
    if log == "events":
        return []
    joined = {key for join in options.join for key in join.features}
    return ([options.columns.get(f"label.{task}", task) for task in schema.tasks]
            + [c for c in options.dense_columns if f"dense.{c}" not in joined]
            + [c for c in options.candidate_dense_columns
               if f"candidate_dense.{c}" not in joined])


def log_columns(schema: Any, options: ImportOptions, log: str) -> list[str]:
    """Every column of ``log`` the import may read."""
    return list(dict.fromkeys([*text_columns(schema, options, log), options.timestamp_column,
                               *number_columns(schema, options, log)]))


def feature_keys(schema: Any, options: ImportOptions) -> dict[str, tuple[str, Any]]:
    """Every key of ``[import.features]``: ``key -> (kind, feature or numeric column)``."""
    keys: dict[str, tuple[str, Any]] = {}
    for kind, features in (("event", schema.event_features),
                           ("candidate", schema.candidate_features),
                           ("sparse", schema.sparse_features)):
        for f in features:
            keys[f"{kind}.{f.name}"] = (kind, f)
    for column in options.dense_columns:
        keys[f"dense.{column}"] = ("dense", column)
    for column in options.candidate_dense_columns:
        keys[f"candidate_dense.{column}"] = ("candidate_dense", column)
    return keys


def _unknown(path: Path, key: str, known: list[str], where: str, what: str) -> None:
    import difflib

    from gem_core.errors import GemDataError

    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    raise GemDataError(f"{path}: unknown key {key!r} in {where}{hint}; keys are {what}: "
                       f"{', '.join(known)}")


def _check_column_keys(path: Path, schema: Any, options: ImportOptions) -> None:
    """Refuse an ``[import.columns]`` key that names no feature or task of the schema (a typo
    would otherwise leave the feature reading the column of its own name), with close
    matches."""
    known = ([f"event.{f.name}" for f in schema.event_features]
             + [f"candidate.{f.name}" for f in schema.candidate_features]
             + [f"label.{task}" for task in schema.tasks]
             + [f"sparse.{f.name}" for f in schema.sparse_features])
    for key in options.columns:
        if key not in known:
            _unknown(path, key, known, "[import.columns]", "event.<feature>, "
                     "candidate.<feature>, label.<task> or sparse.<feature> of the schema")


def check_options(path: Path, schema: Any, options: ImportOptions) -> None:
    """The cross-checks of request keys, ``[import.features]``, ``[import.strings]`` and
    ``[[import.join]]`` against the schema, naming the key."""
    from gem_core.errors import GemDataError

    def fail(message: str) -> None:
        raise GemDataError(f"{path}: {message}")

    if options.request_column is not None and options.request_columns:
        fail("give import.request_column or import.request_columns, not both")
    if len(set(options.request_columns)) != len(options.request_columns):
        fail(f"import.request_columns names a column twice: {list(options.request_columns)}")
    tables = [t.name for t in schema.tables]
    for table, policy in options.strings.items():
        if table not in tables:
            _unknown(path, table, tables, "[import.strings]", "table names of the schema")
        if policy not in STRING_POLICIES:
            fail(f"import.strings.{table} must be one of {', '.join(STRING_POLICIES)}, got "
                 f"{policy!r}")
        if policy == "hash" and schema.table(table).id_policy == "dense":
            fail(f'import.strings.{table} = "hash" gives 64-bit ids, which table {table!r} '
                 '(id_policy dense) has no rows for: give it id_policy = "hash" (or "modulo", '
                 '"managed"), or use import.strings = "vocabulary"')
    if isinstance(schema.view_action, str):
        table = next(f.table for f in schema.event_features if f.name == schema.action_feature)
        if options.strings.get(table) != "vocabulary":
            fail(f"view_action = {schema.view_action!r} is an action's text, looked up in the "
                 f"vocabulary of table {table!r} (action_feature {schema.action_feature!r}): "
                 f'it needs import.strings.{table} = "vocabulary", or give the raw id')
    keys = feature_keys(schema, options)
    for key, entry in options.features.items():
        if key not in keys:
            _unknown(path, key, list(keys), "[import.features]", "event.<feature>, "
                     "candidate.<feature>, sparse.<feature>, dense.<column> or "
                     "candidate_dense.<column>")
        kind, feature = keys[key]
        where = f"import.features.{key!r}"
        if kind in NUMERIC_KINDS:
            continue
        if entry.default is not None and not isinstance(entry.default, int):
            fail(f"{where}.default must be an integer id, got {entry.default!r}")
        table = schema.table(feature.table)
        if entry.missing == "default" and entry.default is None \
                and options.strings.get(table.name) != "vocabulary":
            fail(f'{where}: missing = "default" needs a default id (default = ...); only a table '
                 'with import.strings = "vocabulary" has a reserved missing row')
        if entry.default is not None and table.id_policy == "dense" \
                and not 0 <= entry.default < table.num_embeddings:
            fail(f"{where}.default = {entry.default} is outside [0, {table.num_embeddings}) of "
                 f"table {table.name!r} (id_policy dense)")
    sourced: dict[str, str] = {}
    for index, join in enumerate(options.join):
        where = f"import.join[{index}] ({join.file})"
        if not join.features:
            fail(f"{where}: features is empty; name which side-table columns become which "
                 "features")
        for key in join.features:
            if key not in keys:
                _unknown(path, key, list(keys), f"{where}.features", "event.<feature>, "
                         "candidate.<feature>, sparse.<feature>, dense.<column> or "
                         "candidate_dense.<column>")
            kind = keys[key][0]
            if KIND_LOG[kind] != join.log:
                fail(f"{where}: {key} is a feature of the {KIND_LOG[kind]} log, but the join "
                     f"has log = {join.log!r}")
            if key in sourced:
                fail(f"{where}: {key} is already taken from {sourced[key]}")
            if key in options.columns:
                fail(f"{where}: {key} is also in [import.columns]; a feature has one source")
            sourced[key] = join.file
