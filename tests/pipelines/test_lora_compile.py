"""LoRA composes with ``--compile``: the compiled transformer with adapters hooked gives, for a batch
mixing adapter A, adapter B, A+B stacked and none, the eager family's latents (which equal pristine
diffusers, ``test_lora_qwenimage.py``) within a tolerance; and a changing mix of adapters, scales
and batch sizes compiles nothing after the warm-up a compiled denoiser serving adapters runs
before it registers (``engine/warmup.py``: every served adapter loaded, a row with one and a row
without, at two batch sizes).

The per-row deltas run outside the compiled graphs (``lora/rows.py``): traced, the hooks specialised
on each plan, and every new mix compiled 2 more graphs until dynamo's recompile limit (8), after
which the blocks ran eagerly without a word (measured before the fix: 2, 4, 6, 8 graphs over four
mixes). Measured before the adapter warm-up (torch 2.13 CPU, tiny Qwen-Image, 3 steps): 10 graphs at the
first mix (the blocks' graphs break around the hooked layers), 3 more at a second batch size
(once), 0 over six later mixes; with it, 0 over all eight mixes. Compiled vs eager latents 1.25e-6
max abs at worst (a separate eight-mix run).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import tiny_qwen_with_two_adapters
from triptych.accel import SpeedConfig
from triptych.accel.compile import compile_counts
from triptych.engine import DenoiserEngine, EngineConfig
from triptych.engine.warmup import warm_up
from triptych.families.base import GenerationParams
from triptych.families.registry import load_family

TOLERANCE = 1e-5  # measured 1.25e-6 (compiled vs eager latents, worst mix)
A, B, AB = (("a", 1.0),), (("b", 0.7),), (("a", 0.5), ("b", 1.2))
FIRST = [A, B, AB, ()]
WARM = [B, (), A]  # a second batch size (without the warm-up's two sizes, dynamo compiled 3 more graphs here)
LATER = [[A, A], [(), ()], [(), A, B], [(("a", 0.3),), B], [AB, AB, B, (("b", 1.5),), ()], [AB, A, B, (), A, B]]


@pytest.fixture(scope="module")
def families(tmp_path_factory, inductor_cache_dir):
    root = tmp_path_factory.mktemp("lora_compile")
    model, config = tiny_qwen_with_two_adapters(root)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = load_family(model)
    compiled = load_family(model, speed=SpeedConfig(compile=True, compile_cache_dir=inductor_cache_dir))
    for family in (eager, compiled):
        family.enable_lora(config)
    counts = warm_up(compiled)  # as a compiled denoiser serving adapters does before it registers
    return eager, compiled, counts


def run(family, mix):
    engine = DenoiserEngine(family, EngineConfig(fuse_cfg=True))
    for i, lora in enumerate(mix):
        p = family.resolve(GenerationParams(prompt=f"shape number {i}", seed=10 + i, steps=3, guidance=4.0))
        engine.add(family.prepare(f"r{i}", p.replace(lora=lora), family.encode(p)))
    with torch.no_grad():
        return {s.request_id: s.latents for s in engine.run_until_done()}


def worst(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_compiled_mixed_lora_batch_matches_eager_and_nothing_compiles_after_the_warm_up(families):
    eager, compiled, counts = families
    assert all(b._compiled_call_impl is not None for b in compiled.pipe.transformer.transformer_blocks)
    assert counts["unique_graphs"] > 0 and counts["lora_adapters"] == 2  # it compiled, with both adapters
    assert sorted(compiled.lora.store.loaded()) == ["a", "b"] and not compiled.lora.store.in_use()
    warm = compile_counts()
    diffs = [worst(run(compiled, mix), run(eager, mix)) for mix in [FIRST, WARM, *LATER]]
    after = compile_counts()
    print(f"compiled vs eager: {[f'{d:.2e}' for d in diffs]}; graphs: warm-up {warm}, after the mixes {after}")
    assert max(diffs) <= TOLERANCE
    assert after == warm  # no graph and no recompile for any mix of adapters, scales or sizes
    # The compiled blocks ran (dynamo did not give up and leave them eager): not bit-equal to eager.
    assert max(diffs) > 0
