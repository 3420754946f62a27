"""Scaling the interaction's tokens one position at a time (``model.token_norm``).

The interactions normalise all their tokens together (a LayerNorm over the flattened tokens or
over the tokens and their pairwise products), so one token that sums many events sets the scale
for the rest: in ``tiny`` trained on ``cross`` the attribute-attention token's RMS is 5-6 and the
context's 0.2, and a cross of the context, the candidate and a dense feature then enters at a
fraction of a percent of its size (docs/results.md). Scaling each position by its own batch
statistics puts every token on one footing while a sample's size relative to the batch (how many
events matched) survives:

- ``batch``: torch's BatchNorm with one channel per token (each position's mean and variance
  over the batch and the embedding dimension; a learned scale and shift per position);
- ``rms``: :class:`TokenRMSNorm`, each position divided by its batch RMS with a learned gain per
  position and no centring, so a token that is exactly zero (no matching event) stays zero;
- ``sample``: :class:`SampleTokenRMSNorm`, each token of each sample divided by its own RMS
  (over the embedding dimension) with a learned gain per position: no batch statistics, so it
  runs on any number of ranks and scores a sample alone the same as in a batch, but a token's
  size (how many events a sum token matched) is lost and only its direction is kept;
- ``cap``: :class:`SampleTokenCap`, each token of each sample times ``1 / sqrt(1 + ms)`` (``ms``
  its mean square): a quiet token passes nearly unchanged, a loud one is brought down to an RMS
  just under 1, and sizes keep their order; no statistics, no parameters.

``batch`` and ``rms`` keep running statistics for evaluation, each rank its own, which is why
the trainer refuses them on more than one rank
(:func:`gem_core.model.building.check_token_norm`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gem_core.config.model_schema import TOKEN_NORMS
from gem_core.errors import GemConfigError


class TokenRMSNorm(nn.Module):
    """``(N, n, d)`` -> ``(N, n, d)``: position ``k`` times ``gain_k / sqrt(ms_k + eps)``, with
    ``ms_k`` the mean square of position ``k`` over the batch and the embedding dimension while
    training (gradients flow through it, as through BatchNorm's statistics) and its running
    mean (``momentum``) at evaluation."""

    def __init__(self, num_tokens: int, *, momentum: float = 0.1, eps: float = 1e-5) -> None:
        super().__init__()
        self.momentum, self.eps = momentum, eps
        self.gain = nn.Parameter(torch.ones(num_tokens))
        self.register_buffer("running_ms", torch.ones(num_tokens))

    def forward(self, tokens: Tensor) -> Tensor:
        if self.training:
            ms = tokens.pow(2).mean(dim=(0, 2))
            with torch.no_grad():
                self.running_ms.lerp_(ms.detach().to(self.running_ms.dtype), self.momentum)
        else:
            ms = self.running_ms.to(tokens.dtype)
        scale = self.gain / torch.sqrt(ms + self.eps)
        return tokens * scale.view(1, -1, 1)


class SampleTokenRMSNorm(nn.Module):
    """``(N, n, d)`` -> ``(N, n, d)``: every token of every sample times
    ``gain_k / sqrt(mean_d(x^2) + eps)``; a zero token stays zero. Stateless: the same in
    training and evaluation, and on every rank."""

    def __init__(self, num_tokens: int, *, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.gain = nn.Parameter(torch.ones(num_tokens))

    def forward(self, tokens: Tensor) -> Tensor:
        ms = tokens.pow(2).mean(dim=-1, keepdim=True)
        return tokens * torch.rsqrt(ms + self.eps) * self.gain.view(1, -1, 1)


class SampleTokenCap(nn.Module):
    """``(N, n, d)`` -> ``(N, n, d)``: every token of every sample times ``1 / sqrt(1 + ms)``,
    ``ms`` its mean square over the embedding dimension, so its RMS becomes
    ``rms / sqrt(1 + rms^2)``: below 1, monotone in ``rms``, about ``rms`` for a quiet token.
    Stateless and without parameters: the same in training and evaluation, on every rank."""

    def forward(self, tokens: Tensor) -> Tensor:
        return tokens * torch.rsqrt(1.0 + tokens.pow(2).mean(dim=-1, keepdim=True))


def token_norm(kind: str, num_tokens: int) -> nn.Module | None:
    """The module of ``model.token_norm = kind`` for ``num_tokens`` tokens (None for ``none``)."""
    if kind == "batch":
        return nn.BatchNorm1d(num_tokens)
    if kind == "rms":
        return TokenRMSNorm(num_tokens)
    if kind == "sample":
        return SampleTokenRMSNorm(num_tokens)
    if kind == "cap":
        return SampleTokenCap()
    if kind == "none":
        return None
    raise GemConfigError(f"model.token_norm = {kind!r}: expected one of {list(TOKEN_NORMS)}")
