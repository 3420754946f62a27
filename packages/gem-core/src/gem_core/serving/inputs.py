"""The flat tensor inputs of an exported program, named after the data set's feature schema.

An exported program takes one ``dict[str, Tensor]`` (no attrs classes, no gem imports needed to
call it). A request-level :class:`~gem_core.batch.JaggedBatch` maps to it one field at a time:

==============================  =========================  ====================================
input                           shape                      what
==============================  =========================  ====================================
``seq_offsets``                 ``(requests + 1,)`` int64  history events of request r:
                                                           ``seq_offsets[r]:seq_offsets[r+1]``
``seq_timestamps``              ``(events,)`` int64        event times (seconds)
``event.<name>``                ``(events,)`` int64        single-valued event feature ids
``event.<name>.values/offsets`` ``(ids,)``, ``(events+1,)`` multi-valued event feature ids
``request_timestamps``          ``(requests,)`` int64      request times (seconds)
``candidate_offsets``           ``(requests + 1,)`` int64  candidates of request r
``candidate.<name>``            ``(candidates,)`` int64    single-valued candidate feature ids
``candidate.<name>.values/...`` as for events              multi-valued candidate feature ids
``sparse.<name>.values/offsets`` ``(ids,)``, ``(requests+1,)`` context feature ids (multi-hot)
``dense``                       ``(requests, num_dense)``  dense float features
``seq_dense``                   ``(events, seq_dense_dim)`` history content vectors
``candidate_dense``             ``(candidates, seq_dense_dim)`` candidate content vectors
``candidate_numeric``           ``(candidates, width)``    candidate numeric features (price)
``user_embedding``              ``(requests, width)``      cached upstream user embedding
==============================  =========================  ====================================

Which of them a program takes depends on the program (the user tower reads no candidates; the
ranker reads the user embedding instead of running the tower) and on the schema (no ``dense``
without dense features). :func:`input_specs` lists them, :func:`batch_inputs` builds the dict
from a batch, and :func:`batch_from_inputs` is the inverse the programs run inside the graph.
"""

from __future__ import annotations

from typing import Mapping

import attrs
import torch
from torch import Tensor

from gem_core.batch import Ids, JaggedBatch
from gem_core.jagged import Jagged
from gem_core.schema import FeatureSchema

#: The groups of inputs a program can read.
HISTORY, CANDIDATES, CONTEXT, USER_EMBEDDING = "history", "candidates", "context", "user_embedding"


@attrs.frozen(kw_only=True)
class InputSpec:
    """One flat input of an exported program."""

    name: str
    """The key in the input dict."""
    dtype: str
    """``int64`` or ``float32``."""
    shape: tuple[str | int, ...]
    """Symbolic dims by name (``requests``, ``events``, ...) and fixed widths as ints."""
    source: str
    """Where it comes from in the data set: ``<kind> feature <name>`` or the batch field."""


def _id_inputs(prefix: str, dim: str, features, where: str) -> list[InputSpec]:
    specs = []
    for feature in features:
        name = f"{prefix}.{feature.name}"
        source = f"{where} feature {feature.name!r} (table {feature.table!r})"
        if feature.multi_valued:
            specs += [InputSpec(name=f"{name}.values", dtype="int64", shape=(f"{name}.ids",),
                                source=f"{source}: every id, back to back"),
                      InputSpec(name=f"{name}.offsets", dtype="int64", shape=(f"{dim}+1",),
                                source=f"{source}: offsets of each {dim[:-1]}'s ids")]
        else:
            specs.append(InputSpec(name=name, dtype="int64", shape=(dim,), source=source))
    return specs


