"""What a checkpoint must agree on with the run that resumes from it, and where the data stream
continues when the number of ranks changed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gem_core.config import GemConfig, structure, unstructure
from gem_core.config.written_before import as_written
from gem_core.errors import GemConfigError, GemDataError

#: Version of the model's parameter layout and data model in checkpoints. 2: request-level
#: samples with declared feature schemas (one table per declared table, event tokens summed from
#: every event feature, position embeddings). Checkpoints without it are of version 1 (one
#: candidate per row, fixed item/action event features), which this model cannot load.
MODEL_FORMAT = 2


def with_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's stored configuration with the keys added since it was written at their
    defaults, or where the default changed at what that version did
    (:func:`~gem_core.config.written_before.as_written`), so a new key alone is not a
    difference. One this version cannot read (a key it does not know) is compared as stored:
    the difference is named."""
    try:
        return unstructure(structure(GemConfig, as_written(saved)))
    except (GemConfigError, TypeError, ValueError):
        return saved


def check_compatible(state: dict[str, Any], path: Path, *, config: GemConfig, strategy: str,
                     engine_format: str, world_size: int,
                     schema: dict[str, Any] | None = None,
                     allow_data_change: bool = False) -> None:
    """Refuse, naming the reason and ``--fresh``, a checkpoint this run cannot continue: one of
    an older model format, another ``[model]``, ``[data]`` or feature schema, another engine
    format, or (full-state engines only) another dense strategy or number of ranks. DCP
    checkpoints load into any DCP engine and number of ranks. ``allow_data_change``
    (``--allow-data-change``) accepts another ``[data]`` (the feature schema must still
    match)."""
    saved_format_version = state.get("model_format", 1)
    if saved_format_version != MODEL_FORMAT:
        raise GemConfigError(
            f"{path} was written by an older GEM trainer (model format {saved_format_version}: "
            "one candidate per row and fixed item/action history features); this version "
            f"trains request-level samples with declared feature schemas (model format "
            f"{MODEL_FORMAT}) and cannot load its parameters. Start over with --fresh (or "
            "another --out), or finish that run with the release that wrote it")
    if schema is not None and state.get("schema") not in (None, schema):
        raise GemConfigError(
            f"{path} was trained on data with another feature schema (tables, features or "
            "tasks differ); use --fresh to start over or another --out")
    saved, current = with_defaults(state["config"]), unstructure(config)
    for section in ("model",) if allow_data_change else ("model", "data"):
        if saved[section] != current[section]:
            changed = sorted(k for k in current[section]
                             if saved[section].get(k) != current[section][k])
            raise GemConfigError(
                f"{path} was trained with a different [{section}] ({', '.join(changed)}); "
                "use --fresh to start over or another --out"
                + ("" if section == "model" else
                   ", or --allow-data-change to continue on the new data on purpose")
            )
    share = current["train"]["validation_share"]
    saved_share = saved["train"].get("validation_share", 0.0)
    if saved_share != share:
        # The checkpoints so far are ranked by one part of the eval split; a new share would
        # rank the rest by another and report other users.
        raise GemConfigError(
            f"{path} was trained with train.validation_share = {saved_share} and this run has "
            f"{share}: its checkpoints are ranked, and its evaluations reported, on other "
            "users. Resume with the same share, or use --fresh or another --out")
    saved_strategy, saved_format = state["dense_sharding"], state["format"]
    if saved_format != engine_format:
        raise GemConfigError(
            f"{path} holds the model and optimizer as {saved_format!r} (written with dense "
            f"sharding {saved_strategy!r}) and this run's {strategy!r} needs {engine_format!r}; "
            f"resume with {saved_strategy!r} or use --fresh"
        )
    if engine_format == "full" and saved_strategy != strategy:
        raise GemConfigError(
            f"{path} was written with dense sharding {saved_strategy!r} and this run uses "
            f"{strategy!r}; full-state checkpoints keep that strategy's optimizer layout, so "
            f"resume with {saved_strategy!r} or use --fresh"
        )
    if engine_format == "full" and state["world_size"] != world_size:
        raise GemConfigError(
            f"{path} was written by {state['world_size']} ranks and this run has {world_size}; "
            f"{saved_strategy!r} checkpoints hold per-rank optimizer partitions and cannot be "
            "resharded: resume with the same number of ranks or use --fresh"
        )


def check_steps_cover(saved_step: int, steps: int, path: Path) -> None:
    """Refuse a ``train.steps`` below the checkpoint's step (before config.toml is rewritten):
    the run would stop at once and record a schedule it never followed."""
    if steps < saved_step:
        raise GemConfigError(
            f"{path} is at step {saved_step} and train.steps is {steps}: a run cannot end "
            f"before its latest checkpoint. Set train.steps >= {saved_step} to continue (the "
            "learning-rate schedule follows train.steps), use --until-step to stop early, or "
            "use --fresh / another --out to start over")


def load_data_position(stream: Any, state: dict[str, Any], path: Path, *, rank: int,
                       world_size: int, source: str) -> None:
    """Put this rank's training stream where the checkpoint left it.

    Same number of ranks: each rank takes its own saved position. Another number: the position
    must be global, i.e. the same on every saved rank (what a stream of global batches split by
    the balancer saves: the global batches consumed), and is loaded on every rank, so the run
    continues at the same global batch. A per-rank position (ranks reading disjoint shards) has
    no meaning for another number of ranks: a clear error names the source.
    """
    positions = state["data"]
    saved_world = state["world_size"]
    if saved_world == world_size:
        stream.load_state_dict(positions[rank])
        return
    advice = (f"resume with {saved_world} ranks, or use --fresh")
    if any(p != positions[0] for p in positions):
        raise GemConfigError(
            f"{path} was written by {saved_world} ranks and this run has {world_size}: data "
            f"source {source!r} saved a different position on each rank (rank 0: "
            f"{positions[0]}), so it cannot continue at the same global batch with another "
            f"number of ranks; {advice}"
        )
    try:
        stream.load_state_dict(positions[0])
    except GemDataError as error:
        raise GemConfigError(
            f"{path} was written by {saved_world} ranks and this run has {world_size}: data "
            f"source {source!r} cannot continue at the same global batch ({error}); {advice}"
        ) from None
