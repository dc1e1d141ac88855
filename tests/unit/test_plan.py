"""``triptych plan``: FLOPs counted on meta from configs alone, checked against an independent count
of the diffusers module itself; weight bytes against an independent parameter count; unknown
components; every family's tiny model and the packaged default."""

from __future__ import annotations

import json

import pytest
import torch

from triptych.cli import main

FLUX_DEV = {
    "_class_name": "FluxTransformer2DModel",
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": True,
    "in_channels": 64,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 19,
    "num_single_layers": 38,
    "patch_size": 1,
    "pooled_projection_dim": 768,
}
FLUX_VAE = {
    "_class_name": "AutoencoderKL",
    "block_out_channels": [32, 32, 32, 32],
    "latent_channels": 16,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "layers_per_block": 1,
    "norm_num_groups": 8,
    "in_channels": 3,
    "out_channels": 3,
}


@pytest.fixture(scope="module")
def flux_dev_configs(tmp_path_factory):
    """FLUX.1-dev's model_index and transformer config (real shapes), a small VAE config, no text-encoder
    configs and no weights."""
    root = tmp_path_factory.mktemp("flux-dev")
    index = {
        "_class_name": "FluxPipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    (root / "model_index.json").write_text(json.dumps(index))
    for name, cfg in (("transformer", FLUX_DEV), ("vae", FLUX_VAE)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
    return root


@pytest.fixture(scope="module")
def flux_dev_meta():
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        return FluxTransformer2DModel.from_config(FLUX_DEV).to(torch.bfloat16)


def _independent(model, size: int) -> tuple[int, int]:
    """FLOPs of one FLUX.1-dev forward at ``size``² (512 text tokens) and its parameter count: the
    diffusers module called directly on hand-built meta inputs."""
    from torch.utils.flop_counter import FlopCounterMode

    tokens = (size // 16) ** 2
    bf = dict(device="meta", dtype=torch.bfloat16)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(
            hidden_states=torch.empty(1, tokens, 64, **bf),
            encoder_hidden_states=torch.empty(1, 512, 4096, **bf),
            pooled_projections=torch.empty(1, 768, **bf),
            timestep=torch.empty(1, **bf),
            guidance=torch.empty(1, device="meta"),
            img_ids=torch.empty(tokens, 3, device="meta"),
            txt_ids=torch.empty(512, 3, device="meta"),
            return_dict=False,
        )
    return counter.get_total_flops(), sum(p.numel() for p in model.parameters())


def _plan(capsys, *args) -> dict:
    assert main(["plan", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("size", [1024, 512])
def test_flux_dev_forward_flops_and_weights_match_an_independent_count(flux_dev_configs, flux_dev_meta, capsys, size):
    flops, params = _independent(flux_dev_meta, size)
    out = _plan(capsys, flux_dev_configs, "--height", size, "--width", size)
    forward = out["stages"]["transformer_forward"]["flops"]
    # measured: equal (the same module, the same shapes); 1% allowed
    assert forward == pytest.approx(flops, rel=0.01)
    assert out["components"]["transformer"]["weight_bytes"]["bf16"] == pytest.approx(2 * params, rel=0.01)
    assert params == pytest.approx(11.9e9, rel=0.01)  # FLUX.1-dev's published transformer size
    assert out["request"]["branches"] == 1  # guidance-distilled, no true CFG: one branch


def test_true_cfg_doubles_the_step_and_missing_configs_are_unknown(flux_dev_configs, capsys):
    out = _plan(capsys, flux_dev_configs, "--height", 512, "--width", 512, "--true-cfg", 2, "--batch", 3)
    one = out["stages"]["transformer_forward"]["flops"]
    assert out["stages"]["denoise_step"]["flops"] == pytest.approx(6 * one, rel=1e-6)  # 3 requests x 2 branches
    assert out["components"]["text_encoder"]["unknown"] == "no text_encoder/config.json"
    assert "unknown" in out["components"]["text_encoder_2"]
    assert out["placement"]["unknown_components"] == ["text_encoder", "text_encoder_2"]
    assert out["stages"]["decode"]["flops"] > 0  # the VAE config is there


def test_the_human_report_names_the_figures(flux_dev_configs, capsys):
    assert main(["plan", str(flux_dev_configs), "--height", "512", "--width", "512", "--devices", "2"]) == 0
    text = capsys.readouterr().out
    assert "text_encoder" in text and "unknown" in text and "H100" in text and "MI300X" in text
    assert "placement on 2 x H100" in text


@pytest.mark.parametrize("family", ["flux", "flux-schnell", "qwen-image", "qwen-image-edit", "wan-t2v", "wan-i2v"])
def test_every_family_plans_its_tiny_model(tiny_model_dir, capsys, family):
    out = _plan(capsys, tiny_model_dir(family), "--device", "cpu", "--devices", "3")
    stages = out["stages"]
    for key in ("transformer_forward", "denoise_step", "decode"):
        assert stages[key]["flops"] > 0, (key, stages[key])
    assert stages["encode"].get("unknown") is None and stages["encode"]["flops"] > 0
    assert stages["denoise_step"]["flops"] >= stages["transformer_forward"]["flops"]
    assert out["request_flops"] > out["request"]["steps"] * stages["denoise_step"]["flops"]
    assert out["placement"]["fits"] and out["device"]["peak_bf16_flops"] > 0


def test_the_packaged_default_model(capsys):
    from pathlib import Path

    import triptych

    out = _plan(capsys, Path(triptych.__file__).parent / "assets" / "default", "--devices", "2")
    assert out["family"].startswith("qwen-image") and out["request"]["branches"] == 2
    assert out["placement"]["cfg"] == 2  # two branches on two devices: CFG parallel


def test_bad_flags_are_refused_naming_them(flux_dev_configs, capsys):
    assert main(["plan", str(flux_dev_configs), "--devices", "0"]) == 2
    assert "--devices" in capsys.readouterr().err
    assert main(["plan", str(flux_dev_configs), "--device", "TPU"]) == 2
    assert "--device" in capsys.readouterr().err
