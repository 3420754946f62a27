"""The trainer's checkpoints: the engine through torch.distributed.checkpoint (DCP), the rest in a
small side file from rank 0, saved synchronously or in the background, published atomically by
:mod:`gem_core.checkpoint.layout` only once every rank's write has finished. Loading first
verifies the files against their digests and falls back to the newest checkpoint that verifies
(:meth:`Checkpointer.newest_intact`); nothing is unpickled (:mod:`gem_core.checkpoint.io`).

Sharded modules (TorchRec-sharded tables) add their own state: see
:mod:`gem_core.checkpoint.sharded_modules`.
"""

from __future__ import annotations

import logging
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from gem_core.checkpoint import io as checkpoint_io
from gem_core.checkpoint import sharded_modules
from gem_core.checkpoint.digests import verify_files
from gem_core.checkpoint.layout import (
    ENGINE_DIR,
    FULL_ENGINE_FILE,
    LEGACY_TRAINER_FILE,
    SHARDED_DIR,
    TRAINER_FILE,
    TRAINER_TENSORS_FILE,
    complete_checkpoints,
    prepare_staging,
    publish,
    staging_dir,
    write_info,
)
from gem_core.checkpoint.retention import BEST_BY, best_checkpoint, retain
from gem_core.config import TrainConfig
from gem_core.distributed import ParallelContext
from gem_core.engine import Engine
from gem_core.errors import GemCheckpointError, GemConfigError

log = logging.getLogger(__name__)

# A single-process run saves with no_dist=True on purpose; DCP still warns on every save that it
# is "assuming the intent is to save in a single process". That is the intent: keep logs clean.
warnings.filterwarnings("ignore", category=UserWarning,
                        message="torch.distributed is disabled, unavailable or uninitialized")


@attrs.define
class _Pending:
    """A background save: its step, DCP's future, and whether rank 0 has published it."""

    step: int
    future: Future
    started: float
    published: bool = False


