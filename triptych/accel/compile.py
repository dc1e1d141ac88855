"""Regional ``torch.compile``: each repeated transformer block compiled once, cached on disk.

As diffusers' ``ModelMixin.compile_repeated_blocks``: every submodule whose class the model lists in
``_repeated_blocks`` gets ``nn.Module.compile`` (its ``__call__`` goes through one compiled
function; dynamo inlines ``nn.Module`` and lifts parameters to inputs, so every block of a class
shares one graph). ``dynamic=True`` makes the batch and sequence sizes symbolic from the first
compile, so a step batch that grows or shrinks, TeaCache's sub-batches and padded prompts of any
length reuse it; dynamo still specialises a size of 1 and whether a text mask is passed, so a mixed
load compiles a small, fixed number of graphs (``compile_counts``; figures in docs/speed.md).

Hooks added after a compile must take effect (LoRA attaches its per-row hooks when an adapter first
loads, ``lora/rows.py``): dynamo by default does not guard on ``nn.Module`` hooks
(``skip_nnmodule_hook_guards``), so a graph compiled before a hook existed would run without it,
silently. ``compile_repeated_blocks`` turns those guards on: a block whose hooks changed is compiled
again (``tests/pipelines/test_lora_compile.py`` fails without it: the adapters' rows come out as
if no adapter were loaded).

The VAE decoder is compiled where a family says it pays (``Family.compile_vae_decoder``,
``compile_decoder``). A causal-3D VAE (Qwen-Image's) compiles its one-frame decoder
(``accel/frame_decode.py``: the causal 3x3x3 convolutions of one frame as 2D convolutions, a third of
their work), which the family calls for one-frame latents: on the default model, 64x64, one thread,
about 4x per decode against the eager decoder (benchmarks/RESULTS.md). Another VAE's decoder is
compiled whole, in place. On CPU it compiles with ``CPU_OPTIONS``.

Inductor's FX graph and AOTAutograd caches are on by default; ``set_cache_dir`` points them at the
user cache dir so a restarted process reuses the generated code instead of compiling it again.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

#: inductor options on CPU for the decoder here and Qwen-Image's block stack
#: (``families/qwenimage/fast_stack.py``): ``cpp_wrapper``, the graph's calls made from C++ (faster for the
#: stack: benchmarks/RESULTS.md). NOTE: inductor's ``freezing`` is not among
#: them. Passed as a ``torch.compile`` option it does not take effect on torch 2.13 (``compile_fx``
#: reads it outside the options' patch: no weight was packed, inductor's counters say); set globally it
#: packs the linears for oneDNN, which made the stack slower at dynamic shapes
#: and bypasses the FX graph cache (a restart would compile again).
CPU_OPTIONS = {"cpp_wrapper": True}

logger = logging.getLogger(__name__)


def set_cache_dir(path: Path) -> None:
    """Inductor's on-disk cache directory for this process (before the first compile)."""
    path.mkdir(parents=True, exist_ok=True)
    # NOTE: inductor reads its cache directory from this variable at each lookup; there is no config
    # field for it. The value comes from SpeedConfig, never from the user's environment here.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)


def compile_repeated_blocks(model: torch.nn.Module) -> int:
    """Compile every block of ``model``'s ``_repeated_blocks`` classes; returns how many were compiled."""
    names = set(getattr(model, "_repeated_blocks", None) or ())
    if not names:
        raise ValueError(f"{type(model).__name__} declares no _repeated_blocks to compile")
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    torch._dynamo.config.skip_nnmodule_hook_guards = False  # see the module docstring
    for block in blocks:
        block.compile(dynamic=True)
    logger.info("compiling %d %s blocks of %s", len(blocks), "/".join(sorted(names)), type(model).__name__)
    return len(blocks)


def options_for(device) -> dict | None:
    """``CPU_OPTIONS`` on a CPU device, else None (``torch.compile``'s defaults)."""
    return CPU_OPTIONS if torch.device(device).type == "cpu" else None


def compile_decoder(vae: torch.nn.Module, device="cpu") -> torch.nn.Module | None:
    """Compile ``vae``'s decoder (``nn.Module.compile``, shapes static at first, so the warm-up's size
    gets a graph of its own and a second size makes dynamo compile a dynamic one). Returns the
    compiled ``FrameDecoder`` of a causal-3D VAE (the family decodes one-frame latents with it);
    otherwise compiles ``vae.decoder`` in place and returns None (also when there is no decoder).
    The encoder half is left alone (edit's condition image only)."""
    from triptych.accel.frame_decode import frame_decoder

    frame = frame_decoder(vae)
    if frame is not None:
        frame.compile(options=options_for(device))
        logger.info("compiling the %s one-frame decoder", type(vae).__name__)
        return frame
    decoder = getattr(vae, "decoder", None)
    if isinstance(decoder, torch.nn.Module):
        decoder.compile(options=options_for(device))
        logger.info("compiling the %s decoder", type(vae).__name__)
    return None


def compile_counts() -> dict[str, int]:
    """This process's dynamo counters: graphs compiled (``unique_graphs``) and recompilations
    (``recompiles``, compiles of a frame already compiled once, i.e. a guard failed)."""
    from torch._dynamo.utils import counters

    return {
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "recompiles": sum(counters["recompiles"].values()),
    }
