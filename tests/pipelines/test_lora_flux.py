"""Different LoRAs in one batch (FLUX): the Qwen-Image test's check on FLUX's file format and layers.

Four requests in one engine (adapter A, B at 0.7, A at 0.5 stacked with B at 1.2, none), each
compared with the same request alone through a pristine ``FluxPipeline`` with both adapters loaded
by ``load_lora_weights`` and weighted by ``set_adapters``; one transformer forward per step. The
adapters are written by ``FluxPipeline.save_lora_weights`` and read back through
``FluxPipeline.lora_state_dict`` (the reader with FLUX's format conversions).

Text-encoder LoRA (FLUX's format carries it for the CLIP encoder): adapter T adapts the transformer
and the text encoder. T, B, T stacked with B, and none are encoded in one CLIP forward (each row its
own text-encoder delta) and denoised in one transformer forward per step, each equal to the request
alone in the pristine pipeline; T's text-encoder part moves the image (checked with it disabled in
diffusers). A plain encode after a LoRA'd one of the same prompt is bit-identical to one before it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline

from tests.helpers import flux_reference, pristine_pipeline
from triptych.engine import DenoiserEngine, EngineConfig
from triptych.families.base import GenerationParams, Role
from triptych.families.registry import load_family
from triptych.lora.config import LoraConfig
from triptych.lora.synthetic import write_random_lora

# Mixed batch vs alone in diffusers, decoded images in [0, 1]: measured 2.2e-6 max abs (one run; the
# request without an adapter 1.6e-6: batching's reduction order); the bound is 9x that.
MIXED_IMAGE_TOL = 2e-5  # measured 2.2e-6
# The same with the text-encoder adapter (T, B, T+B with true CFG, none; encoded and denoised
# together): measured 1.9e-6 (T+B; none 1.7e-6, one run); the bound is 8x that.
TE_IMAGE_TOL = 1.5e-5  # measured 1.9e-6
MIN_EFFECT = 1e-2
REQUESTS = {"A": (("a", 1.0),), "B": (("b", 0.7),), "A+B": (("a", 0.5), ("b", 1.2)), "none": ()}
TE_REQUESTS = {"T": (("t", 1.0),), "B": (("b", 0.7),), "T+B": (("t", 0.6), ("b", 1.2)), "none": ()}
# The four prompts in one CLIP/T5 forward vs each encoded alone: measured 1.0e-6 max abs on the
# prompt and pooled embeddings (one run; batched kernels' reduction order); the bound is 5x that.
MIXED_EMBED_TOL = 5e-6  # measured 1.0e-6
TE_TARGETS = ("self_attn.q_proj", "self_attn.out_proj", "mlp.fc1")


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-flux")
    model = tiny_model_dir("flux")
    pristine = pristine_pipeline(model)
    tr = pristine.transformer
    write_random_lora(
        root / "a", tr, ("attn.to_q", "ff.net.2"), rank=4, alpha=8.0, seed=1, std=0.3, pipeline_class=FluxPipeline
    )
    write_random_lora(root / "b", tr, ("attn.to_k", "proj_mlp"), rank=2, seed=2, std=0.3, pipeline_class=FluxPipeline)
    te = pristine.text_encoder
    write_random_lora(
        root / "t", tr, ("attn.to_v",), 4, 3, 6.0, 0.3, FluxPipeline, text_encoder=te, text_encoder_targets=TE_TARGETS
    )
    for name in ("a", "b", "t"):
        pristine.load_lora_weights(str(root / name), adapter_name=name)
    assert pristine.get_list_adapters() == {"transformer": ["a", "b", "t"], "text_encoder": ["t"]}
    family = load_family(model)
    family.enable_lora(LoraConfig(lora=tuple(f"{n}={root / n}" for n in ("a", "b", "t"))))
    return pristine, family, root


def reference(pipe, p):
    if p.lora:
        pipe.enable_lora()
        pipe.set_adapters([n for n, _ in p.lora], [s for _, s in p.lora])
    else:
        pipe.disable_lora()
    return flux_reference(pipe, p)


def test_mixed_batch_matches_each_request_alone_in_diffusers_in_one_forward_per_step(setup):
    pristine, family, _ = setup
    ps = {
        k: family.resolve(GenerationParams(prompt=f"a shape number {i}", seed=20 + i, steps=3)).replace(lora=lora)
        for i, (k, lora) in enumerate(REQUESTS.items())
    }
    engine = DenoiserEngine(family, EngineConfig(fuse_cfg=True))
    for k, p in ps.items():
        engine.add(family.prepare(k, p, family.encode(p)))
    calls = []
    handle = family.pipe.transformer.register_forward_hook(lambda *a: calls.append(1))
    try:
        finished = {s.request_id: s for s in engine.run_until_done()}
    finally:
        handle.remove()
    assert len(calls) == 3  # one forward per step for the four requests
    got = {k: family.decode(finished[k].latents, p).array for k, p in ps.items()}
    want = {k: reference(pristine, p) for k, p in ps.items()}
    errors = {k: float(np.abs(got[k] - want[k]).max()) for k in ps}
    assert max(errors.values()) <= MIXED_IMAGE_TOL, errors
    base = {k: reference(pristine, p.replace(lora=())) for k, p in ps.items() if p.lora}
    effects = {k: float(np.abs(want[k] - base[k]).max()) for k in base}
    assert min(effects.values()) > MIN_EFFECT, effects


def text_encoder_calls(family):
    calls = []
    handle = family.pipe.text_encoder.register_forward_pre_hook(
        lambda mod, args, kwargs: calls.append(int(kwargs.get("input_ids", args[0] if args else None).shape[0])),
        with_kwargs=True,
    )
    return calls, handle


def test_text_encoder_lora_per_row_in_one_encoder_forward_matches_each_request_alone_in_diffusers(setup):
    pristine, family, _ = setup
    ps = {
        k: family.resolve(GenerationParams(prompt=f"a shape number {i}", seed=30 + i, steps=3)).replace(lora=lora)
        for i, (k, lora) in enumerate(TE_REQUESTS.items())
    }
    ps["T+B"] = ps["T+B"].replace(negative_prompt="a green square", true_cfg=2.0)  # its negative gets T too
    calls, handle = text_encoder_calls(family)
    try:
        conds = dict(zip(ps, family.encode_many(list(ps.values()))))
    finally:
        handle.remove()
    assert calls == [4, 1]  # one CLIP forward, the four requests its rows; one for T+B's negative prompt
    alone = {k: family.encode(p) for k, p in ps.items()}
    embed_errors = {
        (k, branch, key): float((conds[k].branches[branch][key] - alone[k].branches[branch][key]).abs().max())
        for k in ps
        for branch in conds[k].branches
        for key in ("prompt_embeds", "pooled_prompt_embeds")
    }
    assert max(embed_errors.values()) <= MIXED_EMBED_TOL, embed_errors
    engine = DenoiserEngine(family, EngineConfig(fuse_cfg=True))
    for k, p in ps.items():
        engine.add(family.prepare(k, p, conds[k]))
    forwards = []
    handle = family.pipe.transformer.register_forward_hook(lambda *a: forwards.append(1))
    try:
        finished = {s.request_id: s for s in engine.run_until_done()}
    finally:
        handle.remove()
    assert len(forwards) == 3  # one forward per step for the four requests
    got = {k: family.decode(finished[k].latents, p).array for k, p in ps.items()}
    want = {k: reference(pristine, p) for k, p in ps.items()}
    errors = {k: float(np.abs(got[k] - want[k]).max()) for k in ps}
    assert max(errors.values()) <= TE_IMAGE_TOL, errors
    # T's text-encoder part acts: in diffusers, T with its text-encoder layers off gives another image
    from diffusers.loaders.lora_base import disable_lora_for_text_encoder

    for k in ("T", "T+B"):
        reference(pristine, ps[k])  # sets T's adapters, then its text-encoder layers go off
        disable_lora_for_text_encoder(pristine.text_encoder)
        without_te = flux_reference(pristine, ps[k])
        assert float(np.abs(want[k] - without_te).max()) > MIN_EFFECT, k


def test_a_plain_encode_after_a_lora_one_of_the_same_prompt_is_bit_identical_to_one_before(setup):
    _, family, _ = setup
    p = family.resolve(GenerationParams(prompt="a red circle on a blue background", seed=1, steps=1))
    before = family.encode(p).branches["cond"]
    lora = family.encode(p.replace(lora=(("t", 1.0),))).branches["cond"]
    after = family.encode(p).branches["cond"]
    for key in ("prompt_embeds", "pooled_prompt_embeds"):
        assert torch.equal(before[key], after[key]), key
    assert float((lora["pooled_prompt_embeds"] - before["pooled_prompt_embeds"]).abs().max()) > MIN_EFFECT


def test_an_encoder_only_instance_loads_a_run_time_adapter_from_the_request_and_holds_it_per_request(setup):
    _, family, root = setup
    encoder = load_family(family.model_dir, roles={Role.ENCODER})
    encoder.enable_lora(LoraConfig(lora_root=str(root)))  # no flag adapters: it learns t's file from the request
    assert encoder.lora is None and encoder.text_lora is not None  # no transformer here: text encoder only
    p = family.resolve(GenerationParams(prompt="a blue square on a white background", seed=2, steps=1))
    p = p.replace(lora=(("t", 0.8),), lora_paths=(("t", str(root / "t")),))
    want = family.encode(p).branches["cond"]
    for _ in range(2):
        got = encoder.encode(p).branches["cond"]
        for key in ("prompt_embeds", "pooled_prompt_embeds"):
            assert torch.equal(got[key], want[key]), key
    stats = encoder.text_lora.stats
    assert (stats.misses, stats.hits, encoder.text_lora.store.loaded()) == (1, 1, ["t"])
    held = stats.resident_bytes
    plain = encoder.encode(p.replace(lora=(("b", 1.0),), lora_paths=(("b", str(root / "b")),))).branches["cond"]
    assert torch.equal(
        plain["pooled_prompt_embeds"], family.encode(p.replace(lora=())).branches["cond"]["pooled_prompt_embeds"]
    )
    assert encoder.text_lora.store.loaded() == ["t", "b"] and stats.resident_bytes == held  # b: no text-encoder part
