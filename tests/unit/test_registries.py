"""One typed registry of the built-in families (``families.registry.ENTRIES``) and one ``Role`` and
``TransferKind`` enum: each entry names what its adapter is, no ``"module:attr"`` string is left to
resolve, and the enums are the strings the wire, the flags and the metric labels carry."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

import triptych
from triptych.control import protocol as P
from triptych.core.kinds import ROLES, Role, TransferKind
from triptych.families import registry
from triptych.families.base import Family


@pytest.mark.parametrize("entry", registry.ENTRIES, ids=lambda e: e.name)
def test_each_entry_names_its_adapters_name_and_pipeline_class(entry):
    cls = entry.adapter()
    assert (cls.name, cls.pipeline_class.__name__) == (entry.name, entry.pipeline)
    for _, variant in entry.variants:  # a checkpoint of this class doing more, under the same name
        assert issubclass(variant(), cls) and variant().name == entry.name
    module = cls.__module__.rsplit(".", 1)[0]  # triptych.families.<family>
    for name, maker in entry.tiny:
        assert maker().__module__ == f"{module}.tiny", name
    for adapter in (cls, *(v() for _, v in entry.variants)):  # the entry says what the adapter does
        assert entry.teacache == (adapter.teacache_plan is not Family.teacache_plan), adapter.__name__


def test_lookups_cover_every_entry_and_nothing_else():
    assert registry.supported() == sorted(e.pipeline for e in registry.ENTRIES)
    assert registry.tiny_names() == ["flux", "flux-schnell", "qwen-image", "qwen-image-edit", "wan-i2v", "wan-t2v"]
    assert registry.teacache_families() == sorted(e.name for e in registry.ENTRIES)
    assert all(registry.has_teacache(name) for name in registry.teacache_families())
    assert registry.has_teacache("no-such-family") is False
    with pytest.raises(ValueError, match="unknown family 'sdxl'"):
        registry.make_tiny("sdxl", "unused")


def test_no_module_attr_strings_are_resolved_in_the_package():
    pattern = re.compile(r"""["']triptych(\.\w+)+:\w+["']""")
    found = [
        f"{path.relative_to(Path(triptych.__file__).parent)}: {m.group(0)}"
        for path in Path(triptych.__file__).parent.rglob("*.py")
        for m in pattern.finditer(path.read_text())
    ]
    assert found == []


def test_role_and_transfer_kind_are_their_strings_on_the_wire_and_in_text():
    assert [str(r) for r in ROLES] == ["encoder", "denoiser", "decoder"] and f"{Role.DECODER}-0" == "decoder-0"
    assert {Role.ENCODER: 1}["encoder"] == 1 and set(TransferKind) == {"auto", "mooncake", "zmq"}
    assert repr(ROLES) == "('encoder', 'denoiser', 'decoder')" and repr({TransferKind.ZMQ: 1}) == "{'zmq': 1}"
    msg = P.Register(
        instance_id="enc-0",
        role=Role.ENCODER,
        capacity=4,
        control="enc-0",
        data="tcp://127.0.0.1:1",
        transfer=TransferKind.ZMQ,
        revision="abc",
        pid=1,
    )
    raw = msgspec.msgpack.encode(msg)
    assert b"encoder" in raw and b"zmq" in raw and b"Role" not in raw
    back = msgspec.msgpack.decode(raw, type=P.Register)
    assert back.role is Role.ENCODER and back.transfer is TransferKind.ZMQ
    bad = msgspec.msgpack.encode(msgspec.structs.replace(msg, role="painter"))
    with pytest.raises(msgspec.ValidationError, match="role"):
        msgspec.msgpack.decode(bad, type=P.Register)
