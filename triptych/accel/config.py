"""``SpeedConfig``: whether a process compiles its transformer and which components it quantizes.

Standard library only at import time (the CLI builds its flags from it before torch loads).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

#: ``--quantize COMPONENT=MODE`` modes (torchao configs in ``accel/quantize.py``); fp8 needs CUDA.
QUANT_MODES = ("int8-weight-only", "int8-dynamic", "fp8")
#: Pipeline components ``--quantize`` may name (their ``nn.Linear`` weights are quantized).
QUANT_COMPONENTS = ("transformer", "text_encoder")


@dataclass(frozen=True)
class SpeedConfig:
    """Compilation and lower precision for the components one process loads.

    Applied once at load (``accel.apply_speed``), after placement on the device; a component the
    process does not load (another role's) is left alone.
    """

    compile: bool = False
    """Regional torch.compile: every repeated transformer block (the model's ``_repeated_blocks``,
    as diffusers' compile_repeated_blocks) compiled once, with dynamic shapes so a changing batch or
    text length does not recompile; and the VAE decoder where the family measured it to pay
    (Qwen-Image). Workers compile and warm up before they register."""
    cuda_graphs: bool = False
    """With --compile on a CUDA device: Qwen-Image's compiled block stack replays as CUDA graphs
    (torch.compile's mode reduce-overhead, inductor's CUDA graph trees), one recorded per shape of
    rows, text and image tokens met, so a step launches one graph instead of its kernels. Refused
    without --compile, off CUDA, with --offload, and on families without the stack."""
    step_graphs: bool = False
    """On a CUDA device, every family: the denoising step's transformer forward captured as a CUDA
    graph per batch bucket, shapes and dtypes met (accel/step_graphs.py), rows padded up to the
    bucket and the padding sliced off; LoRA rows, a hooked transformer and rows above the largest
    bucket run eagerly, each counted. Refused off CUDA and beside --cuda-graphs."""
    graph_buckets: tuple[int, ...] = (1, 2, 4, 8)
    """--step-graphs' batch buckets, repeatable: a forward of n rows replays the graph of the
    smallest bucket >= n."""
    graph_max: int = 16
    """--step-graphs: at most this many graphs captured at once (see --graph-policy)."""
    graph_pool_mib: int | None = None
    """--step-graphs: at most this many MiB held by the graphs' memory pools; none: no byte bound."""
    graph_policy: Literal["lru", "refuse"] = "lru"
    """Past --graph-max or --graph-pool-mib: lru drops the least recently replayed graph to capture
    the new one; refuse runs the new shapes eagerly."""
    compile_cache_dir: Path | None = None
    """Where inductor caches compiled artefacts across processes (TORCHINDUCTOR_CACHE_DIR); none:
    inductor under the user cache dir ($TRIPTYCH_CACHE or ~/.cache/triptych)."""
    quantize: tuple[str, ...] = ()
    """COMPONENT=MODE, repeatable: component transformer or text_encoder, mode int8-weight-only,
    int8-dynamic (torchao, CPU and CUDA) or fp8 (CUDA only)."""

    def __post_init__(self) -> None:
        seen = set()
        for item in self.quantize:
            component, sep, mode = str(item).partition("=")
            if not sep or component not in QUANT_COMPONENTS or mode not in QUANT_MODES:
                raise ValueError(
                    f"quantize={item!r}: write COMPONENT=MODE with COMPONENT one of {', '.join(QUANT_COMPONENTS)} "
                    f"and MODE one of {', '.join(QUANT_MODES)}"
                )
            if component in seen:
                raise ValueError(f"quantize={item!r}: {component} is named twice")
            seen.add(component)
        if not self.graph_buckets or min(self.graph_buckets) < 1:
            raise ValueError(f"graph_buckets={self.graph_buckets!r}: give one or more row counts >= 1")
        if self.graph_max < 1:
            raise ValueError(f"graph_max={self.graph_max}: must be >= 1 (turn --step-graphs off instead)")
        if self.graph_pool_mib is not None and self.graph_pool_mib < 1:
            raise ValueError(f"graph_pool_mib={self.graph_pool_mib}: must be >= 1, or none for no byte bound")

    @property
    def quantized(self) -> dict[str, str]:
        """Component → quantization mode."""
        return dict(item.split("=", 1) for item in self.quantize)

    @property
    def active(self) -> bool:
        return self.compile or bool(self.quantize)
