"""The worker's port (``worker.port.JobPort``): built whole with its runner, it hands each finished
transfer on by its typed tag (a landed handoff to ``arrived``, a landed or lost preview to
``preview_arrived``, a finished push to the head as ``PushDone``) and a drop to the runner's ``abort``."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from triptych.control import protocol as P
from triptych.transfer import TransferError
from triptych.worker.port import JobPort
from triptych.worker.runners.base import Job


class Endpoint:
    """Reserves named slots; a wait or push returns (or raises) what the test put in ``results``."""

    def __init__(self):
        self.results: dict[str, object] = {}  # handoff -> tensors or an exception
        self.cancelled: list[str] = []
        self.pushed: list[dict] = []

    def reserve_bundle(self, prefix, specs, peer, timeout_s, request=""):
        return {
            name: SimpleNamespace(transfer_id=f"{prefix}/{name}", handoff=prefix.rsplit("/", 1)[1]) for name in specs
        }

    def _result(self, handoff):
        out = self.results[handoff]
        if isinstance(out, Exception):
            raise out
        return out

    def wait_bundle(self, refs):
        return self._result(next(iter(refs.values())).handoff)

    def push_bundle(self, refs, tensors):
        self.pushed.append(tensors)
        return self._result("push")

    def cancel(self, transfer_id):
        self.cancelled.append(transfer_id)


class Runner:
    stage = "denoise"

    def __init__(self, port):
        self.port = port
        self.calls: list[tuple] = []

    def abort(self, job):
        self.calls.append(("abort", job.request_id))

    def arrived(self, job, tensors):
        job.incoming = tensors
        self.calls.append(("arrived", job.request_id, sorted(tensors)))

    def preview_arrived(self, job, handoff, tensors):
        self.calls.append(("preview", job.request_id, handoff, tensors is None))


def make_port():
    sent, done, endpoint = [], threading.Event(), Endpoint()
    port = JobPort("den-0", sent.append, endpoint, threading.Event(), Runner, wake=done.set)
    return port, endpoint, sent, done


def collect_after(port, done):
    assert done.wait(10), "the transfer never ended"  # a liveness bound; the fakes return at once
    done.clear()
    port.collect()


def test_the_port_builds_its_runner_whole_and_hands_it_a_landed_handoff():
    port, endpoint, sent, done = make_port()
    assert isinstance(port.runner, Runner) and port.runner.port is port
    job = Job("r1", 2, None, None)
    port.adopt(job)
    endpoint.results["cond"] = {"cond.x": torch.ones(1)}
    port.reserve(job, "cond", {"cond.x": None}, "enc-0", 5.0)
    assert isinstance(sent[0], P.SlotsReserved) and job.reserved == ["r1/g2/cond/cond.x"]
    collect_after(port, done)
    assert port.runner.calls == [("arrived", "r1", ["cond.x"])]
    assert job.reserved == [] and job.incoming is not None and job.outgoing is None


def test_a_finished_push_reports_push_done_and_releases_the_job():
    port, endpoint, sent, done = make_port()
    job = Job("r1", 1, None, None)
    port.adopt(job)
    job.outgoing = {"latents": torch.zeros(2)}
    endpoint.results["push"] = None
    port.push(P.PushTask(request_id="r1", generation=1, handoff="latents", refs={}))
    collect_after(port, done)
    assert endpoint.pushed and job.outgoing is None
    assert [type(m) for m in sent] == [P.PushDone] and sent[0].handoff == "latents" and "r1" not in port.jobs


def test_a_lost_preview_costs_one_partial_image_and_a_lost_handoff_fails_the_job_retryably():
    port, endpoint, sent, done = make_port()
    job = Job("r1", 1, None, None)
    port.adopt(job)
    endpoint.results["preview0"] = TransferError("peer gone")
    port.reserve(job, "preview0", {"latents": None}, "den-1", 5.0)
    collect_after(port, done)
    assert port.runner.calls == [("preview", "r1", "preview0", True)] and port.owns(job)
    endpoint.results["latents"] = TransferError("peer gone")
    port.reserve(job, "latents", {"latents": None}, "den-1", 5.0)
    collect_after(port, done)
    (error,) = [m for m in sent if isinstance(m, P.StageError)]
    assert error.retryable and error.stage == "denoise" and not port.owns(job)
    assert port.runner.calls[-1] == ("abort", "r1")


def test_a_result_for_a_dropped_generation_is_discarded():
    port, endpoint, sent, done = make_port()
    job = Job("r1", 1, None, None)
    port.adopt(job)
    gate = threading.Event()
    endpoint.wait_bundle = lambda refs: gate.wait(10) and {"latents": torch.ones(1)}
    port.reserve(job, "latents", {"latents": None}, "den-1", 5.0)
    port.drop("r1", 1, "cancelled")
    assert port.runner.calls == [("abort", "r1")] and endpoint.cancelled == ["r1/g1/latents/latents"]
    gate.set()
    collect_after(port, done)
    assert port.runner.calls == [("abort", "r1")]  # no arrival for a job nobody holds
