"""Image affinity on the head: route a request to the encoder that already holds its images.

Every encoder keeps its own encoder layer (processor outputs, vision-tower embeddings by mm-hash),
so an image encoded on encoder A is a hit on A only. The head remembers, per tenant, which encoder
it last sent each image to (a bounded LRU of ``(tenant, image hash) → instance id``; the hash is of
the decoded pixels, so the same picture under any file name or encoding is one key) and prefers
that instance for the next request carrying the image while it has a free slot; when it is busy,
draining, failed this request or gone, the role's dispatch policy chooses as usual. The tenant is
part of every key: one tenant's images never steer another's requests.

It also remembers what the encoders reported holding for those images (``held``: the mm-hashes and
shapes of the embeddings, from ``EncodeDone`` / ``ChatDone``). A request sent to another encoder
than the holder carries ``hints`` naming the holder and its transfer address, so that encoder
fetches the embedding peer to peer instead of running its tower (``worker.mm_remote``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from cachetools import FIFOCache

from triptych.control.dispatch import Instance
from triptych.control.mm_hints import MMHint, MMImage

#: Images remembered (the oldest are forgotten first); 16 Ki entries are about 2 MiB of keys.
MOST = 16384


def image_key(image) -> str:
    """SHA-256 of a PIL image's mode, size and pixels."""
    h = hashlib.sha256(f"{image.mode}|{image.size}|".encode())
    h.update(image.tobytes())
    return h.hexdigest()


class ImageAffinity:
    def __init__(self, most: int = MOST):
        if most < 1:
            raise ValueError(f"most={most}: must be >= 1")
        self.most = most
        # Bounded by entries, the least recently *recorded* forgotten first: a lookup (``prefer``,
        # ``hints``) does not refresh an entry, a new record does (FIFO with re-insertion).
        self._where: FIFOCache[tuple[str, str], str] = FIFOCache(most)
        #: (tenant, image hash) → (instance, the embeddings it reported for the request carrying it)
        self._held: FIFOCache[tuple[str, str], tuple[str, tuple[MMImage, ...]]] = FIFOCache(most)
        self.preferred = 0  # requests routed to the instance holding their images (tests, describe)

    def __len__(self) -> int:
        return len(self._where)

    def keys(self, tenant: str, images: Iterable) -> list[tuple[str, str]]:
        return [(tenant, image_key(im)) for im in images if im is not None]

    def prefer(
        self, keys: list[tuple[str, str]], pool: list[Instance], exclude=frozenset(), chat: bool = False
    ) -> Instance | None:
        """The free instance of ``pool`` (``chat``: with a free chat slot) that holds the most of these
        images, or None."""
        votes: dict[str, int] = {}
        for key in keys:
            where = self._where.get(key)
            if where is not None:
                votes[where] = votes.get(where, 0) + 1
        by_id = {
            i.instance_id: i
            for i in pool
            if (i.chat_free if chat else i.free) > 0 and not i.draining and i.instance_id not in exclude
        }
        held = [(n, iid) for iid, n in votes.items() if iid in by_id]
        if not held:
            return None
        self.preferred += 1
        return by_id[max(held)[1]]

    def record(self, keys: list[tuple[str, str]], instance_id: str) -> None:
        """These images are (about to be) encoded on ``instance_id``."""
        for key in keys:
            self._where[key] = instance_id

    def held(self, keys: list[tuple[str, str]], instance_id: str, images: tuple[MMImage, ...]) -> None:
        """``instance_id`` reports holding ``images`` (embeddings) for a request with these image keys.

        NOTE: a request's images and its embeddings are not paired one to one here (a chat may
        refer to an image twice, or not at all); each key remembers all of them, and the encoder a
        hint goes to uses only a hint whose mm-hash is the one it computed itself."""
        if not images:
            return
        for key in keys:
            self._held[key] = (instance_id, images)

    def hints(self, keys: list[tuple[str, str]], target: str, addresses: dict[str, str]) -> tuple[MMHint, ...]:
        """Hints for a request with these image keys sent to ``target``: the embeddings another live
        encoder (``addresses``: instance id → transfer address) reported holding, one per mm-hash."""
        out: dict[str, MMHint] = {}
        for tenant, image in keys:
            holder, images = self._held.get((tenant, image), (None, ()))
            if holder is None or holder == target or holder not in addresses:
                continue
            for im in images:
                out.setdefault(
                    im.mm_hash,
                    MMHint(holder=holder, address=addresses[holder], tenant=tenant, mm_hash=im.mm_hash, spec=im.spec),
                )
        return tuple(out.values())

    def forget(self, instance_id: str) -> None:
        """The instance left (its caches went with it)."""
        for key in [k for k, v in self._where.items() if v == instance_id]:
            del self._where[key]
        for key in [k for k, (v, _) in self._held.items() if v == instance_id]:
            del self._held[key]
