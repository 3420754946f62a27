"""Forward FLOPs per module of :class:`~gem_core.model.gem.GEMModel`, as MFU counts them
(matmuls only): the one place that says what each of its modules spends."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gem_core.flops import linear_layer_flops


def forward_flops_by_module(model: nn.Module, lengths: Tensor, candidates: Tensor | None = None,
                            *, dense: bool = False) -> dict[str, int]:
    """Forward FLOPs per module of a training forward of ``model`` (a ``GEMModel``, whose
    modules it reads by name) for a batch of requests with these history lengths and
    ``candidates`` per request (None: one each). ``dense``: attention as a backend that computes
    every sample's full query x key rectangle (the reference backend) spends it; otherwise the
    masked pairs. Modules that run in training only (the learned path's
    loss head) are counted: these are the FLOPs a training step spends."""
    c = model.config
    lengths = lengths.to(torch.int64).cpu()
    candidates = (torch.ones_like(lengths) if candidates is None
                  else candidates.to(torch.int64).cpu())
    batch, tokens = lengths.numel(), int(lengths.sum())
    impressions = int(candidates.sum())
    counts: dict[str, int] = {}
    content = model.events.content
    if content is not None:
        # History events, and the candidates (the data sends their content vectors).
        counts["events"] = linear_layer_flops(content, tokens + impressions)
    if model.dense_proj is not None:
        counts["dense_proj"] = linear_layer_flops(model.dense_proj, batch)
    if model.candidate_numeric is not None:
        counts["candidate_numeric"] = linear_layer_flops(model.candidate_numeric, impressions)
    if model.tower is not None:
        for key, value in model.tower.flops(lengths, model.num_context, dense).items():
            counts[f"tower.{key}"] = value
    if model.pma is not None:
        for key, value in model.pma.flops(lengths).items():
            counts[f"pma.{key}"] = value
    if model.target_attention is not None:
        queries = 1 + (model.num_context if c.target_queries == "all" else 0)
        for key, value in model.target_attention.flops(lengths, queries, c.pma_queries,
                                                       candidates).items():
            counts[f"target_attention.{key}"] = value
    if model.attribute_attention is not None:
        counts["attribute_attention"] = model.attribute_attention.flops(
            lengths, candidates, c.attribute_attention_retrieve)
    if model.path_loss is not None:  # its head runs in every training forward
        counts["path_loss"] = linear_layer_flops(model.path_loss.heads, impressions)
    if model.target_match is not None:
        counts["target_match"] = model.target_match.flops(lengths, candidates)
    if model.teacher_token is not None:
        counts["teacher_token"] = linear_layer_flops(model.teacher_token, batch)
    if model.teacher_match is not None:
        counts["teacher_match"] = linear_layer_flops(model.teacher_match, batch)
    counts["interaction"] = model.interaction.flops(impressions)
    if model.cross_branch is not None:
        counts["cross_branch"] = model.cross_branch.flops(impressions)
    counts["heads"] = linear_layer_flops(model.heads, impressions)
    if model.candidate_bias is not None:
        counts["candidate_bias"] = linear_layer_flops(model.candidate_bias, impressions)
    return counts
