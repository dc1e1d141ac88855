"""Request parameters on the wire: ``GenerationParams`` ⇄ ``WireParams`` and ``ChatParams`` ⇄ ``ChatTask``.

The control messages themselves live in ``protocol``; this module converts the in-process parameter
objects (PIL images included) to and from their wire structs. Images travel as lossless PNG, so a
condition image arrives pixel for pixel.
"""

from __future__ import annotations

import io

from triptych.control.protocol import ChatMessage, ChatPart, ChatTask, WireParams
from triptych.families.base import GenerationParams


# ---- images travel as lossless PNG ----------------------------------------------------------
def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def rgb_image(data: bytes):
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return im.convert("RGB")


# ---- GenerationParams <-> WireParams ---------------------------------------------------------
def params_to_wire(p: GenerationParams) -> WireParams:
    """``p`` must be resolved (height, width, steps set); the image travels as lossless PNG."""
    return WireParams(
        prompt=p.prompt,
        negative_prompt=p.negative_prompt,
        height=int(p.height),
        width=int(p.width),
        frames=p.frames,
        steps=int(p.steps),
        guidance=p.guidance,
        seed=int(p.seed),
        image_png=None if p.image is None else png_bytes(p.image),
        true_cfg=float(p.true_cfg),
        teacache_threshold=float(p.teacache_threshold),
        tenant=p.tenant,
        lora=[(str(n), float(s)) for n, s in p.lora],
        lora_paths=[(str(n), str(f)) for n, f in p.lora_paths],
        priority=int(p.priority),
    )


def params_from_wire(w: WireParams) -> GenerationParams:
    return GenerationParams(
        prompt=w.prompt,
        negative_prompt=w.negative_prompt,
        height=w.height,
        width=w.width,
        frames=w.frames,
        steps=w.steps,
        guidance=w.guidance,
        seed=w.seed,
        image=None if w.image_png is None else rgb_image(w.image_png),
        true_cfg=w.true_cfg,
        teacache_threshold=w.teacache_threshold,
        tenant=w.tenant,
        lora=tuple((n, s) for n, s in w.lora),
        lora_paths=tuple((n, f) for n, f in w.lora_paths),
        priority=w.priority,
    )


# ---- ChatParams <-> ChatTask -----------------------------------------------------------------
#: Images of at most this many pixels in all encode as PNG faster than a hop
#: to the head's offload pool: the head encodes them where it is, a hop to its offload pool would cost more.
SMALL_PIXELS = 96 * 96


def chat_images(p) -> list[bytes]:
    """The images of ``p`` (a ``ChatParams``) as they travel: lossless PNGs."""
    return [png_bytes(im) for im in p.images]


def small_images(p) -> bool:
    """``chat_images(p)`` is cheap enough to run on an event loop (``SMALL_PIXELS``)."""
    return sum(im.width * im.height for im in p.images) <= SMALL_PIXELS


def chat_to_wire(
    request_id: str, generation: int, p, stream: bool, images_png: list[bytes] | None = None, mm_hints=()
) -> ChatTask:
    """``p``: a checked ``triptych.chat.ChatParams``; images travel as lossless PNG
    (``images_png``: ``chat_images(p)`` made already; None = made here); ``mm_hints``: other encoders
    holding its images' embeddings (``worker.mm_remote``)."""
    messages = [
        ChatMessage(role=t.role, parts=[ChatPart(image=x) if isinstance(x, int) else ChatPart(text=x) for x in t.parts])
        for t in p.turns
    ]
    return ChatTask(
        request_id=request_id,
        generation=generation,
        messages=messages,
        images_png=chat_images(p) if images_png is None else images_png,
        max_tokens=int(p.max_tokens),
        temperature=float(p.temperature),
        top_p=float(p.top_p),
        seed=int(p.seed),
        stream=stream,
        ignore_eos=bool(p.ignore_eos),
        tenant=p.tenant,
        mm_hints=tuple(mm_hints),
    )


def chat_from_wire(task: ChatTask):
    from triptych.chat import ChatParams, ChatTurn

    images = [rgb_image(data) for data in task.images_png]
    turns = tuple(
        ChatTurn(m.role, tuple(x.image if x.image is not None else x.text or "" for x in m.parts))
        for m in task.messages
    )
    return ChatParams(
        turns, tuple(images), task.max_tokens, task.temperature, task.top_p, task.seed, task.ignore_eos, task.tenant
    )
