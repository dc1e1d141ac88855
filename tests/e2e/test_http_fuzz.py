"""Schema fuzzing: bodies, queries and paths generated from the served OpenAPI schema never give a 5xx,
and every error is in OpenAI's shape. The head validates against the real tiny FLUX family
(weightless); a fake backend returns images without compute.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from tests.e2e.http_support import FakeBackend, FakeFamily, serve  # noqa: E402
from triptych.families.registry import load_family  # noqa: E402
from triptych.head.admission import AdmissionLimits  # noqa: E402
from triptych.head.app import HeadConfig, create_app  # noqa: E402

LIMITS = AdmissionLimits(max_pixels=64 * 64, max_n=2, max_steps=4, max_frames=9, max_queued_requests=8)


@pytest.fixture(scope="module")
def base_url(tiny_model_dir, tmp_path_factory):
    family = load_family(tiny_model_dir("flux"), roles=())
    app = create_app(FakeBackend(family), HeadConfig(data_dir=tmp_path_factory.mktemp("fuzz"), limits=LIMITS))
    with serve(app) as base:
        yield base


@pytest.fixture(scope="module")
def api_schema(base_url):
    return schemathesis.openapi.from_url(f"{base_url}/openapi.json")


@pytest.fixture(scope="module")
def video_base_url(tiny_model_dir, tmp_path_factory):
    try:
        family = load_family(tiny_model_dir("wan-t2v"), roles=())
    except (ImportError, ValueError):
        family = FakeFamily(tmp_path_factory.mktemp("fake-video"), is_video=True)
    app = create_app(FakeBackend(family), HeadConfig(data_dir=tmp_path_factory.mktemp("fuzz-video"), limits=LIMITS))
    with serve(app) as base:
        yield base


def check(case, base_url) -> None:
    response = case.call(base_url=base_url, timeout=30)
    assert response.status_code < 500, f"{case.method} {case.path}: {response.status_code} {response.text[:300]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text


def test_no_5xx_and_openai_error_shape(api_schema, base_url):
    # NOTE: schemathesis' pytest plugin (from_fixture) breaks on pytest 9; drive hypothesis directly.
    operations = [op.ok() for op in api_schema.get_all_operations()]
    assert len(operations) >= 10
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def fuzz(case):
            check(case, base_url)

        fuzz()


def test_video_create_on_a_video_model_never_5xx(video_base_url):
    schema = schemathesis.openapi.from_url(f"{video_base_url}/openapi.json").include(path="/v1/videos", method="POST")
    (operation,) = [op.ok() for op in schema.get_all_operations()]
    for media_type in ("application/json", "multipart/form-data"):

        @given(case=operation.as_strategy(media_type=media_type))
        @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def fuzz(case):
            check(case, video_base_url)

        fuzz()


@pytest.fixture(scope="module")
def chat_base_url(tmp_path_factory):
    """The real chat path on the packaged default edit model (answers capped at 8 tokens)."""
    from triptych.control.backend import InProcessBackend
    from triptych.families.models import PACKAGED_DEFAULT

    family = load_family(PACKAGED_DEFAULT.parent / "default_edit")
    limits = AdmissionLimits(max_chat_tokens=8, max_chat_images=2, max_upload_pixels=256 * 256)
    app = create_app(InProcessBackend(family), HeadConfig(data_dir=tmp_path_factory.mktemp("fuzz-chat"), limits=limits))
    with serve(app) as base:
        yield base


def test_chat_on_a_vlm_model_never_5xx(chat_base_url):
    schema = schemathesis.openapi.from_url(f"{chat_base_url}/openapi.json").include(path="/v1/chat/completions")
    (operation,) = [op.ok() for op in schema.get_all_operations()]

    @given(case=operation.as_strategy())
    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def fuzz(case):
        check(case, chat_base_url)

    fuzz()
