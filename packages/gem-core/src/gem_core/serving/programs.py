"""The modules ``gem export-model`` captures: a trained model behind flat tensor inputs.

Three programs, each an :class:`torch.nn.Module` taking one ``dict[str, Tensor]``
(:mod:`gem_core.serving.inputs`):

* ``full``: the whole model, history + context + candidates -> per-task probabilities (and
  logits), one per candidate;
* ``user_tower``: the upstream alone, history + context -> the user embedding
  ``(requests, pma_queries * embedding_dim)`` (what ``gem export-user-embeddings`` caches);
* ``ranker``: the downstream alone, the cached user embedding + candidates + context (+ the
  history events when target attention, target match or the history mean read them) -> per-task
  probabilities and logits.

The tower and ranker exist for multi-stage runs only (``downstream_history = 'events'``,
``pma_queries > 0``): otherwise the downstream reads the tower's outputs, not just the user
embedding, and there is nothing to cache between the two.
"""

from __future__ import annotations

from typing import Mapping

import attrs
import torch
from torch import Tensor, nn

from gem_core.contracts import AttentionBackend
from gem_core.model.gem import GEMModel
from gem_core.serving.inputs import CANDIDATES, CONTEXT, HISTORY, USER_EMBEDDING, batch_from_inputs

FULL, USER_TOWER, RANKER = "full", "user_tower", "ranker"


def logit_name(task: str) -> str:
    """The output holding ``task``'s logit (the task's own name holds its probability)."""
    return f"{task}.logit"


class ScoringProgram(nn.Module):
    """``model`` behind flat inputs: probabilities and logits per task, ``(candidates,)``."""

    def __init__(self, model: GEMModel, groups: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.groups = model, groups

    def forward(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        logits = self.model(batch_from_inputs(inputs, self.model.schema, self.groups))
        out = {task: torch.sigmoid(logit) for task, logit in logits.items()}
        out.update({logit_name(task): logit for task, logit in logits.items()})
        return out


class UserTowerProgram(nn.Module):
    """The upstream of ``model`` behind flat inputs: ``{"user_embedding": (requests, width)}``."""

    def __init__(self, model: GEMModel) -> None:
        super().__init__()
        self.model, self.groups = model, (HISTORY, CONTEXT)

    def forward(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        batch = batch_from_inputs(inputs, self.model.schema, self.groups)
        return {"user_embedding": self.model.user_embedding(batch)}


def is_multi_stage(model: GEMModel) -> bool:
    """Whether the upstream reaches the downstream only through the PMA user tokens."""
    c = model.config
    return c.downstream_history == "events" and c.pma_queries > 0


def ranker_reads_history(model: GEMModel) -> bool:
    """Whether the downstream reads the history events (target attention, target match or the
    history mean), so the ranker program takes them as inputs."""
    c = model.config
    return bool(c.target_attention or c.target_match or c.history_mean)


def ranker_groups(model: GEMModel) -> tuple[str, ...]:
    return ((HISTORY,) if ranker_reads_history(model) else ()) + (CANDIDATES, CONTEXT,
                                                                   USER_EMBEDDING)


def ranker_model(model: GEMModel, attention: AttentionBackend) -> GEMModel:
    """The downstream of a live multi-stage ``model`` as a model of its own
    (``user_embeddings = 'cached'``), sharing ``model``'s weights; ``attention``: the backend
    ``model`` was built with."""
    width = model.config.pma_queries * model.config.embedding_dim
    schema = attrs.evolve(model.schema, user_embedding_dim=width)
    config = attrs.evolve(model.config, user_embeddings="cached")
    ranker = GEMModel(config, schema, attention=attention,
                      embeddings=model.embeddings)
    upstream = {k for k in model.state_dict() if k.startswith(("tower.", "pma."))}
    missing, unexpected = ranker.load_state_dict(model.state_dict(), strict=False)
    if missing or set(unexpected) != upstream:
        raise RuntimeError(f"ranker weights do not line up with the model's: missing {missing}, "
                           f"unexpected {sorted(set(unexpected) - upstream)}")
    return ranker.eval()


def programs_of(model: GEMModel, attention: AttentionBackend) -> Mapping[str, nn.Module]:
    """Every program ``model`` (built with ``attention``) can be exported as, by name."""
    if model.config.user_embeddings == "cached":
        # Trained on cached embeddings: the model is the ranker already.
        return {RANKER: ScoringProgram(model, ranker_groups(model))}
    programs: dict[str, nn.Module] = {FULL: ScoringProgram(model, (HISTORY, CANDIDATES,
                                                                   CONTEXT))}
    if is_multi_stage(model):
        programs[USER_TOWER] = UserTowerProgram(model)
        ranker = ranker_model(model, attention)
        programs[RANKER] = ScoringProgram(ranker, ranker_groups(ranker))
    return programs
