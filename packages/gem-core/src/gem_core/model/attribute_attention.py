"""Attribute attention: a learned, unnormalised target attention that scores every history event
against the candidate attribute by attribute (an activation unit, as DIN calls it).

Soft dot-product target attention (:mod:`gem_core.model.target_attention`) compares one query,
the candidate's summed token, with one key per event, and a softmax then divides the weights
among the events. Both work against what ads labels say: "an engaged event shares the
candidate's advertiser" is a statement about one attribute of a few events, and the softmax
turns "how many such events" into "what share of the history", which is gone when the history
is long. Measured on ``synthetic-ads`` (docs/results.md) soft target attention alone stays at
the pooled baseline's NE.

Here each attribute a candidate shares with the events (a candidate feature and an event feature
on one table: ad id, advertiser, category, a multi-valued genre or topic list pooled per event)
is compared on its own. For candidate ``n``, event ``e`` and shared attribute ``p``, with ``q_p``
the candidate's vector of that attribute and ``k_p`` the event's, a small MLP sees::

    hidden(n, e) = act( sum_p [ A_p q_p + A2_p q_p^2 + B_p k_p + B2_p k_p^2 + C_p (q_p * k_p)
                                + S_p cos(q_p, k_p) ] + G x_e + H h_e + b )
                                                     (q, k, x, h each RMS-normalised)
    weight(n, e, p) = W_p hidden(n, e) + c_p          (no softmax: "how much" survives)
    out(n) = proj( sum_e sum_p weight(n, e, p) * V_p x_e )

``x_e`` is the event's raw token (its attributes, action, age bucket, position from the end and
content) and ``h_e`` the sequence tower's output for it, so the weight can depend on how and
when the user engaged, not only on what the event was. The squares make ``(q - k)^2`` a linear
function of the inputs, so equality of an attribute is as easy to read as similarity; DIN's
``q - k`` term is linear in ``q`` and ``k`` and is covered by ``A`` and ``B``. Only ``C_p`` runs
per (candidate, event) pair; every other term is computed once per candidate or once per event
and broadcast, which keeps the cost near ``2 N W d h`` per attribute.

Every input vector is RMS-normalised (no learned scale) before it enters the MLP: embeddings
start small (std 0.05), and ``q * k`` of two such vectors is of order 1e-3, which left the
product term, the only one that can see equality, too weak to learn from; normalised, equal
attributes give products of mean 1 and unrelated ones of mean 0 from the first step. The
cosine ``cos(q_p, k_p)`` (the mean of those products) is fed on its own through ``S_p``: ``C_p``
starts as random directions, under which equality is no more visible than any other pattern,
while the cosine is 1 for equal attributes and near 0 for unrelated ones at initialisation, so
every hidden unit can read "same advertiser" from the first step.

For an attribute that is multi-valued on either side (genres, topics), the pooled vectors'
cosine blurs a one-value overlap among several values (a candidate of three topics sharing one
with the event is as far from it as one sharing none, once the means are taken). With
``overlap`` each such pair also feeds every hidden unit a **soft overlap count**::

    overlap_p(n, e) = sum_{a in values_p(n)} max_{b in values_p(e)} cos(u_a, u_b)

through its own ``O_p`` (beside ``S_p``), where ``u`` are the values' own vectors
(RMS-normalised). With equal ids giving cosine 1 and unrelated ones near 0, it counts the
candidate's values that the event has, from the first step, and stays a learned similarity
(values whose vectors grow alike count as shared). A single-valued side is a set of one.

The events scored are the most recent ``history`` of each request (0: all of them), padded per
candidate to the longest with a mask (a request's candidates share its events).
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gem_core.flops import linear_layer_flops
from gem_core.jagged import Jagged, max_length, positions_in_row, row_ids
from gem_core.model.interest_evolution import InterestEvolution
from gem_core.model.target_match import recent_event_index
from gem_core.schema import feature_key


def _unit(vectors: Tensor) -> Tensor:
    """RMS-normalised over the last dimension, no learned scale."""
    return F.rms_norm(vectors, (vectors.shape[-1],), eps=1e-6)


def _padded_units(values: Jagged | Tensor) -> tuple[Tensor, Tensor]:
    """A feature's vectors as ``(rows, width, d)`` RMS-normalised sets, padded to the widest
    row, and ``(rows, width)`` which slots hold a value. A plain ``(rows, d)`` tensor (a
    single-valued feature) is a set of one per row."""
    if not isinstance(values, Jagged):
        unit = _unit(values).unsqueeze(1)
        return unit, torch.ones(unit.shape[:2], dtype=torch.bool, device=unit.device)
    rows, width = values.offsets.numel() - 1, max_length(values.lengths())
    padded = values.values.new_zeros(rows, width, values.values.shape[1])
    present = torch.zeros(rows, width, dtype=torch.bool, device=padded.device)
    where = (row_ids(values.offsets), positions_in_row(values.offsets))
    padded = padded.index_put(where, _unit(values.values))
    present = present.index_put(where, torch.ones_like(where[0], dtype=torch.bool))
    return padded, present


def soft_overlap(candidate: Jagged | Tensor, event: Jagged | Tensor, index: Tensor) -> Tensor:
    """``(N, W)``: for candidate ``n`` and its ``W`` scored events (``index`` into the events),
    the sum over the candidate's values of each one's best cosine with the event's values (the
    module docstring's ``overlap_p``). Every event and candidate holds at least one value (the
    schema's rule for multi-valued features)."""
    q, q_present = _padded_units(candidate)  # (N, C, d)
    k, k_present = _padded_units(event)  # (E, V, d)
    cosines = torch.einsum("ncd,nwvd->nwcv", q, k[index]) / q.shape[-1]  # (N, W, C, V)
    # Padding never wins the maximum (cosines are at least -1; every event has a value).
    cosines = cosines.masked_fill(~k_present[index].unsqueeze(2), -2.0)
    best = cosines.amax(dim=-1)  # (N, W, C)
    return (best * q_present.unsqueeze(1).to(best.dtype)).sum(dim=-1)


