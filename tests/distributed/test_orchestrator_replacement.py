"""The only instance of a role dies mid-request (scripted fake workers): the request waits for a
replacement to register and completes on it; the wait is bounded by ``replacement_wait_s`` and by the
request's deadline; nothing is held meanwhile; the dead attempt's late packets are dropped; a video
job survives it; a dead encoder whose conditioning already reached the denoiser costs nothing."""

from __future__ import annotations

import dataclasses
import time

import pytest
import zmq
from fake_workers import FakeWorker, HeadThread, next_of
from orchestrator_support import job

from tests.e2e.http_support import wait_for
from triptych.control import protocol as P
from triptych.control.backend import GenerationJob, StageFailed, Unavailable
from triptych.control.orchestrator import OrchestratorConfig
from triptych.families.base import GenerationParams
from triptych.families.registry import load_family, make_tiny

SPEC = {"cond.prompt_embeds": P.TensorSpec("float32", (1, 4, 8))}
LATENTS = {"latents": P.TensorSpec("float32", (1, 16, 8, 8))}
SLOW_BEATS = dict(heartbeat_interval_s=5.0, heartbeat_timeout_s=60.0)  # only the test declares deaths


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny("flux", tmp_path_factory.mktemp("orch-replace") / "flux")
    return path, load_family(path, roles=())


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def start(model_dir, ctx, **config):
    head = HeadThread(model_dir, OrchestratorConfig(**SLOW_BEATS, **config))
    workers = {r: FakeWorker(ctx, head.orch, f"{r}-0", r) for r in ("encoder", "denoiser", "decoder")}
    assert all(w.ack.accepted for w in workers.values())
    return head, workers


def kill(head: HeadThread, instance_id: str) -> None:
    """What the supervisor does when a worker's process exits (``kill -9``)."""
    head.on_loop(head.orch.instance_dead, instance_id, "its process exited with code -9")


def held(head: HeadThread) -> dict[str, list[str]]:
    return {i["id"]: i["held"] for i in head.on_loop(head.orch.describe)["instances"] if i["held"]}


def stats(head: HeadThread) -> dict[str, int]:
    return head.on_loop(head.orch.describe)["stats"]


def encode(enc: FakeWorker, rid: str, generation: int) -> P.EncodeTask:
    task = next_of(enc, P.EncodeTask)
    assert (task.request_id, task.generation) == (rid, generation)
    enc.send(P.EncodeDone(request_id=rid, generation=generation, instance_id=enc.id, specs=SPEC))
    return task


def denoise_and_decode(den: FakeWorker, dec: FakeWorker, rid: str, generation: int, data: bytes) -> None:
    task = next_of(den, P.DenoiseTask)
    assert (task.request_id, task.generation, task.decoder) == (rid, generation, dec.id)
    den.send(P.DenoiseDone(request_id=rid, generation=generation, instance_id=den.id, specs=LATENTS))
    decode = next_of(dec, P.DecodeTask)
    assert (decode.request_id, decode.generation, decode.source) == (rid, generation, den.id)
    dec.send(P.MediaResult(request_id=rid, generation=generation, instance_id=dec.id, data=data, output_format="png"))


def drain(worker: FakeWorker) -> list:
    """Every message queued for ``worker`` (until none came for a moment)."""
    out = []
    while worker.sock.poll(300):
        out.append(worker.client.recv())
    return out


def cancels(worker: FakeWorker) -> set[tuple[str, int]]:
    """The (request, generation) of each ``Cancel`` queued for ``worker``."""
    return {(m.request_id, m.generation) for m in drain(worker) if isinstance(m, P.Cancel)}


def test_the_only_denoiser_dies_mid_denoise_and_the_request_completes_on_its_replacement(model, ctx):
    head, w = start(model[0], ctx)
    try:
        pending = head.submit(head.orch.run(job(model[1], "w-1")))
        encode(w["encoder"], "w-1", 1)
        assert next_of(w["denoiser"], P.DenoiseTask).generation == 1  # mid-denoise: every role charged
        kill(head, "denoiser-0")
        w["denoiser"].sock.close(0)

        assert not pending.done()  # waiting, not failed: no other denoiser is registered
        assert held(head) == {}  # the dead attempt holds no slot on the live encoder and decoder
        assert ("w-1", 1) in cancels(w["encoder"]) and ("w-1", 1) in cancels(w["decoder"])  # their copies freed
        desc = head.on_loop(head.orch.describe)
        assert desc["requests"] == {"queued": 1} and desc["stats"]["replacement_waits"] == 1

        # late packets of the dead attempt (generation 1) change nothing
        dropped = desc["stats"].get("dropped_stale", 0)
        w["encoder"].send(P.EncodeDone(request_id="w-1", generation=1, instance_id="encoder-0", specs=SPEC))
        w["decoder"].send(
            P.MediaResult(request_id="w-1", generation=1, instance_id="decoder-0", data=b"stale", output_format="png")
        )
        wait_for(lambda: stats(head).get("dropped_stale", 0) == dropped + 2, "both late packets dropped")
        assert not pending.done()

        # the supervisor's restart: the same instance id, a new process (socket)
        den = FakeWorker(ctx, head.orch, "denoiser-0", "denoiser", identity=b"denoiser-0#2")
        assert den.ack.accepted
        assert encode(w["encoder"], "w-1", 2).denoiser == "denoiser-0"
        denoise_and_decode(den, w["decoder"], "w-1", 2, b"fresh")
        assert pending.result(30) == b"fresh"
        desc = head.on_loop(head.orch.describe)
        assert desc["stats"]["retries"] == 1 and desc["stats"]["done"] == 1 and "failed" not in desc["stats"]
        assert desc["requests"] == {} and held(head) == {}
    finally:
        head.close()


