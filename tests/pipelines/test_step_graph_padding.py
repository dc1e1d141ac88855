"""Step graphs on the real tiny transformers, on CPU: padding rows up to a bucket does not change the
real rows' output, and a step through ``Family.step_forward`` with graphs gives what it gives without.

The capture is faked (``ReplayBackend`` reruns the call on its static buffers, as a CUDA graph
replays its kernels on them), so what is checked is everything but the recording: the families'
``graph_call`` (arguments, per-row and shared, settings), the padding, the buffers refilled per
replay, the slicing. The recording itself is tests/pipelines/test_gpu_speed.py's (on CUDA).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import prepared_states
from triptych.accel.step_graphs import GraphCall, StepGraphs, pad_rows
from triptych.families.base import COND, UNCOND, Row
from triptych.families.registry import load_family

FAMILIES = ("flux", "qwen-image", "wan-t2v", "wan-i2v")
# float32 on CPU, one thread. 3 rows run as a batch of 4 (padding: copies of row 0) against the 3 rows
# alone, measured max abs: flux 0, qwen-image 0, wan-t2v 6.0e-7, wan-i2v 4.8e-7 (Wan's kernels block
# a batch of 4 differently); 4 steps through the graphs (buckets 2, 4, 8) against eager steps:
# flux 2.4e-7, qwen-image 7.2e-7, wan-t2v 1.2e-6, wan-i2v 1.7e-6.
PADDED_TOLERANCE = 1e-5


class ReplayCaptured:
    def __init__(self, run):
        self.run, self.nbytes = run, 0
        self.output = run()

    def replay(self):
        self.output.copy_(self.run())


class ReplayBackend:
    """A capture backend that "replays" by running the call again on the captured buffers."""

    def __init__(self):
        self.captures = 0

    def refusal(self, tensors):
        return None

    def capture(self, run, device):
        self.captures += 1
        return ReplayCaptured(run)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def families(tiny_model_dir):
    return {name: load_family(tiny_model_dir(name)) for name in FAMILIES}


def padded(call: GraphCall, bucket: int) -> dict:
    return {n: (pad_rows(t, bucket) if n in call.batched and t is not None else t) for n, t in call.tensors.items()}


@pytest.mark.parametrize("name", FAMILIES)
def test_padded_rows_sliced_equal_the_unpadded_forward(families, name):
    family = families[name]
    states = prepared_states(family, 3)
    rows = [Row(s, COND) for s in states]
    call = family.graph_call(rows)
    with torch.no_grad():
        alone = call.fn(3, **call.tensors)
        together = call.fn(4, **padded(call, 4))
    assert together.shape[0] == 4 and alone.shape[0] == 3
    diff = float((together[:3] - alone).abs().max())
    print(f"{name}: padded 3 -> 4 rows vs 3 rows, max abs {diff:.2e}")
    assert diff <= PADDED_TOLERANCE
    assert torch.equal(family.forward(rows), alone)  # graph_call's contract: forward's output


@pytest.mark.parametrize("name", FAMILIES)
def test_steps_through_step_graphs_equal_eager_steps(families, name):
    family = families[name]
    eager_states, graph_states = prepared_states(family, 3), prepared_states(family, 3)
    backend = ReplayBackend()
    family.step_graphs = StepGraphs(backend, buckets=(2, 4, 8))
    forwards = 0
    try:
        for _ in range(2):
            forwards += family.denoise_step(graph_states, fuse_cfg=True).forwards  # 3 or 6 rows: bucket 4 or 8
            forwards += family.denoise_step(graph_states[:1], fuse_cfg=False).forwards  # 1 row a forward: bucket 2
        stats = family.step_graphs.stats
    finally:
        family.step_graphs = None
    for _ in range(2):
        family.denoise_step(eager_states, fuse_cfg=True)
        family.denoise_step(eager_states[:1], fuse_cfg=False)
    diff = max(float((g.latents - e.latents).abs().max()) for g, e in zip(graph_states, eager_states))
    print(f"{name}: 4 steps through step graphs vs eager, max abs {diff:.2e}")
    assert diff <= PADDED_TOLERANCE
    assert stats.replays == forwards and not stats.fallbacks
    # one graph per bucket met; Qwen-Image's prompts keep their lengths (a graph per length met)
    assert backend.captures == 2 if name != "qwen-image" else backend.captures >= 2


def test_a_hooked_transformer_runs_eagerly_and_is_counted(families):
    family = families["flux"]
    states = prepared_states(family, 2)
    rows = [Row(s, b) for b in (COND, UNCOND) for s in states if b in s.cond.branches]
    want = family.forward(rows)
    family.step_graphs = StepGraphs(ReplayBackend(), buckets=(8,))
    handle = family.pipe.transformer.register_forward_pre_hook(lambda module, args: None)
    try:
        why = family.graph_refusal(rows)
        got = family.step_forward(rows)
        stats = family.step_graphs.stats
    finally:
        handle.remove()
        family.step_graphs = None
    assert torch.equal(got, want)
    assert "hook" in why and stats.replays == 0 and dict(stats.fallbacks) == {why: 1}


def test_a_lora_row_is_refused_with_its_reason(families):
    family = families["flux"]
    state = prepared_states(family, 1)[0]
    plain = [Row(state, COND)]
    assert family.graph_refusal(plain) is None
    state.params = state.params.replace(lora=(("style", 1.0),))
    assert "LoRA" in family.graph_refusal([Row(state, COND)])


def test_the_engine_reports_replays_and_fallbacks_and_counts_no_padding_flops(families):
    from triptych.engine import DenoiserEngine, EngineConfig
    from triptych.plan.costs import RowCosts

    family = families["flux"]
    finished, stats = {}, {}
    for name, buckets in (("eager", None), ("small", (1, 2)), ("fits", (4,))):
        family.step_graphs = None if buckets is None else StepGraphs(ReplayBackend(), buckets=buckets)
        try:
            engine = DenoiserEngine(family, EngineConfig(max_batch_requests=3, fuse_cfg=True))
            engine.flop_costs = RowCosts(family)
            for s in prepared_states(family, 3):  # 3 rows a forward: above (1, 2), padded to 4 in (4,)
                engine.add(s)
            finished[name] = {s.request_id: s.latents for s in engine.run_until_done()}
            stats[name] = engine.stats
        finally:
            family.step_graphs = None
    small, fits = stats["small"], stats["fits"]
    assert small.graph_fallbacks == {"rows above the largest bucket": small.forwards} and small.graph_replays == 0
    assert fits.graph_replays == fits.forwards and not fits.graph_fallbacks and fits.graph_captures == 1
    assert fits.flops == stats["eager"].flops > 0  # the padding row is not a request's: not counted
    for r, want in finished["eager"].items():
        assert torch.equal(finished["small"][r], want)  # every forward eager: the same bits
        assert float((finished["fits"][r] - want).abs().max()) <= PADDED_TOLERANCE
