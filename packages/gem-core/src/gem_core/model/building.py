"""Building a run's model through its ``model`` plugin (``backends.model``), checked against the
contracts the trainer and the strategies rely on."""

from __future__ import annotations

from typing import Any

from torch import nn

from gem_core.config import ModelConfig
from gem_core.config.model_schema import TOKEN_NORMS_WITH_STATISTICS
from gem_core.contracts import RankingModel, StrategyModel, check_contract
from gem_core.errors import GemConfigError, GemPluginError
from gem_core.schema import FeatureSchema


def check_token_norm(config: ModelConfig, *, world_size: int) -> None:
    """Refuse ``token_norm`` or ``cross_branch_norm`` ``batch`` and ``rms`` on more than one
    rank (``sample`` and ``cap`` keep no statistics and run anywhere): their running statistics
    would be each rank's own (DDP here does not broadcast buffers, FSDP2 keeps a copy per rank, and
    torch's SyncBatchNorm runs on GPUs only), so ranks would evaluate differently and a resume
    would load rank 0's statistics into every rank."""
    if world_size == 1:
        return
    norms = {"token_norm": config.token_norm}
    if config.cross_branch:
        norms["cross_branch_norm"] = config.cross_branch_norm
    for field, kind in norms.items():
        if kind in TOKEN_NORMS_WITH_STATISTICS:
            raise GemConfigError(
                f"model.{field} = {kind!r} keeps running statistics per rank, which would "
                f"differ between the {world_size} ranks of this run; train it in one process "
                f"or set model.{field} = 'sample' or 'cap' (no statistics) or 'none'")


def build_run_model(backends: Any, config: ModelConfig, schema: FeatureSchema) -> nn.Module:
    """The model of ``backends.model`` (a resolved ``model`` factory) for ``config`` and
    ``schema``, built with the run's resolved attention, embedding and norm backends."""
    return build_checked(backends.model, config, schema, attention=backends.attention.impl,
                         embedding_backend=backends.embedding.impl, norm=backends.norm.impl)


def build_checked(factory: Any, config: ModelConfig, schema: FeatureSchema, *, attention: Any,
                  embedding_backend: Any, norm: Any) -> nn.Module:
    """Call a resolved ``model`` factory and check what it built: an ``nn.Module`` implementing
    :class:`~gem_core.contracts.RankingModel` and
    :class:`~gem_core.contracts.StrategyModel` (an error names the plugin otherwise)."""
    spec = factory.spec
    model = factory.impl(config, schema, attention=attention,
                         embedding_backend=embedding_backend, norm=norm)
    where = dict(kind="model", name=spec.name, plugin=spec.plugin,
                 distribution=spec.distribution)
    if not isinstance(model, nn.Module):
        raise GemPluginError(
            f"model {spec.name!r} (plugin {spec.plugin or '?'}, distribution "
            f"{spec.distribution or '?'}) built a {type(model).__name__}, not a torch nn.Module")
    check_contract(model, RankingModel, **where)
    check_contract(model, StrategyModel, **where)
    return model
