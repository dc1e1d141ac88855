"""``--attention auto``: the backend picked from a device description, by compute capability and what
is usable there (a fake ``usable``), the flag's override kept, the choice logged."""

from __future__ import annotations

import logging

import pytest

from triptych.core.attention_choice import AttentionDevice, candidates, choose
from triptych.core.devices import DeviceConfig, auto_attention

H100 = AttentionDevice("cuda", "bfloat16", (9, 0), "NVIDIA H100 80GB HBM3")
A100 = AttentionDevice("cuda", "bfloat16", (8, 0), "NVIDIA A100-SXM4-80GB")
L40S = AttentionDevice("cuda", "float16", (8, 9), "NVIDIA L40S")
B200 = AttentionDevice("cuda", "bfloat16", (10, 0), "NVIDIA B200")
V100 = AttentionDevice("cuda", "float16", (7, 0), "Tesla V100")


def usable_set(*names):
    probed = []

    def usable(name):
        probed.append(name)
        return name in names

    return usable, probed


def test_off_cuda_it_is_native_without_probing_anything():
    usable, probed = usable_set("flash", "_flash_3")
    assert choose(AttentionDevice("cpu", "float32"), usable)[0] == "native"
    assert probed == []


@pytest.mark.parametrize(
    ("device", "installed", "expected"),
    [
        (H100, {"_flash_3", "_native_cudnn", "flash"}, "_flash_3"),
        (H100, {"_native_cudnn", "flash"}, "_native_cudnn"),
        (H100, {"flash"}, "flash"),
        (H100, set(), "native"),
        (B200, {"_flash_3", "_native_cudnn", "flash"}, "_native_cudnn"),  # flash attention 3 is Hopper's
        (A100, {"_flash_3", "_native_cudnn", "flash"}, "flash"),
        (L40S, {"flash"}, "flash"),
        (A100, set(), "native"),
        (V100, {"flash", "_native_cudnn"}, "native"),
    ],
)
def test_the_first_usable_backend_of_the_device_is_chosen(device, installed, expected):
    usable, _ = usable_set(*installed)
    assert choose(device, usable)[0] == expected


def test_the_reason_names_what_was_not_usable():
    usable, probed = usable_set("flash")
    backend, reason = choose(H100, usable)
    assert backend == "flash" and probed == ["_flash_3", "_native_cudnn", "flash"]
    assert "_flash_3, _native_cudnn not usable" in reason


def test_float32_and_attention_masks_keep_to_native():
    usable, probed = usable_set("_flash_3", "_native_cudnn", "flash")
    fp32 = AttentionDevice("cuda", "float32", (9, 0))
    assert choose(fp32, usable) == ("native", candidates(fp32)[0][1])
    backend, reason = choose(H100, usable, masks=True)
    assert backend == "native" and "mask" in reason and probed == []


def test_auto_on_this_cpu_is_native_and_logged(caplog):
    auto_attention.cache_clear()
    with caplog.at_level(logging.INFO, logger="triptych.core.devices"):
        assert DeviceConfig(device="cpu", attention="auto").attention_backend() == "native"
    assert any("attention auto on cpu" in r.getMessage() and "native" in r.getMessage() for r in caplog.records)


def test_a_named_backend_overrides_auto():
    assert DeviceConfig(attention="_native_math").attention_backend(masks=True) == "_native_math"
    assert DeviceConfig().attention == "auto"


def test_sequence_parallel_runs_a_backend_without_context_parallel_support_as_native():
    from triptych.parallel.sequence import context_parallel_backend

    assert context_parallel_backend("_flash_3") == "native"  # auto's Hopper pick
    assert context_parallel_backend("flash") == "flash" and context_parallel_backend("_native_cudnn") == "_native_cudnn"
    assert context_parallel_backend("native") == "native"
