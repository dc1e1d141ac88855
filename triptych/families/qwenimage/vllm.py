"""What vLLM needs from a Qwen-Image model to answer its chats: a plain Qwen2.5-VL folder, and each
image of a chat as precomputed embeddings with its mm-hash.

``export_vllm_folder`` writes the folder vLLM loads (config, generation config, weights and
tokenizer from the model's ``text_encoder/`` and ``processor/``; a ``tokenizer_config.json`` whose
processor class is vLLM's ``Qwen2_5_VLProcessor``; a ``preprocessor_config.json`` built from the
processor's image-processor block, ``min_pixels``/``max_pixels`` read from its ``size``). With
``vision="nan"`` the vision tower's weights in vLLM's copy are NaN: vLLM never runs it (it receives
embeddings), and any run would show in the answers.

``embedding_items`` runs the encoder's own vision tower (through ``get_image_features``, where the
mm-hash cache sits) on each image of a chat, so vLLM gets the same embeddings the built-in engine
and image edits use, each with its mm-hash (pixels, patch grid, encoder scope and tenant).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from triptych.core.errors import InvalidParam
from triptych.mmcache.cache import TENANT, content_hash, tenant_scope

#: The processor class vLLM's Qwen2.5-VL support expects (Triptych's own is torchvision-free).
VLLM_PROCESSOR_CLASS = "Qwen2_5_VLProcessor"
WEIGHTS = "model.safetensors"
VISION_PREFIX = "visual."


def export_vllm_folder(model_dir: str | Path, out: str | Path, vision: str = "copy") -> Path:
    """Write (or refresh) the vLLM model folder of ``model_dir`` at ``out``; returns ``out``."""
    if vision not in ("copy", "nan"):
        raise ValueError(f"vision={vision!r} must be copy or nan")
    src, out = Path(model_dir), Path(out)
    encoder, processor = src / "text_encoder", src / "processor"
    if not (encoder / "config.json").is_file() or not (processor / "processor_config.json").is_file():
        raise InvalidParam("model", str(src), "needs text_encoder/ and processor/ (a Qwen2.5-VL) to chat with vLLM")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (encoder / name).is_file():
            shutil.copyfile(encoder / name, out / name)
    for name in ("tokenizer.json", "chat_template.jinja", "vocab.json", "merges.txt"):
        if (processor / name).is_file():
            shutil.copyfile(processor / name, out / name)
    tokenizer_config = json.loads((processor / "tokenizer_config.json").read_text())
    tokenizer_config["processor_class"] = VLLM_PROCESSOR_CLASS
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    image = dict(json.loads((processor / "processor_config.json").read_text())["image_processor"])
    size = image.get("size") or {}
    if "shortest_edge" in size and "longest_edge" in size:  # transformers 5 spells min/max pixels so
        image.setdefault("min_pixels", size["shortest_edge"])
        image.setdefault("max_pixels", size["longest_edge"])
    image["processor_class"] = VLLM_PROCESSOR_CLASS
    (out / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    _write_weights(encoder / WEIGHTS, out / WEIGHTS, vision)
    return out


def _write_weights(src: Path, dst: Path, vision: str) -> None:
    if vision == "copy":
        shutil.copyfile(src, dst)
        return
    from safetensors.torch import load_file, save_file

    tensors = load_file(src)
    poisoned = {k: torch.full_like(v, float("nan")) if k.startswith(VISION_PREFIX) else v for k, v in tensors.items()}
    if not any(k.startswith(VISION_PREFIX) for k in tensors):
        raise ValueError(f"{src} has no {VISION_PREFIX}* weights to replace")
    save_file(poisoned, dst, metadata={"format": "pt"})


@dataclass(frozen=True)
class EmbeddingItem:
    """One image of a chat as vLLM's Qwen2.5-VL takes it precomputed."""

    uuid: str  # the mm-hash: vLLM's prefix cache keys the image's blocks on it
    image_embeds: torch.Tensor  # (image tokens, hidden): the vision tower's merged output
    image_grid_thw: torch.Tensor  # (3,): the patch grid (temporal, height, width)


@torch.no_grad()
def embedding_items(chat_model, params, scope: str) -> tuple[int, dict[int, EmbeddingItem]]:
    """The chat's prompt length in tokens (images expanded) and, per image index it uses, its item.

    Runs the processor as the built-in engine does (so the context check and the pixels are the same)
    and the vision tower once per distinct image, each through the mm-hash cache."""
    with tenant_scope(params.tenant):
        inputs = chat_model.inputs(params)
        order = list(dict.fromkeys(p for t in params.turns for p in t.parts if isinstance(p, int)))
        items: dict[int, EmbeddingItem] = {}
        if order:
            model = chat_model.model
            grids = inputs["image_grid_thw"]
            starts = [0, *torch.cumsum(grids.prod(-1), 0).tolist()]
            # the processor concatenated the patches of each image occurrence in message order
            occurrences = [p for t in params.turns for p in t.parts if isinstance(p, int)]
            for n, index in enumerate(occurrences):
                if index in items:
                    continue
                pixels = inputs["pixel_values"][starts[n] : starts[n + 1]].to(model.device)
                grid = grids[n : n + 1].to(model.device)
                embeds = model.get_image_features(pixels, grid).pooler_output[0]
                mm_hash = content_hash(pixels, grid, extra=f"{scope}|tenant={TENANT.get()}")
                items[index] = EmbeddingItem(mm_hash, embeds.detach().float().cpu().contiguous(), grid[0].cpu())
            assert set(items) == set(order)
    return int(inputs["input_ids"].shape[1]), items
