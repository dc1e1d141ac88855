"""``StepGraphs``' bookkeeping with a fake capture backend: buckets, padding and slicing, static
buffers refilled per replay, keys, the count and byte bounds (lru and refuse), and every fallback
counted under its reason. The real CUDA capture is tests/pipelines/test_gpu_speed.py's."""

from __future__ import annotations

import pytest
import torch

from triptych.accel.step_graphs import (
    ABOVE_BUCKETS,
    LIMIT_REFUSED,
    TOO_LARGE,
    UNCAPTURABLE,
    GraphCall,
    StepGraphs,
    bucket_for,
    pad_rows,
)


class FakeCaptured:
    """A "graph" that reruns its call on the buffers it was captured with, into one output tensor."""

    def __init__(self, run, nbytes):
        self.run, self.nbytes = run, nbytes
        self.output = run()

    def replay(self):
        self.output.copy_(self.run())


class FakeBackend:
    def __init__(self, nbytes=100, refuse=None, fail=False):
        self.nbytes, self.refuse, self.fail, self.captures, self.devices = nbytes, refuse, fail, 0, []

    def refusal(self, tensors):
        return self.refuse

    def capture(self, run, device):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1
        self.devices.append(device)
        return FakeCaptured(run, self.nbytes)


def affine(seen=None):
    """fn(batch, x, scale) = x * scale + batch, recording the padded batches it ran."""

    def run(batch, x, scale):
        if seen is not None:
            seen.append(x.clone())
        return x * scale + batch

    return run


def call(x, scale=None, settings=(), seen=None):
    scale = torch.tensor(2.0) if scale is None else scale
    return GraphCall(affine(seen), {"x": x, "scale": scale}, frozenset({"x"}), x.shape[0], settings)


