"""The chat latency histograms (``control.metrics_chat``): a fake clock drives one chat's pieces and
answer through ``ChatClock``; the ``/metrics`` exposition (``render_labelled``) shows what it saw."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from triptych.chat import ChatResult
from triptych.chat.timing import ChatTiming
from triptych.control.metrics import Metrics, render_labelled
from triptych.control.metrics_chat import ChatClock

TIMING = ChatTiming(queue_s=0.25, vision_s=0.5, prefill_s=1.0, first_token_s=2.0, total_s=5.0, head_queue_s=0.125)


class FakeClock:
    def __init__(self, *times: float):
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def samples(metrics: Metrics) -> dict[tuple[str, str], float]:
    """(sample name, its ``le`` or "") → value, for the model ``m``'s series."""
    out = {}
    for family in text_string_to_metric_families(render_labelled({"m": metrics}).decode()):
        for s in family.samples:
            if s.name.startswith("triptych_chat_") and s.name.endswith(("_bucket", "_sum", "_count")):
                assert s.labels["model"] == "m"
                out[(s.name, s.labels.get("le", ""))] = s.value
    return out


def test_a_streamed_chat_records_its_first_piece_its_gaps_and_its_stages():
    metrics = Metrics()
    clock = ChatClock(metrics.chat_latency, t0=10.0, decode_s=0.0625, clock=FakeClock(13.0, 13.25, 14.0))
    for _ in range(3):
        clock.piece()
    clock.finished(ChatResult("abc", 7, 3, "stop", TIMING))
    got = samples(metrics)
    ttft = "triptych_chat_time_to_first_token_seconds"
    assert got[(f"{ttft}_count", "")] == 1 and got[(f"{ttft}_sum", "")] == 3.0  # from the first piece, not the answer
    assert got[(f"{ttft}_bucket", "2.5")] == 0 and got[(f"{ttft}_bucket", "5.0")] == 1
    gaps = "triptych_chat_inter_token_seconds"
    assert got[(f"{gaps}_count", "")] == 2 and got[(f"{gaps}_sum", "")] == 1.0  # 0.25 then 0.75
    assert got[(f"{gaps}_bucket", "0.25")] == 1 and got[(f"{gaps}_bucket", "0.5")] == 1
    assert got[("triptych_chat_media_decode_seconds_sum", "")] == 0.0625
    assert got[("triptych_chat_queue_seconds_sum", "")] == 0.375  # the head's wait and the worker's
    assert got[("triptych_chat_vision_encode_seconds_sum", "")] == 0.5
    assert got[("triptych_chat_prefill_seconds_sum", "")] == 1.0
    for name in ("media_decode", "queue", "vision_encode", "prefill"):
        assert got[(f"triptych_chat_{name}_seconds_count", "")] == 1


def test_an_unstreamed_chat_times_its_first_token_from_the_worker_s_stage_times():
    metrics = Metrics()
    # answered 8 s after receipt; the worker took 3 s from its first token to its last: 5 s
    ChatClock(metrics.chat_latency, t0=2.0, decode_s=0.0, clock=FakeClock(10.0)).finished(
        ChatResult("abc", 7, 3, "stop", TIMING)
    )
    got = samples(metrics)
    assert got[("triptych_chat_time_to_first_token_seconds_sum", "")] == 5.0
    assert got[("triptych_chat_inter_token_seconds_count", "")] == 0


def test_an_answer_without_stage_times_records_only_what_the_head_saw():
    metrics = Metrics()
    clock = ChatClock(metrics.chat_latency, t0=0.0, decode_s=0.5, clock=FakeClock(1.0, 1.5))
    clock.piece()
    clock.piece()
    clock.finished(ChatResult("ab", 7, 2, "stop"))  # a remote engine: no timing
    got = samples(metrics)
    assert got[("triptych_chat_time_to_first_token_seconds_sum", "")] == 1.0
    assert got[("triptych_chat_inter_token_seconds_sum", "")] == 0.5
    assert got[("triptych_chat_media_decode_seconds_count", "")] == 1
    for name in ("queue", "vision_encode", "prefill"):
        assert got[(f"triptych_chat_{name}_seconds_count", "")] == 0
