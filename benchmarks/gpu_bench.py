"""Denoise throughput on one GPU: Triptych's step batching vs diffusers' pipeline, batched and one by one.

    python benchmarks/gpu_bench.py [--device cuda] [--families flux qwen-image wan-t2v] [--sizes 512 1024]
    python benchmarks/gpu_bench.py --device cpu --tiny       # smoke run of every code path (CPU, seconds)

Each family's published transformer architecture (FLUX.1-dev 12B, Qwen-Image 20B, Wan 2.1 T2V 14B) is
built from its config *directly on the device* in bfloat16 with random weights: constructed under a
``torch.device`` context with bf16 as the default dtype, so nothing is materialised on the CPU and no
weight touches the disk. Only the few JSON configs a model directory needs are written to a temporary
directory, deleted at exit. Text encoders and the VAE are not built: every contender gets the same
random prompt embeddings and stops at latents (``output_type="latent"``), so the table measures the
denoise loop only:

- ``triptych``: N requests prepared separately, then the serving engine (``DenoiserEngine``) steps all of
  them in each tick, CFG branches fused: one transformer forward of N (x2 with CFG) rows per step.
- ``diffusers batched``: one ``pipe(prompt_embeds=<N stacked>)`` call (CFG as separate forwards).
- ``diffusers sequential``: N ``pipe(...)`` calls of one request each.

Speed is a ratio against the peers in the same run (never an absolute time); the first call of each is a warm-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass
class Arch:
    """One family's denoiser as the benchmark needs it: published transformer config and the files a
    model directory needs besides weights."""

    family: str
    pipeline: str
    transformer_class: str
    transformer: dict
    tiny: dict  # overrides for --tiny
    scheduler: dict
    vae: dict
    text_len: int  # prompt embedding tokens
    guidance: float
    frames: int = 1
    extra_index: dict = field(default_factory=dict)


FLOW = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "use_dynamic_shifting": True}
ARCHS = {
    "flux": Arch(
        "flux",
        "FluxPipeline",
        "FluxTransformer2DModel",
        dict(
            patch_size=1,
            in_channels=64,
            num_layers=19,
            num_single_layers=38,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        ),
        dict(
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            axes_dims_rope=(4, 6, 6),
        ),
        dict(FLOW, base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15, shift=3.0),
        {"_class_name": "AutoencoderKL", "block_out_channels": [128, 256, 512, 512], "latent_channels": 16},
        text_len=512,
        guidance=3.5,
    ),
    "qwen-image": Arch(
        "qwen-image",
        "QwenImagePipeline",
        "QwenImageTransformer2DModel",
        dict(
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=60,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=3584,
            guidance_embeds=False,
            axes_dims_rope=(16, 56, 56),
        ),
        dict(
            num_layers=1, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)
        ),
        dict(
            FLOW,
            base_image_seq_len=256,
            base_shift=0.5,
            max_image_seq_len=8192,
            max_shift=0.9,
            shift=1.0,
            shift_terminal=0.02,
            time_shift_type="exponential",
        ),
        {"_class_name": "AutoencoderKLQwenImage", "z_dim": 16, "temperal_downsample": [False, True, True]},
        text_len=128,
        guidance=4.0,
    ),
    "wan-t2v": Arch(
        "wan-t2v",
        "WanPipeline",
        "WanTransformer3DModel",
        dict(
            patch_size=(1, 2, 2),
            num_attention_heads=40,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            freq_dim=256,
            ffn_dim=13824,
            num_layers=40,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            rope_max_seq_len=1024,
        ),
        dict(num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=1),
        {
            "_class_name": "UniPCMultistepScheduler",
            "num_train_timesteps": 1000,
            "prediction_type": "flow_prediction",
            "use_flow_sigmas": True,
            "flow_shift": 3.0,
            "solver_order": 2,
        },
        {"_class_name": "AutoencoderKLWan", "z_dim": 16, "temperal_downsample": [False, True, True]},
        text_len=512,
        guidance=5.0,
        frames=5,
    ),
}


def model_dir(arch: Arch, root: Path, tiny: bool) -> Path:
    """A weightless model directory: model_index, scheduler, transformer and VAE configs only."""
    d = root / arch.family
    cfg = dict(arch.transformer, **(arch.tiny if tiny else {}))
    files = {
        "model_index.json": {
            "_class_name": arch.pipeline,
            "scheduler": ["diffusers", arch.scheduler["_class_name"]],
            "transformer": ["diffusers", arch.transformer_class],
            "vae": ["diffusers", arch.vae["_class_name"]],
            **arch.extra_index,
        },
        "scheduler/scheduler_config.json": arch.scheduler,
        "transformer/config.json": {"_class_name": arch.transformer_class, **cfg},
        "vae/config.json": arch.vae,
    }
    for name, content in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(json.dumps(content))
    return d


def build_transformer(arch: Arch, config_path: Path, device: torch.device, dtype: torch.dtype):
    """The transformer with random weights, allocated on ``device`` in ``dtype`` from the start."""
    import diffusers

    from triptych.plan.trace import default_dtype

    cls = getattr(diffusers, arch.transformer_class)
    cfg = {k: v for k, v in json.loads(config_path.read_text()).items() if not k.startswith("_")}
    with torch.device(device), default_dtype(dtype), torch.no_grad():
        model = cls(**cfg)
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, module in model.named_modules():  # as from_pretrained(dtype=...) leaves them
        if name.split(".")[-1] in keep:
            module.to(torch.float32)
    return model.eval()


def load_denoiser(arch: Arch, d: Path, transformer, device: str, dtype: str):
    """The family adapter, denoiser role, with the prebuilt transformer (``Family._build_components``)."""
    from triptych.core.devices import DeviceConfig
    from triptych.families.base import Role
    from triptych.families.registry import family_class

    base = family_class(d)
    adapter = type(
        f"Prebuilt{base.__name__}", (base,), {"_build_components": lambda self, wanted: {"transformer": transformer}}
    )
    return adapter(d, roles={Role.DENOISER}, device=DeviceConfig(device=device, dtype=dtype))


def embeddings(arch: Arch, family, n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random prompt embeddings (and FLUX's pooled ones) for ``n`` requests, on the device."""
    cfg = family.pipe.transformer.config
    width = cfg.get("joint_attention_dim") or cfg.get("text_dim")
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = {
        "embeds": torch.randn(n, arch.text_len, width, generator=g),
        "negative": torch.randn(n, arch.text_len, width, generator=g),
    }
    if arch.family == "flux":
        out["pooled"] = torch.randn(n, cfg.pooled_projection_dim, generator=g)
    return {k: v.to(family.device, family.dtype) for k, v in out.items()}


