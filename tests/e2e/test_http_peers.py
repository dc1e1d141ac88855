"""Clients written for the peers (issue 24, item 14), over a fake backend: their names for the same
knobs are accepted (Qwen-Image's ``true_cfg_scale``, vLLM-Omni's ``num_frames``/``fps``/``width``/
``height`` for videos), a knob given under both names with different values is a 400 naming both,
``n`` takes OpenAI's 1-10, and ``--model-alias`` maps a client's own model name to a served model.
Each fails on the head before this change."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.http_support import FakeBackend, FakeFamily, png_bytes, serve, wait_for
from triptych.head.app import HeadConfig, create_app


def make_server(tmp_path, family=None, **config):
    backend = FakeBackend(family or FakeFamily(tmp_path / "model"))
    return backend, serve(create_app(backend, HeadConfig(data_dir=tmp_path / "data", **config)))


def post(base: str, path: str, **body) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body)


def error_of(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


# ---- model aliases -----------------------------------------------------------------------------
def test_a_model_alias_reaches_the_served_model(tmp_path):
    _, server = make_server(tmp_path, model_aliases=("gpt-image-1=model", "dall-e-3 = model"))
    with server as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        out = client.images.generate(model="gpt-image-1", prompt="a red circle")
        spaced = post(base, "/v1/images/generations", prompt="x", model="dall-e-3")
        unknown = post(base, "/v1/images/generations", prompt="x", model="gpt-image-2")
        listed = httpx.get(f"{base}/v1/models").json()
    assert out.data[0].b64_json and spaced.status_code == 200, spaced.text
    assert "gpt-image-2" in error_of(unknown, 404)["message"]
    assert [m["id"] for m in listed["data"]] == ["model"]


def test_model_aliases_must_name_served_models(tmp_path):
    backend = FakeBackend(FakeFamily(tmp_path / "model"))
    with pytest.raises(ValueError, match="alias gpt-image-1=nope"):
        create_app(backend, HeadConfig(data_dir=tmp_path, model_aliases=("gpt-image-1=nope",)))
    with pytest.raises(ValueError, match="alias model=model"):
        create_app(backend, HeadConfig(data_dir=tmp_path, model_aliases=("model=model",)))
    for bad in (("gpt-image-1",), ("a=model", "a=model"), ("=model",)):
        with pytest.raises(ValueError, match="ALIAS=MODEL"):
            HeadConfig(data_dir=tmp_path, model_aliases=bad)


# ---- n: OpenAI's range -------------------------------------------------------------------------
def test_n_takes_openais_range_by_default(tmp_path):
    backend, server = make_server(tmp_path)
    with server as base:
        ten = post(base, "/v1/images/generations", prompt="x", n=10)
        eleven = post(base, "/v1/images/generations", prompt="x", n=11)
    assert ten.status_code == 200 and len(ten.json()["data"]) == 10, ten.text
    message = error_of(eleven)["message"]
    assert "invalid n=11" in message and "between 1 and 10" in message and "max_n" in message


# ---- true_cfg_scale on a family whose guidance is diffusers' true_cfg_scale --------------------
def qwen_like(tmp_path):
    family = FakeFamily(tmp_path / "model")
    family.true_cfg_is_guidance = True
    return family


def test_true_cfg_scale_is_guidance_scale_where_the_family_says_so(tmp_path):
    backend, server = make_server(tmp_path, qwen_like(tmp_path))
    with server as base:
        alone = post(base, "/v1/images/generations", prompt="x", true_cfg_scale=4.0)
        agreeing = post(base, "/v1/images/generations", prompt="x", true_cfg_scale=3.0, guidance_scale=3.0)
        both = post(base, "/v1/images/generations", prompt="x", true_cfg_scale=4.0, guidance_scale=1.0)
    assert alone.status_code == 200 and agreeing.status_code == 200, (alone.text, agreeing.text)
    assert [(j.params.guidance, j.params.true_cfg) for j in backend.jobs] == [(4.0, 1.0), (3.0, 1.0)]
    error = error_of(both)
    assert error["param"] == "true_cfg_scale" and "guidance_scale=1.0" in error["message"], error


def test_other_families_keep_true_cfg_scale_as_their_own(tmp_path):
    backend, server = make_server(tmp_path)  # FLUX-like: true CFG is its own knob
    with server as base:
        assert post(base, "/v1/images/generations", prompt="x", true_cfg_scale=4.0).status_code == 200
    assert (backend.jobs[0].params.guidance, backend.jobs[0].params.true_cfg) == (None, 4.0)


def test_the_qwen_image_families_take_true_cfg_scale_as_guidance():
    from triptych.families.flux.family import FluxFamily
    from triptych.families.qwenimage.family import QwenImageEditFamily, QwenImageFamily

    assert QwenImageFamily.true_cfg_is_guidance and QwenImageEditFamily.true_cfg_is_guidance
    assert not FluxFamily.true_cfg_is_guidance


# ---- vLLM-Omni's video fields ------------------------------------------------------------------
def video_server(tmp_path, **config):
    return make_server(tmp_path, FakeFamily(tmp_path / "model", is_video=True), **config)


def test_vllm_omnis_video_form_is_accepted(tmp_path):
    """vLLM-Omni's documented example, as multipart fields."""
    backend, server = video_server(tmp_path)
    form = {"prompt": "x", "width": "64", "height": "32", "num_frames": "9", "fps": "8", "num_inference_steps": "3"}
    with server as base:
        resp = httpx.post(f"{base}/v1/videos", files={k: (None, v) for k, v in form.items()})  # multipart
    assert resp.status_code == 200, resp.text
    video = resp.json()
    assert (video["size"], video["frames"], video["seconds"]) == ("64x32", 9, "1.125")  # 9 frames at 8 fps
    job = backend.jobs[0] if backend.jobs else None
    assert job is None or (job.fps, job.params.steps) == (8, 3)


