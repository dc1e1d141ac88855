"""Dense peak rates and memory of common accelerators, and the measured matmul rate of this CPU.

Figures are vendors' datasheet numbers for dense tensor math (not the 2:4-sparse figures the same
sheets also print); ``fp8`` None: the device has no fp8 tensor math."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

TERA = 1e12


@dataclass(frozen=True)
class Peak:
    name: str
    bf16: float  # FLOP/s, dense
    fp8: float | None  # FLOP/s, dense; None: no fp8
    memory: int  # bytes of device memory


GB = 10**9
DEVICES: dict[str, Peak] = {
    p.name: p
    for p in (
        Peak("H100", 989 * TERA, 1979 * TERA, 80 * GB),  # H100 SXM
        Peak("H200", 989 * TERA, 1979 * TERA, 141 * GB),
        Peak("A100", 312 * TERA, None, 80 * GB),
        Peak("L40S", 362 * TERA, 733 * TERA, 48 * GB),
        Peak("B200", 2250 * TERA, 4500 * TERA, 180 * GB),
        Peak("MI300X", 1307 * TERA, 2615 * TERA, 192 * GB),
    )
}


def lookup(device_name: str) -> Peak | None:
    """The table's entry a device name (``torch.cuda.get_device_name``, or a table key) names; None
    when none does."""
    text = device_name.upper().replace(" ", "")
    for key in sorted(DEVICES, key=len, reverse=True):
        if key in text:
            return DEVICES[key]
    return None


def measured_matmul_rate(n: int = 1024, seconds: float = 0.2, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of ``n``×``n`` matmuls on the CPU, best of the repeats that fit in about ``seconds``."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    end = time.perf_counter() + seconds
    while True:
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() > end:
            break
    return 2 * n**3 / best


def cpu_peak(memory: int | None = None) -> Peak:
    """This CPU as a ``Peak``: its measured fp32 matmul rate for both formats (no fp8 tensor math)."""
    if memory is None:
        import os

        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Peak("CPU (measured fp32 matmul)", measured_matmul_rate(), None, memory)
