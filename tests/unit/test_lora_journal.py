"""Run-time adapters survive a head restart: the catalog a restarted head builds from the same data
dir serves what ``POST /v1/loras`` added (and not what ``DELETE`` removed), checks each again as a
new load would, keeps names bound to their files, and keeps another model's adapters apart."""

from __future__ import annotations

import logging
import shutil
import stat

import pytest

from triptych.core.errors import InvalidParam
from triptych.head.admission import AdmissionLimits
from triptych.head.served import ServedModels
from triptych.lora.catalog import LoraCatalog
from triptych.lora.config import LoraConfig
from triptych.lora.journal import LoraJournal
from triptych.lora.synthetic import write_random_lora


@pytest.fixture(scope="module")
def model_and_root(tiny_model_dir, tmp_path_factory):
    from diffusers import QwenImageTransformer2DModel

    model = tiny_model_dir("qwen-image")
    transformer = QwenImageTransformer2DModel.from_pretrained(f"{model}/transformer")
    root = tmp_path_factory.mktemp("root")
    for i, name in enumerate(("c", "d", "e")):
        write_random_lora(root / name, transformer, ("attn.to_q",), rank=2, seed=i)
    return model, root


def catalog(model, root, data, name="m"):
    return LoraCatalog(LoraConfig(lora_root=str(root)), model, name, journal=LoraJournal(data, name))


def test_a_restarted_head_serves_the_run_time_adapters_it_had(model_and_root, tmp_path):
    model, root = model_and_root
    first = catalog(model, root, tmp_path)
    first.add("c", "c")
    first.add("d", "d")
    assert first.remove("d")

    again = catalog(model, root, tmp_path)
    assert sorted(again.added) == ["c"]
    assert again.check("c") == (("c", 1.0),)
    assert [card["source"] for card in again.cards()] == ["api"]
    assert again.paths((("c", 1.0),)) == (("c", str((root / "c" / "pytorch_lora_weights.safetensors").resolve())),)
    with pytest.raises(InvalidParam, match="not a served adapter"):
        again.check("d")
    # A name keeps its file across restarts: d was d/, so e/ cannot take the name.
    with pytest.raises(InvalidParam, match="was served from"):
        again.add("d", "e")
    assert again.add("d", "d").name == "d"
    mode = stat.S_IMODE(first.journal.path.stat().st_mode)
    assert mode == 0o600, oct(mode)


def test_an_adapter_that_no_longer_passes_is_dropped_and_logged(model_and_root, tmp_path, caplog):
    model, root = model_and_root
    moved = tmp_path / "root"
    shutil.copytree(root, moved)
    first = catalog(model, moved, tmp_path / "data")
    first.add("c", "c")
    first.add("e", "e")
    shutil.rmtree(moved / "c")
    with caplog.at_level(logging.WARNING):
        again = catalog(model, moved, tmp_path / "data")
    assert sorted(again.added) == ["e"]
    assert "'c'" in caplog.text and "not served again" in caplog.text
    # The dropped one is gone from the journal too; a third head does not warn about it again.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert sorted(catalog(model, moved, tmp_path / "data").added) == ["e"]
    assert "not served again" not in caplog.text


def test_another_root_refuses_what_was_under_the_old_one(model_and_root, tmp_path):
    model, root = model_and_root
    catalog(model, root, tmp_path).add("c", "c")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert catalog(model, elsewhere, tmp_path).added == {}


def test_models_keep_their_own_journals_and_a_head_without_a_data_dir_keeps_none(model_and_root, tmp_path):
    model, root = model_and_root

    class Backend:
        class family:
            model_dir = model

    lora = LoraConfig(lora_root=str(root))
    served = ServedModels({"one": Backend(), "two": Backend()}, AdmissionLimits(), lora=lora, data_dir=tmp_path)
    served.by_name["one"].lora.add("c", "c")
    restarted = ServedModels({"one": Backend(), "two": Backend()}, AdmissionLimits(), lora=lora, data_dir=tmp_path)
    assert sorted(restarted.by_name["one"].lora.added) == ["c"]
    assert restarted.by_name["two"].lora.added == {}
    bare = ServedModels({"one": Backend()}, AdmissionLimits(), lora=lora)
    assert bare.by_name["one"].lora.journal is None