def test_the_only_encoder_dies_and_the_request_completes_on_its_replacement(model, ctx):
    head, w = start(model[0], ctx)
    try:
        pending = head.submit(head.orch.run(job(model[1], "w-2")))
        next_of(w["encoder"], P.EncodeTask)
        kill(head, "encoder-0")
        w["encoder"].sock.close(0)
        assert held(head) == {} and not pending.done()
        assert ("w-2", 1) in cancels(w["denoiser"])
        w["encoder"] = FakeWorker(ctx, head.orch, "encoder-0", "encoder", identity=b"encoder-0#2")
        encode(w["encoder"], "w-2", 2)
        denoise_and_decode(w["denoiser"], w["decoder"], "w-2", 2, b"fresh")
        assert pending.result(30) == b"fresh"
        assert held(head) == {}
    finally:
        head.close()


def test_the_only_decoder_dies_mid_denoise_and_the_request_completes_on_its_replacement(model, ctx):
    """The latents do not survive (they were not made yet; once pushed they live on the decoder
    only): the request is encoded again at once, then waits for a decoder before it denoises."""
    head, w = start(model[0], ctx)
    try:
        pending = head.submit(head.orch.run(job(model[1], "w-3")))
        encode(w["encoder"], "w-3", 1)
        next_of(w["denoiser"], P.DenoiseTask)  # the decoder is charged from the start of the denoise
        kill(head, "decoder-0")
        w["decoder"].sock.close(0)
        encode(w["encoder"], "w-3", 2)
        left = drain(w["denoiser"])
        assert ("w-3", 1) in {(m.request_id, m.generation) for m in left if isinstance(m, P.Cancel)}
        assert not [m for m in left if isinstance(m, P.DenoiseTask)]  # no denoise without a decoder
        assert held(head) == {"encoder-0": ["w-3"], "denoiser-0": ["w-3"]} and not pending.done()
        w["decoder"] = FakeWorker(ctx, head.orch, "decoder-0", "decoder", identity=b"decoder-0#2")
        denoise_and_decode(w["denoiser"], w["decoder"], "w-3", 2, b"fresh")
        assert pending.result(30) == b"fresh"
        assert held(head) == {}
    finally:
        head.close()


def test_the_wait_is_bounded_by_replacement_wait_s(model, ctx):
    head, w = start(model[0], ctx, replacement_wait_s=0.5)
    try:
        pending = head.submit(head.orch.run(job(model[1], "w-3b")))
        next_of(w["encoder"], P.EncodeTask)
        kill(head, "encoder-0")
        with pytest.raises(
            StageFailed, match=r"encoder-0 died.*no encoder instance registered within replacement_wait_s=0.5s"
        ):
            pending.result(30)
        desc = head.on_loop(head.orch.describe)
        assert desc["stats"]["replacement_waits_expired"] == 1 and desc["requests"] == {} and held(head) == {}
    finally:
        head.close()


@pytest.mark.parametrize("left_s", [0.5, -1.0])
def test_the_wait_is_bounded_by_the_request_deadline(model, ctx, left_s):
    """The request's own deadline (the HTTP head's request_timeout_s) ends the wait before a long
    ``replacement_wait_s``; a deadline passed already fails the request at the death."""
    head, w = start(model[0], ctx, replacement_wait_s=600.0)
    try:
        j = dataclasses.replace(job(model[1], "w-4"), deadline=time.monotonic() + left_s)
        pending = head.submit(head.orch.run(j))
        next_of(w["encoder"], P.EncodeTask)
        kill(head, "encoder-0")
        with pytest.raises(StageFailed, match=r"no encoder instance registered within the request's deadline"):
            pending.result(30)
        assert head.on_loop(head.orch.describe)["requests"] == {} and held(head) == {}
    finally:
        head.close()


