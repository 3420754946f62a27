"""Turning raw features into d-dimensional tokens (event tokens and non-sequence tokens)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def log_time_buckets(age_seconds: Tensor, num_buckets: int) -> Tensor:
    """Bucket of an event's age: 0 for under a minute, then log2-spaced, the last bucket open."""
    minutes = age_seconds.clamp(min=0).to(torch.float32) / 60.0
    bucket = torch.floor(torch.log2(minutes.clamp(min=1.0))).to(torch.int64) + 1
    bucket = torch.where(minutes < 1.0, torch.zeros_like(bucket), bucket)
    return bucket.clamp(max=num_buckets - 1)


class EventTokenizer(nn.Module):
    """An event token = item embedding + action embedding + age-bucket embedding (+ content)."""

    def __init__(self, dim: int, num_actions: int, time_buckets: int, seq_dense_dim: int) -> None:
        super().__init__()
        self.time_buckets = time_buckets
        self.action = nn.Embedding(num_actions, dim)
        self.age = nn.Embedding(time_buckets, dim)
        self.content = nn.Linear(seq_dense_dim, dim) if seq_dense_dim else None
        std = 1.0 / math.sqrt(dim)
        nn.init.normal_(self.action.weight, std=std)
        nn.init.normal_(self.age.weight, std=std)

    def content_vector(self, dense: Tensor | None) -> Tensor | None:
        """The projection of a content vector; candidates share it with history events so that
        their similarity is visible from the first step."""
        if self.content is None or dense is None:
            return None
        return self.content(dense)

    def forward(self, item_vectors: Tensor, actions: Tensor, ages: Tensor,
                seq_dense: Tensor | None) -> Tensor:
        tokens = item_vectors + self.action(actions)
        tokens = tokens + self.age(log_time_buckets(ages, self.time_buckets))
        content = self.content_vector(seq_dense)
        if content is not None:
            tokens = tokens + content
        return tokens
