"""LoRA through the real server: adapters named per request, batched together, checked at the head.

One module-scoped server (HTTP head over an ``EmbeddedBackend``: encoder, denoiser and decoder
processes, tiny Qwen-Image) serving three adapters with ``--lora NAME=DIR``: ``a`` and ``b`` (random,
seeded, diffusers format) and ``wide``, written for a larger model. Two requests with different
adapters are sent at once and denoised in shared steps (the ``mixed_batches`` counter says they
were); each image equals the same request run alone in process (``run_request`` with the adapter).

Tolerance: as ``test_server_batching``: a batched forward changes CPU kernels' reduction order, so a
request denoised beside another may differ from running alone by a uint8 level or two. Measured:
0 and 1 levels for the two requests (one run); we allow 2, the bound of the plain batching test. The
adapters move the same images by 21 and 41 levels, so the comparison can fail.
"""

from __future__ import annotations

import base64
import json
import shutil
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.e2e.http_support import decode_pixels, serve, wait_for
from tests.e2e.test_server_batching import scrape
from triptych.control.orchestrator import OrchestratorConfig
from triptych.deploy.launch import EmbeddedBackend, TopologyConfig
from triptych.engine.runner import run_request
from triptych.families.base import GenerationParams
from triptych.families.registry import load_family, make_tiny
from triptych.head.app import HeadConfig, create_app
from triptych.lora.config import LoraConfig
from triptych.lora.synthetic import write_random_lora

STEPS = 16  # long enough that the second request joins the first mid-denoise
SIZE = 64
MAX_DIFF = 2  # uint8 levels; measured 0 and 1 (one run)
MIXED = "triptych_denoiser_lora_mixed_batches_total"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from diffusers import QwenImageTransformer2DModel

    root = tmp_path_factory.mktemp("lora")
    model = tiny_model_dir("qwen-image")
    transformer = QwenImageTransformer2DModel.from_pretrained(f"{model}/transformer")
    write_random_lora(root / "a", transformer, ("attn.to_q", "attn.to_v"), rank=4, alpha=8.0, seed=1, std=0.4)
    write_random_lora(root / "b", transformer, ("img_mlp.net.2", "attn.to_k"), rank=2, seed=2, std=0.4)
    other = make_tiny("qwen-image", root / "other", seed=1, size="small")
    wide = QwenImageTransformer2DModel.from_pretrained(f"{other}/transformer")
    write_random_lora(root / "wide", wide, ("attn.to_q",), rank=2, seed=3)
    write_random_lora(root / "run" / "c", transformer, ("attn.to_q", "attn.to_v"), rank=4, alpha=8.0, seed=4, std=0.4)
    lora = LoraConfig(lora=(f"a={root / 'a'}", f"b={root / 'b'}", f"wide={root / 'wide'}"), lora_root=str(root))
    flags = ("--max-batch-requests", "4", "--lora-root", str(root), *(x for e in lora.lora for x in ("--lora", e)))
    backend = EmbeddedBackend(
        model,
        OrchestratorConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=10.0),
        TopologyConfig(transfer="zmq", capacity=4, torch_threads=1, extra_args=flags),
    )
    head = HeadConfig(data_dir=tmp_path_factory.mktemp("head"), lora=lora)
    with serve(create_app(backend, head)) as base:
        yield model, base, lora, root