def conditioning(arch: Arch, family, emb: dict, i: int):
    from triptych.families.base import COND, UNCOND, Conditioning

    if arch.family == "flux":
        ids = torch.zeros(arch.text_len, 3, device=family.device, dtype=family.dtype)
        return Conditioning(
            {
                COND: {
                    "prompt_embeds": emb["embeds"][i : i + 1],
                    "pooled_prompt_embeds": emb["pooled"][i : i + 1],
                    "text_ids": ids,
                }
            }
        )
    branches = {
        COND: {"prompt_embeds": emb["embeds"][i : i + 1]},
        UNCOND: {"prompt_embeds": emb["negative"][i : i + 1]},
    }
    return Conditioning(branches)


def run_triptych(arch: Arch, family, emb: dict, n: int, size: int, steps: int) -> None:
    from triptych.families.base import GenerationParams

    neg = None if arch.family == "flux" else "-"
    params = [
        family.resolve(GenerationParams("-", neg, size, size, arch.frames, steps, arch.guidance, seed=i))
        for i in range(n)
    ]
    from triptych.engine import DenoiserEngine, EngineConfig

    # the serving engine, every request in each tick's one forward (no token budget cuts the batch)
    engine = DenoiserEngine(family, EngineConfig(max_batch_requests=n, max_batch_tokens=2**62, fuse_cfg=True))
    for i, p in enumerate(params):
        engine.add(family.prepare(f"r{i}", p, conditioning(arch, family, emb, i)))
    engine.run_until_done()


