"""A corpus of malformed uploads and data URLs against every route that takes an image: never a 5xx,
always a 4xx in OpenAI's error shape that names the field.

Routes: ``/v1/images/edits`` (multipart ``image``) on the packaged default edit model (weightless:
the head validates, a fake backend would answer), ``/v1/videos`` (multipart ``input_reference`` and
JSON ``input_reference.image_url``) on a tiny Wan I2V model, and ``/v1/chat/completions``
(``image_url`` data URLs) on the same edit model's VLM. The corpus: empty, a few bytes, text, HTML,
SVG, a truncated PNG and JPEG, a PNG with a corrupt chunk CRC, a PNG header claiming 100k×100k
pixels (decompression bomb), a PNG larger than the upload limit, a 1×1 PNG, an animated GIF's
garbage tail, a zip, a PDF; data URLs without ``base64``, with invalid base64, with a non-image MIME
type, remote ``http``/``file`` URLs (the server fetches nothing), a 4 MB string of ``A``.

A clean 1×1 image is valid input (no 4xx expected; included to show the corpus reaches the decoder
and not only the framing checks).
"""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest
from PIL import Image

from tests.e2e.http_support import FakeBackend, serve
from triptych.families.registry import load_family
from triptych.head.admission import AdmissionLimits
from triptych.head.app import HeadConfig, create_app

LIMITS = AdmissionLimits(max_upload_bytes=64 * 1024, max_upload_pixels=512 * 512, max_n=1, max_queued_requests=4)


def _png(width: int = 16, height: int = 16) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(buf, "PNG")
    return buf.getvalue()


def _jpeg() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 200, 10)).save(buf, "JPEG")
    return buf.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _bomb_header() -> bytes:
    """A valid PNG signature and IHDR claiming 100,000 × 100,000 pixels, with a tiny IDAT."""
    ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 64)) + _chunk(b"IEND", b"")
    )


def _bad_crc() -> bytes:
    data = bytearray(_png())
    data[29] ^= 0xFF  # inside IHDR's CRC
    return bytes(data)


def _noisy_png_over_limit() -> bytes:
    import numpy as np

    buf = io.BytesIO()
    Image.fromarray(np.random.RandomState(0).randint(0, 256, (200, 200, 3), dtype=np.uint8)).save(buf, "PNG")
    assert len(buf.getvalue()) > LIMITS.max_upload_bytes
    return buf.getvalue()


BAD_FILES = {
    "empty": b"",
    "few-bytes": b"\x89P",
    "text": b"hello, I am not an image",
    "html": b"<html><body>hi</body></html>",
    "svg": b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>',
    "truncated-png": _png()[:40],
    "truncated-jpeg": _jpeg()[:60],
    "bad-crc-png": _bad_crc(),
    "bomb-png": _bomb_header(),
    "over-limit-png": _noisy_png_over_limit(),
    "gif-garbage": b"GIF89a" + b"\xff" * 50,
    "zip": b"PK\x03\x04" + b"\0" * 40,
    "pdf": b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<<>>\nendobj\n",
}
BAD_URLS = {
    "no-base64": "data:image/png,iVBORw0KGgo=",
    "bad-base64": "data:image/png;base64,!!!not base64!!!",
    "text-mime": "data:text/plain;base64," + base64.b64encode(b"hello").decode(),
    "empty-payload": "data:image/png;base64,",
    "http": "http://127.0.0.1:1/a.png",
    "file": "file:///etc/passwd",
    "huge": "data:image/png;base64," + "A" * (4 * 1024 * 1024),
    **{f"file-{k}": "data:image/png;base64," + base64.b64encode(v).decode() for k, v in BAD_FILES.items()},
}


def _check(response, field_hint: str, case: str) -> None:
    assert response.status_code < 500, f"{case}: {response.status_code} {response.text[:300]}"
    assert 400 <= response.status_code < 500, f"{case}: malformed input was accepted ({response.status_code})"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, f"{case}: {error}"
    named = f"{error['param']} {error['message']}"
    assert field_hint in named, f"{case}: the error does not name {field_hint!r}: {error}"


@pytest.fixture(scope="module")
def edit_url(tmp_path_factory):
    from triptych.families.models import PACKAGED_DEFAULT

    family = load_family(PACKAGED_DEFAULT.parent / "default_edit", roles=())
    app = create_app(FakeBackend(family), HeadConfig(data_dir=tmp_path_factory.mktemp("malformed"), limits=LIMITS))
    with serve(app) as base:
        yield base


@pytest.fixture(scope="module")
def video_url(tiny_model_dir, tmp_path_factory):
    family = load_family(tiny_model_dir("wan-i2v"), roles=())
    app = create_app(FakeBackend(family), HeadConfig(data_dir=tmp_path_factory.mktemp("malformed-v"), limits=LIMITS))
    with serve(app) as base:
        yield base


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_edit_uploads(edit_url, case):
    import httpx

    files = {"image": ("x.png", BAD_FILES[case], "image/png")}
    r = httpx.post(f"{edit_url}/v1/images/edits", data={"prompt": "make it blue", "size": "64x64"}, files=files)
    _check(r, "image", case)


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_video_reference_uploads(video_url, case):
    import httpx

    files = {"input_reference": ("x.png", BAD_FILES[case], "image/png")}
    data = {"prompt": "a circle moving", "size": "32x32", "seconds": "1"}
    _check(httpx.post(f"{video_url}/v1/videos", data=data, files=files), "input_reference", case)


@pytest.mark.parametrize("case", sorted(BAD_URLS))
def test_video_reference_data_urls(video_url, case):
    import httpx

    body = {
        "prompt": "a circle moving",
        "size": "32x32",
        "seconds": "1",
        "input_reference": {"image_url": BAD_URLS[case]},
    }
    _check(httpx.post(f"{video_url}/v1/videos", json=body), "input_reference", case)


@pytest.mark.parametrize("case", sorted(BAD_URLS))
def test_chat_data_urls(edit_url, case):
    import httpx

    content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": BAD_URLS[case]}}]
    body = {"model": "default_edit", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    _check(httpx.post(f"{edit_url}/v1/chat/completions", json=body, timeout=30), "image_url", case)


def test_a_clean_tiny_image_reaches_the_decoder_and_passes(edit_url):
    """The corpus's control: the same route accepts a clean 1x1 PNG (so the refusals above are about
    the bytes, not about the request's framing)."""
    import httpx

    files = {"image": ("x.png", _png(1, 1), "image/png")}
    r = httpx.post(f"{edit_url}/v1/images/edits", data={"prompt": "make it blue", "size": "64x64"}, files=files)
    assert r.status_code == 200, r.text[:300]