def input_specs(schema: FeatureSchema, groups: tuple[str, ...]) -> list[InputSpec]:
    """The inputs of a program that reads ``groups`` (of :data:`HISTORY`, :data:`CANDIDATES`,
    :data:`CONTEXT`, :data:`USER_EMBEDDING`) of a data set with ``schema``, in a fixed order."""
    specs: list[InputSpec] = []
    if HISTORY in groups:
        specs += [InputSpec(name="seq_offsets", dtype="int64", shape=("requests+1",),
                            source="history: offsets of each request's events"),
                  InputSpec(name="seq_timestamps", dtype="int64", shape=("events",),
                            source="history: event time in seconds")]
        specs += _id_inputs("event", "events", schema.event_features, "event")
        if schema.seq_dense_dim:
            specs.append(InputSpec(name="seq_dense", dtype="float32",
                                   shape=("events", schema.seq_dense_dim),
                                   source="history: content vector of each event"))
    if HISTORY in groups or CANDIDATES in groups:
        specs.append(InputSpec(name="request_timestamps", dtype="int64", shape=("requests",),
                               source="request time in seconds"))
    if CANDIDATES in groups:
        specs.append(InputSpec(name="candidate_offsets", dtype="int64", shape=("requests+1",),
                               source="offsets of each request's candidates"))
        specs += _id_inputs("candidate", "candidates", schema.candidate_features, "candidate")
        if schema.candidate_content:
            specs.append(InputSpec(name="candidate_dense", dtype="float32",
                                   shape=("candidates", schema.seq_dense_dim),
                                   source="content vector of each candidate"))
        if schema.candidate_numeric_dim:
            specs.append(InputSpec(name="candidate_numeric", dtype="float32",
                                   shape=("candidates", schema.candidate_numeric_dim),
                                   source="numeric features of each candidate"))
    if CONTEXT in groups:
        for feature in schema.sparse_features:
            name = f"sparse.{feature.name}"
            source = f"context feature {feature.name!r} (table {feature.table!r})"
            specs += [InputSpec(name=f"{name}.values", dtype="int64", shape=(f"{name}.ids",),
                                source=f"{source}: every id, back to back"),
                      InputSpec(name=f"{name}.offsets", dtype="int64", shape=("requests+1",),
                                source=f"{source}: offsets of each request's ids")]
        if schema.num_dense:
            specs.append(InputSpec(name="dense", dtype="float32",
                                   shape=("requests", schema.num_dense),
                                   source="dense features of each request"))
    if USER_EMBEDDING in groups:
        specs.append(InputSpec(name="user_embedding", dtype="float32",
                               shape=("requests", schema.user_embedding_dim),
                               source="user_embedding column (gem export-user-embeddings)"))
    return specs


def _put_ids(out: dict[str, Tensor], prefix: str, features, store: Mapping[str, Ids]) -> None:
    for feature in features:
        ids = store[feature.name]
        name = f"{prefix}.{feature.name}"
        if isinstance(ids, Jagged):
            out[f"{name}.values"], out[f"{name}.offsets"] = ids.values, ids.offsets
        else:
            out[name] = ids


def batch_inputs(batch: JaggedBatch, schema: FeatureSchema,
                 groups: tuple[str, ...]) -> dict[str, Tensor]:
    """The input dict of a program that reads ``groups`` for ``batch`` (contiguous tensors, in
    the order of :func:`input_specs`)."""
    out: dict[str, Tensor] = {}
    if HISTORY in groups:
        out["seq_offsets"], out["seq_timestamps"] = batch.seq_offsets, batch.seq_timestamps
        _put_ids(out, "event", schema.event_features, batch.event_ids)
        if schema.seq_dense_dim:
            out["seq_dense"] = batch.seq_dense
    if HISTORY in groups or CANDIDATES in groups:
        out["request_timestamps"] = batch.request_timestamps
    if CANDIDATES in groups:
        out["candidate_offsets"] = batch.candidate_offsets
        _put_ids(out, "candidate", schema.candidate_features, batch.candidate_ids)
        if schema.candidate_content:
            out["candidate_dense"] = batch.candidate_dense
        if schema.candidate_numeric_dim:
            out["candidate_numeric"] = batch.candidate_numeric
    if CONTEXT in groups:
        for feature in schema.sparse_features:
            bag = batch.sparse[feature.name]
            out[f"sparse.{feature.name}.values"] = bag.values
            out[f"sparse.{feature.name}.offsets"] = bag.offsets
        if schema.num_dense:
            out["dense"] = batch.dense
    if USER_EMBEDDING in groups:
        if batch.user_embedding is None:
            raise ValueError("the program reads the cached user embedding but the batch has "
                             "none: score a data set written by gem export-user-embeddings")
        out["user_embedding"] = batch.user_embedding
    for spec in input_specs(schema, groups):
        if spec.name not in out or out[spec.name] is None:
            raise ValueError(f"the batch has no {spec.name!r} ({spec.source})")
    return {name: tensor.contiguous() for name, tensor in out.items()}


