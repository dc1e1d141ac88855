"""Local worker supervision with 10-line fake processes: exits are reported, restarts back off,
a crash loop is given up on, and ``restart=False`` only reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from triptych.core.kinds import ROLES, Role
from triptych.deploy.launch import TopologyConfig
from triptych.deploy.supervisor import LocalWorkers


class FakeProc:
    pids = iter(range(1000, 2000))

    def __init__(self):
        self.pid = next(self.pids)
        self.code = None

    def poll(self):
        return self.code


def workers(**topology):
    exits = []
    w = LocalWorkers(Path("m"), TopologyConfig(**topology), "t" * 32, lambda iid, code: exits.append((iid, code)))
    w._start = lambda role, head, iid: FakeProc()
    w.spawn("denoiser", "tcp://127.0.0.1:1")
    return w, exits


def test_an_exit_is_reported_once_and_restarted_after_the_backoff():
    w, exits = workers(restart_backoff_s=1.0)
    first = w.procs["denoiser-0"]
    first.code = -9
    w.check(100.0)
    assert exits == [("denoiser-0", -9)] and w.procs["denoiser-0"] is first  # waiting out the backoff
    w.check(100.5)
    assert w.procs["denoiser-0"] is first and len(exits) == 1
    w.check(101.0)
    assert w.procs["denoiser-0"] is not first and w.restarts_total == 1
    w.check(101.5)
    assert len(exits) == 1  # the new process runs


def test_the_backoff_doubles_inside_the_window_and_a_crash_loop_is_given_up():
    w, exits = workers(restart_backoff_s=1.0, crash_loop_limit=3, crash_loop_window_s=60.0)
    now, waits = 0.0, []
    for _ in range(4):
        w.procs["denoiser-0"].code = 1
        w.check(now)
        worker = w.workers["denoiser-0"]
        if worker.given_up:
            break
        waits.append(worker.restart_at - now)
        now = worker.restart_at
        w.check(now)
    assert waits == [1.0, 2.0, 4.0] and w.workers["denoiser-0"].given_up and len(exits) == 4
    assert w.describe()["workers"]["denoiser-0"]["given_up"] is True


def test_restarts_outside_the_window_do_not_count():
    w, _ = workers(restart_backoff_s=1.0, crash_loop_limit=2, crash_loop_window_s=10.0)
    now = 0.0
    for _ in range(5):  # one crash every 100 s never makes a loop
        w.procs["denoiser-0"].code = 1
        w.check(now)
        now = w.workers["denoiser-0"].restart_at
        w.check(now)
        now += 100.0
    assert not w.workers["denoiser-0"].given_up and w.restarts_total == 5


def test_without_restart_an_exit_is_only_reported():
    w, exits = workers(restart=False)
    first = w.procs["denoiser-0"]
    first.code = 0
    w.check(1.0)
    w.check(100.0)
    assert exits == [("denoiser-0", 0)] and w.procs["denoiser-0"] is first and w.restarts_total == 0


def test_threads_split_the_idle_cores_among_local_workers_unless_set(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    monkeypatch.setattr("os.getloadavg", lambda: (0.2, 0.0, 0.0))
    for role in ROLES:
        assert workers(encoders=1, denoisers=2, decoders=1)[0].threads(role) == 4
        assert workers(encoders=1, denoisers=1, decoders=1, torch_threads=3)[0].threads(role) == 3
    monkeypatch.setattr("os.getloadavg", lambda: (8.4, 0.0, 0.0))  # 8 of the 16 cores busy
    assert workers(encoders=1, denoisers=2, decoders=1)[0].threads(Role.DENOISER) == 2
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert workers(encoders=1, denoisers=2, decoders=1)[0].threads(Role.ENCODER) == 1


def test_denoiser_threads_set_the_denoisers_alone(monkeypatch):
    """``--denoiser-threads N``: each denoiser process gets N torch threads; the other roles keep
    ``--threads`` or the split of the idle cores; a spawned denoiser's worker config carries N."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0))
    w, _ = workers(encoders=1, denoisers=1, decoders=1, denoiser_threads=2)
    assert w.threads(Role.DENOISER) == 2
    assert w.threads(Role.ENCODER) == w.threads(Role.DECODER) == 1  # 2 cores among 3 workers
    started = []
    monkeypatch.setattr(
        "triptych.deploy.supervisor.subprocess.Popen", lambda cmd, **kw: started.append(cmd) or FakeProc()
    )
    w = LocalWorkers(Path("m"), TopologyConfig(torch_threads=3, denoiser_threads=2), "t" * 32, lambda *a: None)
    for role in (Role.ENCODER, Role.DENOISER, Role.DECODER):
        w.spawn(role, "tcp://127.0.0.1:1")
    assert [cmd[cmd.index("--role") + 1] for cmd in started] == ["encoder", "denoiser", "decoder"]
    assert [cmd[cmd.index("--threads") + 1] for cmd in started] == ["3", "2", "3"]
    with pytest.raises(ValueError, match="denoiser_threads=-1"):
        TopologyConfig(denoiser_threads=-1)


def test_gpus_are_laid_out_denoisers_first_and_a_worker_sees_only_its_own(monkeypatch):
    """``--gpus``: each denoiser takes as many devices as it has ranks, encoders and decoders share the
    rest; a worker's CUDA_VISIBLE_DEVICES holds its devices, so its own indices start at cuda:0."""
    import pytest

    from triptych.core.devices import DeviceConfig
    from triptych.parallel import ParallelConfig

    for check in ("check_device", "check_dtype", "check_attention"):  # no CUDA on this machine
        monkeypatch.setattr(f"triptych.core.devices.{check}", lambda *a: None)
    cuda = DeviceConfig(device="cuda", dtype="bfloat16")
    t = TopologyConfig(encoders=1, denoisers=2, decoders=1, device=cuda, gpus=(0, 1, 2, 3))
    assert t.layout() == {"denoiser-0": (0,), "denoiser-1": (1,), "encoder-0": (2,), "decoder-0": (3,)}
    t = TopologyConfig(device=cuda, gpus=(4, 5, 6), parallel=ParallelConfig(ulysses=2))
    assert t.layout() == {"denoiser-0": (4, 5), "encoder-0": (6,), "decoder-0": (6,)}
    assert t.device_for("denoiser", "denoiser-0").to_args()[:2] == ["--device", "cuda"]
    with pytest.raises(ValueError, match="need 4"):
        TopologyConfig(denoisers=2, device=cuda, gpus=(0, 1, 2), parallel=ParallelConfig(cfg=2)).layout()
    with pytest.raises(ValueError, match="use device cuda"):
        TopologyConfig(gpus=(0,))


def test_a_retired_worker_is_reported_once_and_not_restarted():
    w, exits = workers(restart_backoff_s=1.0)
    w.retire("denoiser-0")
    assert w.current("denoiser") == []
    w.procs["denoiser-0"].code = 0
    w.check(100.0)
    w.check(200.0)
    assert exits == [("denoiser-0", 0)] and w.restarts_total == 0
    assert w.spawn("denoiser", "tcp://127.0.0.1:1") == "denoiser-1"  # a retired id is not reused
