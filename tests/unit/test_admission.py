"""AdmissionLimits bounds and checks; Admission slot counting."""

from __future__ import annotations

import pytest

from triptych.control.backend import Overloaded
from triptych.core.errors import InvalidParam
from triptych.head.admission import Admission, AdmissionLimits, retry_after_header


@pytest.mark.parametrize("field", ["max_pixels", "max_steps", "max_queued_requests", "retry_after_s"])
def test_limits_refuse_non_positive_values(field):
    with pytest.raises(ValueError, match=field):
        AdmissionLimits(**{field: 0})


def test_limits_refuse_float_for_int_field():
    with pytest.raises(ValueError, match="integer"):
        AdmissionLimits(max_steps=2.5)


def test_limits_refuse_max_n_above_queue():
    with pytest.raises(ValueError, match="max_n=9 exceeds max_queued_requests=8"):
        AdmissionLimits(max_n=9, max_queued_requests=8)


def test_every_field_is_documented():
    import inspect

    source = inspect.getsource(AdmissionLimits)
    for name in AdmissionLimits.__dataclass_fields__:
        after = source.split(f"    {name}:", 1)[1].split("\n", 2)[1]
        assert after.strip().startswith('"""'), f"{name} has no docstring"


@pytest.mark.parametrize(
    "size, expected", [("64x32", (64, 32)), (" 16 X 48 ", (16, 48)), ("auto", (None, None)), (None, (None, None))]
)
def test_parse_size_accepts(size, expected):
    assert AdmissionLimits().parse_size(size) == expected


@pytest.mark.parametrize(
    "size, needle",
    [
        ("64x", "WIDTHxHEIGHT"),
        ("0x64", ">= 1"),
        ("x", "WIDTHxHEIGHT"),
        ("64x64x3", "WIDTHxHEIGHT"),
        ("128x128", "exceeds the limit of 4096"),
    ],
)
def test_parse_size_refuses_naming_size_value_and_limit(size, needle):
    with pytest.raises(InvalidParam) as e:
        AdmissionLimits(max_pixels=64 * 64).parse_size(size)
    assert e.value.field == "size" and e.value.value == size and needle in e.value.rule


def test_checks_name_field_and_limit():
    lim = AdmissionLimits(max_n=2, max_steps=4, max_frames=9, max_prompt_chars=5)
    for call, field, limit in [
        (lambda: lim.check_n(3), "n", "2"),
        (lambda: lim.check_steps(5), "num_inference_steps", "4"),
        (lambda: lim.check_frames(10), "frames", "9"),
        (lambda: lim.check_prompt("abcdef"), "prompt", "5"),
    ]:
        with pytest.raises(InvalidParam) as e:
            call()
        assert e.value.field == field and limit in e.value.rule
    lim.check_n(2), lim.check_steps(None), lim.check_frames(9), lim.check_prompt("abcde")


def test_check_resolved_catches_a_model_default_above_the_limit():
    with pytest.raises(InvalidParam, match="size"):
        AdmissionLimits(max_pixels=100).check_resolved(width=16, height=16, frames=1, steps=1)


def test_admission_reserves_and_releases():
    adm = Admission(AdmissionLimits(max_queued_requests=3, max_n=3, retry_after_s=2.5))
    adm.reserve(2)
    with pytest.raises(Overloaded) as e:
        adm.reserve(2)
    assert e.value.retry_after == 2.5 and adm.in_flight == 2
    with adm.admit(1):
        assert adm.in_flight == 3
    assert adm.in_flight == 2
    adm.release(2)
    assert adm.in_flight == 0


def test_admit_releases_on_error():
    adm = Admission(AdmissionLimits())
    with pytest.raises(RuntimeError):
        with adm.admit(2):
            raise RuntimeError
    assert adm.in_flight == 0


def test_retry_after_header_rounds_up_to_whole_seconds():
    assert [retry_after_header(s) for s in (0.1, 1.0, 2.5)] == ["1", "1", "3"]
