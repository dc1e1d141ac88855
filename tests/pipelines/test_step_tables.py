"""Per-request step tables (``pipelines/qwenimage/fast.py``, ``pipelines/wan/fast.py``, issue 27 item 1).

The fast forward must be taken where it applies, give what the transformer's own forward gives, and
step aside where it cannot (hooks, LoRA rows, tables off). Against pristine diffusers the families'
own tests hold it (test_qwenimage.py, test_wan.py run through it); here: that it ran, and how it
compares with the model's forward on the same rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import pristine_pipeline, qwen_reference, staged
from triptych.families.base import COND, UNCOND, GenerationParams, Row
from triptych.families.qwenimage import denoise as qwen_den
from triptych.families.qwenimage import fast as qwen_fast
from triptych.families.qwenimage.tiny import make_tiny_qwen_image
from triptych.families.registry import load_family, make_tiny
from triptych.families.wan import denoise as wan_den
from triptych.families.wan import fast as wan_fast

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return make_tiny_qwen_image(tmp_path_factory.mktemp("qwen") / "t2i", seed=0)


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    return load_family(qwen_dir)


@pytest.fixture(scope="module")
def wans(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    return {name: load_family(make_tiny(name, root / name, seed=0)) for name in ("wan-t2v", "wan-i2v")}


def spy(monkeypatch, cls) -> list[int]:
    """Rows of every call of ``cls.__call__`` (the fast forward)."""
    calls, original = [], cls.__call__

    def call(self, rows, *args):
        calls.append(len(rows))
        return original(self, rows, *args)

    monkeypatch.setattr(cls, "__call__", call)
    return calls


def prepared(family, params, tables: bool):
    family.step_tables = tables
    try:
        return family.prepare("r", params, family.encode(params))
    finally:
        family.step_tables = True


def test_qwen_request_runs_the_fast_forward_and_equals_diffusers(qwen, qwen_dir, monkeypatch):
    p = qwen.resolve(GenerationParams(prompt="a red circle on a blue square", guidance=4.0, seed=3, steps=3))
    qwen.reference_call(p)  # diffusers' own __call__ on this transformer leaves an empty hook registry
    calls = spy(monkeypatch, qwen_fast.FastForward)
    _, frames = staged(qwen, p, fuse_cfg=False)
    assert calls == [1] * (2 * p.steps)  # every forward: one branch of the request, on the fast path
    want = qwen_reference(pristine_pipeline(qwen_dir), p)
    assert np.abs(frames.array - want).max() == 0


def test_qwen_fused_rows_equal_the_model_forward(qwen, monkeypatch):
    """Several rows (CFG fused, three requests at different steps, prompts of different lengths so
    the text is padded and masked): the same bits as the transformer's own forward on those rows."""
    prompts = ["a red circle", "a large green square at the left on a black background", "a yellow triangle"]
    fast, plain = [], []
    for i, prompt in enumerate(prompts):
        p = qwen.resolve(GenerationParams(prompt=prompt, guidance=3.0, seed=i, steps=4))
        fast.append(prepared(qwen, p, True))
        plain.append(prepared(qwen, p, False))
        fast[-1].step = plain[-1].step = i
    rows = lambda states: [Row(s, b) for s in states for b in (COND, UNCOND)]  # noqa: E731
    calls = spy(monkeypatch, qwen_fast.FastForward)
    with torch.no_grad():
        got = qwen.forward(rows(fast))
        want = qwen_den.forward(qwen.pipe.transformer, rows(plain), qwen.pipe.vae_scale_factor)
    assert calls == [6]
    assert torch.equal(got, want)


