"""Turning raw features into d-dimensional tokens (event tokens and non-sequence tokens)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from gem_core.jagged import row_ids


def log_time_buckets(age_seconds: Tensor, num_buckets: int) -> Tensor:
    """Bucket of an event's age: 0 for under a minute, then log2-spaced, the last bucket open."""
    minutes = age_seconds.clamp(min=0).to(torch.float32) / 60.0
    bucket = torch.floor(torch.log2(minutes.clamp(min=1.0))).to(torch.int64) + 1
    bucket = torch.where(minutes < 1.0, torch.zeros_like(bucket), bucket)
    return bucket.clamp(max=num_buckets - 1)


def positions_from_end(offsets: Tensor) -> Tensor:
    """For every event, how many events of its history are more recent (0 for the last)."""
    ends = offsets[1:][row_ids(offsets)]
    return ends - 1 - torch.arange(ends.numel(), device=offsets.device)


class EventTokenizer(nn.Module):
    """An event token = the sum of its feature vectors + age-bucket embedding + position-from-end
    embedding (+ projected content vector)."""

    def __init__(self, dim: int, time_buckets: int, seq_dense_dim: int,
                 position_buckets: int = 0) -> None:
        super().__init__()
        self.time_buckets, self.position_buckets = time_buckets, position_buckets
        self.age = nn.Embedding(time_buckets, dim)
        self.position = nn.Embedding(position_buckets, dim) if position_buckets else None
        self.content = nn.Linear(seq_dense_dim, dim) if seq_dense_dim else None
        std = 1.0 / math.sqrt(dim)
        nn.init.normal_(self.age.weight, std=std)
        if self.position is not None:
            nn.init.normal_(self.position.weight, std=std)

    def content_vector(self, dense: Tensor | None) -> Tensor | None:
        """The projection of a content vector; candidates share it with history events so that
        their similarity is visible from the first step."""
        if self.content is None or dense is None:
            return None
        return self.content(dense)

    def forward(self, feature_vectors: Tensor, ages: Tensor, offsets: Tensor,
                seq_dense: Tensor | None) -> Tensor:
        tokens = feature_vectors + self.age(log_time_buckets(ages, self.time_buckets))
        if self.position is not None:
            bucket = positions_from_end(offsets).clamp(max=self.position_buckets - 1)
            tokens = tokens + self.position(bucket)
        content = self.content_vector(seq_dense)
        if content is not None:
            tokens = tokens + content
        return tokens
