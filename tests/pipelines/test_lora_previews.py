"""LoRA composes with previews: a batch mixing adapter A, adapter B, A+B stacked and none, with
previews on, gives bit for bit the final latents of the same batch without previews; every request
gets its previews; and a preview reads its own row's adapted prediction (at the last step the
prediction is the result, adapters included, as ``test_previews.py`` checks without adapters).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import tiny_qwen_with_two_adapters
from triptych.engine import DenoiserEngine, EngineConfig
from triptych.engine.previews import preview_steps
from triptych.families.base import GenerationParams
from triptych.families.qwenimage.family import QwenImageFamily

STEPS = 4
REQUESTS = {"A": (("a", 1.0),), "B": (("b", 0.7),), "A+B": (("a", 0.5), ("b", 1.2)), "none": ()}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_previews")
    model, config = tiny_qwen_with_two_adapters(root)
    fam = QwenImageFamily(model)
    fam.enable_lora(config)
    return fam


def run_batch(family, previews: dict[str, frozenset[int]]):
    engine = DenoiserEngine(family, EngineConfig(fuse_cfg=True))
    for i, (k, lora) in enumerate(REQUESTS.items()):
        p = family.resolve(GenerationParams(prompt=f"shape number {i}", seed=10 + i, steps=STEPS, guidance=4.0))
        state = family.prepare(k, p.replace(lora=lora), family.encode(p))
        state.preview_steps = previews.get(k, frozenset())
        engine.add(state)
    finished, got = {}, {}
    while engine.has_work():
        out = engine.step()
        for rid, _, step, _, x0 in out.previews:
            got.setdefault(rid, []).append((step, x0))
        finished.update({s.request_id: s.latents for s in out.finished})
    return finished, got, engine.stats


def test_mixed_lora_batch_with_previews_gives_the_same_latents_and_the_previews(family):
    plain, none, _ = run_batch(family, {})
    assert none == {}
    steps = preview_steps(2, STEPS)  # after steps 1 and 3
    previewed, got, stats = run_batch(family, {k: steps for k in REQUESTS})
    assert stats.forwards == STEPS  # still one forward per step for the mixed batch
    for k in REQUESTS:
        assert torch.equal(previewed[k], plain[k]), k
        assert [s for s, _ in got[k]] == sorted(steps), k
    # Rows with different adapters predict different clean latents (the preview is not shared).
    first = {k: got[k][0][1] for k in REQUESTS}
    assert not torch.allclose(first["A"], first["none"])
    assert not torch.allclose(first["B"], first["none"])


def test_a_preview_reads_its_rows_adapted_prediction(family):
    """At the last step the predicted clean latents are the final latents, for each adapted row."""
    final, got, _ = run_batch(family, {k: frozenset({STEPS}) for k in REQUESTS})
    # Measured: equal bit for bit (x0 = x - s * pred and the last Euler step to sigma 0 are the same
    # arithmetic), so the check is exact.
    for k in REQUESTS:
        assert torch.equal(got[k][0][1], final[k]), k
