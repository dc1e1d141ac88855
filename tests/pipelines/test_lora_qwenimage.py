"""Different LoRAs in one batch (Qwen-Image): exact against diffusers with the adapters loaded by
``load_lora_weights`` and weighted by ``set_adapters``, in one transformer forward per step.

Four requests step together in one engine (fused CFG: 8 rows): adapter A, adapter B at 0.7, A at 0.5
stacked with B at 1.2, and none. Each is compared with the same request run alone through a pristine
diffusers pipeline (a fresh ``from_pretrained`` of the same tiny model, both adapters loaded the
documented way, ``disable_lora`` for the request without). The adapters are random (seeded) and
written by diffusers' own ``save_lora_weights``; A carries PEFT metadata (rank 4, alpha 8: scale 2),
B none (rank 2: scale 1), and they target different layers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import pristine_pipeline
from tests.helpers import qwen_reference as reference
from triptych.core.errors import InvalidParam
from triptych.engine import DenoiserEngine, EngineConfig
from triptych.families.base import GenerationParams
from triptych.families.qwenimage.family import QwenImageFamily
from triptych.families.qwenimage.tiny import make_tiny_qwen_image
from triptych.lora.adapter import LoraFormatError
from triptych.lora.config import LoraConfig
from triptych.lora.synthetic import write_random_lora

# Mixed batch vs each request alone in diffusers, decoded images (float in [0, 1]): measured 1.34e-6
# max abs at worst over the four requests (A 7.2e-7, B 1.34e-6, A+B 1.0e-6, none 9.5e-7: the row
# without an adapter differs as much, so this is batching's reduction order); the bound is 7.5x it.
MIXED_IMAGE_TOL = 1e-5  # measured 1.34e-6
# An adapter must move the image far more than the tolerance, or the comparison proves nothing.
MIN_EFFECT = 1e-2

A_TARGETS = ("attn.to_q", "attn.to_v", "img_mlp.net.2")
B_TARGETS = ("attn.to_k", "attn.add_q_proj", "txt_mlp.net.0.proj", "proj_out")
REQUESTS = {
    "A": (("a", 1.0),),
    "B": (("b", 0.7),),
    "A+B": (("a", 0.5), ("b", 1.2)),
    "none": (),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = make_tiny_qwen_image(root / "model", seed=0)
    pristine = pristine_pipeline(model)
    write_random_lora(root / "a", pristine.transformer, A_TARGETS, rank=4, alpha=8.0, seed=1, std=0.2)
    write_random_lora(root / "b", pristine.transformer, B_TARGETS, rank=2, seed=2, std=0.2)
    pristine.load_lora_weights(str(root / "a"), adapter_name="a")
    pristine.load_lora_weights(str(root / "b"), adapter_name="b")
    family = QwenImageFamily(model)
    family.enable_lora(LoraConfig(lora=(f"a={root / 'a'}", f"b={root / 'b'}")))
    return root, pristine, family


def params(family, i, lora):
    p = GenerationParams(prompt=f"shape number {i} on a plain background", seed=10 + i, steps=3, guidance=4.0)
    return family.resolve(p).replace(lora=lora)


def pristine_alone(pipe, p):
    if p.lora:
        pipe.enable_lora()
        pipe.set_adapters([n for n, _ in p.lora], [s for _, s in p.lora])
    else:
        pipe.disable_lora()
    return reference(pipe, p)


def test_mixed_batch_matches_each_request_alone_in_diffusers_in_one_forward_per_step(setup):
    _, pristine, family = setup
    ps = {k: params(family, i, lora) for i, (k, lora) in enumerate(REQUESTS.items())}
    engine = DenoiserEngine(family, EngineConfig(fuse_cfg=True))
    for k, p in ps.items():
        engine.add(family.prepare(k, p, family.encode(p)))
    calls = []
    handle = family.pipe.transformer.register_forward_hook(lambda m, a, kw, out: calls.append(1), with_kwargs=True)
    mixed_before = family.lora.stats.mixed_batches
    try:
        finished = {s.request_id: s for s in engine.run_until_done()}
    finally:
        handle.remove()
    steps = 3
    assert len(calls) == engine.stats.forwards == steps  # one forward per step for the whole mixed batch
    assert engine.stats.rows == steps * 8
    assert family.lora.stats.mixed_batches - mixed_before == steps
    got = {k: family.decode(finished[k].latents, p).array for k, p in ps.items()}
    want = {k: pristine_alone(pristine, p) for k, p in ps.items()}
    errors = {k: float(np.abs(got[k] - want[k]).max()) for k in ps}
    assert max(errors.values()) <= MIXED_IMAGE_TOL, errors
    # Each adapter does something: the same request without it is far from the adapted result.
    base = {k: pristine_alone(pristine, p.replace(lora=())) for k, p in ps.items() if p.lora}
    effects = {k: float(np.abs(want[k] - base[k]).max()) for k in base}
    assert min(effects.values()) > MIN_EFFECT, effects


def test_batch_without_adapters_is_bit_identical_to_the_family_without_lora(setup, tmp_path):
    """Idle cost: with adapters loaded and hooked but no row using one, nothing changes."""
    root, _, family = setup
    plain = QwenImageFamily(root / "model")
    p = params(family, 9, ())
    want = plain.pipe.transformer  # the same weights, never hooked
    assert want is not family.pipe.transformer
    family.lora.acquire("warm", (("a", 1.0),))  # loads and hooks A's layers
    family.lora.release("warm")
    outs = []
    for fam in (plain, family):
        state = fam.prepare("r", p, fam.encode(p))
        while not state.done:
            fam.denoise_step([state], fuse_cfg=True)
        outs.append(state.latents)
    assert torch.equal(outs[0], outs[1])


def test_adapter_for_another_shape_is_refused_naming_module_and_shapes(setup, tmp_path):
    root, _, family = setup
    other = make_tiny_qwen_image(tmp_path / "other", seed=1, size="small")
    other_pipe = pristine_pipeline(other)
    write_random_lora(tmp_path / "wide", other_pipe.transformer, ("attn.to_q",), rank=2, seed=3)
    family.lora.add_path("wide", tmp_path / "wide")
    with pytest.raises(LoraFormatError, match=r"transformer_blocks\.0\.attn\.to_q.*lora_A"):
        family.lora.acquire("w", (("wide", 1.0),))
    assert "wide" not in family.lora.store.loaded()


def test_lora_with_teacache_is_refused_on_a_multi_rank_engine(setup):
    """One rank applies adapters in TeaCache's pieces (``test_lora_teacache.py``); an instance of
    several ranks is not checked, so its engine refuses the pair (the ranks are a stand-in here: the
    refusal comes before anything uses them)."""
    from triptych.engine.teacache import make_teacache

    _, _, family = setup
    p = params(family, 0, (("a", 1.0),)).replace(teacache_threshold=0.1)
    engine = DenoiserEngine(family, EngineConfig(), accel=make_teacache(family, ranks=object()))
    with pytest.raises(InvalidParam, match="teacache_threshold") as err:
        engine.add(family.prepare("t", p, family.encode(p)))
    assert "multi-rank" in err.value.rule and not engine.has_work()
