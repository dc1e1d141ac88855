"""The adapter store's contract, one behaviour each, with fake adapters of known byte sizes; and the
adapter format's checks (pairs, shapes, scales from metadata)."""

from __future__ import annotations

import pytest
import torch

from triptych.core.errors import InvalidParam
from triptych.lora.adapter import Adapter, LoraFormatError, LoraModule, check_fits, from_state_dict
from triptych.lora.config import LoraConfig, lora_args
from triptych.lora.formats import LoraFormat
from triptych.lora.rows import segments_of
from triptych.lora.store import AdapterStore, LoraBudgetError


def fake(name: str, kib: int) -> Adapter:
    # float32 A (1, 128*kib) and B (128*kib, 1): 256 four-byte elements per KiB
    n = 256 * kib
    return Adapter(name, {"m": LoraModule(torch.zeros(1, n // 2), torch.zeros(n // 2, 1), 1.0)})


def store(budget_kib: int, loads: list | None = None) -> AdapterStore:
    sizes = {"a": 4, "b": 4, "c": 4, "big": 16}
    loads = loads if loads is not None else []
    return AdapterStore(budget_kib * 1024, lambda n: loads.append(n) or fake(n, sizes[n]))


def test_second_acquire_is_a_hit_and_does_not_reload():
    loads = []
    s = store(16, loads)
    s.acquire("r1", ["a"])
    s.acquire("r2", ["a"])
    assert loads == ["a"] and (s.stats.hits, s.stats.misses, s.stats.loaded) == (1, 1, 1)


def test_unused_adapter_is_evicted_least_recently_used_first_only_when_room_is_needed():
    s = store(8)
    s.acquire("r1", ["a"]), s.release("r1")
    s.acquire("r2", ["b"]), s.release("r2")
    assert s.loaded() == ["a", "b"] and s.stats.evicted == 0
    s.acquire("r3", ["c"])
    assert s.loaded() == ["b", "c"] and s.stats.evicted == 1


def test_adapter_in_use_is_never_evicted_and_a_load_without_room_fails_cleanly():
    s = store(8)
    s.acquire("r1", ["a"])
    s.acquire("r2", ["b"])
    with pytest.raises(LoraBudgetError, match="held by running requests"):
        s.acquire("r3", ["c"])
    assert s.loaded() == ["a", "b"] and s.stats.resident_bytes == 8 * 1024
    s.release("r1")
    s.acquire("r3", ["c"])
    assert s.loaded() == ["b", "c"]


def test_failed_acquire_releases_what_it_took():
    s = store(8)
    with pytest.raises(LoraBudgetError):
        s.acquire("r1", ["a", "big"])
    s.acquire("r2", ["b"])  # "a" is unreferenced again: it may go
    s.acquire("r3", ["c"])
    assert s.loaded() == ["b", "c"]


def test_scale_comes_from_peft_metadata_else_is_one():
    sd = {
        "transformer.x.lora_A.weight": torch.zeros(4, 3),
        "transformer.x.lora_B.weight": torch.zeros(5, 4),
    }
    assert from_state_dict("n", sd).modules["x"].scale == 1.0
    meta = {"transformer.r": 4, "transformer.lora_alpha": 8}
    assert from_state_dict("n", sd, meta).modules["x"].scale == 2.0


@pytest.mark.parametrize(
    "sd, match",
    [
        ({"text_encoder.x.lora_A.weight": torch.zeros(1, 1)}, "the model's diffusers LoRA format has no text-encoder"),
        ({"unet.x.lora_A.weight": torch.zeros(1, 1)}, "'unet.x.lora_A.weight' is not a LoRA key of the model's"),
        ({"transformer.x.lora_A.weight": torch.zeros(2, 3)}, "without its pair"),
        (
            {"transformer.x.lora_A.weight": torch.zeros(2, 3), "transformer.x.lora_B.weight": torch.zeros(5, 4)},
            r"lora_A \(2, 3\) and lora_B \(5, 4\)",
        ),
    ],
)
def test_malformed_state_dicts_are_refused_naming_the_key(sd, match):
    with pytest.raises(LoraFormatError, match=match):
        from_state_dict("n", sd)


def test_check_fits_names_module_and_both_shapes():
    a = from_state_dict(
        "n", {"transformer.x.lora_A.weight": torch.zeros(2, 3), "transformer.x.lora_B.weight": torch.zeros(5, 2)}
    )
    check_fits(a, {"x": (5, 3)})
    with pytest.raises(LoraFormatError, match=r"'x' is \(5 out, 4 in\).*lora_A \(2, 3\)"):
        check_fits(a, {"x": (5, 4)})
    with pytest.raises(LoraFormatError, match="'x' is not a Linear"):
        check_fits(a, {"y": (5, 3)})


def test_segments_gather_only_rows_that_use_an_adapter():
    a, b = fake("a", 1), fake("b", 1)
    segs = segments_of([((a, 1.0),), ((a, 1.0), (b, 0.5)), ()])
    assert [s.adapter.name for s in segs] == ["a", "b"]
    assert segs[0].rows.tolist() == [0, 1] and segs[1].rows.tolist() == [1]
    assert segments_of([((a, 2.0),), ((a, 2.0),)])[0].rows is None  # every row, one scale: no gather


def test_config_refuses_malformed_and_repeated_names():
    with pytest.raises(ValueError, match="NAME=DIR"):
        LoraConfig(lora=("nodir",))
    with pytest.raises(ValueError, match="repeat"):
        LoraConfig(lora=("a=/x", "a=/y"))


def test_generate_lora_args_take_a_folder_and_an_optional_scale(tmp_path):
    (tmp_path / "style").mkdir()
    config, spec = lora_args([f"{tmp_path / 'style'}:0.5"])
    assert spec == (("style", 0.5),) and config.adapters == {"style": tmp_path / "style"}
    assert lora_args([str(tmp_path / "style")])[1] == (("style", 1.0),)
    with pytest.raises(InvalidParam, match="scale must be between"):
        lora_args([f"{tmp_path / 'style'}:9"])
    with pytest.raises(InvalidParam, match="adapter folder or .safetensors file"):
        lora_args([str(tmp_path / "missing")])


def test_generate_lora_args_resolve_a_bare_name_to_the_adapter_the_model_ships():
    from triptych.families.models import default_model_dir

    shipped = default_model_dir() / "lora"
    config, spec = lora_args(["invert:0.5", "resize"], shipped=shipped)
    assert spec == (("invert", 0.5), ("resize", 1.0))
    assert config.adapters == {"invert": shipped / "invert", "resize": shipped / "resize"}
    with pytest.raises(InvalidParam, match=r"an adapter the model ships: \['invert', 'resize'\]"):
        lora_args(["outline"], shipped=shipped)
    with pytest.raises(InvalidParam, match="adapter folder or .safetensors file"):
        lora_args(["invert"])  # without the model's folder a bare name is no adapter


def test_each_family_applies_lora_to_components_its_diffusers_format_carries():
    from triptych.families.registry import adapters
    from triptych.lora.formats import LoraFormat

    fmts = {cls.__name__: LoraFormat.of(cls) for cls in adapters()}
    assert len(fmts) == 6  # five pipeline classes and the generate+edit variant
    for name, fmt in fmts.items():
        assert set(fmt.applied) <= set(fmt.loadable), name  # never a component diffusers would not load
    with_te = {name for name, f in fmts.items() if "text_encoder" in f.applied}
    carried = {name for name, f in fmts.items() if any(c.startswith("text_encoder") for c in f.loadable)}
    assert with_te == carried == {"FluxFamily"}  # the installed diffusers: only FluxPipeline's format has it


def test_a_component_the_format_carries_but_triptych_does_not_apply_is_refused_naming_it():
    wan = LoraFormat("wan-t2v", ("transformer",), ("transformer", "transformer_2"))
    sd = {"transformer_2.x.lora_A.weight": torch.zeros(2, 3), "transformer_2.x.lora_B.weight": torch.zeros(5, 2)}
    with pytest.raises(LoraFormatError, match="'transformer_2' LoRA, which Triptych does not apply on wan-t2v yet"):
        from_state_dict("n", sd, fmt=wan)
    flux = LoraFormat("flux", ("transformer", "text_encoder"), ("transformer", "text_encoder"))
    sd = {"text_encoder.x.lora_A.weight": torch.zeros(2, 3), "text_encoder.x.lora_B.weight": torch.zeros(5, 2)}
    assert from_state_dict("n", sd, fmt=flux).modules == {}  # the transformer's part of a text-encoder-only file
    assert from_state_dict("n", sd, component="text_encoder", fmt=flux).modules["x"].rank == 2
