"""The process group of a run: started by torchrun (or the DeepSpeed launcher) or a single
process."""

from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import sys
import threading
from typing import Callable, Mapping

import attrs
import torch
import torch.distributed as dist

from gem_core.errors import GemConfigError

log = logging.getLogger(__name__)


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

    local_world_size: int = attrs.field(
        default=attrs.Factory(lambda self: self.world_size, takes_self=True))
    """Ranks per node (torchrun's ``LOCAL_WORLD_SIZE``); every node has the same number, and
    the launcher numbers ranks node by node, so node ``k`` holds ranks ``k * local_world_size``
    to ``(k + 1) * local_world_size - 1``. Default: every rank on one node."""

    node_rank: int = 0
    """This process's node, 0 to ``num_nodes - 1`` (torchrun's ``GROUP_RANK``)."""

    def __attrs_post_init__(self) -> None:
        if self.local_world_size < 1 or self.world_size % self.local_world_size:
            raise GemConfigError(
                f"{self.world_size} ranks do not make whole nodes of {self.local_world_size} "
                f"ranks (LOCAL_WORLD_SIZE); start every node with the same --nproc-per-node")
        if not 0 <= self.node_rank < self.num_nodes:
            raise GemConfigError(f"node rank {self.node_rank} is outside the {self.num_nodes} "
                                 "node(s) of the run")

    @property
    def num_nodes(self) -> int:
        """Nodes of the run (``world_size / local_world_size``)."""
        return self.world_size // self.local_world_size

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
    local_world_size, node_rank = node_layout(os.environ, world_size, rank)
    device = resolve_device(requested_device, local_rank)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=_TIMEOUT,
                                store=_store_for_this_attempt(rank, world_size),
                                rank=rank, world_size=world_size)
        if world_size > local_world_size:
            check_agents_agree_on_nodes(world_size // local_world_size, node_rank)
    return ParallelContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device,
                           local_world_size=local_world_size, node_rank=node_rank)


LAUNCH_NNODES = "GEM_LAUNCH_NNODES"
"""Environment variable ``gem train --nnodes N`` gives its torchrun agent (and so its ranks)."""


def check_agents_agree_on_nodes(num_nodes: int, node_rank: int) -> None:
    """Every rank together: refuse a group whose agents were started with different
    ``--nnodes``. torchrun's c10d rendezvous completes as soon as the first agent's count of
    nodes has joined, so an agent told 3 can end up in a group of 2; all ranks then fail with the
    same message rather than some waiting for ranks that never come."""
    told = int(os.environ.get(LAUNCH_NNODES, "0"))  # 0: started by torchrun directly
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (node_rank, told))
    counts: dict[int, set[int]] = {}
    for node, count in gathered:  # type: ignore[misc]
        if count:
            counts.setdefault(count, set()).add(node)
    if set(counts) - {num_nodes}:
        started = "; ".join(f"--nnodes {count} on node(s) {sorted(nodes)}"
                            for count, nodes in sorted(counts.items()))
        raise GemConfigError(
            f"the agents were started with different --nnodes ({started}) and torchrun's "
            f"rendezvous formed a group of {num_nodes} nodes; start every node with the same "
            "--nnodes")


def node_layout(environ: Mapping[str, str], world_size: int, rank: int) -> tuple[int, int]:
    """``(local_world_size, node_rank)`` from the launcher's environment: torchrun's
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` and ``GROUP_WORLD_SIZE`` (the number of nodes), checked
    to describe nodes of equal size; without them every rank is on one node. Nodes of different
    sizes are refused: TorchRec's topology and the HSDP mesh assume equal ones."""
    local_world_size = int(environ.get("LOCAL_WORLD_SIZE", world_size))
    node_rank = int(environ.get("GROUP_RANK", rank // max(local_world_size, 1)))
    nodes = environ.get("GROUP_WORLD_SIZE")
    if nodes is not None and int(nodes) * local_world_size != world_size:
        raise GemConfigError(
            f"the launch has {world_size} ranks on {nodes} nodes, but this node (node rank "
            f"{node_rank}) has {local_world_size} (LOCAL_WORLD_SIZE): the nodes have different "
            "numbers of ranks; start every node with the same --nproc-per-node")
    return local_world_size, node_rank


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


DESTROY_LIMIT_S = 60.0
"""How long a rank waits for ``destroy_process_group`` once every rank has passed the closing
barrier (it takes milliseconds; see :func:`destroy_within`)."""


def shutdown(ctx: ParallelContext) -> None:
    """End the process group cleanly (without the barrier, about a third of gloo runs crash at
    exit), or the one-rank group :func:`single_process_group` started."""
    global _single_process_destroy
    if ctx.is_distributed and dist.is_initialized():
        dist.barrier()
        destroy_within(dist.destroy_process_group, DESTROY_LIMIT_S)
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


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: a DTensor's local shard (a view, so writes reach
    the parameter), else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def destroy_within(destroy: Callable[[], None], limit_s: float) -> bool:
    """Run ``destroy`` (the process group's teardown, after the closing barrier: every rank's
    work is done and saved) and wait for it at most ``limit_s`` seconds. True when it finished;
    an error it raised is raised here. Past the limit it is left running in its (daemon) thread,
    a warning and every thread's stack go to stderr, and False is returned: the caller ends
    without it. ``destroy_process_group`` hangs now and then at the end of a run whose ranks all
    reached it (pytorch/pytorch#75097; seen once in our CI on a 2-rank gloo run, whose rank 0
    had printed its result), and a finished run must not wait on it without end (a rank then
    ends through ``os._exit``, :mod:`gem_core.rank_exit`, which stops that thread too)."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            destroy()
        except BaseException as error:  # noqa: BLE001 - any error of the teardown (gloo's
            # RuntimeError, a SystemExit) is kept and raised again in the caller's thread
            failure.append(error)

    worker = threading.Thread(target=run, name="gem-destroy-process-group", daemon=True)
    worker.start()
    worker.join(limit_s)
    if worker.is_alive():
        log.warning("destroying the process group did not finish within %g s of the closing "
                    "barrier (a known rare hang of torch.distributed at exit); this rank's work "
                    "is done and saved, so it ends without waiting for it. Its threads' stacks "
                    "follow on stderr.", limit_s)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        return False
    if failure:
        raise failure[0]
    return True
