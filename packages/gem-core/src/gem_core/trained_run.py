"""One way to open a trained run directory: its config, data source, schema and the model with the
weights of a complete checkpoint, in one process on the CPU.

Every consumer of a finished run (``gem export-user-embeddings``, ``gem export-model``,
``gem distill``'s teacher, ``gem score``) goes through :func:`load_run`, at the checkpoint
:func:`choose_checkpoint` picks (the best unless a step is asked for), so a run is rebuilt one
way: with every backend the run resolved (attention, norm and embedding), its model-format check,
and the TorchRec tables a full-state engine (DeepSpeed) keeps beside its ``engine.pt``. Resuming a
run is the trainer's business (:class:`gem_core.checkpoint.checkpointer.Checkpointer`), which loads
shards in place on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import attrs
from torch import nn

from gem_core.checkpoint.checkpointer import read_checkpoint
from gem_core.checkpoint.layout import complete_checkpoints, read_info
from gem_core.checkpoint.resume import MODEL_FORMAT
from gem_core.checkpoint.retention import BEST_BY, best_checkpoint
from gem_core.config import DataConfig, GemConfig, load_config, structure, unstructure
from gem_core.config.written_before import as_written
from gem_core.distributed import ParallelContext
from gem_core.errors import GemConfigError
from gem_core.model.building import build_run_model
from gem_core.plugins import GemPlugins, build_data_source, build_plugins
from gem_core.schema import (
    ACTION_FIELDS,
    TEACHER_FIELDS,
    FeatureSchema,
    schema_to_dict,
    without_teacher_signals,
)
from gem_core.train.applied import config_as_source_applies
from gem_core.train.backends import RunBackends, resolve_backends


@attrs.frozen(kw_only=True)
class CheckpointChoice:
    """The checkpoint a reader of a run uses, and why."""

    step: int
    """Its step."""
    path: Path
    """Its directory."""
    reason: str
    """Why this one, for the user: e.g. ``best eval NE 0.9000 at step 200; the last, step 600,
    had 0.9900``."""
    best: bool
    """Whether it is the best checkpoint (by :data:`gem_core.checkpoint.retention.BEST_BY`)."""


def choose_checkpoint(run_dir: Path, step: int | None = None) -> CheckpointChoice:
    """The checkpoint of ``run_dir`` every reader uses: ``step``'s when given, else the *best*
    complete one (the lowest evaluation NE recorded in its ``info.json``, the figure of
    :func:`gem_core.train.evaluate.selection_ne`), else the newest when none has an NE.
    Training past the data's first pass often makes the last checkpoint worse than an earlier
    one; the best is what the run learnt. Raises :class:`GemConfigError` when there is none."""
    run_dir = Path(run_dir)
    checkpoints = complete_checkpoints(run_dir)
    if not checkpoints:
        raise GemConfigError(f"{run_dir} has no complete checkpoint (checkpoints/step-*/COMPLETE); "
                             "train it with train.checkpoint_every > 0 or let it finish")
    by_step = dict(checkpoints)
    last_step, last_path = checkpoints[-1]
    last_ne = read_info(last_path).get("ne")

    def of(path: Path) -> str:
        """Which part of the evaluation a checkpoint's NE is of (train.validation_share)."""
        return read_info(path).get("ne_of", "eval")

    last = (f"the last, step {last_step}, had {last_ne:.4f}"
            if isinstance(last_ne, (int, float)) else f"the last is step {last_step}")
    best = best_checkpoint(run_dir)
    if step is not None:
        if step not in by_step:
            raise GemConfigError(f"{run_dir} has no complete checkpoint of step {step}; it has "
                                 f"{sorted(by_step)}")
        ne = read_info(by_step[step]).get("ne")
        shown = (f" ({of(by_step[step])} NE {ne:.4f})" if isinstance(ne, (int, float))
                 else "")
        versus = (f"; the best is step {best[0]} with {of(by_step[best[0]])} NE {best[1]:.4f}"
                  if best is not None and best[0] != step else "")
        return CheckpointChoice(step=step, path=by_step[step], best=bool(best and best[0] == step),
                                reason=f"step {step} as asked{shown}{versus}")
    if best is None:
        return CheckpointChoice(step=last_step, path=last_path, best=False,
                                reason=f"the newest checkpoint, step {last_step} (none has an "
                                       "evaluation NE)")
    if best[0] == last_step:
        return CheckpointChoice(step=last_step, path=last_path, best=True,
                                reason=f"best {of(last_path)} NE {best[1]:.4f} ({BEST_BY}) "
                                       f"at step {last_step}, the last checkpoint")
    return CheckpointChoice(step=best[0], path=by_step[best[0]], best=True,
                            reason=f"best {of(by_step[best[0]])} NE {best[1]:.4f} ({BEST_BY}) "
                                   f"at step {best[0]}; {last} (use --step {last_step} for it)")


