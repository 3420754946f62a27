"""How ``gem train`` starts several ranks: it runs itself again under torchrun
(``torch.distributed.run``, through :mod:`gem_core.cli.torchrun_agent`), which starts the ranks
of this node and joins them with the other nodes' through torchrun's rendezvous. Nothing here
is a launcher of its own: one node is torchrun ``--standalone``; several are torchrun's ``c10d``
rendezvous at ``--rdzv-endpoint``, the same as running ``torchrun --nnodes N --rdzv-backend
c10d --rdzv-endpoint HOST:PORT -m gem_core.cli.main train ...`` on every node.

Stopping: SIGTERM or SIGINT to ``gem train`` goes to torchrun's agent (in a session of its own,
so a terminal's Ctrl-C reaches it once, through here), which sends it to every rank of this
node; the ranks stop after the same step with its checkpoint (:mod:`gem_core.train.stop_signal`)
and this process exits with the signal's status (143, 130) and a line naming the step saved.
A second signal (a second or more later) kills the agent, and with it the ranks. On Linux the
agent dies with this process (``PR_SET_PDEATHSIG``: a ``kill -9`` of ``gem train`` kills the
agent) and each rank gets SIGTERM when its agent dies, so no rank outlives the launcher by more
than ``train.stop_grace_s``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Sequence

import attrs
import click

from gem_core.distributed import LAUNCH_NNODES
from gem_core.logs import current_logging
from gem_core.process_life import (
    LAUNCHER_PID,
    REPEAT_AFTER_S,
    STOP_SIGNALS,
    agent_preexec,
    exit_status,
    signal_name,
)

_ENDPOINT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")

SHUTDOWN_MARGIN_S = 30
"""What torchrun's agent waits past the ranks' grace period: their teardown after the save."""

_RENDEZVOUS_ERRORS = {
    "RendezvousTimeoutError": "timeout",
    "RendezvousConnectionError": "connection",
    "RendezvousClosedError": "closed",
}
"""torchrun's rendezvous exceptions (as its agent prints them) and what they mean to us."""


@attrs.frozen(kw_only=True)
class Launch:
    """Where and how many ranks ``gem train`` starts."""

    nproc_per_node: int = 1
    """Ranks started on this node."""

    nnodes: int = 1
    """Nodes of the run; every node runs the same command (one torchrun agent each)."""

    rdzv_endpoint: str | None = None
    """``HOST:PORT`` of torchrun's c10d rendezvous (several nodes only): a port free on HOST,
    reachable from every node; the agent on HOST serves it."""

    rdzv_timeout_s: int = 600
    """Seconds the agents wait for all nodes to join (and for the endpoint to answer) before
    giving up."""

    max_restarts: int = 0
    """Times torchrun restarts a failed group."""

    stop_grace_s: float = 25.0
    """The ranks' ``train.stop_grace_s``: torchrun's agent, once signalled, waits this long (and
    a margin, :data:`SHUTDOWN_MARGIN_S`) for them to end before it kills them."""

    @property
    def needs_torchrun(self) -> bool:
        return self.nproc_per_node > 1 or self.nnodes > 1


def check_launch(launch: Launch) -> None:
    """Refuse launch options that cannot form a group, naming the option."""
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        raise click.BadParameter(
            f"--nnodes {launch.nnodes} needs --rdzv-endpoint HOST:PORT: the address every node "
            "reaches (usually the first node's) and a free port", param_hint="--rdzv-endpoint")
    if launch.rdzv_endpoint is not None:
        if launch.nnodes == 1:
            raise click.BadParameter("--rdzv-endpoint is for runs of several nodes (--nnodes N); "
                                     "one node needs none", param_hint="--rdzv-endpoint")
        match = _ENDPOINT.match(launch.rdzv_endpoint)
        if match is None or not 0 < int(match.group(2)) < 65536:
            raise click.BadParameter(f"{launch.rdzv_endpoint!r} is not HOST:PORT (e.g. "
                                     "node001:29400)", param_hint="--rdzv-endpoint")


