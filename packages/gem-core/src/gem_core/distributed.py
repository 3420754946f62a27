"""The process group of a run: started by torchrun (or the DeepSpeed launcher) or a single process."""

from __future__ import annotations

import datetime
import os
from typing import Callable

import attrs
import torch
import torch.distributed as dist

from gem_core.errors import GemConfigError


@attrs.frozen(kw_only=True)
class ParallelContext:
    """Where this process sits in the run. Strategies receive it; the model never sees it."""

    rank: int = 0
    """Global rank of this process."""

    world_size: int = 1
    """Number of processes."""

    local_rank: int = 0
    """Rank within this node (selects the GPU)."""

    device: torch.device = torch.device("cpu")
    """Device this rank computes on."""

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_TIMEOUT = datetime.timedelta(minutes=10)


def _store_for_this_attempt(rank: int, world_size: int) -> dist.Store:
    """The launcher's key-value store, under a prefix per restart attempt.

    When torchrun restarts a failed group it keeps its store, and the addresses the previous
    attempt's ranks published there are stale: a new rank would try to connect to a dead one
    (gloo: "connectFullMesh failed ... Connection refused"). A fresh prefix per attempt avoids it.
    """
    host = os.environ["MASTER_ADDR"]
    port = int(os.environ["MASTER_PORT"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world_size, is_master=(rank == 0 and not agent_hosts_store),
                          timeout=_TIMEOUT)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"gem/attempt-{attempt}", store)


def resolve_device(requested: str, local_rank: int = 0) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            build = (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but "
                     "finds no GPU (driver, CUDA_VISIBLE_DEVICES?)" if torch.version.cuda else
                     f"torch {torch.__version__} is a CPU-only build")
            raise GemConfigError(f"train.device = 'cuda' but there is no CUDA device: {build}; "
                                 "use train.device=cpu (or auto)")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_from_environment(requested_device: str) -> ParallelContext:
    """Join the process group described by the launcher's environment (RANK, WORLD_SIZE, ...),
    or run as one process when there is none."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(requested_device, local_rank)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=_TIMEOUT,
                                store=_store_for_this_attempt(rank, world_size),
                                rank=rank, world_size=world_size)
    return ParallelContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


_single_process_destroy: Callable[[], None] | None = None
"""How :func:`shutdown` destroys the group :func:`single_process_group` started (None: none)."""


def single_process_group(ctx: ParallelContext, *,
                         destroy: Callable[[], None] | None = None) -> None:
    """Give a one-process run a process group of one rank, for strategies built on
    torch.distributed (DeviceMesh, FSDP2, DeepSpeed) that need one even where every collective is
    trivial. Gloo (plus NCCL on CUDA) over an in-memory ``HashStore``: no address, port or launcher
    environment. Nothing is started when a group exists already (several ranks, or a caller that
    started its own). :func:`shutdown` destroys the group started here with ``destroy`` (default
    ``torch.distributed.destroy_process_group``); a library that caches its own references to
    groups (DeepSpeed) passes its own teardown, so that a later run in the same process does not
    meet stale groups."""
    global _single_process_destroy
    if ctx.is_distributed:
        raise RuntimeError(f"single_process_group is for one-process runs; this run has "
                           f"{ctx.world_size} ranks")
    if dist.is_initialized():
        if _single_process_destroy is not None and destroy is not None:
            _single_process_destroy = destroy
        return
    # On CUDA, gloo too: background checkpoints need a CPU backend in the default group.
    backend = "cpu:gloo,cuda:nccl" if ctx.device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=_TIMEOUT)
    _single_process_destroy = destroy or dist.destroy_process_group


def shutdown(ctx: ParallelContext) -> None:
    """End the process group cleanly (without the barrier, about a third of gloo runs crash at
    exit), or the one-rank group :func:`single_process_group` started."""
    global _single_process_destroy
    if ctx.is_distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    elif _single_process_destroy is not None:
        destroy, _single_process_destroy = _single_process_destroy, None
        if dist.is_initialized():
            destroy()


def all_reduce_sum(values: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    if ctx.is_distributed:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def all_reduce_max(values: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    if ctx.is_distributed:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


def all_gather_tensors(value: torch.Tensor, ctx: ParallelContext) -> list[torch.Tensor]:
    """Tensors of different first dimension from every rank, in rank order."""
    if not ctx.is_distributed:
        return [value]
    gathered: list[object] = [None] * ctx.world_size
    dist.all_gather_object(gathered, value.cpu())
    return [t for t in gathered]  # type: ignore[misc]