@attrs.frozen(kw_only=True)
class LoadedRun:
    """A trained run, rebuilt for inference."""

    run_dir: Path
    """The run directory."""
    config: GemConfig
    """The configuration stored with the checkpoint (the run's ``config.toml`` must agree with
    it on ``[model]`` and ``[data]``), with the overrides :func:`load_run` was given."""
    source: Any
    """The data source of ``config.data`` (the run's own data unless ``data`` was given)."""
    backends: RunBackends
    """Every kind resolved for one CPU process from ``config.backends``."""
    model: nn.Module
    """The model with the checkpoint's weights, in eval mode, float32, on the CPU."""
    step: int
    """The step of the checkpoint the weights come from."""
    checkpoint: Path
    """That checkpoint's directory."""
    trainer_state: dict[str, Any]
    """The checkpoint's side file (step, counters, config, schema, ...)."""
    choice: CheckpointChoice
    """Which checkpoint was loaded and why (:func:`choose_checkpoint`)."""

    @property
    def schema(self) -> FeatureSchema:
        """The feature schema the model was built for (its data source's)."""
        return self.source.schema


def load_run(run_dir: Path, *, step: int | None = None, data: DataConfig | None = None,
             backends: dict[str, str] | None = None,
             plugins: GemPlugins | None = None,
             check_config: Callable[[GemConfig], None] | None = None) -> LoadedRun:
    """Open ``run_dir`` at its best complete checkpoint (or the one of ``step``; see
    :func:`choose_checkpoint`).

    ``data``: read another data set than the run's (its feature schema must be the run's:
    same tables, features and tasks). ``backends``: kind -> implementation name to use instead of
    the run's (an exporter swapping in an attention backend that exports); the weights do not
    depend on these backends. ``check_config``: called with the run's config (``config.toml``
    first, then the checkpoint's) before the model is built, to refuse a run the caller cannot
    use (it raises). The model, its data and backends are built from the configuration stored
    with the checkpoint (:func:`checkpoint_config`, which refuses a ``config.toml`` edited
    since). Every problem is a :class:`GemConfigError` naming the run.
    """
    run_dir = Path(run_dir)
    config_file = run_dir / "config.toml"
    if not config_file.is_file():
        raise GemConfigError(f"{run_dir} is not a run directory (no config.toml)")
    edited = load_config(path=config_file, stored=True)
    if backends:
        unknown = sorted(set(backends) - set(attrs.fields_dict(type(edited.backends))))
        if unknown:
            raise GemConfigError(f"unknown backend kinds {unknown}; the kinds are "
                                 f"{sorted(attrs.fields_dict(type(edited.backends)))}")
    if check_config is not None:  # a run the caller cannot use is refused before any checkpoint
        check_config(edited)
    choice = choose_checkpoint(run_dir, step)
    step, path = choice.step, choice.path
    saved = read_checkpoint(path)
    state = saved["trainer"]
    saved_format = state.get("model_format", 1)
    if saved_format != MODEL_FORMAT:
        raise GemConfigError(f"{path} holds model format {saved_format}; this version reads "
                             f"format {MODEL_FORMAT} (request-level samples with declared "
                             "feature schemas): retrain the run with this version")
    config = checkpoint_config(state, path, edited, config_file)
    if check_config is not None:
        check_config(config)
    if data is not None:
        config = attrs.evolve(config, data=data)
    if backends:
        config = attrs.evolve(config, backends=attrs.evolve(config.backends, **backends))
    plugins = plugins if plugins is not None else build_plugins()
    resolved = resolve_backends(config, plugins, ParallelContext())
    source = build_data_source(resolved.data, config.data, seed=config.train.seed)
    config = config_as_source_applies(config, source)  # as the run did
    # Teacher columns (gem distill-precompute) are not features: a data set that has them is
    # the same data for this model. Nor is the declaration of which feature holds the actions:
    # the run's configuration recorded what its model read (model.action_feature).
    trained = state.get("schema")
    trained = None if trained is None else {k: v for k, v in trained.items()
                                            if k not in (*TEACHER_FIELDS, *ACTION_FIELDS)}
    given = {k: v for k, v in schema_to_dict(without_teacher_signals(source.schema)).items()
             if k not in ACTION_FIELDS}
    if trained is not None and trained != given:
        raise GemConfigError(
            f"the data of {config.data.source!r} has another feature schema than {run_dir} "
            f"was trained on: {_schema_difference(trained, given)}")
    model = build_run_model(resolved, config.model, source.schema)
    weights = dict(saved["engine"]["model"])
    # Full-state engines (DeepSpeed) keep TorchRec-sharded tables in a DCP directory beside
    # engine.pt, under the names the unsharded tables have.
    weights.update(saved["engine"].get("sharded", {}).get("model", {}))
    missing, unexpected = model.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}, strict=False)
    if missing or unexpected:
        raise GemConfigError(f"{path} does not hold this model's weights: missing {missing[:8]}, "
                             f"unexpected {unexpected[:8]}")
    return LoadedRun(run_dir=run_dir, config=config, source=source, backends=resolved,
                     model=model.float().eval(), step=step, checkpoint=path,
                     trainer_state=state, choice=choice)