def torchrun_command(launch: Launch, train_args: Sequence[str]) -> list[str]:
    """The torchrun command line that runs ``gem train TRAIN_ARGS`` on every rank of this node."""
    log_level, log_format = current_logging()  # from gem's options or train's
    if launch.nnodes == 1:
        where = ["--standalone"]
    else:
        # join_timeout: how long the agents wait for every node; read_timeout: how long a
        # connection to the endpoint's store may stay unanswered.
        where = [f"--nnodes={launch.nnodes}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={launch.rdzv_endpoint}", "--rdzv-id=gem",
                 f"--rdzv-conf=join_timeout={launch.rdzv_timeout_s},"
                 f"read_timeout={launch.rdzv_timeout_s}"]
    return [sys.executable, "-m", "gem_core.cli.torchrun_agent", *where,
            f"--nproc-per-node={launch.nproc_per_node}", f"--max-restarts={launch.max_restarts}",
            f"--shutdown-timeout={int(launch.stop_grace_s) + SHUTDOWN_MARGIN_S}",
            "-m", "gem_core.cli.main", "--log-level", log_level, "--log-format", log_format,
            "train", *train_args]


def run_torchrun(launch: Launch, train_args: Sequence[str], *,
                 run_dir: Path | None = None) -> None:
    """Run torchrun and wait; a failed rendezvous or group is a ``ClickException`` that says
    what to check, a stop by a signal one with the signal's status that names the checkpoint
    saved in ``run_dir``. The agent's and the ranks' output goes to this process's stderr as it
    comes (relayed line by line when several nodes meet, to recognise rendezvous errors)."""
    command = torchrun_command(launch, train_args)
    if launch.nnodes > 1:
        silent = probe_endpoint(launch.rdzv_endpoint or "", launch.rdzv_timeout_s)
        if silent is not None:
            # The endpoint may also be an agent of this run that is going away (it gave up
            # waiting for a node started with another --nnodes): name that fix too.
            raise click.ClickException(f"{silent}; {same_command_hint(launch)}")
    relay = launch.nnodes > 1
    seen: set[str] = set()
    env = {**os.environ, LAUNCHER_PID: str(os.getpid())}
    if relay:  # the ranks check that every agent was told the same number of nodes
        env[LAUNCH_NNODES] = str(launch.nnodes)
    with SignalForwarding(run_dir) as forwarding:
        # A session of its own: a terminal's Ctrl-C reaches the agent only through here.
        with subprocess.Popen(command, stderr=subprocess.PIPE if relay else None, text=True,
                              bufsize=1, env=env, start_new_session=True,
                              preexec_fn=agent_preexec(os.getpid())) as process:
            forwarding.attach(process)
            if relay:
                assert process.stderr is not None
                for line in process.stderr:
                    sys.stderr.write(line)
                    seen.update(kind for name, kind in _RENDEZVOUS_ERRORS.items()
                                if name in line)
    if forwarding.signum is not None:
        stopped = click.ClickException(forwarding.outcome())
        stopped.exit_code = exit_status(forwarding.signum)
        raise stopped
    if process.returncode == 0:
        return
    if not relay:
        raise click.ClickException(
            f"torchrun with {launch.nproc_per_node} ranks exited with status "
            f"{process.returncode}; the ranks' errors are printed above")
    raise click.ClickException(rendezvous_failure(launch, seen, process.returncode))


