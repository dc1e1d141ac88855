"""``Family.sequence_tokens`` (what ``AdmissionLimits.max_tokens`` counts) equals the sequence length
the transformer's first block really receives, per family (tiny models, one denoising step), and the
head refuses a request over the limit naming the size, the token count and the limit."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from triptych.core.errors import InvalidParam
from triptych.families.base import GenerationParams
from triptych.families.registry import load_family
from triptych.head.admission import AdmissionLimits

CASES = {
    "flux": dict(height=32, width=48),
    "qwen-image": dict(height=64, width=32),
    "qwen-image-edit": dict(height=32, width=32, image=Image.new("RGB", (48, 32), (9, 9, 9))),
    "wan-t2v": dict(height=32, width=48, frames=9),
}


def _first_block(transformer) -> torch.nn.Module:
    blocks = getattr(transformer, "transformer_blocks", None) or transformer.blocks
    return blocks[0]


@pytest.mark.parametrize("name", sorted(CASES))
def test_sequence_tokens_is_what_the_first_block_sees(tiny_model_dir, name):
    family = load_family(tiny_model_dir(name))
    params = family.resolve(GenerationParams("a red circle", steps=2, seed=0, **CASES[name]))
    seen = []

    def record(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        seen.append(hidden.shape[1])

    handle = _first_block(family.pipe.transformer).register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            state = family.prepare("r", params, family.encode(params))
            family.denoise_step([state], fuse_cfg=True)
    finally:
        handle.remove()
    assert seen and set(seen) == {family.sequence_tokens(params)}, (name, seen, family.sequence_tokens(params))
    # the weightless adapter the head loads counts the same
    assert load_family(tiny_model_dir(name), roles=()).sequence_tokens(params) == seen[0]


def test_the_limit_names_size_tokens_and_limit():
    limits = AdmissionLimits(max_tokens=256)
    limits.check_tokens(256, "256x256")
    with pytest.raises(InvalidParam) as e:
        limits.check_tokens(257, "272x256")
    assert e.value.field == "size" and e.value.value == "272x256"
    assert "257 transformer tokens" in e.value.rule and "limit of 256" in e.value.rule