class Checkpointer:
    """Saves and loads the trainer's checkpoints. Every method is called on every rank together
    (they run collectives), except :meth:`poll`, which runs none."""

    def __init__(self, run_dir: Path, ctx: ParallelContext, engine: Engine,
                 config: TrainConfig, *, checkpoint_classes: tuple[str, ...] = ()) -> None:
        self.run_dir, self.ctx, self.engine = Path(run_dir), ctx, engine
        # The classes the run's dense strategy declares its full-state engine file may hold
        # (DenseSharding.checkpoint_classes): no other class is built when one is loaded.
        self.checkpoint_classes = tuple(checkpoint_classes)
        self.keep_last, self.keep_best = config.keep_checkpoints, config.keep_best
        self.background = config.async_checkpoint and engine.distributed_checkpoint
        self.format = "dcp" if engine.distributed_checkpoint else "full"
        self._pending: _Pending | None = None
        self._group = None
        if self.background and ctx.is_distributed:
            # The background writer runs collectives while the training loop runs its own on
            # the default group: a group of its own keeps the two threads' messages apart.
            self._group = dist.new_group(backend="gloo")
        self.sharded_modules = sharded_modules.find(engine)
        self.blocking_s: list[float] = []
        self.write_s: list[float] = []
        self.last_bytes = 0
        self.damaged: list[dict[str, Any]] = []  # checkpoints that failed verification
        self.verify_s = 0.0
        self._newest_verified: int | None = None  # retention never deletes it

    # -- saving ---------------------------------------------------------------------------------

    def save(self, step: int, trainer_state: dict[str, Any], *, ne: float | None,
             ne_of: str = "eval") -> None:
        """Write ``step``: every rank its engine shards, rank 0 ``trainer_state`` (plain data:
        positions, RNG, counters, config) and ``ne`` (for keep-best retention; ``ne_of``: the
        part of the evaluation it is of, ``eval`` or ``validation``). Synchronous
        saves are published before returning; background ones by :meth:`poll` or :meth:`wait`
        once the write has finished on every rank."""
        started = time.perf_counter()
        self.wait()  # one save in flight at a time
        if self.ctx.is_main:
            prepare_staging(self.run_dir, step)
        self._barrier()
        staging = staging_dir(self.run_dir, step)
        future = None
        if self.engine.distributed_checkpoint:
            state = self.engine.sharded_state_dict()
            target = staging / ENGINE_DIR
            no_dist = not self.ctx.is_distributed
            if self.background:
                # DCP first copies the tensors to CPU staging memory, so training may change
                # them as soon as this returns.
                stager = sharded_modules.Stager(self.sharded_modules)
                future = dcp.async_save(state, checkpoint_id=target, process_group=self._group,
                                        async_stager=stager, no_dist=no_dist)
                stager.close()
            else:
                sharded_modules.attach(state, sharded_modules.collect(self.sharded_modules))
                dcp.save(state, checkpoint_id=target, no_dist=no_dist)
        else:
            full = self.engine.state_dict()  # collectives: every rank
            if self.ctx.is_main:
                torch.save(full, staging / FULL_ENGINE_FILE)
            if self.sharded_modules:
                # The full-state file has no room for shards: they go through DCP beside it.
                dcp.save(sharded_modules.standalone(self.sharded_modules),
                         checkpoint_id=staging / SHARDED_DIR, no_dist=not self.ctx.is_distributed)
        if self.ctx.is_main:
            layouts = {name: module.checkpoint_layout()
                       for name, module in self.sharded_modules.items()}
            checkpoint_io.write_trainer_state(
                {**trainer_state, "format": self.format, "sharded_modules": layouts},
                staging / TRAINER_FILE, staging / TRAINER_TENSORS_FILE)
            write_info(staging, step=step, format=self.format, ne=ne, ne_of=ne_of)
        if future is None:
            self._barrier()  # every rank's shards are on disk
            if self.ctx.is_main:
                self._publish(step, started)
            self._barrier()
        else:
            self._pending = _Pending(step=step, future=future, started=started)
        self.blocking_s.append(time.perf_counter() - started)

    def poll(self) -> None:
        """Publish a background save that has finished (rank 0; no collectives, so it may run at
        any step). DCP's future completes on rank 0 only after every rank's write result has
        reached it and the metadata is written, so the checkpoint is whole."""
        pending = self._pending
        if pending is None or pending.published or not pending.future.done():
            return
        pending.future.result()  # raise the writer's error, if any
        if self.ctx.is_main:
            self._publish(pending.step, pending.started)
        pending.published = True

    def wait(self) -> None:
        """Block until the background save (if any) is written and published on every rank:
        before another save, a rollback and the end of the run."""
        pending = self._pending
        if pending is None:
            return
        pending.future.result()
        if not pending.published and self.ctx.is_main:
            self._publish(pending.step, pending.started)
        self._pending = None
        self._barrier()  # the published checkpoint is visible to every rank from here on

    def close(self, *, publish: bool = True, timeout_s: float = 600.0) -> None:
        """At the end of the run, before the process group is destroyed: let a background
        save's writer thread (collectives on this checkpointer's group) finish. On success it
        is published (:meth:`wait`). After an error it is waited for, at most ``timeout_s``
        (other ranks may be gone, and their sockets' closing ends its collectives), and left
        unpublished in staging, which the next run removes as torn."""
        if publish:
            self.wait()
            return
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.future.result(timeout=timeout_s)
        except Exception as error:  # noqa: BLE001 - the run's own error is the one to report
            log.warning("background checkpoint of step %d did not finish (%s: %s); it stays "
                        "unpublished", pending.step, type(error).__name__, error)

    def _publish(self, step: int, started: float) -> None:
        staging = staging_dir(self.run_dir, step)
        self.last_bytes = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
        final = publish(self.run_dir, step)
        self.write_s.append(time.perf_counter() - started)
        self._newest_verified = step  # its digests were just taken from the files
        retain(self.run_dir, keep_last=self.keep_last, keep_best=self.keep_best,
               protect=[step])
        log.info("checkpoint %s published (%.1f MB)", final, self.last_bytes / 1e6)

    def _barrier(self) -> None:
        if self.ctx.is_distributed:
            dist.barrier()

    # -- loading --------------------------------------------------------------------------------

    def verify(self, path: Path) -> list[str]:
        """Every rank together: the problems of checkpoint ``path`` (empty when every file
        matches its digest). Each rank checks every size and hashes its share of the files;
        all ranks then hold the same verdict."""
        started = time.perf_counter()
        problems = verify_files(path, rank=self.ctx.rank, world_size=self.ctx.world_size)
        if self.ctx.is_distributed:
            found: list[Any] = [None] * self.ctx.world_size
            dist.all_gather_object(found, problems)
            problems = sorted({p for rank_problems in found for p in rank_problems})
        self.verify_s += time.perf_counter() - started
        return problems

    def newest_intact(self) -> tuple[int, Path] | None:
        """Every rank together: ``(step, path)`` of the newest complete checkpoint that
        verifies, ``None`` when there is no complete checkpoint. Each damaged newer one is
        reported by name (log warning, and :meth:`report` for summary.json); when every one is
        damaged this stops with the options. A checkpoint of the older pickle format is refused."""
        self._barrier()  # rank 0 may just have published an interrupted save (remove_torn)
        found = complete_checkpoints(self.run_dir)
        skipped = []
        for step, path in reversed(found):
            refuse_legacy(path)
            problems = self.verify(path)
            if not problems:
                if skipped and self.ctx.is_main:
                    log.warning("using %s: the newer %s failed verification (see above)",
                                path, ", ".join(p.name for p in skipped))
                self._newest_verified = step
                return step, path
            skipped.append(path)
            record = {"step": step, "path": str(path), "problems": problems}
            if record not in self.damaged:
                self.damaged.append(record)
            if self.ctx.is_main:
                log.warning("checkpoint %s is damaged and is not loaded: %s", path,
                            "; ".join(problems))
        if not found:
            return None
        listing = "; ".join(f"{Path(d['path']).name}: {', '.join(d['problems'])}"
                            for d in self.damaged if Path(d["path"]) in set(skipped))
        raise GemCheckpointError(
            f"no checkpoint in {self.run_dir / 'checkpoints'} verifies ({listing}). Options: "
            "--fresh starts over and deletes them; another --out starts over and keeps this "
            f"directory as it is; `gem checkpoints verify {self.run_dir}` lists the damage")

    def read_state(self, path: Path) -> dict[str, Any]:
        """The side file of a complete checkpoint (every rank reads it)."""
        return read_trainer_state(path)

    def load_engine(self, path: Path, state: dict[str, Any]) -> None:
        """Load the engine in place from ``path`` (whose side file is ``state``). DCP reshards:
        any number of ranks and any DCP engine can load what any other wrote."""
        if state["format"] != self.format:
            raise RuntimeError(f"{path} holds a {state['format']!r} engine; this run's engine "
                               f"needs {self.format!r}")  # the trainer checks this first
        sharded_modules.check_layouts(path, state, self.sharded_modules)
        if self.format == "full":
            self.engine.load_state_dict(
                checkpoint_io.load_full_engine_state(path / FULL_ENGINE_FILE,
                                                     allowed=self.checkpoint_classes))
            if self.sharded_modules:
                shards = sharded_modules.standalone(self.sharded_modules)
                sharded_modules.check_saved_shapes(path / SHARDED_DIR, state,
                                                   sharded_modules.flat_names(shards))
                self._load_dcp(shards, path / SHARDED_DIR)
            for module in self.sharded_modules.values():
                module.checkpoint_loaded()
            return
        sharded = self.engine.sharded_state_dict()
        stateless = drop_unsaved_optimizer_state(sharded, path / ENGINE_DIR)
        attached = sharded_modules.attach(sharded, sharded_modules.collect(self.sharded_modules))
        sharded_modules.check_saved_shapes(path / ENGINE_DIR, state, attached)
        try:
            self._load_dcp(sharded, path / ENGINE_DIR)
            sharded_modules.detach(sharded, attached)
            self.engine.load_sharded_state_dict(sharded, stateless=stateless)
        except GemCheckpointError:
            raise
        except (RuntimeError, ValueError, KeyError, dcp.CheckpointException) as error:
            saved = state["world_size"]
            if saved == self.ctx.world_size:
                raise
            # DCP reshards what it knows the layout of; this names the checkpoint's ranks
            # when something it holds still did not fit.
            raise GemConfigError(
                f"{path} was written by {saved} ranks and does not load into "
                f"{self.ctx.world_size} (embedding sharding "
                f"{state.get('embedding_sharding')!r}): {_reason(error)}. Resume with {saved} "
                "ranks or use --fresh"
            ) from error
        for module in self.sharded_modules.values():
            module.checkpoint_loaded()

    def _load_dcp(self, state: dict[str, Any], directory: Path) -> None:
        checkpoint_io.load_dcp(state, directory, no_dist=not self.ctx.is_distributed)

    def report(self) -> dict[str, Any]:
        """For ``summary.json``: format, mode, timings, size, kept steps and the best one."""
        best = best_checkpoint(self.run_dir) if self.keep_best else None

        def mean(xs: list[float]) -> float | None:
            return sum(xs) / len(xs) if xs else None

        return {
            "format": self.format, "async": self.background, "saves": len(self.blocking_s),
            "blocking_s_mean": mean(self.blocking_s), "write_s_mean": mean(self.write_s),
            "last_bytes": self.last_bytes,
            "kept_steps": [step for step, _ in complete_checkpoints(self.run_dir)],
            "best": {"step": best[0], "ne": best[1]} if best else None, "best_by": BEST_BY,
            # Checkpoints that failed verification when this run looked for one to load.
            "damaged": self.damaged, "verify_s": self.verify_s,
        }


