"""Text-encoder LoRA through the real server (tiny FLUX): the encoder processes apply an adapter's
text-encoder part, for an adapter given with ``--lora`` and for one loaded at run time.

One module-scoped server (HTTP head over an ``EmbeddedBackend``: encoder, denoiser and decoder
processes) serving ``t`` (random, seeded: transformer and CLIP text-encoder LoRA, written by
``FluxPipeline.save_lora_weights``) with ``--lora`` and ``run/te`` (text encoder only) under
``--lora-root``. Each image equals the same request run in process (``run_request``, every role in
one family with the adapter). The check that the encoders, not only the denoiser, applied it: ``t``
without its text-encoder part (the same seeded transformer tensors) gives another image, and ``te``
(no transformer part) moves the image from the plain one.

Tolerance: a request served alone equals ``run_request`` as in ``test_server_batching``; measured 0
uint8 levels for both requests (one run); we allow 2, the bound of ``test_http_lora``. The
text-encoder parts move the images by far more (the assertions need 4x the bound).
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
from diffusers import FluxPipeline

from tests.e2e.http_support import decode_pixels, serve
from tests.helpers import pristine_pipeline
from triptych.control.orchestrator import OrchestratorConfig
from triptych.deploy.launch import EmbeddedBackend, TopologyConfig
from triptych.engine.runner import run_request
from triptych.families.base import GenerationParams
from triptych.families.registry import load_family
from triptych.head.app import HeadConfig, create_app
from triptych.lora.config import LoraConfig
from triptych.lora.synthetic import write_random_lora

STEPS = 4
SIZE = 64
MAX_DIFF = 2  # uint8 levels; measured 0 and 0 (one run)
TE_TARGETS = ("self_attn.q_proj", "mlp.fc1")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-flux")
    model = tiny_model_dir("flux")
    pipe = pristine_pipeline(model)
    tr, te = pipe.transformer, pipe.text_encoder
    common = dict(rank=4, seed=1, std=0.3, pipeline_class=FluxPipeline)
    write_random_lora(root / "t", tr, ("attn.to_q",), text_encoder=te, text_encoder_targets=TE_TARGETS, **common)
    write_random_lora(root / "t_transformer", tr, ("attn.to_q",), **common)  # t's transformer tensors only
    write_random_lora(root / "run" / "te", None, (), text_encoder=te, text_encoder_targets=TE_TARGETS, **common)
    lora = LoraConfig(lora=(f"t={root / 't'}",), lora_root=str(root))
    flags = ("--lora-root", str(root), "--lora", lora.lora[0])
    backend = EmbeddedBackend(
        model,
        OrchestratorConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=10.0),
        TopologyConfig(transfer="zmq", capacity=2, torch_threads=1, extra_args=flags),
    )
    head = HeadConfig(data_dir=tmp_path_factory.mktemp("head"), lora=lora)
    with serve(create_app(backend, head)) as base:
        yield model, base, root


def send(base: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"{base}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def generate(base: str, prompt: str, seed: int, lora) -> np.ndarray:
    body = dict(prompt=prompt, size=f"{SIZE}x{SIZE}", response_format="b64_json", seed=seed, num_inference_steps=STEPS)
    status, out = send(base, "/v1/images/generations", dict(body, lora=lora))
    assert status == 200, out
    return decode_pixels(base64.b64decode(out["data"][0]["b64_json"]))


def alone(model, root, prompt, seed, name: str | None) -> np.ndarray:
    family = load_family(model)
    paths = {"t": root / "t", "t_transformer": root / "t_transformer", "te": root / "run" / "te"}
    family.enable_lora(LoraConfig(lora=tuple(f"{n}={p}" for n, p in paths.items())))
    spec = () if name is None else ((name, 1.0),)
    params = GenerationParams(prompt=prompt, seed=seed, steps=STEPS, height=SIZE, width=SIZE, lora=spec)
    frames, _ = run_request(family, params)
    return frames.to_uint8()[0]


def diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


def test_the_encoders_apply_a_served_adapters_text_encoder_part(server):
    model, base, root = server
    prompt, seed = "a red circle on a blue background", 5
    got = generate(base, prompt, seed, "t")
    assert diff(got, alone(model, root, prompt, seed, "t")) <= MAX_DIFF
    assert diff(got, alone(model, root, prompt, seed, "t_transformer")) > 4 * MAX_DIFF  # the text-encoder part acted


def test_a_text_encoder_only_adapter_loaded_at_run_time_reaches_the_encoders(server):
    model, base, root = server
    status, out = send(base, "/v1/loras", {"name": "te", "path": "run/te"})
    assert status == 200, out
    prompt, seed = "a blue square on a white background", 6
    got = generate(base, prompt, seed, "te")
    assert diff(got, alone(model, root, prompt, seed, "te")) <= MAX_DIFF
    assert diff(got, alone(model, root, prompt, seed, None)) > 4 * MAX_DIFF
