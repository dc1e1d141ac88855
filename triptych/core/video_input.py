"""Decode an uploaded video clip into a few sampled frames (chat about videos).

The clip is checked before it is decoded: byte size first, then the stream's frame size from
ffmpeg's header (``imageio_ffmpeg.read_frames``' first item), then its frame count (ffmpeg counts
without handing frames over). Frames are then read one at a time and only the sampled ones kept,
so a long clip never sits in memory whole. Sampling: at ``fps`` frames per second of the clip, at
most ``max_frames``; more than that is spread uniformly over the whole clip (a long clip is
sampled, not refused).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import numpy as np

from triptych.core.errors import InvalidParam


@dataclass(frozen=True)
class VideoLimits:
    """Upload limits of one clip, checked before its frames are decoded."""

    max_bytes: int = 32 * 1024 * 1024
    max_pixels: int = 1920 * 1080  # one frame's width x height
    max_frames: int = 16  # frames sampled from one clip


@dataclass(frozen=True)
class Frame:
    seconds: float  # where in the clip
    image: object  # RGB PIL image


def sample_indices(count: int, clip_fps: float, fps: float, max_frames: int) -> list[int]:
    """Which of ``count`` frames to keep: ``fps`` per second of the clip, at most ``max_frames``,
    spread uniformly (always at least one frame)."""
    if count < 1:
        return []
    want = int(round(count / clip_fps * fps)) if clip_fps > 0 else max_frames
    want = max(1, min(want, max_frames, count))
    return sorted({int(i) for i in np.linspace(0, count - 1, want).round()})


def decode_video(
    data: bytes, limits: VideoLimits, field: str, fps: float, max_frames: int | None = None
) -> list[Frame]:
    """Clip bytes → its sampled frames in order, refusing oversize or undecodable input with
    ``InvalidParam`` naming ``field`` and the limit. ``max_frames`` (None: the limit's) must be
    within ``limits.max_frames``."""
    import imageio_ffmpeg
    from PIL import Image

    if len(data) > limits.max_bytes:
        raise InvalidParam(field, f"<{len(data)} bytes>", f"video must be at most {limits.max_bytes} bytes")
    if not data:
        raise InvalidParam(field, "<0 bytes>", "video is empty")
    cap = limits.max_frames if max_frames is None else max_frames
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "clip")
        with open(path, "wb") as f:
            f.write(data)
        reader = None
        try:
            reader = imageio_ffmpeg.read_frames(path, pix_fmt="rgb24")
            meta = next(reader)
            w, h = (int(v) for v in meta["size"])
            if w * h > limits.max_pixels:
                raise InvalidParam(field, f"<{w}x{h}>", f"video frames must have at most {limits.max_pixels} pixels")
            count, _ = imageio_ffmpeg.count_frames_and_secs(path)
            clip_fps = float(meta.get("fps") or 0)
            keep = sample_indices(int(count), clip_fps, fps, cap)
            frames, wanted = [], set(keep)
            for i, raw in enumerate(reader):
                if i in wanted:
                    pixels = np.frombuffer(raw, np.uint8).reshape(h, w, 3)
                    frames.append(Frame(i / clip_fps if clip_fps > 0 else float(i), Image.fromarray(pixels.copy())))
                if i >= keep[-1]:
                    break
        except InvalidParam:
            raise
        except (OSError, RuntimeError, ValueError, KeyError, StopIteration, IndexError) as e:
            reason = str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__
            raise InvalidParam(field, f"<{len(data)} bytes>", f"not a decodable video ({reason})") from None
        finally:
            if reader is not None:
                reader.close()
    if not frames:
        raise InvalidParam(field, f"<{len(data)} bytes>", "not a decodable video (no frames)")
    return frames
