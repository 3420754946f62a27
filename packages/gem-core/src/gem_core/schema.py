"""The feature schema: what a request-level training example holds, declared by the data set.

A row of data is one **request**: one user's history (a jagged list of events, oldest first),
the user's and context's non-sequence features, and ``K >= 1`` **candidates** (the ads shown in
that request), each with its own features and per-task labels. Nothing here names an item id or
an action specially: a data set declares

- its **embedding tables** (id space and how raw ids reach it: :class:`EmbeddingTable`);
- **event features**: categorical attributes of every history event (ad id, advertiser,
  category, action type, ...), each single- or multi-valued per event, each looked up in a
  declared table;
- **candidate features**, which may share a table with an event feature (the candidate's ad id
  and each event's ad id index one table, so candidate tokens live in the event space);
- **context features**: pooled multi-hot ids of the user or request (segments, surface, ...);
- dense vectors (per event, per candidate, per request) and the free-named binary **tasks**.

The model, the TorchRec plan, validation, the loader and the exports all follow this schema.
"""

from __future__ import annotations

from typing import Iterator

import attrs

_positive = attrs.validators.gt(0)

#: How a raw id reaches its table's rows (see :class:`EmbeddingTable`).
ID_POLICIES = ("dense", "modulo", "hash", "managed")

#: Which live id a full ``managed`` table evicts for a new one (TorchRec's MCH eviction policies).
EVICTION_POLICIES = ("lru", "lfu", "distance_lfu")

#: The fields of :class:`EmbeddingTable` that only a ``managed`` table uses (left out of the
#: plain-data form of other tables, so their schema reads as it did before the policy existed).
MANAGED_FIELDS = ("eviction_policy", "eviction_decay")


def _unique_names(instance: object, attribute: attrs.Attribute, value: tuple) -> None:
    names = [feature.name for feature in value]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{attribute.name} names must be unique, "
                         f"repeated: {', '.join(duplicates)}")