def test_qwen_batch_text_is_kept_across_steps_and_follows_its_rows_and_weights(qwen):
    """A several-row batch's padded text projection is kept on its first request for the next step
    (``FastForward.batch_text``): the same bits as the model's forward at each of three steps, the
    same tensor while rows and weights stay, recomputed for another batch of rows and after ``txt_in``
    changes in place."""
    prompts = ["a red circle", "a large green square at the left on a black background"]
    fast, plain = [], []
    for i, prompt in enumerate(prompts):
        p = qwen.resolve(GenerationParams(prompt=prompt, guidance=3.0, seed=i, steps=4))
        fast.append(prepared(qwen, p, True))
        plain.append(prepared(qwen, p, False))
    rows = lambda states: [Row(s, b) for s in states for b in (COND, UNCOND)]  # noqa: E731
    t, ff = qwen.pipe.transformer, qwen._fast

    def step(fast_states, plain_states):
        with torch.no_grad():
            got = qwen.forward(rows(fast_states))
            want = qwen_den.forward(t, rows(plain_states), qwen.pipe.vae_scale_factor)
        assert torch.equal(got, want)
        for s in (*fast_states, *plain_states):
            s.step += 1

    step(fast, plain)
    kept = fast[0].step_consts.batch[2]
    step(fast, plain)
    step(fast, plain)
    assert fast[0].step_consts.batch[2] is kept  # computed once for the three steps
    with torch.no_grad():
        other = ff.embed([Row(fast[1], COND), Row(fast[0], COND)])  # another batch, led by the other request
    assert fast[1].step_consts.batch[2] is other.txt and other.txt.shape[0] == 2
    assert fast[0].step_consts.batch[2] is kept
    saved = t.txt_in.weight.detach().clone()
    try:
        with torch.no_grad():
            t.txt_in.weight.mul_(1.5)
        step(fast, plain)
        assert fast[0].step_consts.batch[2] is not kept
    finally:
        with torch.no_grad():
            t.txt_in.weight.copy_(saved)


def test_qwen_fused_weights_follow_a_weight_changed_in_place(qwen):
    """The fused q/k/v and modulation copies are rebuilt when a weight changes in place."""
    p = qwen.resolve(GenerationParams(prompt="a blue square", guidance=3.0, seed=1, steps=2))
    fast, plain = prepared(qwen, p, True), prepared(qwen, p, False)
    rows = lambda s: [Row(s, COND), Row(s, UNCOND)]  # noqa: E731
    block = qwen.pipe.transformer.transformer_blocks[0]
    weights = (block.attn.to_q.weight, block.img_mod[1].weight)
    saved = [w.detach().clone() for w in weights]
    try:
        with torch.no_grad():
            qwen.forward(rows(fast))  # builds the fused copies
            for w in weights:
                w.mul_(1.5)
            got = qwen.forward(rows(fast))
            want = qwen_den.forward(qwen.pipe.transformer, rows(plain), qwen.pipe.vae_scale_factor)
        assert torch.equal(got, want)
    finally:
        with torch.no_grad():
            for w, s in zip(weights, saved):
                w.copy_(s)


def test_qwen_steps_aside_for_a_hook_and_without_tables(qwen, monkeypatch):
    p = qwen.resolve(GenerationParams(prompt="a red circle", guidance=3.0, seed=0, steps=2))
    fast, plain = prepared(qwen, p, True), prepared(qwen, p, False)
    assert fast.step_consts is not None and plain.step_consts is None
    calls = spy(monkeypatch, qwen_fast.FastForward)
    seen = []
    handle = qwen.pipe.transformer.register_forward_hook(lambda m, a, out: seen.append(1))
    try:
        with torch.no_grad():
            qwen.forward([Row(fast, COND)])
    finally:
        handle.remove()
    with torch.no_grad():
        qwen.forward([Row(plain, COND)])
    assert seen == [1] and calls == []  # the hooked model ran its own forward; no tables: too


@pytest.mark.parametrize("name", ["wan-t2v", "wan-i2v"])
def test_wan_fast_forward_against_the_model_forward(wans, name, monkeypatch):
    family = wans[name]
    image = Image.fromarray(np.random.RandomState(0).randint(0, 256, (40, 48, 3), dtype=np.uint8))
    p = GenerationParams(prompt="a cat on a red chair", negative_prompt="blurry", seed=2, steps=3)
    p = family.resolve(p.replace(image=image) if family.accepts_image else p)
    fast, plain = prepared(family, p, True), prepared(family, p, False)
    calls = spy(monkeypatch, wan_fast.FastForward)
    with torch.no_grad():
        for step in range(p.steps):
            fast.step = plain.step = step
            for branch in (COND, UNCOND):  # one row: the same bits
                got = family.forward([Row(fast, branch)])
                assert torch.equal(got, wan_den.forward(family.pipe.transformer, [Row(plain, branch)]))
            both = family.forward([Row(fast, COND), Row(fast, UNCOND)])  # the request's fused CFG tables
            assert torch.equal(both, wan_den.forward(family.pipe.transformer, [Row(plain, COND), Row(plain, UNCOND)]))
            other = prepared(family, p.replace(seed=5), True)  # two requests: computed batched, as the model
            other.step = step
            rows = [Row(fast, COND), Row(other, COND), Row(fast, UNCOND)]
            want = wan_den.forward(family.pipe.transformer, [Row(plain, COND), Row(other, COND), Row(plain, UNCOND)])
            assert torch.equal(family.forward(rows), want)
    assert calls == [1, 1, 2, 3] * p.steps


