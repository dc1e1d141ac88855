"""Denoiser caches, speed vs quality on one model: Triptych TeaCache vs diffusers and cache-dit peers.

    python benchmarks/denoiser_cache.py --size tiny --steps 8
    python benchmarks/denoiser_cache.py --size small --steps 20 --write-results

Every method runs the same prompts and seeds on the same tiny/small FLUX checkpoint (built from
config, seeded) and is compared with the uncached output of the same run:

- Triptych TeaCache (a few thresholds) through Triptych's staged path (``Family.denoise_step`` with
  ``TeaCache.bind``), profile fitted in this script on other prompts/seeds;
- diffusers 0.42.1 FirstBlockCache, MagCache (ratios from its own calibrate mode on a calibration
  prompt), TaylorSeerCache, via ``transformer.enable_cache(...)`` through the diffusers pipeline's
  ``__call__`` (prompt embeddings passed in, ``output_type="latent"``, so only the denoise loop runs);
- cache-dit 1.5.3 DBCache (F1B0 + TaylorSeer order-1 calibrator) through the same pipeline call.

Columns: block-stack passes (calls of the last single block: a full transformer computation; TaylorSeer
keeps calling every block and predicts module outputs inside, so its saving shows in time only), denoise
speedup against the uncached run of the same path (staged or pipeline; the two uncached outputs are
bit-identical, contract 1), PSNR and SSIM (torchmetrics) of decoded images against the uncached decode.
Time is the thread CPU time of the denoise loop with torch on one thread (``--threads 1``, default: a
shared machine's load does not change it; wall time with more threads), minimum over ``--repeats``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from triptych.cache.teacache import TeaCache
from triptych.cache.teacache_profile import ProfileIndex
from triptych.calibration.collect import DEFAULT_PROMPTS
from triptych.calibration.fit import calibrate
from triptych.calibration.metrics import psnr, ssim
from triptych.pipelines.base import GenerationParams
from triptych.pipelines.flux.teacache import plan_for
from triptych.pipelines.registry import load_family, make_tiny

PROMPTS = ("a koi pond under cherry blossoms", "a desert highway at noon", "a robot reading a book")
SEED = 42
FBC_THRESHOLDS = (0.1, 0.3, 0.6)
MAG_THRESHOLDS = (0.06, 0.15)
DBCACHE_THRESHOLDS = (0.1, 0.3, 0.6)
SECTION = "## Denoiser caches (benchmarks/denoiser_cache.py)"


@dataclass
class Result:
    method: str
    path: str  # "staged" or "pipeline"
    passes: int
    seconds: float
    images: torch.Tensor  # (N, 3, H, W) in [0, 1]
    note: str = ""


def clock() -> float:
    """CPU seconds of this thread: with torch on one thread (``--threads 1``, the default) all model
    compute runs here, so the figure does not depend on what else the shared machine runs."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


class PassCounter:
    """Counts full block-stack passes: calls of the last single block's MLP projection.

    NOTE: not the block itself: diffusers' cache hooks still *call* a skipped block (its forward is
    replaced by a pass-through), so a pre-hook on the block counts skipped steps too.
    """

    def __init__(self, transformer):
        self.n = 0
        self.handle = transformer.single_transformer_blocks[-1].proj_mlp.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.n += 1


def images(family, latents, params) -> torch.Tensor:
    return torch.from_numpy(family.decode(latents, params).array).permute(0, 3, 1, 2)


def run_staged(family, plist, cond, counter, tc=None, repeats=1) -> tuple[int, float, torch.Tensor]:
    best, imgs = float("inf"), []
    for r in range(repeats):
        counter.n, total, imgs = 0, 0.0, []
        for i, p in enumerate(plist):
            state = family.prepare(f"bench-{r}-{i}", p, cond[p.prompt])
            forward = tc.bind(family.forward) if tc is not None else None
            t = clock()
            while not state.done:
                family.denoise_step([state], forward=forward)
            total += clock() - t
            if tc is not None:
                tc.release(state.request_id)
            imgs.append(images(family, state.latents, p))
        passes, best = counter.n, min(best, total)
    return passes, best, torch.cat(imgs)


