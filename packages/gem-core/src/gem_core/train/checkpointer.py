"""The trainer's checkpoints: the engine through torch.distributed.checkpoint (DCP), the rest in a
small side file from rank 0, saved synchronously or in the background, published atomically by
:mod:`gem_core.checkpoint` only once every rank's write has finished.

Sharded modules (TorchRec-sharded tables) add their own state: see
:mod:`gem_core.train.sharded_modules`.
"""

from __future__ import annotations

import logging
import tempfile
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

from gem_core.checkpoint import (
    BEST_BY,
    ENGINE_DIR,
    FULL_ENGINE_FILE,
    SHARDED_DIR,
    TRAINER_FILE,
    best_checkpoint,
    complete_checkpoints,
    prepare_staging,
    publish,
    retain,
    staging_dir,
    write_info,
)
from gem_core.config import TrainConfig
from gem_core.distributed import ParallelContext
from gem_core.engine import Engine
from gem_core.errors import GemConfigError
from gem_core.train import sharded_modules

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
                 config: TrainConfig) -> None:
        self.run_dir, self.ctx, self.engine = Path(run_dir), ctx, engine
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

    # -- saving ---------------------------------------------------------------------------------

    def save(self, step: int, trainer_state: dict[str, Any], *, ne: float | None) -> None:
        """Write ``step``: every rank its engine shards, rank 0 ``trainer_state`` (plain data:
        positions, RNG, counters, config) and ``ne`` (for keep-best retention). Synchronous
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
            torch.save({**trainer_state, "format": self.format, "sharded_modules": layouts},
                       staging / TRAINER_FILE)
            write_info(staging, step=step, format=self.format, ne=ne)
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

    def _publish(self, step: int, started: float) -> None:
        staging = staging_dir(self.run_dir, step)
        self.last_bytes = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
        final = publish(self.run_dir, step)
        self.write_s.append(time.perf_counter() - started)
        retain(self.run_dir, keep_last=self.keep_last, keep_best=self.keep_best)
        log.info("checkpoint %s published (%.1f MB)", final, self.last_bytes / 1e6)

    def _barrier(self) -> None:
        if self.ctx.is_distributed:
            dist.barrier()

    # -- loading --------------------------------------------------------------------------------

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
                torch.load(path / FULL_ENGINE_FILE, map_location="cpu", weights_only=False))
            if self.sharded_modules:
                shards = sharded_modules.standalone(self.sharded_modules)
                sharded_modules.check_saved_shapes(path / SHARDED_DIR, state,
                                                   sharded_modules.flat_names(shards))
                self._load_dcp(shards, path / SHARDED_DIR)
            for module in self.sharded_modules.values():
                module.checkpoint_loaded()
            return
        sharded = self.engine.sharded_state_dict()
        attached = sharded_modules.attach(sharded, sharded_modules.collect(self.sharded_modules))
        sharded_modules.check_saved_shapes(path / ENGINE_DIR, state, attached)
        try:
            self._load_dcp(sharded, path / ENGINE_DIR)
            sharded_modules.detach(sharded, attached)
            self.engine.load_sharded_state_dict(sharded)
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
        # flatten_sharded_tensors=False: that step (for FSDP1's nested ShardedTensors) drops a
        # ShardedTensor with no shard on this rank (a table another rank holds), and DCP then
        # takes the checkpoint's key for it as a sign of a pre-2.4 checkpoint and looks up
        # every key in that older format.
        dcp.load(state, checkpoint_id=directory,
                 planner=DefaultLoadPlanner(flatten_sharded_tensors=False),
                 no_dist=not self.ctx.is_distributed)

    def report(self) -> dict[str, Any]:
        """For ``summary.json``: format, mode, timings, size, kept steps and the best one."""
        best = best_checkpoint(self.run_dir) if self.keep_best else None
        mean = (lambda xs: sum(xs) / len(xs) if xs else None)
        return {
            "format": self.format, "async": self.background, "saves": len(self.blocking_s),
            "blocking_s_mean": mean(self.blocking_s), "write_s_mean": mean(self.write_s),
            "last_bytes": self.last_bytes,
            "kept_steps": [step for step, _ in complete_checkpoints(self.run_dir)],
            "best": {"step": best[0], "ne": best[1]} if best else None, "best_by": BEST_BY,
        }


def _reason(error: BaseException) -> str:
    """One line of ``error``: DCP's exception carries every rank's traceback; the first
    ``...Error: message`` line is the reason."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = next((line for line in lines if "Error: " in line), lines[0] if lines else repr(error))
    return reason.rstrip(".")


def read_trainer_state(path: Path) -> dict[str, Any]:
    side = Path(path) / TRAINER_FILE
    if not side.exists():
        old = " (it holds state.pt: an older single-file format)" if (
            Path(path) / "state.pt").exists() else ""
        raise GemConfigError(f"checkpoint {path} has no {TRAINER_FILE}{old}; use --fresh or "
                             "another --out")
    # weights_only=False: the side file holds RNG states and plain Python data written by us.
    return torch.load(side, map_location="cpu", weights_only=False)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """A whole checkpoint in one process, with full (unsharded) tensors: ``{"trainer": side
    file, "engine": {"model": ..., "optimizer": ...}}`` (plus ``"sharded"``, the sharded
    modules' state, for full-state engines). For tests and inspection; a run loads through
    :class:`Checkpointer`."""
    path = Path(path)
    trainer = read_trainer_state(path)
    if trainer["format"] == "full":
        engine = torch.load(path / FULL_ENGINE_FILE, map_location="cpu", weights_only=False)
        if (path / SHARDED_DIR).is_dir():
            engine["sharded"] = _read_dcp(path / SHARDED_DIR)
    else:
        engine = _read_dcp(path / ENGINE_DIR)
    return {"trainer": trainer, "engine": engine}


def _read_dcp(directory: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(directory, Path(scratch) / "state.pt")
        return torch.load(Path(scratch) / "state.pt", weights_only=False)
