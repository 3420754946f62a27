"""What a ``[distill]`` section implies for the student's model, decided before anything is
built."""

from __future__ import annotations

from pathlib import Path

import attrs

from gem_core.config import GemConfig, ModelConfig, load_config
from gem_core.errors import GemConfigError


def teacher_embedding_width(model: ModelConfig) -> int:
    """Floats of a model's user embedding (its flattened PMA tokens); 0 when it has none."""
    if model.user_embeddings != "live" or not model.pma_queries:
        return 0
    return model.pma_queries * model.embedding_dim


def read_teacher_config(teacher: str | Path) -> GemConfig:
    """The teacher run's ``config.toml``, with an error naming the directory when it is not a
    run."""
    config_file = Path(teacher) / "config.toml"
    if not config_file.is_file():
        raise GemConfigError(f"distill.teacher = {str(teacher)!r} is not a run directory (no "
                             "config.toml); name the run directory of a finished gem train")
    return load_config(path=config_file, stored=True)


def resolve_distillation(config: GemConfig) -> GemConfig:
    """``config`` with ``model.teacher_embedding_dim`` / ``teacher_match_dim`` set from the
    teacher's user-embedding width where ``[distill]`` asks for them; errors for combinations
    that cannot work. Unchanged when distillation is off."""
    d, model = config.distill, config.model
    set_dims = {"teacher_embedding_dim": model.teacher_embedding_dim,
                "teacher_match_dim": model.teacher_match_dim}
    if not d.enabled:
        for name, value in set_dims.items():
            if value:
                raise GemConfigError(f"model.{name} is set but [distill] names no teacher; use "
                                     "gem distill --teacher RUN_DIR (or distill.teacher)")
        return config
    teacher = read_teacher_config(d.teacher)
    if teacher.model.teacher_embedding_dim:
        raise GemConfigError(f"the teacher {d.teacher} is itself a student fed its teacher's "
                             "embedding (model.teacher_embedding_dim > 0); chains of teachers are "
                             "not supported")
    width = teacher_embedding_width(teacher.model)
    wanted = {"distill.embedding_feature": d.embedding_feature,
              "distill.embedding_match_weight > 0": d.embedding_match_weight > 0,
              "distill.adapter.use_embedding": d.adapter.enabled and d.adapter.use_embedding}
    needing = [name for name, on in wanted.items() if on]
    if needing and not width:
        raise GemConfigError(
            f"{', '.join(needing)} use the teacher's user embedding, but the teacher {d.teacher} "
            f"has none (model.pma_queries = {teacher.model.pma_queries}, user_embeddings = "
            f"{teacher.model.user_embeddings!r}): choose a teacher with PMA or turn them off")
    changes = {}
    for field, on in (("teacher_embedding_dim", d.embedding_feature),
                      ("teacher_match_dim", d.embedding_match_weight > 0)):
        current = set_dims[field]
        if on and current not in (0, width):
            raise GemConfigError(f"model.{field} = {current} but the teacher's user embedding "
                                 f"has {width} floats; leave it 0 (gem distill sets it)")
        if not on and current:
            raise GemConfigError(f"model.{field} = {current} is set but [distill] does not use "
                                 "it (distill.embedding_feature / embedding_match_weight)")
        if on:
            changes[field] = width
    if changes.get("teacher_match_dim") and not (model.pma_queries
                                                 and model.user_embeddings == "live"):
        raise GemConfigError(
            "distill.embedding_match_weight > 0 matches the student's user embedding (its PMA "
            f"tokens) with the teacher's, but the student has model.pma_queries = "
            f"{model.pma_queries}: give it PMA (model.pma_queries > 0) or set the weight to 0")
    if not changes:
        return config
    try:
        return attrs.evolve(config, model=attrs.evolve(model, **changes))
    except ValueError as error:
        raise GemConfigError(f"[model] with the distillation options: {error}") from None