def run_diffusers(
    arch: Arch,
    family,
    emb: dict,
    rows: slice,
    size: int,
    steps: int,
    width: int | None = None,
    frames: int | None = None,
) -> None:
    """diffusers' own call of the rows' requests at ``size`` (x ``width``; ``frames`` for video)."""
    n = len(range(*rows.indices(emb["embeds"].shape[0])))
    kw = dict(height=size, width=width or size, num_inference_steps=steps, output_type="latent")
    kw["generator"] = [family.generator(i) for i in range(rows.start or 0, (rows.start or 0) + n)]
    if arch.family == "flux":
        kw.update(
            prompt_embeds=emb["embeds"][rows], pooled_prompt_embeds=emb["pooled"][rows], guidance_scale=arch.guidance
        )
    elif arch.family == "qwen-image":
        ones = torch.ones(n, arch.text_len, dtype=torch.long, device=family.device)
        kw.update(prompt_embeds=emb["embeds"][rows], prompt_embeds_mask=ones, true_cfg_scale=arch.guidance)
        kw.update(negative_prompt_embeds=emb["negative"][rows], negative_prompt_embeds_mask=ones)
    else:
        kw.update(prompt_embeds=emb["embeds"][rows], negative_prompt_embeds=emb["negative"][rows])
        kw.update(guidance_scale=arch.guidance, num_frames=frames or arch.frames)
    family.pipe(**kw)


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


def bench_family(arch: Arch, root: Path, args, deadline: float) -> list[dict]:
    d = model_dir(arch, root, args.tiny)
    device = torch.device(args.device)
    transformer = build_transformer(arch, d / "transformer" / "config.json", device, getattr(torch, args.dtype))
    family = load_denoiser(arch, d, transformer, args.device, args.dtype)
    rows = [measure(arch, family, size, args) for size in args.sizes if time.monotonic() < deadline]
    if len(rows) < len(args.sizes):
        print(f"{arch.family}: time budget spent, skipped sizes {args.sizes[len(rows) :]}", file=sys.stderr)
    return rows


@torch.no_grad()
def measure(arch: Arch, family, size: int, args) -> dict:
    n, steps = args.requests, args.steps
    emb = embeddings(arch, family, n)

    def sequential():
        for i in range(n):
            run_diffusers(arch, family, emb, slice(i, i + 1), size, steps)

    contenders = {
        "triptych": lambda s=steps: run_triptych(arch, family, emb, n, size, s),
        "diffusers batched": lambda s=steps: run_diffusers(arch, family, emb, slice(0, n), size, s),
        "diffusers sequential": sequential,
    }
    for name in ("triptych", "diffusers batched"):  # warm-up: kernels, allocator, at the measured shapes
        contenders[name](2)
    seconds = {name: timed(fn, family.device) for name, fn in contenders.items()}
    params_b = sum(p.numel() for p in family.pipe.transformer.parameters()) / 1e9
    row = dict(family=arch.family, params_b=params_b, size=size, n=n, steps=steps, **seconds)
    print(table_row(row), flush=True)  # row by row: a run stopped by its time cap keeps what it measured
    return row


HEADER = (
    "| family | params | size | requests x steps | triptych s | diffusers batched s | diffusers sequential s "
    "| vs batched | vs sequential |\n" + "|---" * 9 + "|"
)


def table_row(r: dict) -> str:
    t, b, s = r["triptych"], r["diffusers batched"], r["diffusers sequential"]
    return (
        f"| {r['family']} | {r['params_b']:.2f}B | {r['size']}² | {r['n']} x {r['steps']} | {t:.2f} | {b:.2f} "
        f"| {s:.2f} | {b / t:.2f}x | {s / t:.2f}x |"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--families", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    ap.add_argument("--sizes", nargs="+", type=int, default=None, help="default 512 1024 (--tiny: 32 64)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=300, help="start no new measurement after this many seconds")
    ap.add_argument("--tiny", action="store_true", help="tiny configs (a CPU smoke run of every code path)")
    args = ap.parse_args(argv)
    args.sizes = args.sizes or ([32, 64] if args.tiny else [512, 1024])
    if args.tiny:
        args.requests, args.steps = min(args.requests, 2), min(args.steps, 2)
    deadline = time.monotonic() + args.budget_s
    print(HEADER, flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="triptych-gpu-bench-") as root:
        for name in args.families:
            if time.monotonic() < deadline:
                rows += bench_family(ARCHS[name], Path(root), args, deadline)
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
    print(f"{len(rows)} measurements", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
