"""``--compile`` on the default model: the regional compile matches diffusers' own eager ``__call__``,
and after the warm-up a mixed load (batches of 1 to 4 requests, prompts of different lengths, one
branch or both, TeaCache sub-batches) compiles nothing more.

Measured (torch 2.13 CPU, one thread, 20 steps, 64x64): compiled staged vs the eager pipeline's
``__call__``, max abs over the image 3.9e-6 (fused CFG) / 3.1e-6 (separate forwards; 3.8e-6 / 2.6e-6
before the stack's CPU forms of attention, GELU and products, ``fast_stack.py``), the VAE
decoder compiled too (``compile_vae_decoder``: its one-frame decoder, ``accel/frame_decode.py``;
alone, on the same latents, 8.9e-7 from the eager decoder); the tolerance is 10x the larger; with TeaCache 0.1 and previews on both, 1.0e-4 (5.2e-5 before the
CPU forms; the shipped profile's linear forecast extrapolates the rounding of two computed residuals
into each skipped step; 1.9e-5 when it reused one), against ``TEACACHE_TOLERANCE``, 2.5x that. The warm-up compiles 2 graphs of the fast path's block stack
(``families/qwenimage/fast_stack.py``: one row and several; ``engine/warmup.py`` runs the shapes; 5
before ``stack_inputs`` gave every call one form of inputs) and the decoder's
warm-up one more, the mixed load after them 0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from triptych.accel import SpeedConfig
from triptych.accel.compile import compile_counts
from triptych.engine.runner import run_request
from triptych.engine.warmup import warm_up, warm_up_decoder
from triptych.families.base import COND, UNCOND, GenerationParams, Row
from triptych.families.models import default_model_dir
from triptych.families.registry import load_family

TOLERANCE = 3.9e-5  # measured 3.9e-6 (3.8e-6 before the stack's CPU forms; 4.2e-6 in one run)
TEACACHE_TOLERANCE = 2.6e-4  # measured 1.0e-4 (TeaCache 0.1 with the profile's forecast, previews)
DECODER_TOLERANCE = 8.9e-6  # measured 8.9e-7 (the compiled one-frame decoder alone, same denoised latents)
WARMUP_GRAPHS = 2  # measured: the block stack's graphs (one row, several) for the shapes of engine/warmup.py
PROMPTS = ["a red circle on a blue background", "a green square", "a small yellow triangle on a white background"]


@pytest.fixture(scope="module")
def families(inductor_cache_dir):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    speed = SpeedConfig(compile=True, compile_cache_dir=inductor_cache_dir)
    compiled = load_family(default_model_dir(), speed=speed)
    counts = warm_up(compiled)
    counts = dict(counts, after_decoder=warm_up_decoder(compiled))  # a served decoder warms up alike
    return load_family(default_model_dir()), compiled, counts


def test_compiled_blocks_are_the_repeated_blocks(families):
    eager, compiled, _ = families
    blocks = compiled.pipe.transformer.transformer_blocks
    assert all(b._compiled_call_impl is not None for b in blocks)
    assert all(b._compiled_call_impl is None for b in eager.pipe.transformer.transformer_blocks)
    # the family's compile_vae_decoder: its one-frame decoder (accel/frame_decode.py), the VAE's own untouched
    assert compiled.frame_decoder is not None and compiled.frame_decoder._compiled_call_impl is not None
    assert eager.frame_decoder is None
    assert compiled.pipe.vae.decoder._compiled_call_impl is None
    assert compiled.pipe.vae.encoder._compiled_call_impl is None


def test_compiled_decoder_matches_eager_and_compiles_nothing_after_its_warm_up(families):
    """The compiled VAE decoder gives the eager decoder's image of the same latents within the
    tolerance, and decoding requests of the default size after ``warm_up_decoder`` compiles nothing."""
    eager, compiled, counts = families
    params = compiled.resolve(GenerationParams(prompt=PROMPTS[2], seed=7))
    state = eager.prepare("d", params, eager.encode(params))
    while not state.done:
        eager.denoise_step([state])
    before = compile_counts()
    got, want = compiled.decode(state.latents, params).array, eager.decode(state.latents, params).array
    diff = float(np.abs(got - want).max())
    print(f"compiled vs eager VAE decode: max abs {diff:.2e}; warm-up {counts['after_decoder']}")
    assert diff <= DECODER_TOLERANCE
    assert counts["after_decoder"]["unique_graphs"] > counts["unique_graphs"]  # the decoder's graph(s)
    assert compile_counts() == before


@pytest.mark.parametrize("fuse_cfg", [True, False])
def test_compiled_matches_eager_diffusers(families, fuse_cfg):
    eager, compiled, _ = families
    params = compiled.resolve(GenerationParams(prompt=PROMPTS[0], seed=3))
    frames, _ = run_request(compiled, params, fuse_cfg=fuse_cfg)
    reference = eager.reference_call(params)
    diff = float(np.abs(frames.array - reference).max())
    print(f"compiled vs eager __call__ (fuse_cfg={fuse_cfg}): max abs {diff:.2e}")
    assert diff <= TOLERANCE


def test_mixed_load_compiles_nothing_after_warm_up(families):
    _, compiled, counts = families
    assert counts["unique_graphs"] == WARMUP_GRAPHS
    counts = counts["after_decoder"]  # what is compiled once the decoder warmed up too
    states = []
    for i, prompt in enumerate(PROMPTS * 2):
        params = compiled.resolve(GenerationParams(prompt=prompt, seed=i))
        states.append(compiled.prepare(f"r{i}", params, compiled.encode(params)))

    plan = compiled.teacache_plan()
    with torch.no_grad():
        for n in (1, 2, 3, 4, 6, 2, 1):
            rows = [Row(s, b) for b in (COND, UNCOND) for s in states[:n]]
            compiled.forward(rows)
            compiled.forward([r for r in rows if r.branch == COND])  # one branch: separate CFG forwards
            plan.blocks(plan.embed(rows), torch.arange(0, len(rows), 2))  # TeaCache computes a sub-batch
    after = compile_counts()
    print(f"warm-up {counts}, after the mixed load {after}")
    assert after["unique_graphs"] == counts["unique_graphs"]
    assert after["recompiles"] == counts["recompiles"]


def test_compile_composes_with_teacache_and_previews(families):
    """TeaCache's piecewise forward and previews on the compiled family: the same skips and the same
    image as on the eager one (within the tolerance), and the previews arrive."""
    from triptych.engine.teacache import make_teacache

    eager, compiled, _ = families
    params = compiled.resolve(GenerationParams(prompt=PROMPTS[1], seed=5, teacache_threshold=0.1))
    out = {}
    for name, family in (("eager", eager), ("compiled", compiled)):
        accel, previews = make_teacache(family), []
        frames, _ = run_request(family, params, accel=accel, previews=2, on_preview=lambda i, f: previews.append(i))
        out[name] = (frames.array, accel.stats.rows_skipped, previews)
    diff = float(np.abs(out["compiled"][0] - out["eager"][0]).max())
    print(f"TeaCache 0.1 + 2 previews, compiled vs eager: max abs {diff:.2e}, skipped {out['compiled'][1]}")
    assert out["compiled"][1] == out["eager"][1] > 0
    assert out["compiled"][2] == out["eager"][2] == [0, 1]
    assert diff <= TEACACHE_TOLERANCE
