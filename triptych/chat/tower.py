"""The chat engine's vision-tower calls beyond the inline one a chunk makes: the vision thread
(``ChatEngineConfig.vision_thread``: a prompt's images run through the tower on a thread of their
own, one call for all of a chat's images, while the engine's steps go on decoding, torch ops
releasing the GIL; a chat's chunks take an image once its embeddings are in, ``Towers.ready``), and
a step's tower runs batched into one call (``batch_towers``, ``vision_call_stretch``).

Thread calls run in submission order (one thread), so the chats admitted first get their embeddings
first. Every call is the one ``chunk_embeddings`` makes inline (``get_image_features``, through the
mm-hash cache where installed, under the chat's tenant), so the embeddings are the same tensors."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from triptych.mmcache.cache import tenant_scope

logger = logging.getLogger(__name__)


@dataclass
class Towers:
    """One chat's tower call in flight: the image indices it covers and its future, whose result is
    ``(features by image index, seconds, vision tokens)``."""

    images: tuple[int, ...]
    future: Future

    def ready(self) -> bool:
        return self.future.done()


class VisionThread:
    """One thread running tower calls in submission order (started at the first call)."""

    def __init__(self, model):
        self.model = model
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, prompt, images: list[int], tenant: str) -> Towers:
        """The tower over ``prompt``'s images ``images`` (indices into ``prompt.images``), as one call."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="chat-vision")
        return Towers(tuple(images), self._pool.submit(image_features, self.model, prompt, images, tenant))


def image_features(model, prompt, images: list[int], tenant: str) -> tuple[dict[int, torch.Tensor], float, int]:
    """(image index -> its embeddings, the call's seconds, its vision tokens) for ``images`` of
    ``prompt``, in one tower call; a count that does not match the image's tokens is a ValueError."""
    pieces, seconds, tokens = batch_features(model, [(prompt, j) for j in images], tenant)
    return dict(zip(images, pieces)), seconds, tokens


def batch_features(model, items: list, tenant: str) -> tuple[list[torch.Tensor], float, int]:
    """(each image's embeddings, the call's seconds, its vision tokens) for ``items``
    (``(prompt, image index)`` pairs, of one prompt or several), in one tower call under
    ``tenant``; a count that does not match an image's tokens is a ValueError."""
    start = time.perf_counter()
    spans = [prompt.images[j] for prompt, j in items]
    pixels = torch.cat([prompt.pixel_values[p0:p1] for (prompt, _), (_, _, p0, p1) in zip(items, spans)])
    grid = torch.cat([prompt.image_grid_thw[j : j + 1] for prompt, j in items])
    weight = model.get_input_embeddings().weight
    with torch.no_grad(), tenant_scope(tenant):
        out = model.model.get_image_features(pixels, grid, return_dict=True)
    got = []
    for (_, j), (t0, t1, _, _), piece in zip(items, spans, out.pooler_output):
        piece = piece.to(weight.device, weight.dtype)
        if piece.shape[0] != t1 - t0:
            raise ValueError(
                f"image {j} of the prompt has {t1 - t0} placeholder tokens "
                f"but the vision tower gave {piece.shape[0]} embeddings for it"
            )
        got.append(piece)
    return got, time.perf_counter() - start, sum(t1 - t0 for t0, t1, _, _ in spans)


def start_towers(vision: VisionThread | None, chat) -> None:
    """A prefilling chat's images that still need the tower go to ``vision`` as one call (its
    ``towers``); nothing without a vision thread."""
    if vision is None:
        return
    todo = [j for j, (_, t1, _, _) in enumerate(chat.prompt.images) if t1 > chat.prefilled and j not in chat.features]
    if todo:
        chat.towers = vision.submit(chat.prompt, todo, chat.params.tenant)


def collect_towers(chats, costs, wait: bool) -> list[tuple[object, BaseException]]:
    """The finished tower calls' embeddings into their chats' ``features``, each call observed in
    ``costs`` (``wait``: all of them, waiting for those in flight); returns ``(chat, error)`` for
    each chat whose call failed (that chat fails alone)."""
    failed = []
    for chat in list(chats):
        towers = chat.towers
        if towers is None or not (wait or towers.ready()):
            continue
        chat.towers = None
        try:
            got, seconds, tokens = towers.future.result()
        except (ValueError, RuntimeError) as e:  # this chat's images
            failed.append((chat, e))
            continue
        chat.features.update(got)
        chat.vision_s += seconds
        costs.observe("vision", tokens, seconds, calls=1)
    return failed


def batch_towers(model, costs, batch: list[tuple[object, int]]) -> None:
    """A step's tower runs (``(chat, image index)`` pairs, ``chunks.tower_batch``) as one call,
    their embeddings into each chat's ``features``, the call observed in ``costs``. Should the call
    fail, each chat's own chunk meets its images again and fails alone."""
    if len(batch) < 2:
        return  # one image: its chunk runs it, as without batching
    try:
        pieces, seconds, tokens = batch_features(
            model, [(chat.prompt, j) for chat, j in batch], batch[0][0].params.tenant
        )
    except (ValueError, RuntimeError):
        logger.warning("a batched tower call of %d images failed; each chat's chunk runs its own", len(batch))
        return
    costs.observe("vision", tokens, seconds, calls=1)
    for (chat, j), piece in zip(batch, pieces):
        chat.features[j] = piece
    for chat in dict.fromkeys(chat for chat, _ in batch):
        chat.vision_s += seconds