def checkpoint_config(state: dict[str, Any], path: Path, edited: GemConfig,
                      config_file: Path) -> GemConfig:
    """The configuration a checkpoint was trained with (its side file's ``config``), which a
    reader of the run builds from; refuses, naming the keys, when ``edited`` (the run
    directory's ``config.toml``) disagrees with it on what the model and its data are
    (:data:`CHECKED_SECTIONS`): an edit there would otherwise rebuild another model than the
    one trained, or be ignored without a word. Other sections (``[train]``, ``[backends]``,
    ...) may change when a run resumes and do not change the weights."""
    stored = state.get("config")
    if not isinstance(stored, dict):
        raise GemConfigError(f"{path} holds no configuration (trainer.json has no 'config'); "
                             "it was not written by gem train")
    config = structure(GemConfig, as_written(stored), str(path / "trainer.json"))
    trained, current = unstructure(config), unstructure(edited)
    differing = [key for section in CHECKED_SECTIONS
                 for key in _differing_keys(trained[section], current[section], section)]
    if differing:
        shown = "; ".join(f"{key}: config.toml has {_at(current, key)!r}, the checkpoint "
                          f"{_at(trained, key)!r}" for key in differing[:4])
        raise GemConfigError(
            f"{config_file} disagrees with the configuration {path} was trained with on "
            f"{', '.join(differing)} ({shown}); a trained run is read with its checkpoint's "
            "configuration: undo the edit of config.toml (train a new run to change them)")
    return config


#: Sections of the configuration a reader's model and data are built from, which config.toml
#: must not contradict (the ones a resume also holds to, see ``train.resume``).
CHECKED_SECTIONS = ("model", "data")


def _differing_keys(saved: Any, current: Any, prefix: str) -> list[str]:
    """Dotted keys where two unstructured configuration tables differ."""
    if isinstance(saved, dict) and isinstance(current, dict):
        return [key for name in sorted(set(saved) | set(current), key=str)
                for key in _differing_keys(saved.get(name, _MISSING), current.get(name, _MISSING),
                                           f"{prefix}.{name}")]
    return [] if saved == current else [prefix]


_MISSING = object()


def _at(table: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        if not isinstance(table, dict) or part not in table:
            return "(unset)"
        table = table[part]
    return table


def _schema_difference(saved: dict[str, Any], current: dict[str, Any]) -> str:
    """Which top-level parts of two schema dicts differ, with both values (short)."""
    parts = []
    for key in sorted(set(saved) | set(current)):
        if saved.get(key) != current.get(key):
            parts.append(f"{key}: trained on {saved.get(key)!r}, data has {current.get(key)!r}")
    return "; ".join(parts) or "they differ"
