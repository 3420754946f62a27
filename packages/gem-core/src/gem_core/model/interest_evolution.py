"""Interest evolution: a GRU run over each candidate's scored events in time order, reading
attribute attention's per-event scorer activations (DIEN's idea, as a part of attribute
attention).

Attribute attention scores every event on its own and sums: it can say "an engaged event of
this category exists" and "a view of this advertiser exists", but not which of the two came
last. A label that depends on order (a purchase after the last view of the advertiser, a
category engaged since the advertiser was last ignored) needs a reading of the events in
sequence. Here, for candidate ``n``, the scorer's hidden activations ``a(n, e)`` of its scored
events (the recent window, most recent first, then the retrieved older ones) drive a GRU::

    r = sigmoid(W_r a + U_r s + b_r)        z = sigmoid(W_z a + U_z s + b_z)
    c = tanh(W_c a + b_c + r * (U_c s + b_uc))
    s <- (1 - z) * c + z * s                 (only where the slot holds an event)

from ``s = 0``, newest event first (so the first event that matches stands out and "which
came first" reads as "which is more recent"); the final state, projected to the model width,
joins attribute attention's pooled output. ``a(n, e)`` already holds the candidate-event
similarity of every shared attribute, the event's action, age and position, so the GRU sees
what matched and how, per event, in order.

The input projection runs once per (candidate, event) slot; the recurrence is a loop over the
slots (the longest window of the batch, plus the retrieved), ``(N, width) x (width, 3 width)``
per step."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gem_core.flops import linear_layer_flops


class InterestEvolution(nn.Module):
    """A GRU of ``width`` over per-slot inputs of ``inputs`` features, its final state
    projected to ``dim`` (see the module docstring)."""

    def __init__(self, inputs: int, width: int, dim: int) -> None:
        super().__init__()
        self.width = width
        self.input_gates = nn.Linear(inputs, 3 * width)  # W_r, W_z, W_c with their biases
        self.state_gates = nn.Linear(width, 3 * width)  # U_r, U_z, U_c with theirs
        self.out = nn.Linear(width, dim, bias=False)  # no events: nothing added

    def forward(self, inputs: Tensor, valid: Tensor) -> Tensor:
        """``inputs`` ``(N, S, inputs)`` per candidate and slot, newest first; ``valid``
        ``(N, S)`` which slots hold an event. Returns ``(N, dim)``."""
        gates_in = self.input_gates(inputs)  # (N, S, 3 width), once for every slot
        state = inputs.new_zeros(inputs.shape[0], self.width)
        for slot in range(inputs.shape[1]):
            in_r, in_z, in_c = gates_in[:, slot].chunk(3, dim=-1)
            st_r, st_z, st_c = self.state_gates(state).chunk(3, dim=-1)
            reset = torch.sigmoid(in_r + st_r)
            update = torch.sigmoid(in_z + st_z)
            candidate = torch.tanh(in_c + reset * st_c)
            stepped = (1 - update) * candidate + update * state
            state = torch.where(valid[:, slot].unsqueeze(1), stepped, state)
        return self.out(state)

    def flops(self, slots: int, candidates: int, steps: int) -> int:
        """Forward FLOPs (matmuls) for ``candidates`` of ``steps`` slots each (``slots`` in
        all, padded ones included: every candidate steps through the batch's longest)."""
        return (linear_layer_flops(self.input_gates, slots)
                + steps * linear_layer_flops(self.state_gates, candidates)
                + linear_layer_flops(self.out, candidates))
