"""Several models behind one head: which served model a request goes to, the ``model`` label on every
metric, ``serve --model`` parsing and the built-in model list. Fakes only (no weights, no workers)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from starlette.exceptions import HTTPException

from triptych.control.metrics import Metrics, render_labelled
from triptych.head.admission import AdmissionLimits
from triptych.head.served import ServedModels


class Fam:
    def __init__(self, model_dir, video=False, accepts=False, requires=False, chat=False):
        self.name, self.model_dir = "fake", Path(model_dir)
        self.is_video, self.accepts_image, self.requires_image, self.supports_chat = video, accepts, requires, chat


class Backend:
    def __init__(self, family):
        self.family = family
        self.metrics = Metrics()


@pytest.fixture
def models(tmp_path):
    backends = {
        "video": Backend(Fam(tmp_path, video=True)),
        "t2i": Backend(Fam(tmp_path, chat=True)),
        "edit": Backend(Fam(tmp_path, accepts=True, requires=True, chat=True)),
    }
    return ServedModels(backends, AdmissionLimits())


def test_a_missing_model_goes_to_the_first_that_does_the_job(models):
    picked = {kind: models.pick(None, kind).name for kind in ("image", "edit", "video", "chat")}
    assert picked == {"image": "t2i", "edit": "edit", "video": "video", "chat": "t2i"}


def test_a_named_model_is_taken_even_for_another_job_its_family_then_refuses(models):
    assert models.pick("edit", "image").name == "edit"


def test_an_unknown_model_is_a_404_naming_the_served_ids(models):
    with pytest.raises(HTTPException) as err:
        models.pick("nope", "image")
    assert err.value.status_code == 404
    assert "'nope'" in err.value.detail and all(f"'{n}'" in err.value.detail for n in ("video", "t2i", "edit"))


def test_a_model_that_generates_and_edits_takes_both_jobs_and_says_so(tmp_path):
    both = ServedModels(
        {"vid": Backend(Fam(tmp_path, video=True)), "both": Backend(Fam(tmp_path, accepts=True))}, AdmissionLimits()
    )
    assert both.pick(None, "image").name == both.pick(None, "edit").name == "both"
    assert [m.kind for m in both] == ["video", "image+edit"]
    assert both.by_name["both"].card().kind == "image+edit"


def test_no_model_of_the_kind_falls_back_to_the_first(tmp_path):
    only = ServedModels({"t2i": Backend(Fam(tmp_path))}, AdmissionLimits())
    assert only.pick(None, "edit").name == "t2i"  # whose own check says it is text-only


def test_each_model_has_its_own_admission_counter(models):
    models.pick("t2i", "image").admission.reserve(1)
    assert [m.admission.in_flight for m in models] == [0, 1, 0]


def test_cards_say_kind_and_chat(models):
    cards = {m.name: (m.card().kind, m.card().chat) for m in models}
    assert cards == {"video": ("video", False), "t2i": ("image", True), "edit": ("image-edit", True)}


def test_trained_sizes_warn_only_off_the_list(tmp_path):
    (tmp_path / "triptych.json").write_text('{"trained_sizes": ["64x64", "32x48"]}')
    m = ServedModels({"m": Backend(Fam(tmp_path))}, AdmissionLimits()).first
    assert m.size_warning(64, 64) is None and m.size_warning(32, 48) is None
    assert "64x64, 32x48" in m.size_warning(256, 256) and "256x256" in m.size_warning(256, 256)
    bare = tmp_path / "real"
    bare.mkdir()
    assert ServedModels({"r": Backend(Fam(bare))}, AdmissionLimits()).first.size_warning(256, 256) is None


def test_every_series_carries_its_model_and_unrouted_outcomes_are_model_empty():
    a, b, head = Metrics(), Metrics(), Metrics()
    a.record_request("/v1/images/generations", "success", 0.1)
    b.record_request("/v1/videos", "success")
    head.record_request("/v1/images/generations", "invalid")
    text = render_labelled({"img": a, "vid": b}, unrouted=head).decode()
    assert 'triptych_requests_total{endpoint="/v1/images/generations",model="img",outcome="success"} 1.0' in text
    assert 'triptych_requests_total{endpoint="/v1/videos",model="vid",outcome="success"} 1.0' in text
    assert 'triptych_requests_total{endpoint="/v1/images/generations",model="",outcome="invalid"} 1.0' in text
    series = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert series and all(re.search(r'model="(img|vid)?"', line) for line in series)
    assert not any('model=""' in line for line in series if not line.startswith("triptych_requests"))
    assert text.count("# TYPE triptych_requests_total counter") == 1  # one family, both models' series


def test_serve_model_flags_name_each_model(tmp_path):
    from triptych.cli.serve import served_models
    from triptych.core.errors import InvalidParam

    a, b = tmp_path / "flux-a", tmp_path / "wan"
    assert served_models([str(a), f"vid={b}"]) == {"flux-a": a, "vid": b}
    with pytest.raises(InvalidParam):
        served_models([str(a), f"flux-a={b}"])


def test_builtin_models_are_the_packaged_image_and_edit_model_and_the_video_model_present(tmp_path, monkeypatch):
    """The packaged default generates and edits (one model, one set of pools): its edit-only
    directory, which links the same weights, is not served beside it."""
    from triptych.families import models
    from triptych.families.qwenimage.generate_edit import QwenImageGenerateEditFamily
    from triptych.families.registry import family_class

    if not (models.PACKAGED_DEFAULT / "model_index.json").is_file():
        pytest.skip("no packaged default model")
    monkeypatch.setattr(models, "PACKAGED_VIDEO", tmp_path / "video")
    assert models.builtin_models() == {"default": models.PACKAGED_DEFAULT}
    assert family_class(models.PACKAGED_DEFAULT) is QwenImageGenerateEditFamily
    (tmp_path / "video").mkdir()
    (tmp_path / "video" / "model_index.json").write_text("{}")
    assert list(models.builtin_models()) == ["default", "video"]
