"""The encoder's mm-hash cache vs the plain encode stage (diffusers' own calls), same weights, same run.

Qwen-Image-Edit's encode stage is diffusers' ``encode_prompt`` for the prompt and again for the
negative prompt (each runs the Qwen2.5-VL vision tower on the condition image) plus the VAE encode
of that image. Two encoder families are built on one seeded model: one with the mm-hash cache off
(exactly the pipeline's calls) and one with it on. They alternate on the same requests:
- ``new image``: an image neither has seen (the cache saves the second branch's vision pass);
- ``same image again``: an image seen before (both branches hit);
- ``chat about the edited image``: a one-token chat (``ChatModel``, the understanding path on the same
  encoder) about the image the edit just encoded: the prefill's vision pass hits the edit's entry.
  The images are square at the condition area, so the edit's resize leaves them as they are and
  chat and edit hand the processor the same pixels.
Reported: best process CPU time (one thread) of each and the ratio cached / plain (lower is
better), plus a bit-identity check of the conditioning. Prints a markdown table.

The packaged test sizes bound the processor to 16 vision tokens and a 2-layer, 16-64-wide vision
tower, far from Qwen2.5-VL's (32 layers x 1280, ~1,300 tokens for the pipeline's 1 MP condition);
``--vision-layers/--vision-dim`` build a heavier tower that sees the whole condition image.

    python benchmarks/mm_cache.py [--size tiny|small] [--area 262144] [--repeats 3]
                                  [--vision-layers 8 --vision-dim 256]

``--encoder-layer`` measures the encoder layer instead, on the packaged edit model through the
encoder runner (``benchmarks/encoder_layer.py``): vision-tower forwards for 8 concurrent requests
with 8 distinct images (4 chats, 4 edits) with and without cross-request batching, the largest
difference from each request alone, two encoders with and without the head's image affinity, and a
soak of ``--soak`` chats with images (RSS, cache bytes, references left).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()
clock = time.process_time

from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit  # noqa: E402

from triptych.families.base import GenerationParams, Role  # noqa: E402
from triptych.families.qwenimage import tiny  # noqa: E402


def image(seed: int):
    from PIL import Image

    side = int(AREA**0.5)
    return Image.fromarray((np.random.RandomState(seed).rand(side, side, 3) * 255).astype("uint8"))


AREA = 512 * 512


def family(model_dir, cache_mb: str):
    from triptych.families.qwenimage.family import QwenImageEditFamily
    from triptych.mmcache.cache import MMCacheConfig

    return QwenImageEditFamily(model_dir, roles=(Role.ENCODER,), mm_cache_config=MMCacheConfig(max_mb=float(cache_mb)))


def timed(fn):
    t = clock()
    out = fn()
    return clock() - t, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--area", type=int, default=512 * 512, help="condition image area (the pipeline's: 1048576)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vision-layers", type=int, help="vision tower depth (default: the size's)")
    ap.add_argument("--vision-dim", type=int, help="vision tower width (default: the size's)")
    ap.add_argument("--encoder-layer", action="store_true", help="measure the encoder layer (see above)")
    ap.add_argument("--soak", type=int, default=1000, help="chats in the encoder layer's soak")
    args = ap.parse_args(argv)
    if args.encoder_layer:
        from encoder_layer import main as layer_main  # this folder is on the path of a script

        return layer_main(args.soak)
    global AREA
    AREA = args.area
    original = pipeline_qwenimage_edit.calculate_dimensions
    pipeline_qwenimage_edit.calculate_dimensions = lambda area, ratio: original(args.area, ratio)
    from triptych.chat import ChatParams, ChatTurn

    rows = {"new image": ([], []), "same image again": ([], []), "chat about the edited image": ([], [])}
    identical = True
    with tempfile.TemporaryDirectory() as tmp:
        dims = tiny.SIZES[args.size]
        if args.vision_layers or args.vision_dim:
            dims = dataclasses.replace(
                dims,
                vision_layers=args.vision_layers or dims.vision_layers,
                vision_dim=args.vision_dim or dims.vision_dim,
                image_max_pixels=args.area,
            )
        model = tiny.save_model(
            tiny.build_components(dims, seed=0, edit=True),
            tmp,
            {"height": 64, "width": 64, "steps": 4, "guidance": 4.0},
        )
        plain, cached = family(model, "0"), family(model, "1024")
        base = GenerationParams(prompt="make the circle green", negative_prompt="blurry", guidance=4.0, seed=0)
        for r in range(args.repeats + 1):  # round 0 is a warm-up
            p = cached.resolve(base.replace(image=image(r)))
            for case in list(rows)[:2]:  # a new image first, then the same one again
                t_plain, want = timed(lambda: plain.encode(p).flat())
                t_cached, got = timed(lambda: cached.encode(p).flat())
                identical &= got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
                if r:
                    rows[case][0].append(t_plain)
                    rows[case][1].append(t_cached)
            ask = ChatParams((ChatTurn("user", (0, "What is in this image?")),), (p.image,), max_tokens=1)
            t_plain, want = timed(lambda: plain.chat_model().run(ask))
            t_cached, got = timed(lambda: cached.chat_model().run(ask))
            identical &= got.text == want.text
            if r:
                rows["chat about the edited image"][0].append(t_plain)
                rows["chat about the edited image"][1].append(t_cached)
    stats = cached.mm_cache.stats
    print(
        f"qwen-image-edit {args.size} (vision tower {dims.vision_layers} layers x {dims.vision_dim}), "
        f"condition area {args.area} px, CFG (prompt + negative), "
        f"best of {args.repeats}; conditioning bit-identical and chat answers equal: {identical}; cache hits {stats.hits}, "
        f"misses {stats.misses}\n"
    )
    print("| request | plain CPU ms | cached CPU ms | ratio |")
    print("|---|---|---|---|")
    for case, (t_plain, t_cached) in rows.items():
        a, b = min(t_plain), min(t_cached)
        print(f"| {case} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f} |")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
