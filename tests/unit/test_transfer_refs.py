"""TensorRef encoding and dtype helpers."""

import pytest
import torch

from triptych.transfer.refs import (
    MooncakeLocation,
    TensorRef,
    check_tensor,
    decode_ref,
    dtype_from_name,
    dtype_name,
    encode_ref,
    tensor_nbytes,
)


def make_ref(**overrides) -> TensorRef:
    fields = dict(
        transfer_id="r1/latents",
        dtype="bfloat16",
        shape=(2, 3),
        nbytes=12,
        owner="rx",
        slot=0,
        endpoint="tcp://127.0.0.1:1",
        mooncake=MooncakeLocation("127.0.0.1:2", 4096),
    )
    fields.update(overrides)
    return TensorRef(**fields)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_dtype_name_round_trips(dtype):
    assert dtype_from_name(dtype_name(dtype)) is dtype


def test_unknown_dtype_name_raises():
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_from_name("float128")


def test_tensor_nbytes_matches_torch():
    t = torch.zeros(3, 5, dtype=torch.bfloat16)
    assert tensor_nbytes(t.dtype, t.shape) == t.numel() * t.element_size() == 30
    assert tensor_nbytes("int64", ()) == 8


def test_ref_round_trips_through_msgpack():
    ref = make_ref()
    assert decode_ref(encode_ref(ref)) == ref
    assert decode_ref(encode_ref(make_ref(mooncake=None))).mooncake is None


def test_ref_fields_are_required():
    with pytest.raises(TypeError):
        TensorRef(transfer_id="x", dtype="float32", shape=(1,), nbytes=4)  # type: ignore[call-arg]


def test_check_tensor_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="shape"):
        check_tensor(make_ref(), torch.zeros(3, 2, dtype=torch.bfloat16))


def test_check_tensor_rejects_dtype_mismatch():
    with pytest.raises(ValueError, match="dtype"):
        check_tensor(make_ref(), torch.zeros(2, 3, dtype=torch.float16))


def test_check_tensor_accepts_match():
    check_tensor(make_ref(), torch.zeros(2, 3, dtype=torch.bfloat16))