def _feature_name(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not value or not all(c.isalnum() or c in "_-" for c in value):
        raise ValueError(f"feature and table names are words of letters, digits, '_' or '-'; "
                         f"got {value!r}")


@attrs.frozen(kw_only=True)
class EmbeddingTable:
    """One embedding table: its rows and how the raw ids of its features are mapped to rows."""

    name: str = attrs.field(validator=_feature_name)
    """Table name (unique); features refer to it by this name."""

    num_embeddings: int = attrs.field(validator=_positive)
    """Rows of the table."""

    id_policy: str = attrs.field(default="dense", validator=attrs.validators.in_(ID_POLICIES))
    """``dense``: raw ids are already rows, ``0 .. num_embeddings - 1``; any other id is an
    error naming file, row, feature and value. ``modulo``: row = id mod ``num_embeddings`` (ids
    that are small integers with a known bound). ``hash``: row = a stable 64-bit mix of the raw
    id (splitmix64's finalizer) mod ``num_embeddings``, for unbounded 64-bit hashed ids; distinct
    ids may share a row (``gem data inspect`` reports the collision rate). ``managed``:
    zero-collision hashing by TorchRec's managed-collision module (``MCHManagedCollisionModule``):
    the raw 64-bit ids reach the embedding backend untouched and its remapper gives each id a row
    of its own while the id is live; when the table is full, a new id takes the row of the id
    :attr:`eviction_policy` evicts. The last row is the remapper's shared row for ids that hold
    none (seen first in evaluation, or more new ids in one batch than there are free rows), so a
    managed table keeps ``num_embeddings - 1`` ids live. The remapper's state (id -> row, its
    counters) is part of the model and of its checkpoints; evaluation only looks ids up, it
    never inserts them. Needs an embedding backend that declares the ``managed_ids`` capability
    (``torchrec-managed``) and, on several ranks, ``--embedding-sharding torchrec``."""

    eviction_policy: str = attrs.field(default="lru",
                                       validator=attrs.validators.in_(EVICTION_POLICIES))
    """``managed`` tables only: which live id a new id replaces when the table is full. ``lru``:
    the one seen longest ago; ``lfu``: the one seen the fewest times; ``distance_lfu``: the
    fewest times, each count weighted down by its age (:attr:`eviction_decay`). Ids of the
    current batch are kept first, whatever the policy."""

    eviction_decay: float = attrs.field(default=1.0, validator=attrs.validators.gt(0))
    """``distance_lfu`` only: the exponent of the age (in steps) that divides an id's count,
    score = count / age ** eviction_decay; larger values forget old ids faster."""

    def __attrs_post_init__(self) -> None:
        defaults = {f.name: f.default for f in attrs.fields(EmbeddingTable)}
        if self.id_policy != "managed":
            changed = [name for name in MANAGED_FIELDS if getattr(self, name) != defaults[name]]
            if changed:
                raise ValueError(f"table {self.name!r}: {', '.join(changed)} applies to "
                                 f"id_policy 'managed' only; this table's is {self.id_policy!r}")
            return
        if self.num_embeddings < 2:
            raise ValueError(f"table {self.name!r}: a managed table needs at least 2 rows (the "
                             "last one is the shared row of ids that hold none)")
        if self.eviction_policy != "distance_lfu" and self.eviction_decay != 1.0:
            raise ValueError(f"table {self.name!r}: eviction_decay weighs the counts of "
                             f"eviction_policy 'distance_lfu'; this table's policy is "
                             f"{self.eviction_policy!r}")


@attrs.frozen(kw_only=True)
class SequenceFeature:
    """A categorical attribute of every history event, or of every candidate."""

    name: str = attrs.field(validator=_feature_name)
    """Feature name (the data column is ``event.<name>`` or ``candidate.<name>``)."""

    table: str = attrs.field(validator=_feature_name)
    """The declared table its ids index; an event and a candidate feature may share one."""

    multi_valued: bool = False
    """Several ids per event (a movie's genres, an ad's topics), jagged within the event, pooled
    into one vector per event; at least one id per event (an empty list is an error)."""

    pooling: str = attrs.field(default="mean", validator=attrs.validators.in_(("sum", "mean")))
    """How a multi-valued feature's ids are pooled into the event's (or candidate's) vector."""


@attrs.frozen(kw_only=True)
class ContextFeature:
    """A multi-hot feature of the user or the request, pooled into one vector per request."""

    name: str = attrs.field(validator=_feature_name)
    """Feature name (the data column is ``sparse.<name>``)."""

    table: str = attrs.field(validator=_feature_name)
    """The declared table its ids index (used by context features only)."""

    pooling: str = attrs.field(default="sum", validator=attrs.validators.in_(("sum", "mean")))
    """How the bag is reduced to one vector."""


@attrs.frozen(kw_only=True)
class FeatureSchema:
    """Every feature a batch carries. Data sources declare it; the model is built from it."""

    tables: tuple[EmbeddingTable, ...] = attrs.field(converter=tuple, validator=_unique_names)
    """The embedding tables every categorical feature indexes."""

    event_features: tuple[SequenceFeature, ...] = attrs.field(
        converter=tuple, validator=_unique_names)
    """Categorical attributes of each history event (at least one)."""

    candidate_features: tuple[SequenceFeature, ...] = attrs.field(
        converter=tuple, validator=_unique_names)
    """Categorical attributes of each candidate (at least one)."""

    sparse_features: tuple[ContextFeature, ...] = attrs.field(
        default=(), converter=tuple, validator=_unique_names)
    """Non-sequence multi-hot features of the user or context, pooled into one vector each."""

    num_dense: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Number of dense float features per request."""

    seq_dense_dim: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Width of the optional dense content vector of each history event (0: none)."""

    candidate_content: bool = False
    """Each candidate carries a content vector in the history's space (``seq_dense_dim`` floats,
    ``JaggedBatch.candidate_dense``)."""

    candidate_numeric_dim: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Number of numeric features of each candidate (an ad's price, a bid:
    ``JaggedBatch.candidate_numeric``), independent of ``seq_dense_dim``; the model projects
    them into the candidate's token beside its categorical features. 0: none."""

    tasks: tuple[str, ...] = attrs.field(default=("click", "conversion"), converter=tuple)
    """Binary label names, one prediction head each; a label per candidate."""

    user_embedding_dim: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Width of a precomputed user embedding carried by each request (0: none). Set by data sets
    exported with ``gem export-user-embeddings``: the upstream tower's output, so a downstream
    ranker can train and evaluate without running the tower."""

    max_seq_len: int = attrs.field(default=1024, validator=_positive)
    """Longest history the data holds (after truncation to the most recent events)."""

    teacher_tasks: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """Tasks whose teacher logit each candidate carries (``JaggedBatch.teacher_logits``): data
    sets written by ``gem distill-precompute`` for a student of ``gem distill``. Not a
    feature: :func:`without_teacher_signals` leaves it out when schemas are compared."""

    teacher_embedding_dim: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Width of the teacher's user embedding each request carries
    (``JaggedBatch.teacher_embedding``; 0: none). Not a feature, like ``teacher_tasks``."""

    action_feature: str = ""
    """The event feature holding each event's kind of action (a page view, a click, a cart, a
    purchase), where the data's events come in kinds: a single-valued event feature. Empty
    where they do not (every event a rating, a play). Not a feature of its own but what one
    feature means: a model option set to ``model.action_feature = "schema"`` reads it, so a
    preset can turn on what reads actions where the data declares them and leave it off where
    it does not."""

    view_action: int | str = 0
    """The most common, least engaged action of ``action_feature`` (the page view): its raw id,
    or its text (``"pv"``) where the data set keeps a vocabulary of the feature's table
    (``[import.strings]``), looked up when a run starts. Needs ``action_feature``."""

    def __attrs_post_init__(self) -> None:
        if not self.event_features:
            raise ValueError("the schema declares no event features: a history event needs at "
                             "least one categorical attribute (its item or ad id)")
        if not self.candidate_features:
            raise ValueError("the schema declares no candidate features: a candidate needs at "
                             "least one categorical attribute (its item or ad id)")
        if not self.tasks or len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"tasks must be distinct and at least one, got {list(self.tasks)}")
        if not set(self.teacher_tasks) <= set(self.tasks):
            raise ValueError(f"teacher_tasks {list(self.teacher_tasks)} must be among the tasks "
                             f"{list(self.tasks)}")
        if self.candidate_content and not self.seq_dense_dim:
            raise ValueError("candidate_content needs seq_dense_dim > 0 (the candidate's content "
                             "vector lives in the history's space)")
        names = {t.name for t in self.tables}
        users: dict[str, set[str]] = {}
        for where, features in (("event", self.event_features),
                                ("candidate", self.candidate_features),
                                ("context", self.sparse_features)):
            for feature in features:
                if feature.table not in names:
                    raise ValueError(
                        f"{where} feature {feature.name!r} names table {feature.table!r}, which "
                        f"is not declared; declared tables: {', '.join(sorted(names)) or 'none'}")
                users.setdefault(feature.table, set()).add(where)
        for table, kinds in users.items():
            if "context" in kinds and len(kinds) > 1:
                raise ValueError(
                    f"table {table!r} is used by a context feature and by event or candidate "
                    "features; context features are pooled per request and need a table of "
                    "their own")
        unused = sorted(names - set(users))
        if unused:
            raise ValueError(f"tables {', '.join(unused)} are declared but no feature uses them")
        self._check_actions()

    def _check_actions(self) -> None:
        """Raise ValueError unless the declared actions name a single-valued event feature."""
        if not self.action_feature:
            if self.view_action not in (0, ""):
                raise ValueError(f"view_action = {self.view_action!r} needs action_feature (the "
                                 "event feature holding each event's action)")
            return
        events = {feature.name: feature for feature in self.event_features}
        feature = events.get(self.action_feature)
        if feature is None:
            raise ValueError(f"action_feature = {self.action_feature!r} is not an event feature; "
                             f"event features: {', '.join(sorted(events))}")
        if feature.multi_valued:
            raise ValueError(f"action_feature = {self.action_feature!r} is multi-valued; an "
                             "event has one action")
        if isinstance(self.view_action, bool) or not isinstance(self.view_action, (int, str)):
            raise ValueError(f"view_action must be a raw id (an integer) or the action's text; "
                             f"got {self.view_action!r}")

    def table(self, name: str) -> EmbeddingTable:
        """The declared table ``name``."""
        for table in self.tables:
            if table.name == name:
                return table
        raise KeyError(f"no table {name!r}; declared: {', '.join(t.name for t in self.tables)}")

    def id_features(self) -> Iterator[tuple[str, SequenceFeature | ContextFeature]]:
        """Every categorical feature with its kind (``event``, ``candidate``, ``context``)."""
        for feature in self.event_features:
            yield "event", feature
        for feature in self.candidate_features:
            yield "candidate", feature
        for feature in self.sparse_features:
            yield "context", feature