class AttributeAttention(nn.Module):
    """One token per candidate: the attribute-by-attribute activation-unit attention over its
    request's recent events (see the module docstring for the formula)."""

    def __init__(self, dim: int, pairs: list[tuple[str, str]], *, history: int, hidden: int,
                 tower_keys: bool, overlap_pairs: tuple[int, ...] = (),
                 evolution: int = 0) -> None:
        """``overlap_pairs``: the indices of ``pairs`` that get a soft overlap count (those
        multi-valued on either side; empty: none). ``evolution``: the width of a GRU over the
        scored events' hidden activations in time order
        (:mod:`gem_core.model.interest_evolution`; 0: none)."""
        super().__init__()
        if not pairs:
            raise ValueError("model.attribute_attention needs a candidate feature and an event "
                             "feature that share a table; the schema has none")
        self.pairs, self.history, self.hidden = pairs, history, hidden
        self.overlap_pairs = tuple(overlap_pairs)
        num = len(pairs)
        # Per candidate: A q + A2 q^2 for every attribute in one matmul; per event likewise.
        self.candidate_terms = nn.Linear(2 * num * dim, hidden, bias=True)
        self.event_terms = nn.Linear(2 * num * dim, hidden, bias=False)
        # Per (candidate, event) pair: C_p (q_p * k_p), one (d, hidden) matrix per attribute.
        self.products = nn.Parameter(torch.empty(num, dim, hidden))
        nn.init.normal_(self.products, std=1.0 / dim)
        # S_p: the cosine of each attribute pair, its own input of every hidden unit.
        self.similarities = nn.Parameter(torch.randn(num, hidden))
        # O_p: the soft overlap count of each multi-valued pair, likewise.
        self.overlaps = (nn.Parameter(torch.randn(len(self.overlap_pairs), hidden))
                         if self.overlap_pairs else None)
        self.token_terms = nn.Linear(dim, hidden, bias=False)
        self.tower_terms = nn.Linear(dim, hidden, bias=False) if tower_keys else None
        self.act = nn.SiLU()
        self.weights = nn.Linear(hidden, num)
        self.values = nn.Linear(dim, dim * num, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.evolution = InterestEvolution(hidden, evolution, dim) if evolution else None

    def forward(self, candidate_vectors: Mapping[str, Tensor], event_vectors: Mapping[str, Tensor],
                events: Tensor, history: Tensor | None, offsets: Tensor, owner: Tensor,
                max_len: int, retrieved: tuple[Tensor, Tensor] | None = None,
                candidate_values: Mapping[str, Jagged] | None = None,
                event_values: Mapping[str, Jagged] | None = None) -> Tensor:
        """``candidate_vectors`` ``(N, d)`` and ``event_vectors`` ``(E, d)`` per feature name
        (multi-valued ones pooled); ``events`` ``(E, d)`` raw event tokens; ``history`` the
        tower's outputs (None: the raw tokens alone); ``owner`` ``(N,)`` each candidate's
        request; ``retrieved``: ``(N, B)`` indices and mask of older events scored besides the
        recent window (:mod:`gem_core.model.history_retrieval`); ``candidate_values`` and
        ``event_values``: the unpooled vectors of the multi-valued features (needed for the
        overlap pairs). Returns ``(N, d)``."""
        num, dim = len(self.pairs), events.shape[1]
        candidates = owner.numel()
        window = min(self.history, max_len) if self.history else max_len
        if events.shape[0] == 0 or window == 0:
            return self.proj(events.new_zeros(candidates, dim))
        index, valid = recent_event_index(offsets, owner, window)  # (N, W)
        if retrieved is not None:
            index, valid = torch.cat([index, retrieved[0]], 1), torch.cat([valid, retrieved[1]], 1)
        q = _unit(torch.stack([candidate_vectors[c] for c, _ in self.pairs], dim=1))  # (N, P, d)
        k = _unit(torch.stack([event_vectors[e] for _, e in self.pairs], dim=1))  # (E, P, d)
        per_candidate = self.candidate_terms(torch.cat([q, q * q], dim=1).flatten(1))
        per_event = self.event_terms(torch.cat([k, k * k], dim=1).flatten(1))
        unit_events = _unit(events)  # the scores' input and the values' (normalised once)
        per_event = per_event + self.token_terms(unit_events)
        if self.tower_terms is not None and history is not None:
            per_event = per_event + self.tower_terms(_unit(history))
        # (N, W, P, d) products of the candidate's and each event's attribute vectors.
        products = q.unsqueeze(1) * k[index]
        pair_terms = torch.einsum("nwpd,pdh->nwh", products, self.products)
        pair_terms = pair_terms + products.mean(dim=-1) @ self.similarities
        if self.overlaps is not None:
            if candidate_values is None or event_values is None:
                raise ValueError("attribute attention's overlap pairs need the unpooled "
                                 "vectors of the multi-valued features")
            overlaps = []
            for p in self.overlap_pairs:
                c_name, e_name = self.pairs[p]
                overlaps.append(soft_overlap(
                    candidate_values.get(c_name, candidate_vectors[c_name]),
                    event_values.get(e_name, event_vectors[e_name]), index))
            pair_terms = pair_terms + torch.stack(overlaps, dim=-1) @ self.overlaps
        hidden = self.act(per_candidate.unsqueeze(1) + per_event[index] + pair_terms)
        weight = self.weights(hidden) * valid.unsqueeze(-1).to(hidden.dtype)  # (N, W, P)
        values = self.values(unit_events).view(-1, num, dim)[index]  # (N, W, P, d)
        pooled = torch.einsum("nwp,nwpd->nd", weight, values)
        if self.evolution is not None:
            pooled = pooled + self.evolution(hidden, valid)
        return self.proj(pooled)

    def flops(self, lengths: Tensor, candidates: Tensor, retrieved: int = 0,
              widths: Mapping[str, int] | None = None) -> int:
        """Forward FLOPs (matmuls): the per-event and per-candidate terms, the per-pair
        products' projection and weights, the overlap pairs' cosines and projection, the
        weighted sum of values and the output projection, for ``lengths`` events and
        ``candidates`` per request and ``retrieved`` more slots per candidate. ``widths``:
        the widest row of each multi-valued feature in the batch, under its ``feature_key``
        (:meth:`gem_core.batch.JaggedBatch.value_widths`; a feature not named counts one value
        per row)."""
        lengths, candidates = lengths.to(torch.int64), candidates.to(torch.int64)
        events, impressions = int(lengths.sum()), int(candidates.sum())
        window = lengths.clamp(max=self.history) if self.history else lengths
        longest = int(window.max()) if window.numel() else 0
        if not longest:
            return linear_layer_flops(self.proj, impressions)
        # Each candidate scores its request's window (padded to the batch's longest window:
        # every candidate computes max(window) slots, masked ones included) and the retrieved.
        slots = impressions * (longest + retrieved)
        num, dim = self.products.shape[0], self.products.shape[1]
        per_event = linear_layer_flops(self.event_terms, events) + linear_layer_flops(
            self.token_terms, events) + linear_layer_flops(self.values, events)
        if self.tower_terms is not None:
            per_event += linear_layer_flops(self.tower_terms, events)
        per_pair = (2 * slots * num * (dim + 1) * self.hidden
                    + linear_layer_flops(self.weights, slots))
        weighted_sum = 2 * slots * num * dim
        if self.overlap_pairs:
            widths = widths or {}
            for p in self.overlap_pairs:
                c_name, e_name = self.pairs[p]
                per_pair += (2 * slots * widths.get(feature_key("candidate", c_name), 1)
                             * widths.get(feature_key("event", e_name), 1) * dim)
            per_pair += 2 * slots * len(self.overlap_pairs) * self.hidden
        if self.evolution is not None:
            per_pair += self.evolution.flops(slots, impressions, longest + retrieved)
        return (per_event + linear_layer_flops(self.candidate_terms, impressions) + per_pair
                + weighted_sum + linear_layer_flops(self.proj, impressions))
