"""One model identity: config-file hash of a model directory, whole or per component."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from triptych.accel.teacache_profile import PROFILED_COMPONENTS, load_profile
from triptych.core.identity import model_identity, model_revision

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "triptych" / "assets" / "default"


def make_model(root: Path, layers: int = 1) -> Path:
    (root / "transformer").mkdir(parents=True)
    (root / "vae").mkdir()
    (root / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    (root / "transformer" / "config.json").write_text(json.dumps({"num_layers": layers}))
    (root / "transformer" / "weights.safetensors").write_bytes(b"w" * 8)
    (root / "vae" / "config.json").write_text(json.dumps({"z_dim": 4}))
    return root


def test_revision_hashes_config_paths_and_bytes_sorted(tmp_path):
    root = make_model(tmp_path / "m")
    want = hashlib.sha256()
    for rel in ("model_index.json", "transformer/config.json", "vae/config.json"):
        want.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    assert model_revision(root) == want.hexdigest()[:16]


def test_revision_ignores_weights_and_location(tmp_path):
    root = make_model(tmp_path / "m")
    before = model_revision(root)
    (root / "transformer" / "weights.safetensors").write_bytes(b"retrained")
    assert model_revision(root) == before
    assert model_revision(shutil.copytree(root, tmp_path / "elsewhere" / "other-name")) == before


def test_components_limit_what_is_hashed(tmp_path):
    root = make_model(tmp_path / "m")
    transformer = model_revision(root, ("transformer",))
    (root / "vae" / "config.json").write_text(json.dumps({"z_dim": 8}))
    assert model_revision(root, ("transformer",)) == transformer
    (root / "transformer" / "config.json").write_text(json.dumps({"num_layers": 2}))
    assert model_revision(root, ("transformer",)) != transformer


def test_identity_names_the_directory(tmp_path):
    a, b = make_model(tmp_path / "m"), make_model(tmp_path / "n" / "m", layers=2)
    assert model_identity(a, ("transformer",)) == f"m@{model_revision(a, ('transformer',))}"
    assert model_identity(a, ("transformer",)) != model_identity(b, ("transformer",))


def test_shipped_teacache_profile_names_the_packaged_model():
    profile = load_profile(DEFAULT_MODEL / "teacache" / "qwen-image-20steps.json")
    assert profile.model == model_identity(DEFAULT_MODEL, PROFILED_COMPONENTS)
