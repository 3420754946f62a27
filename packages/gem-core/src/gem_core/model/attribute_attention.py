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
                                + (S_p + T_p x_e) cos(q_p, k_p) ] + G x_e + H h_e + b )
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

**Matches by event** (``match_by_event``; off: ``T_p = 0``). In the sum above the event's token
``x_e`` and the match ``cos(q_p, k_p)`` meet only inside the activation, so "a purchase of the
candidate's category" and "a page view of it" get weights that differ only where a hidden unit
has learnt to sit at a threshold that both must cross. ``T_p x_e`` scales each attribute's
cosine by a learned map of the event's token (its action, age and position), so how much a
match weighs can depend on the kind of event from the first step. It is computed once per event
(``(E, P, h)``); per pair it costs ``2 P h``.

**Query and key maps** (``maps``; off: ``M_p = N_p = I``). The terms above compare ``q_p`` and
``k_p`` coordinate by coordinate (``C_p`` is diagonal in them, the cosine too), so two
attributes are similar only where the table has learnt them to be: sibling categories need
rows that point alike, and a row moves only in the batches that look it up. With maps, each
attribute's vectors first pass through a learned ``d x d`` map of their own, one for the
candidate's and one for the event's side::

    q_p <- unit(M_p q_p),  k_p <- unit(N_p k_p)