def test_bucket_is_the_smallest_that_holds_the_rows():
    assert [bucket_for(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def test_pad_rows_repeats_row_zero_up_to_the_bucket():
    x = torch.arange(6.0).view(3, 2)
    padded = pad_rows(x, 5)
    assert padded.shape == (5, 2)
    assert torch.equal(padded[:3], x) and torch.equal(padded[3], x[0]) and torch.equal(padded[4], x[0])


def test_three_rows_replay_the_bucket_of_four_and_get_their_own_rows_back():
    seen = []
    backend = FakeBackend()
    graphs = StepGraphs(backend, buckets=(1, 4))
    x = torch.randn(3, 5)
    out = graphs.run(call(x, seen=seen))
    assert backend.devices == [x.device]  # the capture is told where its inputs live
    assert torch.equal(out, x * 2 + 4)  # the function saw batch 4; only the real rows come back
    assert seen[-1].shape == (4, 5) and torch.equal(seen[-1][3], x[0])  # padding row: a copy of row 0
    assert graphs.stats.replays == 1 and graphs.stats.padded_rows == 1


def test_a_second_call_of_the_same_shapes_replays_on_its_new_values():
    backend = FakeBackend()
    graphs = StepGraphs(backend, buckets=(4,))
    graphs.run(call(torch.randn(3, 5)))
    x, scale = torch.randn(2, 5), torch.tensor(-1.5)  # fewer rows, same bucket; a new shared value
    out = graphs.run(call(x, scale))
    assert backend.captures == 1
    assert torch.equal(out, x * -1.5 + 4)


def test_the_returned_rows_are_a_copy_the_next_replay_does_not_overwrite():
    graphs = StepGraphs(FakeBackend(), buckets=(2,))
    first = graphs.run(call(torch.ones(2, 3)))
    kept = first.clone()
    graphs.run(call(torch.zeros(2, 3)))
    assert torch.equal(first, kept)


def test_a_new_row_shape_dtype_or_setting_is_a_new_graph():
    backend = FakeBackend()
    graphs = StepGraphs(backend, buckets=(2,))
    for c in (
        call(torch.randn(2, 5)),
        call(torch.randn(1, 5)),  # same bucket, same row shape: the same graph
        call(torch.randn(2, 6)),
        call(torch.randn(2, 5, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64)),
        call(torch.randn(2, 5), settings=("other",)),
    ):
        graphs.run(c)
    assert backend.captures == 4 and len(graphs) == 4


def test_rows_above_the_largest_bucket_run_eagerly_and_are_counted():
    backend = FakeBackend()
    graphs = StepGraphs(backend, buckets=(1, 2))
    assert graphs.run(call(torch.randn(3, 5))) is None
    assert graphs.stats.fallbacks == {ABOVE_BUCKETS: 1} and backend.captures == 0


def test_lru_drops_the_least_recently_replayed_graph_past_graph_max():
    graphs = StepGraphs(FakeBackend(), buckets=(1,), max_graphs=2, policy="lru")
    a, b, c = (call(torch.randn(1, n)) for n in (3, 4, 5))
    graphs.run(a)
    graphs.run(b)
    graphs.run(a)  # b is now the least recently replayed
    graphs.run(c)
    shapes = [dict((s[0], s[2]) for s in key[1] if s[1] is not None)["x"] for key in graphs.keys()]
    assert shapes == [(3,), (5,)]
    assert graphs.stats.evictions == 1 and graphs.stats.pool_bytes == 200


def test_refuse_keeps_the_graphs_it_has_and_runs_new_shapes_eagerly():
    backend = FakeBackend()
    graphs = StepGraphs(backend, buckets=(1,), max_graphs=1, policy="refuse")
    a, b = call(torch.randn(1, 3)), call(torch.randn(1, 4))
    graphs.run(a)
    assert graphs.run(b) is None
    assert graphs.run(a) is not None
    assert graphs.stats.fallbacks == {LIMIT_REFUSED: 1} and backend.captures == 1


def test_the_byte_bound_evicts_until_the_new_graph_fits():
    graphs = StepGraphs(FakeBackend(nbytes=100), buckets=(1,), max_graphs=10, pool_bytes=250)
    for n in (3, 4, 5):
        graphs.run(call(torch.randn(1, n)))
    assert len(graphs) == 2 and graphs.stats.pool_bytes == 200 and graphs.stats.evictions == 1
    assert graphs.graph_bytes() == [100, 100]


def test_the_byte_bound_with_refuse_runs_the_shape_that_does_not_fit_eagerly_without_retrying():
    backend = FakeBackend(nbytes=100)
    graphs = StepGraphs(backend, buckets=(1,), pool_bytes=150, policy="refuse")
    graphs.run(call(torch.randn(1, 3)))
    b = call(torch.randn(1, 4))
    assert graphs.run(b) is None and graphs.run(b) is None
    assert backend.captures == 2 and len(graphs) == 1  # captured once, dropped, not captured again
    assert graphs.stats.fallbacks == {LIMIT_REFUSED: 2} and graphs.stats.pool_bytes == 100


def test_one_graph_larger_than_the_byte_bound_is_not_kept_nor_captured_again():
    backend = FakeBackend(nbytes=1000)
    graphs = StepGraphs(backend, buckets=(1,), pool_bytes=500)
    c = call(torch.randn(1, 3))
    assert graphs.run(c) is None and graphs.run(c) is None
    assert backend.captures == 1 and len(graphs) == 0
    assert graphs.stats.fallbacks == {TOO_LARGE: 2} and graphs.stats.pool_bytes == 0


def test_inputs_the_backend_refuses_run_eagerly_with_its_reason():
    backend = FakeBackend(refuse="x is on cpu, not a CUDA device")
    graphs = StepGraphs(backend, buckets=(1,))
    assert graphs.run(call(torch.randn(1, 3))) is None
    assert graphs.stats.fallbacks == {f"{UNCAPTURABLE}: x is on cpu, not a CUDA device": 1}
    assert backend.captures == 0


def test_a_failed_capture_runs_eagerly_and_that_key_is_not_tried_again():
    backend = FakeBackend(fail=True)
    graphs = StepGraphs(backend, buckets=(1,))
    c = call(torch.randn(1, 3))
    assert graphs.run(c) is None
    backend.fail = False
    assert graphs.run(c) is None
    assert graphs.stats.fallbacks == {f"{UNCAPTURABLE}: RuntimeError": 2} and backend.captures == 0


def test_clear_frees_every_graph_and_forgets_refusals():
    backend = FakeBackend(fail=True)
    graphs = StepGraphs(backend, buckets=(1,))
    c = call(torch.randn(1, 3))
    graphs.run(c)
    backend.fail = False
    graphs.clear()
    assert graphs.run(c) is not None and backend.captures == 1
    graphs.clear()
    assert len(graphs) == 0 and graphs.stats.pool_bytes == 0


def test_a_none_argument_is_passed_as_none_and_keys_apart_from_a_tensor():
    backend = FakeBackend()
    graphs = StepGraphs(backend, buckets=(1,))

    def run(batch, x, mask):
        return x if mask is None else x * mask

    x = torch.randn(1, 3)
    plain = graphs.run(GraphCall(run, {"x": x, "mask": None}, frozenset({"x", "mask"}), 1))
    masked = graphs.run(GraphCall(run, {"x": x, "mask": torch.zeros(1, 3)}, frozenset({"x", "mask"}), 1))
    assert torch.equal(plain, x) and torch.equal(masked, torch.zeros(1, 3)) and backend.captures == 2


@pytest.mark.parametrize("policy", ["lru", "refuse"])
def test_the_pool_count_goes_back_to_zero_after_clear(policy):
    graphs = StepGraphs(FakeBackend(nbytes=7), buckets=(1, 2), policy=policy)
    graphs.run(call(torch.randn(2, 3)))
    graphs.run(call(torch.randn(1, 3)))
    assert graphs.stats.pool_bytes == 14
    graphs.clear()
    assert graphs.stats.pool_bytes == 0