def post(base: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"{base}/v1/images/generations", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def generate(base: str, prompt: str, seed: int, lora) -> np.ndarray:
    body = dict(prompt=prompt, size=f"{SIZE}x{SIZE}", response_format="b64_json", seed=seed, num_inference_steps=STEPS)
    status, out = post(base, dict(body, lora=lora))
    assert status == 200, out
    return decode_pixels(base64.b64decode(out["data"][0]["b64_json"]))


def alone(model, lora_config, prompt, seed, spec) -> np.ndarray:
    family = load_family(model)
    family.enable_lora(lora_config)
    params = GenerationParams(prompt=prompt, seed=seed, steps=STEPS, height=SIZE, width=SIZE, lora=spec)
    frames, _ = run_request(family, params)
    return frames.to_uint8()[0]


def test_two_adapters_batched_in_one_step_give_the_images_each_gives_alone(server):
    model, base, lora, _ = server
    before = scrape(base)
    jobs = [("a red cube", 5, "a", (("a", 1.0),)), ("a blue ball", 6, [{"name": "b", "scale": 0.8}], (("b", 0.8),))]
    with ThreadPoolExecutor(2) as pool:
        outputs = list(pool.map(lambda j: generate(base, j[0], j[1], j[2]), jobs))
    after = wait_for(lambda: (s := scrape(base)).get(MIXED, 0) > before.get(MIXED, 0) and s, "a mixed batch", 60)
    assert after["triptych_denoiser_lora_misses_total"] >= 2  # both adapters were loaded by the denoiser
    for (prompt, seed, _, spec), got in zip(jobs, outputs):
        want = alone(model, lora, prompt, seed, spec)
        diff = int(np.abs(got.astype(np.int16) - want.astype(np.int16)).max())
        assert diff <= MAX_DIFF, (prompt, diff)
        plain = alone(model, lora, prompt, seed, ())
        assert np.abs(got.astype(np.int16) - plain.astype(np.int16)).max() > 4 * MAX_DIFF  # the adapter acted


@pytest.mark.parametrize(
    "lora, field, words",
    [
        ("nope", "lora", "is not a served adapter"),
        ([{"name": "a", "scale": 9.0}], "lora.scale", "between -4.0 and 4.0"),
        ("wide", "lora", "for another model"),
        ([{"name": "a"}, {"name": "a"}], "lora", "named twice"),
    ],
)
def test_bad_lora_is_a_400_naming_field_value_and_rule(server, lora, field, words):
    _, base, _, _ = server
    status, body = post(base, dict(prompt="x", size=f"{SIZE}x{SIZE}", num_inference_steps=2, lora=lora))
    assert status == 400, body
    err = body["error"]
    assert err["param"] == field and words in err["message"], err


def test_models_lists_the_adapters_that_fit(server):
    _, base, _, _ = server
    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as r:
        card = json.loads(r.read())["data"][0]
    assert [a["name"] for a in card["loras"]] == ["a", "b"]


def get(base: str, path: str) -> dict:
    with urllib.request.urlopen(f"{base}{path}", timeout=30) as r:
        return json.loads(r.read())


def test_health_and_models_show_the_adapters_each_denoiser_holds(server):
    _, base, _, _ = server
    status, out = post(base, dict(prompt="x", size=f"{SIZE}x{SIZE}", num_inference_steps=2, lora="b"))
    assert status == 200, out

    def denoisers():
        found = [i for i in get(base, "/health")["backend"]["instances"] if i["role"] == "denoiser"]
        return found if any("b" in i["loras"] for i in found) else None

    held = wait_for(denoisers, "a denoiser reporting adapter b in memory", 30)
    assert all(i["loras"] == [] for i in get(base, "/health")["backend"]["instances"] if i["role"] != "denoiser")
    card = {a["name"]: a for a in get(base, "/v1/models")["data"][0]["loras"]}
    assert card["b"]["loaded_on"] == [i["id"] for i in held if "b" in i["loras"]]


def send(base: str, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{base}{path}", data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_run_time_loads_are_a_400_naming_field_value_and_rule(server, tmp_path):
    _, base, _, root = server
    outside = tmp_path / "outside"
    shutil.copytree(root / "a", outside)  # a good adapter, outside the allowed root
    (root / "escape").symlink_to(outside, target_is_directory=True)
    cases = [
        ({"name": "x", "path": str(outside)}, "path", "must resolve under the allowed root"),
        ({"name": "x", "path": "escape"}, "path", "must resolve under the allowed root"),
        ({"name": "x", "path": "../outside"}, "path", "must resolve under the allowed root"),
        ({"name": "x", "path": "https://example.com/a.safetensors"}, "path", "not a URL"),
        ({"name": "x", "path": "missing"}, "path", "must be an adapter folder or .safetensors file"),
        ({"name": "x", "path": "wide"}, "path", "is an adapter for another model"),
        ({"name": "a", "path": "run/c"}, "name", "is already served"),
        ({"name": "../x", "path": "run/c"}, "name", "must be 1-64 letters"),
    ]
    for body, field, words in cases:
        status, out = send(base, "POST", "/v1/loras", body)
        assert status == 400, (body, out)
        err = out["error"]
        assert err["param"] == field and words in err["message"], (body, err)
        assert f"{field}=" in err["message"], err  # the message names the value given


def test_an_adapter_loaded_at_run_time_serves_requests_until_it_is_unloaded(server):
    model, base, _, root = server
    status, out = send(base, "POST", "/v1/loras", {"name": "c", "path": "run/c"})
    assert status == 200 and out["name"] == "c", out
    listed = {a["name"]: a for a in send(base, "GET", "/v1/loras")[1]["data"]}
    assert listed["c"]["source"] == "api" and listed["a"]["source"] == "flag", listed
    # the denoisers were started without "c": the request carries its file and the denoiser loads it
    got = generate(base, "a green cone", 7, "c")
    config = LoraConfig(lora=(f"c={root / 'run' / 'c'}",))
    want = alone(model, config, "a green cone", 7, (("c", 1.0),))
    assert int(np.abs(got.astype(np.int16) - want.astype(np.int16)).max()) <= MAX_DIFF
    plain = alone(model, config, "a green cone", 7, ())
    assert np.abs(got.astype(np.int16) - plain.astype(np.int16)).max() > 4 * MAX_DIFF  # the adapter acted
    assert send(base, "DELETE", "/v1/loras/c")[0] == 200
    status, out = post(base, dict(prompt="x", size=f"{SIZE}x{SIZE}", num_inference_steps=2, lora="c"))
    assert status == 400 and out["error"]["param"] == "lora" and "is not a served adapter" in out["error"]["message"]
    assert send(base, "DELETE", "/v1/loras/c")[0] == 404
    assert send(base, "DELETE", "/v1/loras/a")[0] == 404  # --lora adapters are not unloaded at run time