class SignalForwarding:
    """While entered (main thread): SIGTERM and SIGINT to this process go to the agent's process
    group (:meth:`attach`), the first as it came, a later one (:data:`REPEAT_AFTER_S` or more
    after) as SIGKILL. :meth:`outcome` then says what the ranks saved in ``run_dir``."""

    def __init__(self, run_dir: Path | None) -> None:
        self.run_dir = run_dir
        self.signum: int | None = None
        self._first_at = 0.0
        self._newest_before: int | None = None
        self._process: subprocess.Popen | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> SignalForwarding:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    def attach(self, process: subprocess.Popen) -> None:
        self._process = process
        if self.signum is not None:  # it came while the agent was being started
            self._send(self.signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first_at = signum, now
            self._newest_before = self._newest_step()
            self._send(signum)
        elif now - self._first_at >= REPEAT_AFTER_S:
            self._send(signal.SIGKILL)

    def _send(self, signum: int) -> None:
        process = self._process
        if process is None or process.returncode is not None:
            return
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            pass

    def _newest_step(self) -> int | None:
        from gem_core.checkpoint.layout import latest_checkpoint

        found = latest_checkpoint(self.run_dir) if self.run_dir is not None else None
        return found[0] if found else None

    def outcome(self) -> str:
        """The line a stopped launch ends with: the step saved, and how to resume."""
        from gem_core.checkpoint.layout import latest_checkpoint

        name = signal_name(self.signum or signal.SIGTERM)
        found = latest_checkpoint(self.run_dir) if self.run_dir is not None else None
        again = (f"run the same command again (gem train --out {self.run_dir} ...) to resume "
                 "from it")
        if found and (self._newest_before is None or found[0] > self._newest_before):
            return (f"stopped by {name}: every rank stopped after step {found[0]} and its "
                    f"checkpoint was saved ({found[1]}); {again}")
        if found:
            return (f"stopped by {name} before the ranks saved the step they stopped at (see "
                    f"their messages above); the newest checkpoint is step {found[0]} "
                    f"({found[1]}): {again}")
        return (f"stopped by {name} before any checkpoint was saved; running the same command "
                "again starts the run over")


def probe_endpoint(endpoint: str, timeout_s: float) -> str | None:
    """Check, before torchrun starts, that the rendezvous endpoint answers within
    ``timeout_s``: None when it refuses connections (nobody serves it yet: torchrun's agent on
    that host will) or answers as a store; otherwise what went wrong, naming the endpoint.

    torchrun bounds the wait for other nodes (``join_timeout``) and for an unreachable host
    (``read_timeout``), but its store client waits without limit on an endpoint that accepts
    the connection and never answers (something else listening on the port, a proxy that
    swallows it): this check is what bounds that case."""
    import datetime
    import socket
    import threading

    from torch.distributed import TCPStore

    host, port = endpoint.rsplit(":", 1)
    host = host.strip("[]")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return None
    except OSError as error:  # timeout, unknown host, no route
        return (f"the rendezvous endpoint {endpoint} did not answer within {timeout_s} s "
                f"(--rdzv-timeout): {error}; check the host name, that it is reachable from "
                "this node and that the port is open between the nodes (firewall)")
    answered: list[BaseException | None] = []

    def connect() -> None:
        try:
            TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=timeout_s))
            answered.append(None)
        except (RuntimeError, ValueError, TimeoutError) as error:
            answered.append(error)

    # A daemon thread: a store client that never hears back cannot be interrupted.
    probe = threading.Thread(target=connect, name="gem-rdzv-probe", daemon=True)
    probe.start()
    probe.join(timeout_s)
    if answered and answered[0] is None:
        return None
    reason = (f"it failed: {answered[0]}" if answered else
              "it accepts connections but does not answer as torchrun's rendezvous store")
    return (f"the rendezvous endpoint {endpoint} did not answer within {timeout_s} s "
            f"(--rdzv-timeout): {reason}; check that HOST:PORT is where the first node's agent "
            "serves the rendezvous (a free port there, not another service's)")


def same_command_hint(launch: Launch) -> str:
    """The fix for agents that disagree, which ends in any of the rendezvous failures."""
    return (f"every node must run the same command with --nnodes {launch.nnodes} and "
            f"--rdzv-endpoint {launch.rdzv_endpoint} (agents started with different --nnodes "
            "never complete a rendezvous and time out like this)")


def rendezvous_failure(launch: Launch, seen: set[str], status: int) -> str:
    """What a failed multi-node launch tells the user: the endpoint, and what to check."""
    endpoint, timeout = launch.rdzv_endpoint, launch.rdzv_timeout_s
    same = same_command_hint(launch)
    if "connection" in seen:
        return (f"the rendezvous endpoint {endpoint} did not answer within {timeout} s "
                f"(--rdzv-timeout): check that HOST is this or another node's address, that the "
                f"agent serving it (the one on HOST) is running, and that PORT is open between "
                f"the nodes (firewall); {same}")
    if "timeout" in seen:
        return (f"the rendezvous at {endpoint} did not gather {launch.nnodes} nodes within "
                f"{timeout} s (--rdzv-timeout): {same}; start the other nodes (a SLURM job "
                "starts one agent per node with srun) or give a longer --rdzv-timeout")
    if "closed" in seen:
        return (f"the rendezvous at {endpoint} was closed by another node: it gave up waiting "
                f"(--rdzv-timeout), its ranks failed or it was stopped; see that node's output. "
                f"Also, {same}")
    return (f"torchrun on this node ({launch.nproc_per_node} ranks of a {launch.nnodes}-node "
            f"run, rendezvous {endpoint}) exited with status {status}; the ranks' errors are "
            "printed above")


def train_arguments(*, run_dir: Path, preset: str | None, config_file: str | None,
                    overrides: Sequence[str], fresh: bool, until_step: int | None,
                    allow_data_change: bool) -> list[str]:
    """``gem train`` arguments every rank runs with (the launch options stay here)."""
    args = ["--out", str(run_dir), "--no-progress"]
    if preset:
        args += ["--preset", preset]
    if config_file:
        args += ["--config", str(Path(config_file).resolve())]
    for override in overrides:
        args += ["--set", override]
    if fresh:
        args.append("--fresh")
    if allow_data_change:
        args.append("--allow-data-change")
    if until_step:
        args += ["--until-step", str(until_step)]
    return args