def feature_key(kind: str, name: str) -> str:
    """The name under which a feature's ids travel to the embedding backend (and TorchRec's
    KeyedJaggedTensor): ``event.<name>``, ``candidate.<name>`` or the context feature's name."""
    return name if kind == "context" else f"{kind}.{name}"


_SECTIONS = {"tables": EmbeddingTable, "event_features": SequenceFeature,
             "candidate_features": SequenceFeature, "sparse_features": ContextFeature}


def schema_to_dict(schema: FeatureSchema) -> dict:
    """The schema as plain data (JSON or TOML ready): the form of a data set's manifest and of
    the schema file a user writes for their own data (see :func:`schema_from_dict`)."""
    data = attrs.asdict(schema, recurse=True)
    for table in data["tables"]:
        if table["id_policy"] != "managed":
            for name in MANAGED_FIELDS:
                del table[name]
    # Teacher signals (gem distill-precompute) and candidate numeric features are written only
    # where a data set has them, so every other schema (and its digest) reads as it did before
    # they existed.
    for name in (*TEACHER_FIELDS, "candidate_numeric_dim"):
        if not data[name]:
            del data[name]
    # Likewise the declared actions, only where a data set declares them.
    if not data["action_feature"]:
        for name in ACTION_FIELDS:
            del data[name]
    return data