def run_pipeline(family, plist, cond, counter, repeats=1) -> tuple[int, float, torch.Tensor]:
    best, imgs = float("inf"), []
    for _ in range(repeats):
        counter.n, total, imgs = 0, 0.0, []
        for p in plist:
            c = cond[p.prompt].branches["cond"]
            t = clock()
            latents = family.pipe(
                prompt_embeds=c["prompt_embeds"],
                pooled_prompt_embeds=c["pooled_prompt_embeds"],
                height=p.height,
                width=p.width,
                num_inference_steps=p.steps,
                guidance_scale=p.guidance,
                generator=family.generator(p.seed),
                output_type="latent",
            ).images
            total += clock() - t
            imgs.append(images(family, latents, p))
        passes, best = counter.n, min(best, total)
    return passes, best, torch.cat(imgs)


def mag_ratios(family, plist, cond, steps) -> list[float]:
    """diffusers MagCache's own calibration (it prints the ratios at the end of a run)."""
    from diffusers import MagCacheConfig

    t = family.pipe.transformer
    t.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=steps))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        run_pipeline(family, plist[:1], cond, PassCounter(t))
    t.disable_cache()
    found = re.findall(r"\[([0-9eE.,\s+-]+)\]", buf.getvalue())
    return [float(v) for v in found[-1].split(",")]


def diffusers_methods(steps: int, ratios: list[float]):
    from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    for thr in FBC_THRESHOLDS:
        yield f"diffusers FirstBlockCache t={thr}", FirstBlockCacheConfig(threshold=thr)
    for thr in MAG_THRESHOLDS:
        yield (
            f"diffusers MagCache t={thr}",
            MagCacheConfig(
                threshold=thr, num_inference_steps=steps, mag_ratios=ratios, retention_ratio=0.2, max_skip_steps=3
            ),
        )
    yield (
        "diffusers TaylorSeerCache interval=2",
        TaylorSeerCacheConfig(
            cache_interval=2, disable_cache_before_step=1, max_order=1, taylor_factors_dtype=torch.float32
        ),
    )


def cache_dit_methods():
    import cache_dit

    for thr in DBCACHE_THRESHOLDS:
        cfg = cache_dit.DBCacheConfig(
            Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=2, residual_diff_threshold=thr
        )
        yield f"cache-dit DBCache F1B0 t={thr} +TaylorSeer1", cfg


