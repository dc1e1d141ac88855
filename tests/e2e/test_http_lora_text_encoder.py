"""Text-encoder LoRA at the head: which families' formats carry it, and a 400 naming the field, the
value and the rule for an adapter that cannot apply.

One head serving two models over ``FakeBackend`` (weightless families: the head reads only the
adapter files' headers and the models' weight headers): a tiny FLUX, whose diffusers format carries
text-encoder LoRA for its CLIP encoder, and a tiny Qwen-Image, whose format carries transformer LoRA
only. Served adapters: ``t`` (FLUX transformer + text encoder, written by
``FluxPipeline.save_lora_weights``), ``te_shape`` and ``te_module`` (a text-encoder module of other
shapes, one FLUX's CLIP has not), ``te2`` (FLUX's T5, ``text_encoder_2``, which the format has not),
``qte`` (a Qwen-Image transformer module and a text-encoder key).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch
from diffusers import FluxPipeline
from safetensors.torch import save_file

from tests.e2e.http_support import FakeBackend, serve
from tests.helpers import pristine_pipeline
from triptych.families.registry import load_family
from triptych.head.app import HeadConfig, create_app
from triptych.lora.catalog import model_linear_shapes
from triptych.lora.config import LoraConfig
from triptych.lora.synthetic import write_random_lora


def pair(prefix: str, module: str, out_f: int, in_f: int, rank: int = 2) -> dict:
    return {
        f"{prefix}.{module}.lora_A.weight": torch.zeros(rank, in_f),
        f"{prefix}.{module}.lora_B.weight": torch.zeros(out_f, rank),
    }


def write(path, tensors: dict):
    path.mkdir(parents=True)
    save_file(tensors, str(path / "pytorch_lora_weights.safetensors"))


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-te")
    flux, qwen = tiny_model_dir("flux"), tiny_model_dir("qwen-image")
    pipe = pristine_pipeline(flux)
    write_random_lora(
        root / "t", pipe.transformer, ("attn.to_q",), 2, 1, pipeline_class=FluxPipeline,
        text_encoder=pipe.text_encoder, text_encoder_targets=("self_attn.q_proj",),
    )  # fmt: skip
    q_proj = "encoder.layers.0.self_attn.q_proj"
    out_f, in_f = model_linear_shapes(flux, "text_encoder")[q_proj]
    write(root / "te_shape", pair("text_encoder", q_proj, out_f, in_f + 1))
    write(root / "te_module", pair("text_encoder", "encoder.layers.99.self_attn.q_proj", out_f, in_f))
    write(root / "te2", pair("text_encoder_2", "encoder.block.0.layer.0.SelfAttention.q", 8, 8))
    q_module, (q_out, q_in) = sorted(model_linear_shapes(qwen).items())[0]
    write(root / "qte", {**pair("transformer", q_module, q_out, q_in), **pair("text_encoder", "model.x", 4, 4)})
    names = ("t", "te_shape", "te_module", "te2", "qte")
    lora = LoraConfig(lora=tuple(f"{n}={root / n}" for n in names), lora_root=str(root))
    backends = {m: FakeBackend(load_family(d, roles=())) for m, d in (("flux", flux), ("qwen", qwen))}
    with serve(create_app(backends, HeadConfig(data_dir=tmp_path_factory.mktemp("head"), lora=lora))) as base:
        yield base


def send(base: str, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{base}{path}", data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def generate(base: str, model: str, lora) -> tuple[int, dict]:
    body = {"model": model, "prompt": "a red circle on a blue background", "num_inference_steps": 2, "lora": lora}
    return send(base, "POST", "/v1/images/generations", body)


def test_an_adapter_with_text_encoder_keys_is_served_on_flux(server):
    status, out = generate(server, "flux", "t")
    assert status == 200, out
    cards = {m["id"]: [a["name"] for a in m["loras"]] for m in send(server, "GET", "/v1/models")[1]["data"]}
    assert cards == {"flux": ["t"], "qwen": []}


@pytest.mark.parametrize(
    "model, name, words",
    [
        ("qwen", "qte", "qwen-image's diffusers LoRA format has no text-encoder LoRA (it carries: transformer)"),
        ("qwen", "t", "qwen-image's diffusers LoRA format has no text-encoder LoRA"),
        ("flux", "te2", "'text_encoder_2' LoRA, but flux's diffusers LoRA format has text-encoder LoRA for text_encoder only"),
        ("flux", "te_module", "module 'encoder.layers.99.self_attn.q_proj' is not a Linear layer of this model's text_encoder"),
        ("flux", "te_shape", "module 'encoder.layers.0.self_attn.q_proj' is (32 out, 32 in) in this model's text_encoder but lora_A is (2, 33)"),
    ],
)  # fmt: skip
def test_text_encoder_keys_that_cannot_apply_are_a_400_naming_field_value_and_rule(server, model, name, words):
    status, out = generate(server, model, name)
    assert status == 400, out
    err = out["error"]
    assert err["param"] == "lora" and f"lora='{name}'" in err["message"] and words in err["message"], err


def test_a_run_time_load_of_text_encoder_lora_on_a_family_without_it_is_a_400(server):
    status, out = send(server, "POST", "/v1/loras", {"name": "q2", "path": "qte", "model": "qwen"})
    assert status == 400, out
    err = out["error"]
    assert err["param"] == "path" and "path='qte'" in err["message"], err
    assert "has no text-encoder LoRA" in err["message"], err
    status, out = send(server, "POST", "/v1/loras", {"name": "t2", "path": "t", "model": "flux"})
    assert status == 200 and out["name"] == "t2", out
