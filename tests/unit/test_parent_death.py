"""``parent_death.die_with_parent``: the kernel ends a child when its parent is killed with SIGKILL,
with nothing in the child watching (issue 24 item 6: workers outlived a killed, loaded head by 46 s
while they polled for it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.procs import alive, wait_gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")

# The child asks for the signal, says so, then sleeps: it never looks at its parent itself.
CHILD = """
import os, sys, time
from triptych.worker.parent_death import die_with_parent, parent_death_signal
die_with_parent(int(sys.argv[1]))
print(os.getpid(), parent_death_signal(), flush=True)
time.sleep(600)
"""
# The parent spawns the child as the head spawns a worker (from its main thread), then waits.
PARENT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())], stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), flush=True)
time.sleep(600)
"""


def test_a_child_dies_with_its_sigkilled_parent():
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True, env=env)
    child_pid = 0
    try:
        child_pid, sig = map(int, parent.stdout.readline().split())
        assert sig == signal.SIGTERM and alive(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        # a liveness bound; the child itself would sleep 600 s
        assert not wait_gone([child_pid], 30), "the child outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait(30)
        if child_pid and alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_a_worker_spawned_by_a_head_asks_for_it(monkeypatch):
    """``run_worker`` sets the signal before it loads anything when it has a parent pid, and not
    for a remote worker (no parent pid)."""
    from triptych.worker import process as W

    calls = []
    monkeypatch.setattr(W, "die_with_parent", lambda pid: calls.append(pid))

    class Stop(Exception):
        pass

    def no_worker(config):
        raise Stop

    monkeypatch.setattr(W, "Worker", no_worker)
    for parent in (4321, 0):
        config = W.WorkerConfig(
            role="denoiser", head="tcp://127.0.0.1:1", token="t" * 32, model_dir="m", parent_pid=parent
        )
        with pytest.raises(Stop):
            W.run_worker(config)
    assert calls == [4321]