def test_a_waiting_retry_outlives_the_roles_unavailable_grace(model, ctx):
    """Past ``unavailable_after_s`` new requests get ``Unavailable`` at once; the retry already
    waiting for a replacement keeps its own bound and completes once one registers."""
    head, w = start(model[0], ctx, unavailable_after_s=0.2, replacement_wait_s=600.0)
    try:
        pending = head.submit(head.orch.run(job(model[1], "w-5")))
        next_of(w["encoder"], P.EncodeTask)
        kill(head, "denoiser-0")

        def refused() -> bool:
            try:
                head.call(head.orch.run(job(model[1], f"new-{time.monotonic()}")), timeout=0.5)
            except Unavailable:
                return True
            except TimeoutError:
                pass
            return False

        wait_for(refused, "a new request refused with Unavailable once the grace passed")
        time.sleep(0.3)  # a few ticks of the head's loop, each failing queued requests but the waiting retry
        assert not pending.done()
        den = FakeWorker(ctx, head.orch, "denoiser-0", "denoiser", identity=b"denoiser-0#2")
        assert den.ack.accepted
        encode(w["encoder"], "w-5", 2)
        denoise_and_decode(den, w["decoder"], "w-5", 2, b"fresh")
        assert pending.result(30) == b"fresh"
    finally:
        head.close()


def test_an_encoder_dead_after_its_conditioning_reached_the_denoiser_costs_the_request_nothing(model, ctx):
    """The conditioning survives on the denoiser once pushed (``PushDone`` frees the encoder's slot):
    the request goes on with no retry, and no wait for an encoder."""
    head, w = start(model[0], ctx)
    try:
        pending = head.submit(head.orch.run(job(model[1], "w-6")))
        encode(w["encoder"], "w-6", 1)
        w["encoder"].send(P.PushDone(request_id="w-6", generation=1, instance_id="encoder-0", handoff="cond"))
        wait_for(lambda: "encoder-0" not in held(head), "the encoder's slot freed by its push")
        kill(head, "encoder-0")
        denoise_and_decode(w["denoiser"], w["decoder"], "w-6", 1, b"first")
        assert pending.result(30) == b"first"
        assert "retries" not in stats(head) and "replacement_waits" not in stats(head)
    finally:
        head.close()


def test_a_live_only_instance_that_fails_a_request_retryably_fails_it_at_once(model, ctx):
    """No wait when the instance lives: it failed the request itself (out of memory, say), and
    nothing says another will register."""
    head, w = start(model[0], ctx)
    try:
        pending = head.submit(head.orch.run(job(model[1], "w-8")))
        encode(w["encoder"], "w-8", 1)
        next_of(w["denoiser"], P.DenoiseTask)
        error = P.StageError(
            request_id="w-8",
            generation=1,
            instance_id="denoiser-0",
            stage="denoise",
            kind="OutOfMemoryError",
            message="out of memory",
            retryable=True,
        )
        w["denoiser"].send(error)
        with pytest.raises(StageFailed, match="out of memory; no other denoiser instance is registered"):
            pending.result(30)
        assert "replacement_waits" not in stats(head) and held(head) == {}
    finally:
        head.close()


def test_a_video_job_survives_the_death_of_its_only_denoiser(tmp_path, ctx):
    from triptych.head.admission import Admission, AdmissionLimits
    from triptych.head.jobs import VideoJobs, VideoRecord

    path = make_tiny("wan-t2v", tmp_path / "wan")
    family = load_family(path, roles=())
    head, w = start(path, ctx)
    videos = head.on_loop(VideoJobs, tmp_path / "data", None)
    try:
        params = family.resolve(GenerationParams("a red ball rolling", seed=3, frames=5))
        rec = VideoRecord("video_w7", 0, "queued", 0, "wan", params.prompt, "x", "1", 5)
        j = GenerationJob("video_w7", params, "mp4", fps=8)
        head.on_loop(videos.submit, rec, j, head.orch, Admission(AdmissionLimits()))
        encode(w["encoder"], "video_w7", 1)
        next_of(w["denoiser"], P.DenoiseTask)
        kill(head, "denoiser-0")
        w["denoiser"].sock.close(0)
        time.sleep(1.5)  # longer than the job lasted before it waited for a replacement
        assert videos.store.get("video_w7").status in ("queued", "in_progress")
        den = FakeWorker(ctx, head.orch, "denoiser-0", "denoiser", identity=b"denoiser-0#2")
        encode(w["encoder"], "video_w7", 2)
        denoise_and_decode(den, w["decoder"], "video_w7", 2, b"mp4 bytes")
        wait_for(lambda: videos.store.get("video_w7").status == "completed", "the video job completed")
        assert videos.path("video_w7").read_bytes() == b"mp4 bytes"
    finally:
        head.call(videos.close())
        head.close()