so every term reads the bilinear form ``q^T M_p^T diag(.) N_p k`` and which attributes count
as similar is learnt in two dense matrices that every impression trains. Both start at the
identity, where the module is the one without maps (``unit`` of a unit vector is itself,
to the normalisation's epsilon). The cost is ``2 (N + E) P d^2``, once per candidate and
once per event.

The events scored are the most recent ``history`` of each request (0: all of them), padded per
candidate to the longest with a mask (a request's candidates share its events).

**Latest-match heads** (``latest`` > 0, stick-breaking weights). The sum above cannot say which
of two matching events came last: two histories holding the same events in opposite orders get
the same output, and a label such as "the user engaged with the category after last seeing this
advertiser" is a pure interaction of order. Each latest-match head ``j`` reads the scorer's
hidden units through a gate, and walks the slots from the most recent event back::

    g(n, e, j) = sigmoid(U_j hidden(n, e) + u_j)
    a(n, e, j) = g(n, e, j) * prod_{e' more recent than e} (1 - g(n, e', j))
    latest(n, j) = [ sum_e a(n, e, j) hidden(n, e),  sum_e a(n, e, j) x_e,
                     prod_e (1 - g(n, e, j)) ]
    out(n) += proj_latest( latest(n, 1..J) )

so a head whose gate fires on "an event matching the candidate on some attribute" returns that
event's hidden units and token (its action, its age) as of the most recent such event, however
many older ones there are, and the last term says how much of the gate found nothing. The gate
learns the predicate and the values tell which kind of event came last; the weights need no
softmax and no learned temperature (stick-breaking attention, Tan et al., 2024). At
initialisation the gates sit near 1/2, so the heads start as a recency-weighted read of the
last few events, from which the match can be learned. The cost is ``2 N W h J`` for the gates
and ``2 N W (h + d) J`` for the weighted sums.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gem_core.errors import GemConfigError
from gem_core.flops import linear_layer_flops
from gem_core.model.target_match import recent_event_index


def _unit(vectors: Tensor) -> Tensor:
    """RMS-normalised over the last dimension, no learned scale."""
    return F.rms_norm(vectors, (vectors.shape[-1],), eps=1e-6)


class AttributeAttention(nn.Module):
    """One token per candidate: the attribute-by-attribute activation-unit attention over its
    request's recent events (see the module docstring for the formula)."""

    def __init__(self, dim: int, pairs: list[tuple[str, str]], *, history: int, hidden: int,
                 tower_keys: bool, latest: int = 0, match_by_event: bool = False,
                 maps: bool = False) -> None:
        super().__init__()
        if not pairs:
            raise GemConfigError("model.attribute_attention needs a candidate feature and an event "
                                 "feature that share a table; the schema has none")
        self.pairs, self.history, self.hidden, self.latest = pairs, history, hidden, latest
        num = len(pairs)
        # M_p and N_p (maps): each attribute's candidate and event vectors, from the identity.
        identity = torch.eye(dim).expand(num, dim, dim)
        self.query_maps = nn.Parameter(identity.clone()) if maps else None
        self.key_maps = nn.Parameter(identity.clone()) if maps else None
        # Per candidate: A q + A2 q^2 for every attribute in one matmul; per event likewise.
        self.candidate_terms = nn.Linear(2 * num * dim, hidden, bias=True)
        self.event_terms = nn.Linear(2 * num * dim, hidden, bias=False)
        # Per (candidate, event) pair: C_p (q_p * k_p), one (d, hidden) matrix per attribute.
        self.products = nn.Parameter(torch.empty(num, dim, hidden))
        nn.init.normal_(self.products, std=1.0 / dim)
        # S_p: the cosine of each attribute pair, its own input of every hidden unit.
        self.similarities = nn.Parameter(torch.randn(num, hidden))
        # T_p: each attribute's cosine scaled by a map of the event's token (match_by_event).
        self.match_by_event = nn.Linear(dim, num * hidden, bias=False) if match_by_event else None
        self.token_terms = nn.Linear(dim, hidden, bias=False)
        self.tower_terms = nn.Linear(dim, hidden, bias=False) if tower_keys else None
        self.act = nn.SiLU()
        self.weights = nn.Linear(hidden, num)
        self.values = nn.Linear(dim, dim * num, bias=False)
        self.proj = nn.Linear(dim, dim)
        # The latest-match heads' gates and what their read of each head is projected by: the
        # pooled hidden units, the pooled token and the mass the gates left.
        self.latest_gates = nn.Linear(hidden, latest) if latest else None
        self.latest_proj = nn.Linear(latest * (hidden + dim + 1), dim) if latest else None

    @staticmethod
    def compared(vectors: Tensor, maps: Tensor | None) -> Tensor:
        """``(n, P, d)`` attribute vectors as the scorer compares them: RMS-normalised, and
        through each attribute's map (``query_maps`` for candidates, ``key_maps`` for events)
        back to unit RMS where ``maps`` are on."""
        vectors = _unit(vectors)
        return vectors if maps is None else _unit(torch.einsum("npd,ped->npe", vectors, maps))

    def forward(self, candidate_vectors: Mapping[str, Tensor], event_vectors: Mapping[str, Tensor],
                events: Tensor, history: Tensor | None, offsets: Tensor, owner: Tensor,
                max_len: int, retrieved: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``candidate_vectors`` ``(N, d)`` and ``event_vectors`` ``(E, d)`` per feature name
        (multi-valued ones pooled); ``events`` ``(E, d)`` raw event tokens; ``history`` the
        tower's outputs (None: the raw tokens alone); ``owner`` ``(N,)`` each candidate's
        request; ``retrieved``: ``(N, B)`` indices and mask of older events scored besides the
        recent window (:mod:`gem_core.model.history_retrieval`). Returns ``(N, d)``."""
        num, dim = len(self.pairs), events.shape[1]
        candidates = owner.numel()
        window = min(self.history, max_len) if self.history else max_len
        if events.shape[0] == 0 or window == 0:
            # No event at all: what a candidate with an empty history gets below (the heads'
            # gates found nothing, all their mass is left).
            nothing = events.new_zeros(candidates, 0, 1)
            out = self.proj(events.new_zeros(candidates, dim))
            if self.latest_gates is not None:
                out = out + self._latest(events.new_zeros(candidates, 0, self.hidden),
                                         events.new_zeros(candidates, 0, dim), nothing)
            return out
        index, valid = recent_event_index(offsets, owner, window)  # (N, W)
        if retrieved is not None:
            index, valid = torch.cat([index, retrieved[0]], 1), torch.cat([valid, retrieved[1]], 1)
        q = self.compared(torch.stack([candidate_vectors[c] for c, _ in self.pairs], dim=1),
                          self.query_maps)  # (N, P, d)
        k = self.compared(torch.stack([event_vectors[e] for _, e in self.pairs], dim=1),
                          self.key_maps)  # (E, P, d)
        per_candidate = self.candidate_terms(torch.cat([q, q * q], dim=1).flatten(1))
        per_event = self.event_terms(torch.cat([k, k * k], dim=1).flatten(1))
        unit_events = _unit(events)  # the scores' input and the values' (normalised once)
        per_event = per_event + self.token_terms(unit_events)
        if self.tower_terms is not None and history is not None:
            per_event = per_event + self.tower_terms(_unit(history))
        # (N, W, P, d) products of the candidate's and each event's attribute vectors.
        products = q.unsqueeze(1) * k[index]
        pair_terms = torch.einsum("nwpd,pdh->nwh", products, self.products)
        cosines = products.mean(dim=-1)  # (N, W, P)
        pair_terms = pair_terms + cosines @ self.similarities
        if self.match_by_event is not None:
            by_event = self.match_by_event(unit_events).view(-1, num, self.hidden)  # (E, P, h)
            pair_terms = pair_terms + torch.einsum("nwp,nwph->nwh", cosines, by_event[index])
        hidden = self.act(per_candidate.unsqueeze(1) + per_event[index] + pair_terms)
        mask = valid.unsqueeze(-1).to(hidden.dtype)
        weight = self.weights(hidden) * mask  # (N, W, P)
        values = self.values(unit_events).view(-1, num, dim)[index]  # (N, W, P, d)
        out = self.proj(torch.einsum("nwp,nwpd->nd", weight, values))
        if self.latest_gates is not None:
            out = out + self._latest(hidden, unit_events[index], mask)
        return out

    def _latest(self, hidden: Tensor, tokens: Tensor, mask: Tensor) -> Tensor:
        """The latest-match heads' projected read (the module docstring's formula) from the
        scorer's ``hidden`` ``(N, W, h)``, the slots' normalised ``tokens`` ``(N, W, d)`` and the
        slots' ``mask`` ``(N, W, 1)``; slot 0 is the most recent event."""
        gates = self.latest_gates(hidden)  # (N, W, J) logits
        # In log space: log(1 - sigmoid(x)) = logsigmoid(-x); an empty slot keeps all the mass.
        keep = F.logsigmoid(-gates) * mask
        more_recent = torch.cumsum(keep, dim=1) - keep  # exclusive: the slots before this one
        weights = torch.exp(F.logsigmoid(gates) + more_recent) * mask  # (N, W, J)
        left = torch.exp(keep.sum(dim=1)).unsqueeze(-1)  # (N, J, 1)
        read = torch.cat([torch.einsum("nwj,nwh->njh", weights, hidden),
                          torch.einsum("nwj,nwd->njd", weights, tokens), left], dim=-1)
        return self.latest_proj(read.flatten(1))

    def flops(self, lengths: Tensor, candidates: Tensor, retrieved: int = 0) -> int:
        """Forward FLOPs (matmuls): the per-event and per-candidate terms, the per-pair
        products' projection and weights, the weighted sum of values and the output
        projection, for ``lengths`` events and ``candidates`` per request and ``retrieved``
        more slots per candidate."""
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
        if self.query_maps is not None:  # one (d, d) map per attribute, candidate and event
            per_event += 2 * (impressions + events) * num * dim * dim
        if self.match_by_event is not None:
            per_event += linear_layer_flops(self.match_by_event, events)
            per_pair += 2 * slots * num * self.hidden
        weighted_sum = 2 * slots * num * dim
        latest = 0
        if self.latest_gates is not None:
            latest = (linear_layer_flops(self.latest_gates, slots)
                      + 2 * slots * self.latest * (self.hidden + dim)
                      + linear_layer_flops(self.latest_proj, impressions))
        return (per_event + linear_layer_flops(self.candidate_terms, impressions) + per_pair
                + weighted_sum + linear_layer_flops(self.proj, impressions) + latest)