def test_qwen_idle_lora_hooks_cost_nothing_and_change_nothing(tmp_path, monkeypatch):
    """An instance serving adapters runs a request without one on the fast path, its weights called
    directly past the LoRA runtime's idle hooks (``fastpath.hooked``): the same bits as the model's
    forward with those hooks running; any other hook is still honoured."""
    from tests.helpers import tiny_qwen_with_two_adapters
    from triptych.families import fastpath

    model, config = tiny_qwen_with_two_adapters(tmp_path)
    family = load_family(model)
    family.enable_lora(config)
    family.lora.acquire("warm", (("a", 1.0), ("b", 1.0)))  # loads both and hooks their layers
    hooked = family.pipe.transformer.transformer_blocks[0].attn.to_q
    assert hooked._forward_hooks  # the LoRA runtime's
    p = family.resolve(GenerationParams(prompt="a red circle", guidance=3.0, seed=0, steps=2))
    fast, plain = prepared(family, p, True), prepared(family, p, False)
    calls = spy(monkeypatch, qwen_fast.FastForward)
    rows = lambda s: [Row(s, COND), Row(s, UNCOND)]  # noqa: E731
    with torch.no_grad():
        got = family.forward(rows(fast))
        want = family.forward(rows(plain))
    assert calls == [2] and torch.equal(got, want)
    assert all(ops is not None for ops in family._fast.ops)  # every block on ``joint_block``
    handle = hooked.register_forward_hook(lambda m, a, out: out * 2)  # not idle: must run
    try:
        with torch.no_grad():
            family.forward(rows(fast))
        assert family._fast.ops[0] is None and fastpath.hooked(hooked, family._idle_hooks())
        with torch.no_grad():
            assert torch.equal(family.forward(rows(fast)), family.forward(rows(plain)))
    finally:
        handle.remove()


@pytest.mark.parametrize("name", ["flux", "flux-schnell"])
def test_flux_tables_give_the_model_forward(tmp_path, name, monkeypatch):
    from triptych.families.flux import denoise as flux_den
    from triptych.families.flux import fast as flux_fast

    family = load_family(make_tiny(name, tmp_path / name, seed=0))
    p = GenerationParams(prompt="a red circle", negative_prompt="blurry", true_cfg=2.0, seed=1, steps=2)
    p = family.resolve(p)
    fast, plain = prepared(family, p, True), prepared(family, p, False)
    assert fast.branches() == [COND, UNCOND] and plain.step_consts is None
    calls = []
    original = flux_fast.forward
    monkeypatch.setattr(flux_fast, "forward", lambda t, rows: calls.append(len(rows)) or original(t, rows))
    with torch.no_grad():
        for step in range(p.steps):
            fast.step = plain.step = step
            for rows in ([COND], [UNCOND], [COND, UNCOND]):
                got = family.forward([Row(fast, b) for b in rows])
                want = flux_den.forward(family.pipe.transformer, [Row(plain, b) for b in rows])
                assert torch.equal(got, want)
    assert calls == [1, 1, 2] * p.steps


def test_qwen_block_operands_follow_a_linear_hook_and_keep_their_verdict_otherwise(tiny_model_dir):
    """``FastForward.refresh``: a linear's hook takes the block off ``joint_block`` and, once removed, gives
    it back; a block ineligible for another reason (a q/k/v linear without bias) keeps that verdict
    under the stamp instead of rebuilding at every forward."""
    family = load_family(tiny_model_dir("qwen-image"))
    block, ff = family.pipe.transformer.transformer_blocks[0], family._fast
    ff.refresh()
    assert ff.ops[0] is not None
    handle = block.attn.to_out[0].register_forward_hook(lambda *a: None)
    ff.refresh()
    assert ff.ops[0] is None and ff.ops[1] is not None
    handle.remove()
    ff.refresh()
    assert ff.ops[0] is not None
    block.attn.to_q.bias = None
    ff.refresh()
    stamp = ff._stamp
    ff.refresh()
    assert ff.ops[0] is None and ff._stamp is stamp