def drop_unsaved_optimizer_state(state: dict[str, Any], directory: Path) -> list[str]:
    """Take out of an engine's ``{"model", "optimizer"}`` loading template the optimizer state
    of every parameter that the DCP checkpoint in ``directory`` holds none of, and return those
    parameters' names.

    AdamW creates a parameter's state at its first gradient, so a checkpoint has none for a
    parameter that had not had one yet; the template (``get_state_dict`` of a fresh optimizer)
    has state for every parameter, which DCP would refuse as a missing key. A parameter with
    only part of its state saved is left in, so DCP names what is missing."""
    saved = checkpoint_io.read_dcp_metadata(directory).state_dict_metadata  # nothing unpickled
    optimizer_state = state["optimizer"].get("state", {})
    stateless = [name for name, values in optimizer_state.items()
                 if not any(f"optimizer.state.{name}.{key}" in saved for key in values)]
    for name in stateless:
        del optimizer_state[name]
    return stateless


def _reason(error: BaseException) -> str:
    """One line of ``error``: DCP's exception carries every rank's traceback; the first
    ``...Error: message`` line is the reason."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = next((line for line in lines if "Error: " in line), lines[0] if lines else repr(error))
    return reason.rstrip(".")


def refuse_legacy(path: Path) -> None:
    """A checkpoint of the older format (``trainer.pt``, a pickle) is refused, naming the
    options: loading it could run code."""
    path = Path(path)
    if (path / LEGACY_TRAINER_FILE).exists() and not (path / TRAINER_FILE).exists():
        raise GemCheckpointError(
            f"{path} holds {LEGACY_TRAINER_FILE}, the trainer state of an older version: a "
            "pickle, which can run code when loaded, so this version does not read it. Start "
            "over with --fresh (deletes the run's checkpoints) or another --out, or finish the "
            "run with the release that wrote it")


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer state of checkpoint ``path`` (JSON plus its tensors; nothing unpickled)."""
    path = Path(path)
    refuse_legacy(path)
    side = path / TRAINER_FILE
    if not side.exists():
        old = " (it holds state.pt: an older single-file format)" if (
            path / "state.pt").exists() else ""
        raise GemConfigError(f"checkpoint {path} has no {TRAINER_FILE}{old}; use --fresh or "
                             "another --out")
    return checkpoint_io.read_trainer_state(side, path / TRAINER_TENSORS_FILE)


