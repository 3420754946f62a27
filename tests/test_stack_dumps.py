"""A hung command says where it hung: ``kill -USR1`` makes a gem process print every thread's
stack and go on, and the test harness, before it stops a command past its time limit, collects
the stacks of every gem process of the command's tree (launcher, torchrun's agent, ranks)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from gem_core.process_life import process_stat
from gem_core.testing.processes import CommandTimedOut, run_process_group

HANGS = ("import sys, time\n"
         "from gem_core.stack_dump import enable_stack_dumps\n"
         "enable_stack_dumps()\n"
         "print('ready', flush=True)\n"
         "def waiting_here():\n"
         "    time.sleep(120)\n"
         "waiting_here()\n")


def test_sigusr1_prints_every_threads_stack_and_the_process_goes_on():
    process = subprocess.Popen([sys.executable, "-c", HANGS], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # into the sleep
        os.kill(process.pid, signal.SIGUSR1)
        time.sleep(1.0)
        assert process.poll() is None  # the dump is not the end of the process
    finally:
        process.kill()
        _, stderr = process.communicate()
    assert "waiting_here" in stderr, stderr


@pytest.mark.distributed
def test_a_launch_past_its_limit_dumps_every_gem_process_and_leaves_none(tmp_path):
    """The launcher, torchrun's agent (a session of its own) and the ranks all print their
    stacks into the failure, and none is left running."""
    command = [sys.executable, "-m", "gem_core.cli.main", "train", "--preset", "tiny",
               "--out", str(tmp_path / "run"), "--no-progress", "--nproc-per-node", "2",
               "--set", "train.steps=1000000", "--set", "data.max_seq_len=16",
               "--set", "train.eval_every=1000000"]
    with pytest.raises(CommandTimedOut) as failure:
        run_process_group(command, timeout=45, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          raise_on_timeout=True)
    message = str(failure.value)
    assert "ran past its 45 s limit" in message
    # the launcher waits on torchrun's agent; the agent monitors its ranks; each rank trains
    assert "gem_core/cli/launch.py" in message, message[-5000:]
    assert "torch/distributed/elastic" in message, message[-5000:]
    assert message.count("gem_core/train/") >= 2, message[-5000:]  # both ranks
    tree = re.search(r"of its tree \[([0-9, ]+)\]", message)
    assert tree is not None, message[-2000:]
    pids = [int(pid) for pid in tree.group(1).split(",")]
    assert len(pids) >= 4  # launcher, agent, two ranks
    time.sleep(1.0)
    left = [pid for pid in pids if (stat := process_stat(pid)) is not None and stat[1] != "Z"]
    assert not left, left