def test_fps_sets_the_clip_and_seconds_counts_in_it(tmp_path):
    backend, server = video_server(tmp_path)
    with server as base:
        resp = post(base, "/v1/videos", prompt="x", seconds=1, fps=4)  # 4 frames -> the next count fake takes: 5
        bad = post(base, "/v1/videos", prompt="x", fps=0)
    assert resp.status_code == 200 and resp.json()["frames"] == 5 and resp.json()["seconds"] == "1.25", resp.text
    assert error_of(bad)["param"] == "fps"


@pytest.mark.parametrize(
    "body, param, needle",
    [
        ({"frames": 5, "num_frames": 9}, "num_frames", "frames=5"),
        ({"size": "32x32", "width": 64, "height": 32}, "width", "size='32x32'"),
        ({"width": 64}, "height", "is needed with width"),
    ],
)
def test_a_knob_given_twice_with_different_values_is_400_naming_both(tmp_path, body, param, needle):
    _, server = video_server(tmp_path)
    with server as base:
        resp = post(base, "/v1/videos", prompt="x", **body)
        same = post(base, "/v1/videos", prompt="x", frames=9, num_frames=9, size="64x32", width=64, height=32)
    error = error_of(resp)
    assert error["param"] == param and needle in error["message"], error
    assert same.status_code == 200 and same.json()["frames"] == 9 and same.json()["size"] == "64x32", same.text


def test_an_image_request_with_a_peers_field_is_told_the_triptych_field(tmp_path):
    _, server = make_server(tmp_path)
    with server as base:
        width = post(base, "/v1/images/generations", prompt="x", width=512)
        per_prompt = post(base, "/v1/images/generations", prompt="x", num_images_per_prompt=2)
    assert "Triptych's field for it is size" in error_of(width)["message"]
    assert "Triptych's field for it is n" in error_of(per_prompt)["message"]


# ---- issue 47: more of the peers' spellings, over one image+edit server and one video server ------
@pytest.fixture(scope="module")
def edit_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peers-edit")
    backend = FakeBackend(FakeFamily(tmp / "model", accepts_image=True))
    with serve(create_app(backend, HeadConfig(data_dir=tmp / "data"))) as base:
        yield backend, base


@pytest.fixture(scope="module")
def i2v_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peers-video")
    backend = FakeBackend(FakeFamily(tmp / "model", is_video=True, accepts_image=True))
    with serve(create_app(backend, HeadConfig(data_dir=tmp / "data"))) as base:
        yield backend, base


def data_url(width=32, height=32, value=128) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(png_bytes(width, height, value)).decode()


def last_condition(backend):
    return backend.jobs[-1].params.image


def test_output_format_takes_any_case_and_jpg(edit_server):
    _, base = edit_server
    upper = post(base, "/v1/images/generations", prompt="x", output_format="PNG", response_format="B64_JSON")
    jpg = post(base, "/v1/images/generations", prompt="x", output_format="Jpg")
    gif = post(base, "/v1/images/generations", prompt="x", output_format="GIF")
    assert upper.status_code == 200 and upper.json()["output_format"] == "png", upper.text
    assert jpg.status_code == 200 and jpg.json()["output_format"] == "jpeg", jpg.text
    assert base64_magic(jpg.json()["data"][0]["b64_json"]) == b"\xff\xd8"  # a JPEG was sent
    assert error_of(gif)["param"] == "output_format"


def base64_magic(b64: str) -> bytes:
    import base64

    return base64.b64decode(b64)[:2]


def edit(base, files=None, **fields):
    parts = {k: (None, str(v)) for k, v in fields.items()}
    return httpx.post(f"{base}/v1/images/edits", files={**parts, **(files or {})})


