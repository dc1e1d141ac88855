"""Different LoRAs in one batch (FLUX): the Qwen-Image test's check on FLUX's file format and layers.

Four requests in one engine (adapter A, B at 0.7, A at 0.5 stacked with B at 1.2, none), each
compared with the same request alone through a pristine ``FluxPipeline`` with both adapters loaded
by ``load_lora_weights`` and weighted by ``set_adapters``; one transformer forward per step. The
adapters are written by ``FluxPipeline.save_lora_weights`` and read back through
``FluxPipeline.lora_state_dict`` (the reader with FLUX's format conversions).
"""

from __future__ import annotations

import numpy as np
import pytest
from diffusers import FluxPipeline

from tests.helpers import flux_reference, pristine_pipeline
from triptych.engine import DenoiserEngine, EngineConfig
from triptych.families.base import GenerationParams
from triptych.families.registry import load_family
from triptych.lora.config import LoraConfig
from triptych.lora.synthetic import write_random_lora

# Mixed batch vs alone in diffusers, decoded images in [0, 1]: measured 2.2e-6 max abs (one run; the
# request without an adapter 1.6e-6: batching's reduction order); the bound is 9x that.
MIXED_IMAGE_TOL = 2e-5  # measured 2.2e-6
MIN_EFFECT = 1e-2
REQUESTS = {"A": (("a", 1.0),), "B": (("b", 0.7),), "A+B": (("a", 0.5), ("b", 1.2)), "none": ()}


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
    pristine.load_lora_weights(str(root / "a"), adapter_name="a")
    pristine.load_lora_weights(str(root / "b"), adapter_name="b")
    family = load_family(model)
    family.enable_lora(LoraConfig(lora=(f"a={root / 'a'}", f"b={root / 'b'}")))
    return pristine, family


def reference(pipe, p):
    if p.lora:
        pipe.enable_lora()
        pipe.set_adapters([n for n, _ in p.lora], [s for _, s in p.lora])
    else:
        pipe.disable_lora()
    return flux_reference(pipe, p)


def test_mixed_batch_matches_each_request_alone_in_diffusers_in_one_forward_per_step(setup):
    pristine, family = setup
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
