"""DeviceConfig: bad devices, dtypes, attention backends and offloads are one InvalidParam line (CLI exit 2)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

from triptych.cli import main
from triptych.core.devices import AUTO_TILING_PIXELS, DeviceConfig, add_device_flags, device_config_from_args
from triptych.core.errors import InvalidParam

NO_CUDA = not torch.cuda.is_available()


def test_auto_dtype_is_float32_on_cpu():
    config = DeviceConfig()
    assert config.dtype_name == "float32" and config.torch_dtype is torch.float32
    assert config.torch_device == torch.device("cpu")


@pytest.mark.parametrize(
    "kwargs, option",
    [
        (dict(device="gpu"), "--device"),
        (dict(device="cuda:x"), "--device"),
        (dict(dtype="float64"), "--dtype"),
        (dict(dtype="int8"), "--dtype"),
        (dict(attention="bogus"), "--attention"),
        (dict(offload="disk"), "--offload"),
        (dict(offload="group"), "--offload"),  # offload onto the CPU from the CPU: refused
    ],
)
def test_bad_values_name_the_option(kwargs, option):
    with pytest.raises(InvalidParam) as e:
        DeviceConfig(**kwargs)
    assert e.value.field == option


@pytest.mark.skipif(not NO_CUDA, reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:7"])
def test_cuda_without_a_gpu_is_refused(device):
    with pytest.raises(InvalidParam, match="CUDA is not available") as e:
        DeviceConfig(device=device)
    assert e.value.field == "--device"


def test_unknown_attention_backend_lists_the_valid_ones():
    with pytest.raises(InvalidParam) as e:
        DeviceConfig(attention="bogus")
    assert "native" in e.value.rule and "flex" in e.value.rule and "xformers" in e.value.rule
    assert "flash_hub" not in e.value.rule  # hub kernels download at first use: not offered


def test_backend_whose_package_is_missing_is_refused():
    with pytest.raises(InvalidParam, match="does not run on cpu") as e:
        DeviceConfig(attention="flash")  # flash-attn is not installed here (and has no CPU kernel)
    assert e.value.field == "--attention"


def test_a_backend_that_runs_on_cpu_is_accepted():
    assert DeviceConfig(attention="_native_math").attention == "_native_math"


def test_tiling_auto_follows_the_pixel_threshold_and_flags_override():
    auto = DeviceConfig()
    assert not auto.tiling_for(1024, 1024) and auto.tiling_for(1024, 1024 + 16)
    assert AUTO_TILING_PIXELS == 1024 * 1024
    assert DeviceConfig(vae_tiling=True).tiling_for(64, 64)
    assert not DeviceConfig(vae_tiling=False).tiling_for(4096, 4096)


def test_flags_build_the_config():
    parser = argparse.ArgumentParser()
    add_device_flags(parser)
    args = parser.parse_args(["--dtype", "bfloat16", "--vae-tiling", "--vae-slicing", "--attention", "_native_math"])
    config = device_config_from_args(args)
    assert config == DeviceConfig("cpu", "bfloat16", "_native_math", vae_tiling=True, vae_slicing=True)
    assert device_config_from_args(parser.parse_args(["--no-vae-tiling"])).vae_tiling is False
    assert device_config_from_args(parser.parse_args([])) == DeviceConfig()
    for config in (DeviceConfig(), DeviceConfig(dtype="bfloat16", vae_tiling=False, vae_slicing=True)):
        assert device_config_from_args(parser.parse_args(config.to_args())) == config  # head -> worker argv


BAD_FLAGS = [(["--device", "cuda:7"], "--device"), (["--dtype", "float64"], "--dtype")]
if NO_CUDA:
    BAD_FLAGS.append((["--device", "cuda"], "--device"))


@pytest.mark.parametrize("command", ["generate", "chat", "calibrate", "quality"])
@pytest.mark.parametrize("flags, option", BAD_FLAGS, ids=[f[0][1] for f in BAD_FLAGS])
def test_every_command_exits_2_with_one_line_naming_the_option(tmp_path, capsys, command, flags, option):
    required = {
        "generate": ["--prompt", "x", "--out", str(tmp_path / "a.png")],
        "chat": ["--prompt", "x"],
        "calibrate": ["--steps", "2"],
        "quality": ["--teacache-threshold", "0.1"],
    }[command]
    assert main([command, *required, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: invalid {option}=") and flags[1] in err[0]
    assert not (tmp_path / "a.png").exists()


def test_the_real_command_line_prints_no_traceback(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "triptych.cli", "generate", "--prompt", "x", "--out", str(tmp_path / "a.png")]
        + ["--dtype", "float64"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert (
        out.stderr.strip()
        == "error: invalid --dtype='float64': must be one of float32, bfloat16, float16 (or omitted: auto)"
    )


def test_split_threads_splits_the_idle_cores_among_the_processes():
    from triptych.core.devices import split_threads

    assert split_threads(1, cores=2, load=0.3) == 2  # idle 2-core machine: both
    assert split_threads(1, cores=2, load=9.7) == 1  # loaded: one (48.2 s -> 3.0 s in issue 24)
    assert split_threads(3, cores=16, load=0.0) == 5
    assert split_threads(3, cores=16, load=7.6) == 2  # 8 busy, 8 idle for 3 processes
    assert split_threads(4, cores=2, load=0.0) == 1
