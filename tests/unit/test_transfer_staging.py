"""Host/device staging for transfers: CPU inputs untouched, device tensors to pinned host memory and back."""

from __future__ import annotations

import pytest
import torch

from triptych.transfer.staging import to_device, to_host


def _tensors(device="cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "latents": torch.randn(1, 16, 8, generator=g).to(device),
        "embeds": torch.randn(1, 4, 8, generator=g).to(device=device, dtype=torch.bfloat16),
        "shape": torch.tensor([1, 2, 3]).to(device),
    }


def test_to_host_leaves_cpu_tensors_as_they_are():
    tensors = _tensors()
    host = to_host(tensors)
    assert all(host[k] is tensors[k] for k in tensors)


def test_to_device_casts_floating_tensors_only():
    moved = to_device(_tensors(), "cpu", torch.bfloat16)
    assert moved["latents"].dtype == torch.bfloat16 and moved["embeds"].dtype == torch.bfloat16
    assert moved["shape"].dtype == torch.int64
    assert torch.equal(moved["latents"], _tensors()["latents"].to(torch.bfloat16))


def test_to_device_without_change_does_not_copy():
    tensors = _tensors()
    moved = to_device(tensors, "cpu")
    assert all(moved[k].data_ptr() == tensors[k].data_ptr() for k in tensors)


@pytest.mark.gpu
def test_device_tensors_go_to_pinned_host_memory_and_back():
    on_gpu = _tensors("cuda")
    host = to_host(on_gpu)
    for name, tensor in on_gpu.items():
        assert host[name].device.type == "cpu" and host[name].is_pinned()
        assert host[name].dtype == tensor.dtype and torch.equal(host[name], tensor.cpu())
    back = to_device(host, "cuda")
    assert all(back[k].is_cuda and torch.equal(back[k], on_gpu[k]) for k in on_gpu)
    # A large transfer: the values survive the non-blocking copies and the single synchronize.
    big = {"x": torch.randn(64, 1024, 1024, device="cuda")}
    assert torch.equal(to_device(to_host(big), "cuda")["x"], big["x"])