def read_checkpoint(path: Path, *,
                    checkpoint_classes: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A whole checkpoint in one process, with full (unsharded) tensors: ``{"trainer": side
    file, "engine": {"model": ..., "optimizer": ...}}`` (plus ``"sharded"``, the sharded
    modules' state, for full-state engines), after verifying its files against their digests.
    For inspection and :func:`gem_core.trained_run.load_run`; a run loads through
    :class:`Checkpointer`. ``checkpoint_classes``: the classes a full-state engine file may
    hold; None: those the dense strategy that wrote it (``trainer.json``) declares."""
    path = Path(path)
    refuse_legacy(path)
    problems = verify_files(path)
    if problems:
        raise GemCheckpointError(
            f"checkpoint {path} is damaged: {'; '.join(problems)}. `gem checkpoints verify "
            f"{path.parent.parent}` lists the checkpoints that verify")
    trainer = read_trainer_state(path)
    if trainer["format"] == "full":
        if checkpoint_classes is None:
            checkpoint_classes = declared_checkpoint_classes(trainer.get("dense_sharding"))
        engine = checkpoint_io.load_full_engine_state(path / FULL_ENGINE_FILE,
                                                      allowed=checkpoint_classes)
        if (path / SHARDED_DIR).is_dir():
            engine["sharded"] = checkpoint_io.read_dcp(path / SHARDED_DIR)
    else:
        engine = checkpoint_io.read_dcp(path / ENGINE_DIR)
    return {"trainer": trainer, "engine": engine}


def declared_checkpoint_classes(dense_sharding: str | None) -> tuple[str, ...]:
    """The classes the dense strategy named ``dense_sharding`` declares its full-state engine
    files may hold (:attr:`gem_core.contracts.DenseSharding.checkpoint_classes`), loaded through
    the installed plugins; none for a checkpoint that names no strategy."""
    if not dense_sharding:
        return ()
    from gem_core.plugins import build_plugins

    strategy = build_plugins().resolve("dense_sharding", dense_sharding).impl
    return tuple(strategy.checkpoint_classes)