TEACHER_FIELDS = ("teacher_tasks", "teacher_embedding_dim")

#: The fields that say which event feature holds the actions: a description of a feature,
#: not one (a model's options resolve it when a run starts; see ``model.action_feature``).
ACTION_FIELDS = ("action_feature", "view_action")


def without_teacher_signals(schema: FeatureSchema) -> FeatureSchema:
    """``schema`` without the teacher's columns: the features a model is built from, which
    a precomputed-teacher data set shares with the data the teacher was trained on."""
    return attrs.evolve(schema, teacher_tasks=(), teacher_embedding_dim=0)


def schema_from_dict(data: dict, where: str = "schema") -> FeatureSchema:
    """The :class:`FeatureSchema` of ``data`` (a manifest's ``schema`` or a user's TOML schema
    file), with errors that name ``where``, the section and the field.

    Example (TOML)::

        tasks = ["click", "conversion"]
        max_seq_len = 512
        [[tables]]
        name = "ad"
        num_embeddings = 1000000
        id_policy = "hash"
        [[tables]]
        name = "genre"
        num_embeddings = 32
        [[event_features]]
        name = "ad_id"
        table = "ad"
        [[event_features]]
        name = "genres"
        table = "genre"
        multi_valued = true
        [[candidate_features]]
        name = "ad_id"
        table = "ad"
    """
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a table of schema fields, got {type(data).__name__}")
    known = {f.name for f in attrs.fields(FeatureSchema)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(known))}")
    kwargs: dict = {}
    for key, value in data.items():
        if key in _SECTIONS:
            cls = _SECTIONS[key]
            fields = {f.name for f in attrs.fields(cls)}
            items = []
            for index, item in enumerate(value or []):
                if not isinstance(item, dict):
                    raise ValueError(f"{where}: {key}[{index}] must be a table, got {item!r}")
                extra = sorted(set(item) - fields)
                if extra:
                    raise ValueError(f"{where}: {key}[{index}] has unknown field(s) "
                                     f"{', '.join(extra)}; known: {', '.join(sorted(fields))}")
                try:
                    items.append(cls(**item))
                except (TypeError, ValueError) as error:
                    raise ValueError(f"{where}: {key}[{index}]: {error}") from None
            kwargs[key] = tuple(items)
        else:
            kwargs[key] = tuple(value) if key in ("tasks", "teacher_tasks") else value
    try:
        return FeatureSchema(**kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None