def quality(imgs: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    return psnr(imgs, ref), ssim(imgs, ref, channels_last=False)


def table(results: list[Result], ref: torch.Tensor, base_time: dict[str, float], base_passes: int, kind: str) -> str:
    lines = [
        f"| method | path | block-stack passes | speedup ({kind}) | PSNR dB | SSIM | note |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        db, sim = quality(r.images, ref)
        lines.append(
            f"| {r.method} | {r.path} | {r.passes}/{base_passes} | {base_time[r.path] / r.seconds:.2f}x | "
            f"{db:.2f} | {sim:.4f} | {r.note} |"
        )
    return "\n".join(lines)


def write_results(path: Path, heading: str, body: str) -> None:
    """Replace (or append) this script's sub-section ``heading`` under SECTION; other sections untouched."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if SECTION not in text:
        text = text.rstrip("\n") + f"\n\n{SECTION}\n\n" + __doc__.split("\n\n")[2].strip() + "\n"
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    end = len(text) if end < 0 else end
    section = text[start:end]
    block = f"### {heading}\n\n{body}\n"
    m = re.search(rf"^### {re.escape(heading)}\n.*?(?=^### |\Z)", section, flags=re.S | re.M)
    section = section[: m.start()] + block + "\n" + section[m.end() :] if m else section.rstrip("\n") + "\n\n" + block
    path.write_text(text[:start] + section.rstrip("\n") + "\n" + text[end:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.1, 0.2, 0.4])
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--calib-prompts", type=int, default=4, help="calibration prompts (x 2 seeds)")
    ap.add_argument("--model-dir", help="existing FLUX model dir (default: build the seeded --size model)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads; 1 = time CPU seconds, else wall")
    ap.add_argument("--no-cache-dit", action="store_true")
    ap.add_argument("--write-results", nargs="?", const="benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    model = (
        Path(args.model_dir)
        if args.model_dir
        else make_tiny("flux", Path(tempfile.mkdtemp()) / f"{args.size}-flux", seed=0, size=args.size)
    )
    family = load_family(model)
    t0 = time.perf_counter()
    profile, _ = calibrate(model, args.steps, prompts=DEFAULT_PROMPTS[: args.calib_prompts], family=family)
    calib_s = time.perf_counter() - t0
    plist = [family.resolve(GenerationParams(prompt=p, seed=SEED, steps=args.steps)) for p in PROMPTS[: args.prompts]]
    cond = {p.prompt: family.encode(p) for p in plist}
    transformer = family.pipe.transformer
    counter = PassCounter(transformer)
    results: list[Result] = []

    run_staged(family, plist[:1], cond, counter)  # warm-up, untimed
    passes, secs, ref = run_staged(family, plist, cond, counter, repeats=args.repeats)
    results.append(Result("uncached", "staged", passes, secs, ref))
    base_passes = passes
    tc = TeaCache(plan_for(family), ProfileIndex(model, family.name))
    for thr in args.thresholds:
        plist_t = [p.replace(teacache_threshold=thr) for p in plist]
        n, s, imgs = run_staged(family, plist_t, cond, counter, tc, args.repeats)
        results.append(Result(f"Triptych TeaCache t={thr}", "staged", n, s, imgs))
    assert tc.num_states() == 0

    run_pipeline(family, plist[:1], cond, counter)  # warm-up, untimed
    n, s, pipe_ref = run_pipeline(family, plist, cond, counter, args.repeats)
    note = "bit-identical to staged" if torch.equal(pipe_ref, ref) else f"max diff {(pipe_ref - ref).abs().max():.2e}"
    results.append(Result("uncached", "pipeline", n, s, pipe_ref, note))
    ratios = mag_ratios(family, plist, cond, args.steps)
    for name, cfg in diffusers_methods(args.steps, ratios):
        transformer.enable_cache(cfg)
        n, s, imgs = run_pipeline(family, plist, cond, counter, args.repeats)
        transformer.disable_cache()
        results.append(Result(name, "pipeline", n, s, imgs))
    if not args.no_cache_dit:
        import cache_dit

        for name, cfg in cache_dit_methods():
            cache_dit.enable_cache(
                family.pipe,
                cache_config=cfg,
                calibrator_config=cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=1),
            )
            n, s, imgs = run_pipeline(family, plist, cond, counter, args.repeats)
            cache_dit.disable_cache(family.pipe)
            results.append(Result(name, "pipeline", n, s, imgs))
    n, s, after = run_pipeline(family, plist, cond, counter)
    assert torch.equal(after, pipe_ref), "a peer left the pipeline modified after disable"

    base_time = {r.path: r.seconds for r in results if r.method == "uncached"}
    kind = "thread CPU time" if args.threads == 1 else "wall time"
    md = table(results, ref, base_time, base_passes, kind)
    q = profile.quality
    params = sum(p.numel() for p in transformer.parameters())
    heading = f"{args.size} FLUX ({params / 1e6:.1f}M transformer params), {args.steps} steps, {len(plist)} prompts"
    body = (
        f"`{' '.join(['python', 'benchmarks/denoiser_cache.py'] + (argv if argv is not None else sys.argv[1:]))}`\n\n"
        f"TeaCache profile fitted in the run: r2={q['r2']:.3f}, rmse={q['rmse']:.3g}, {q['points']} points "
        f"({calib_s:.1f} s wall); MagCache ratios from its calibrate mode. Uncached denoise ({kind}): "
        f"staged {base_time['staged']:.2f} s, pipeline {base_time['pipeline']:.2f} s.\n\n{md}"
    )
    print(f"### {heading}\n\n{body}")
    if args.write_results:
        write_results(Path(args.write_results), heading, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