def _get_ids(inputs: Mapping[str, Tensor], prefix: str, features) -> dict[str, Ids]:
    out: dict[str, Ids] = {}
    for feature in features:
        name = f"{prefix}.{feature.name}"
        out[feature.name] = (Jagged(inputs[f"{name}.values"], inputs[f"{name}.offsets"])
                             if feature.multi_valued else inputs[name])
    return out


def _no_rows(features, requests: int, device: torch.device) -> dict[str, Ids]:
    """Ids of zero events (or candidates) of ``requests`` requests, for a program that does not
    read that group."""
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return {f.name: (Jagged(empty, torch.zeros(1, dtype=torch.int64, device=device))
                     if f.multi_valued else empty) for f in features}


def batch_from_inputs(inputs: Mapping[str, Tensor], schema: FeatureSchema,
                      groups: tuple[str, ...]) -> JaggedBatch:
    """The batch a program's model runs on, rebuilt from its flat inputs (traced into the
    graph). A group the program does not read is empty: no events (the ranker of a model whose
    downstream reads no history) or no candidates (the user tower)."""
    anchor = (inputs["request_timestamps"] if "request_timestamps" in inputs
              else inputs["user_embedding"] if "user_embedding" in inputs
              else inputs["dense"])
    requests, device = anchor.shape[0], anchor.device
    no_offsets = torch.zeros(requests + 1, dtype=torch.int64, device=device)
    no_floats = torch.zeros(0, schema.seq_dense_dim, device=device)
    if HISTORY in groups:
        seq_offsets, seq_timestamps = inputs["seq_offsets"], inputs["seq_timestamps"]
        event_ids = _get_ids(inputs, "event", schema.event_features)
        seq_dense = inputs["seq_dense"] if schema.seq_dense_dim else None
    else:
        seq_offsets = no_offsets
        seq_timestamps = torch.zeros(0, dtype=torch.int64, device=device)
        event_ids = _no_rows(schema.event_features, requests, device)
        seq_dense = no_floats if schema.seq_dense_dim else None
    if CANDIDATES in groups:
        candidate_offsets = inputs["candidate_offsets"]
        candidate_ids = _get_ids(inputs, "candidate", schema.candidate_features)
        candidate_dense = inputs["candidate_dense"] if schema.candidate_content else None
        candidate_numeric = inputs.get("candidate_numeric")
    else:
        candidate_offsets = no_offsets
        candidate_ids = _no_rows(schema.candidate_features, requests, device)
        candidate_dense = no_floats if schema.candidate_content else None
        candidate_numeric = (torch.zeros(0, schema.candidate_numeric_dim, device=device)
                             if schema.candidate_numeric_dim else None)
    return JaggedBatch(
        seq_offsets=seq_offsets, seq_timestamps=seq_timestamps, event_ids=event_ids,
        request_timestamps=(inputs["request_timestamps"] if "request_timestamps" in inputs
                            else torch.zeros(requests, dtype=torch.int64, device=device)),
        candidate_offsets=candidate_offsets, candidate_ids=candidate_ids, labels={},
        sparse={f.name: Jagged(inputs[f"sparse.{f.name}.values"],
                               inputs[f"sparse.{f.name}.offsets"])
                for f in schema.sparse_features} if CONTEXT in groups else {},
        dense=inputs["dense"] if CONTEXT in groups and schema.num_dense else None,
        seq_dense=seq_dense, candidate_dense=candidate_dense,
        candidate_numeric=candidate_numeric, user_embedding=inputs.get("user_embedding"),
    )
