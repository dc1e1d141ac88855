"""A chat's ``video_url`` part → the clip's bytes and its sampled frames, as prompt parts.

The clip comes from a base64 ``data:`` URL, a ``/v1/files`` id of an MP4 (``file-...``) or the id of a
completed ``/v1/videos`` job (``video_...``); nothing is fetched. Its frames reach the VLM as images,
in order, each after a short text marker of its time in the clip (``<0.5s>``): each frame is an image
item with its own mm-hash (the content hash of its pixels), so a clip asked about again, or a frame
shared with another clip or an image, hits every cache tier an image does.
"""

from __future__ import annotations

from pathlib import Path

from triptych.core.errors import InvalidParam
from triptych.core.media import data_url_bytes
from triptych.core.video_input import Frame, decode_video

#: Frames sampled per second of a clip when the part names no ``fps`` (Qwen2.5-VL's video default).
DEFAULT_FPS = 2.0


def _read_limited(path: Path, max_bytes: int, field: str) -> bytes:
    size = path.stat().st_size
    if size > max_bytes:
        raise InvalidParam(field, f"<{size} bytes>", f"video must be at most {max_bytes} bytes (max_chat_video_bytes)")
    return path.read_bytes()


def clip_bytes(head, url: str, field: str) -> bytes:
    """The clip a part names (``head``: the route's ``ModelHead``)."""
    max_bytes = head.limits.max_chat_video_bytes
    if url.startswith("data:"):
        return data_url_bytes(url, field)
    if url.startswith("file-"):
        found = head.files.get(url) if head.files is not None else None
        if found is None:
            raise InvalidParam(field, url[:80], "no such file (unknown or expired)")
        path, media_type = found
        if media_type != "video/mp4":
            raise InvalidParam(field, url[:80], f"is a {media_type} file, not a video/mp4")
        return _read_limited(path, max_bytes, field)
    if url.startswith("video_"):
        rec = head.videos.store.get(url) if head.videos is not None else None
        if rec is None:
            raise InvalidParam(field, url[:80], "no such video job")
        if rec.status != "completed" or not head.videos.path(url).is_file():
            raise InvalidParam(field, url[:80], f"the video job is {rec.status}, not completed")
        return _read_limited(head.videos.path(url), max_bytes, field)
    raise InvalidParam(
        field,
        url[:40],
        "must be a base64 data: URL, a file-... id or a completed video_... job id (nothing is fetched)",
    )


def video_frames(head, part, field: str) -> list[Frame]:
    """The part's sampled frames (decodes: run it off the event loop)."""
    lim = head.limits
    if part.max_frames is not None and part.max_frames > lim.max_chat_video_frames:
        raise InvalidParam(
            field.rsplit(".", 1)[0] + ".max_frames",
            part.max_frames,
            f"must be at most {lim.max_chat_video_frames} (the server's max_chat_video_frames)",
        )
    limits = lim.video_limits
    data = clip_bytes(head, part.video_url.url, field)
    if len(data) > limits.max_bytes:
        raise InvalidParam(
            field, f"<{len(data)} bytes>", f"video must be at most {limits.max_bytes} bytes (max_chat_video_bytes)"
        )
    return decode_video(data, limits, field, part.fps or DEFAULT_FPS, part.max_frames)


def marker(frame: Frame) -> str:
    """The text before a frame's image: its time in the clip."""
    return f"<{frame.seconds:.1f}s>"
