"""The vLLM chat engine's pieces that need no vLLM: the exported model folder, the embedding items the
encoder computes (through its mm-hash cache), the request they become, and the config's checks."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from shapeworld import render, sample_scenes
from triptych.chat import ChatParams, ChatTurn
from triptych.families.models import PACKAGED_DEFAULT
from triptych.vllm_chat.config import VllmConfig
from triptych.vllm_chat.engine import chat_body
from triptych.vllm_chat.server import VllmServer, VllmStartFailed


@pytest.fixture(scope="module")
def family():
    from triptych.families.registry import load_family

    torch.set_num_threads(1)
    return load_family(PACKAGED_DEFAULT)


def test_export_writes_a_plain_qwen2_5_vl_folder(family, tmp_path):
    from safetensors.torch import load_file

    out = family.vllm_export(tmp_path / "copy")
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (out / name).is_file(), name
    assert json.loads((out / "tokenizer_config.json").read_text())["processor_class"] == "Qwen2_5_VLProcessor"
    pre = json.loads((out / "preprocessor_config.json").read_text())
    size = json.loads((PACKAGED_DEFAULT / "processor" / "processor_config.json").read_text())["image_processor"]["size"]
    assert pre["min_pixels"] == size["shortest_edge"] and pre["max_pixels"] == size["longest_edge"] == 12544
    assert (out / "model.safetensors").read_bytes() == (
        PACKAGED_DEFAULT / "text_encoder" / "model.safetensors"
    ).read_bytes()

    nan = load_file(family.vllm_export(tmp_path / "nan", vision="nan") / "model.safetensors")
    src = load_file(PACKAGED_DEFAULT / "text_encoder" / "model.safetensors")
    assert nan.keys() == src.keys()
    for key, value in nan.items():
        if key.startswith("visual."):
            assert value.isnan().all(), key
        else:
            assert torch.equal(value, src[key]), key


def _chat(images, question="What is in this image?", tenant=""):
    parts = (*range(len(images)), question)
    return ChatParams((ChatTurn("user", parts),), tuple(images), max_tokens=8, tenant=tenant)


def test_embedding_items_are_the_towers_output_keyed_by_mm_hash(family):
    a, b = (render(s, 64) for s in sample_scenes(2, "vllm-items", "heldout"))
    chat = family.chat_model()
    n, items = family.vllm_inputs(_chat([a, b]))
    assert n == int(chat.inputs(_chat([a, b]))["input_ids"].shape[1])
    assert set(items) == {0, 1} and items[0].uuid != items[1].uuid
    inputs = chat.inputs(_chat([a]))
    with torch.no_grad():
        want = chat.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output[0]
    assert torch.equal(items[0].image_embeds, want)
    assert items[0].image_embeds.shape == (16, 64) and items[0].image_grid_thw.tolist() == [1, 8, 8]
    hits = family.mm_cache.snapshot().hits
    _, again = family.vllm_inputs(_chat([a]))
    assert again[0].uuid == items[0].uuid and family.mm_cache.snapshot().hits > hits  # the cache served it
    _, other = family.vllm_inputs(_chat([a], tenant="t2"))
    assert other[0].uuid != items[0].uuid  # the tenant is part of the mm-hash


def test_chat_body_sends_embeddings_with_their_uuid_and_no_pixels(family):
    image = render(sample_scenes(1, "vllm-body", "heldout")[0], 64)
    params = _chat([image])
    _, items = family.vllm_inputs(params)
    body = chat_body("default", params, items)
    (message,) = body["messages"]
    embeds, text = message["content"]
    assert embeds["type"] == "image_embeds" and embeds["uuid"] == items[0].uuid
    assert text == {"type": "text", "text": "What is in this image?"}
    loaded = torch.from_numpy(np.load(io.BytesIO(base64.b64decode(embeds["image_embeds"]["image_embeds"]))))
    assert torch.equal(loaded, items[0].image_embeds)
    assert "image_url" not in json.dumps(body)
    assert body["temperature"] == 0.0 and body["stream"] and body["max_tokens"] == 8


def test_a_missing_vllm_environment_is_a_clear_error(tmp_path):
    config = VllmConfig(chat_engine="vllm", vllm_python=tmp_path / "nope" / "python")
    with pytest.raises(VllmStartFailed, match="install_vllm.sh"):
        VllmServer(config, tmp_path, ["default"], tmp_path / "vllm.log").start()


@pytest.mark.parametrize(
    "change, field",
    [
        ({"vllm_block_size": 24}, "vllm_block_size"),
        ({"vllm_port": 70000}, "vllm_port"),
        ({"chat_engine": "x"}, "chat_engine"),
    ],
)
def test_config_refuses_bad_values_naming_them(change, field):
    with pytest.raises(ValueError, match=field):
        VllmConfig(**change)


def test_serve_flag_reaches_the_config():
    from triptych.cli import build_parser

    args = build_parser().parse_args(["serve", "--chat-engine", "vllm", "--vllm-python", "/x/python"])
    config = args.serve_flags.vllm.build(args, args.serve_flags.parser)
    assert config.chat_engine == "vllm" and config.vllm_python == Path("/x/python")