def test_an_edit_takes_its_image_as_a_data_url_in_url(edit_server):
    backend, base = edit_server
    by_url = edit(base, prompt="x", url=data_url(48, 32, value=7))
    assert by_url.status_code == 200, by_url.text
    assert last_condition(backend).size == (48, 32) and last_condition(backend).getpixel((0, 0)) == (7, 7, 7)
    both = edit(base, {"image": ("a.png", png_bytes())}, prompt="x", url=data_url())
    remote = edit(base, prompt="x", url="http://127.0.0.1/a.png")
    neither = edit(base, prompt="x")
    assert error_of(both)["param"] == "url" and "give image or url" in error_of(both)["message"]
    assert error_of(remote)["param"] == "url" and "data: URL" in error_of(remote)["message"]
    assert error_of(neither)["param"] == "image" and "url" in error_of(neither)["message"]


def test_an_edit_is_sized_to_its_input_unless_size_is_given(edit_server):
    backend, base = edit_server
    own = edit(base, {"image": ("a.png", png_bytes(64, 48))}, prompt="x")
    auto = edit(base, {"image": ("a.png", png_bytes(80, 32))}, prompt="x", size="auto")
    given = edit(base, {"image": ("a.png", png_bytes(64, 48))}, prompt="x", size="32x32")
    assert [r.json()["size"] for r in (own, auto, given)] == ["64x48", "80x32", "32x32"], (own.text, auto.text)
    assert (backend.jobs[-1].params.width, backend.jobs[-1].params.height) == (32, 32)


def test_input_size_fits_the_pixel_limit_and_the_size_step():
    from types import SimpleNamespace

    from triptych.head.admission import AdmissionLimits
    from triptych.head.routes_images import input_size

    def size(w, h, max_pixels=2048 * 2048):
        return input_size(SimpleNamespace(limits=AdmissionLimits(max_pixels=max_pixels)), SimpleNamespace(size=(w, h)))

    assert size(1000, 700) == "992x688"  # floored to 16 per side
    assert size(4000, 1000, max_pixels=1000 * 250) == "992x240"  # scaled to 1000x250, then floored
    assert size(5, 3) == "16x16"  # never below one step


def test_a_video_takes_urlencoded_fields(i2v_server):
    backend, base = i2v_server
    form = {"prompt": "x", "num_frames": "9", "width": "64", "height": "32", "image_reference[image_url]": data_url()}
    resp = httpx.post(f"{base}/v1/videos", data=form)  # application/x-www-form-urlencoded
    assert resp.status_code == 200, resp.text
    assert (resp.json()["frames"], resp.json()["size"]) == (9, "64x32")
    wait_for(lambda: backend.jobs and backend.jobs[-1].request_id == resp.json()["id"], "the job ran")
    assert last_condition(backend).size == (32, 32)


def test_image_reference_is_input_reference(i2v_server):
    backend, base = i2v_server
    upload = httpx.post(
        f"{base}/v1/videos", data={"prompt": "x"}, files={"image_reference": ("a.png", png_bytes(48, 16))}
    )
    as_json = post(base, "/v1/videos", prompt="x", image_reference={"image_url": data_url(16, 48)})
    both = post(
        base,
        "/v1/videos",
        prompt="x",
        image_reference={"image_url": data_url()},
        input_reference={"image_url": data_url()},
    )
    mixed = httpx.post(
        f"{base}/v1/videos",
        data={"prompt": "x", "input_reference[image_url]": data_url()},
        files={"image_reference": ("a.png", png_bytes())},
    )
    assert upload.status_code == 200 and as_json.status_code == 200, (upload.text, as_json.text)
    ids = {upload.json()["id"]: (48, 16), as_json.json()["id"]: (16, 48)}
    wait_for(lambda: ids.keys() <= {j.request_id for j in backend.jobs}, "both jobs ran")
    assert {j.request_id: j.params.image.size for j in backend.jobs if j.request_id in ids} == ids
    for resp in (both, mixed):
        error = error_of(resp)
        assert error["param"] == "image_reference" and "input_reference" in error["message"], error


def test_limit_0_is_an_empty_page_that_says_whether_any_follow(i2v_server):
    _, base = i2v_server
    assert post(base, "/v1/videos", prompt="x").status_code == 200
    newest = httpx.get(f"{base}/v1/videos", params={"limit": 1}).json()["data"][0]["id"]
    some = httpx.get(f"{base}/v1/videos", params={"limit": 0}).json()
    past_newest = httpx.get(f"{base}/v1/videos", params={"limit": 0, "order": "asc", "after": newest}).json()
    too_many = httpx.get(f"{base}/v1/videos", params={"limit": 101})
    assert (some["data"], some["has_more"]) == ([], True)
    assert (past_newest["data"], past_newest["has_more"]) == ([], False)
    assert error_of(too_many)["param"] == "limit"


def test_other_routes_still_refuse_urlencoded_bodies(edit_server):
    _, base = edit_server
    resp = httpx.post(f"{base}/v1/images/generations", data={"prompt": "x"})
    assert resp.status_code == 415 and "multipart/form-data" in resp.json()["error"]["message"]
