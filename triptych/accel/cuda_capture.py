"""The ``CaptureBackend`` of ``accel/step_graphs.py`` on a CUDA device: ``torch.cuda.CUDAGraph``.

A capture warms the call up on a side stream first (cuBLAS/cuDNN handles, lazily built caches such
as a model's RoPE tables, compiled kernels: none of that may happen inside a capture), then records
one run into a private memory pool. Each graph has its own pool: graphs are replayed in any order,
and a pool shared between graphs is only safe when they replay in the order they were captured.
The bytes a graph's pool took are measured as the growth of the allocator's reserved memory around
its capture. The capture runs without autograd (the denoiser's forwards never need it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch


@dataclass
class CudaGraph:
    """One recorded call: its graph, the static output the replay writes, its pool's bytes."""

    graph: torch.cuda.CUDAGraph
    output: torch.Tensor
    nbytes: int

    def replay(self) -> None:
        self.graph.replay()


class CudaCapture:
    """Captures with ``torch.cuda.graph`` after ``warmup`` eager runs on a side stream."""

    def __init__(self, warmup: int = 2):
        assert warmup >= 1, "a capture needs at least one warm-up run"
        self.warmup = warmup

    def refusal(self, tensors: Mapping[str, torch.Tensor | None]) -> str | None:
        for name, t in tensors.items():
            if t is not None and t.device.type != "cuda":
                return f"{name} is on {t.device}, not a CUDA device"
        return None

    def capture(self, run: Callable[[], torch.Tensor], device: torch.device) -> CudaGraph:
        with torch.cuda.device(device), torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    run()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            before = torch.cuda.memory_reserved()
            graph = torch.cuda.CUDAGraph()
            # NOTE: thread_local: a CUDA call another thread of the worker makes meanwhile (a transfer,
            # a decode) is not an error of this capture; only this thread's unsafe calls are.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                output = run()
            torch.cuda.synchronize()
            return CudaGraph(graph, output, max(0, torch.cuda.memory_reserved() - before))
