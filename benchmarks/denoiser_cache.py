"""Denoiser caches on the trained default model: Triptych TeaCache vs diffusers and cache-dit peers.

    nice -n 5 python benchmarks/denoiser_cache.py --images 16 --repeats 2 --out peers.md

Every method runs the same held-out shape-world requests (the prompts and seeds ``triptych quality``
scores: ``sample_scenes(n, "quality", "heldout")``, seed = index) on the packaged default model
(qwen-image, 64×64, 20 steps, true CFG 4.0) and is compared with the uncached output of the same run:

- Triptych TeaCache through the serving engine (``DenoiserEngine``, one forward per CFG branch, the
  TeaCache as its acceleration), with the shipped profile's polynomial: plain (first step computed, no cap) and
  with the first 4 steps computed and at most 1 or 2 skips in a row (the calibrated variants);
- diffusers 0.42.1 FirstBlockCache, MagCache (ratios from its own calibrate mode on train-split
  captions, cond and uncond averaged) and TaylorSeerCache (order 1, first 3 steps computed), via
  ``transformer.enable_cache`` through the pipeline's ``__call__`` (prompt embeddings passed in,
  ``output_type="latent"``: only the denoise loop is timed);
- cache-dit 1.5.3 DBCache (F1B0, TaylorSeer order-1 calibrator) through the same pipeline call.

The staged per-branch path and the pipeline are bit-identical uncached (the script checks it), so one
uncached output is the reference of every method. Columns: block work (Linear calls inside the
transformer blocks, uncached = 100%: a skipped block or a predicted attention does none; FBCache and
DBCache always run their first block, TaylorSeer predicts attention and still runs the MLPs), the
denoise speedup in thread CPU time (torch on one thread) against the uncached run of the same path,
minimum over ``--repeats`` rounds in which the methods alternate; PSNR/SSIM of decoded images
against uncached (mean and worst); shape-world adherence (shape, colour and background read back).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import re
import sys
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from triptych.accel.teacache import TeaCache
from triptych.accel.teacache_profile import find_profile
from triptych.calibration.metrics import psnr, ssim
from triptych.calibration.quality import _requests, world_prompts
from triptych.calibration.sweep import world_adherence
from triptych.calibration.target import FIT_SEEDS, Target
from triptych.families.base import GenerationParams
from triptych.families.models import resolve_model
from triptych.families.registry import load_family

TEACACHE = {
    (1, None): (0.026, 0.05, 0.1, 0.2, 0.4),
    (4, 1): (0.1, 0.3, 1.0),
    (4, 2): (0.1, 0.3),
}  # (warmup, max skips): thresholds
FBCACHE = (0.1, 0.2, 0.3, 0.5, 0.8)
MAGCACHE = (0.06, 0.12, 0.24, 0.5)
TAYLORSEER = (2, 3, 5)  # cache intervals
DBCACHE = (0.2, 0.3, 0.5, 0.8)


@dataclass
class Method:
    group: str  # the method ("diffusers FBCache"); rows of one group are its sweep
    setting: str  # its parameters ("0.1")
    path: str  # "staged" (Triptych) or "pipeline" (diffusers __call__)
    enable: object = None  # () -> None, before a round; None for uncached / TeaCache
    disable: object = None
    teacache: tuple | None = None  # (TeaCache, threshold)
    times: list[float] = field(default_factory=list)
    work: int = 0
    latents: list[torch.Tensor] = field(default_factory=list)


class WorkCounter:
    """Counts Linear calls inside the transformer blocks (forward pre-hooks on each Linear: the cache
    hooks replace a skipped block's or a predicted attention's forward, so its Linears are not called)."""

    def __init__(self, transformer):
        self.n = 0
        for m in transformer.transformer_blocks.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.n += 1


def run_pipeline(family, p, cond) -> torch.Tensor:
    b = cond.branches
    neg = {"negative_prompt_embeds": b["uncond"]["prompt_embeds"]} if "uncond" in b else {}
    return family.pipe(
        prompt_embeds=b["cond"]["prompt_embeds"],
        **neg,
        true_cfg_scale=p.guidance,
        height=p.height,
        width=p.width,
        num_inference_steps=p.steps,
        generator=family.generator(p.seed),
        output_type="latent",
    ).images


def run_staged(family, p, cond, tc=None, threshold=0.0, rid="r") -> torch.Tensor:
    """One request alone through the serving engine, CFG branches as diffusers runs them, ``tc`` as
    the engine's acceleration (it admits and releases the request)."""
    from triptych.engine import DenoiserEngine, EngineConfig

    state = family.prepare(rid, p.replace(teacache_threshold=threshold), cond)
    engine = DenoiserEngine(family, EngineConfig(max_batch_requests=1, fuse_cfg=False), accel=tc)
    engine.add(state)
    engine.run_until_done()
    return state.latents


def run_round(family, method: Method, plist, conds, counter, keep: bool) -> None:
    if method.enable:
        method.enable()
    counter.n, total, lat = 0, 0.0, []
    try:
        for i, (p, c) in enumerate(zip(plist, conds)):
            t0 = time.thread_time()
            if method.path == "pipeline":
                out = run_pipeline(family, p, c)
            else:
                out = run_staged(family, p, c, *(method.teacache or ()), rid=f"b{i}")
            total += time.thread_time() - t0
            lat.append(out.detach().clone())
    finally:
        if method.disable:
            method.disable()
    if keep:
        method.work, method.latents = counter.n, lat
    else:  # a later round must reproduce the first exactly (no state leaks between rounds)
        same = counter.n == method.work and all(torch.equal(a, b) for a, b in zip(lat, method.latents))
        assert same, f"{method.group} {method.setting}: a later round differs from the first"
    method.times.append(total)


def mag_ratios(family, steps: int, model) -> list[float]:
    """diffusers MagCache's calibrate mode (it prints one ratio list per CFG branch per request)."""
    from diffusers import MagCacheConfig

    t = family.pipe.transformer
    t.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=steps))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        for prompt in world_prompts(model, 2):
            for seed in FIT_SEEDS:
                p = family.resolve(GenerationParams(prompt=prompt, seed=seed, steps=steps))
                run_pipeline(family, p, family.encode(p))
    t.disable_cache()
    lists = [[float(v) for v in s.split(",")] for s in re.findall(r"\[([0-9eE.,\s+-]+)\]", buf.getvalue())]
    return np.mean(lists, axis=0).tolist()


def methods(family, model, steps: int) -> list[Method]:
    import cache_dit
    from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    t = family.pipe.transformer
    out = [Method("uncached", "", "staged"), Method("uncached", "", "pipeline")]
    profile = find_profile(model, steps, family.name)
    plan = family.teacache_plan()
    for (warmup, cap), thresholds in TEACACHE.items():
        variant = replace(profile, warmup=warmup, max_skips=cap)
        tc = TeaCache(plan, profiles=lambda n, v=variant: v)
        for thr in thresholds:
            group = f"Triptych TeaCache, warmup {warmup}, cap {cap or '-'}"
            out.append(Method(group, f"{thr:g}", "staged", teacache=(tc, thr)))

    def hook(group, setting, cfg):
        return Method(group, setting, "pipeline", lambda: t.enable_cache(cfg), t.disable_cache)

    out += [hook("diffusers FBCache", f"{thr:g}", FirstBlockCacheConfig(threshold=thr)) for thr in FBCACHE]
    ratios = mag_ratios(family, steps, model)
    for thr in MAGCACHE:
        cfg = MagCacheConfig(threshold=thr, num_inference_steps=steps, mag_ratios=ratios)
        out.append(hook("diffusers MagCache (retain 20%, ≤ 3 skips)", f"{thr:g}", cfg))
    for k in TAYLORSEER:
        cfg = TaylorSeerCacheConfig(
            cache_interval=k, disable_cache_before_step=3, max_order=1, taylor_factors_dtype=torch.float32
        )
        out.append(hook("diffusers TaylorSeer (order 1, 3 warm-up steps)", f"interval {k}", cfg))
    for thr in DBCACHE:
        cfg = cache_dit.DBCacheConfig(
            Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=2, residual_diff_threshold=thr
        )
        cal = cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=1)
        on = lambda c=cfg, k=cal: cache_dit.enable_cache(family.pipe, cache_config=c, calibrator_config=k)  # noqa: E731
        group = "cache-dit DBCache F1B0 + TaylorSeer 1"
        out.append(Method(group, f"{thr:g}", "pipeline", on, lambda: _dit_off(family)))
    return out


def _dit_off(family) -> None:
    import cache_dit

    cache_dit.disable_cache(family.pipe)


def score(family, plist, scenes, ms: list[Method]) -> list[dict]:
    frames = {id(m): [family.decode(x, p).array for x, p in zip(m.latents, plist)] for m in ms}
    ref = ms[0]
    assert all(torch.equal(a, b) for a, b in zip(ref.latents, ms[1].latents)), "staged and pipeline differ"
    want = frames[id(ref)]
    base = {m.path: min(m.times) for m in ms if m.group == "uncached"}
    rows = []
    for m in ms:
        got = frames[id(m)]
        ps = [psnr(g, w) for g, w in zip(got, want)]
        ss = [ssim(g, w) for g, w in zip(got, want)]
        finite = [v for v in ps if np.isfinite(v)]
        rows.append(
            {
                "group": m.group,
                "setting": m.setting,
                "path": m.path,
                "work": m.work / ref.work,
                "speedup": base[m.path] / min(m.times),
                "psnr_mean": float(np.mean(finite)) if finite else float("inf"),
                "psnr_min": min(ps),
                "ssim_mean": float(np.mean(ss)),
                "ssim_min": min(ss),
                "adherence": world_adherence(got, scenes),
            }
        )
    plain = rows[0]["adherence"]
    for r in rows:
        r["plain_adherence"] = plain
        r["meets"] = not Target().failures(r)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| method | setting | path | block work | forwards ÷ | denoise × (CPU) | PSNR mean / worst dB | SSIM mean / worst "
        "| adherence | target |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['group']} | {r['setting']} | {r['path']} | {r['work']:.0%} | {1 / r['work']:.2f} | {r['speedup']:.2f} "
            f"| {r['psnr_mean']:.1f} / {r['psnr_min']:.1f} | {r['ssim_mean']:.3f} / {r['ssim_min']:.3f} "
            f"| {r['adherence']:.0%} | {'meets' if r['meets'] else '-'} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Per method: the largest saving (block work) under each constraint, or '-' when none saves."""
    plain = rows[0]["adherence"]
    tests = {
        "adherence within 2 points": lambda r: plain - r["adherence"] <= 0.02 + 1e-9,
        "worst PSNR ≥ 30 dB": lambda r: r["psnr_min"] >= 30,
        "worst PSNR ≥ 20 dB": lambda r: r["psnr_min"] >= 20,
        "full target": lambda r: r["meets"],
    }
    cols = " | ".join(tests)
    lines = [f"| method | {cols} |", "|---|" + "---|" * len(tests)]
    for group in dict.fromkeys(r["group"] for r in rows[2:]):
        cells = []
        for ok in tests.values():
            cand = [r for r in rows[2:] if r["group"] == group and ok(r) and r["work"] < 1]
            b = min(cand, key=lambda r: r["work"]) if cand else None
            cells.append(
                f"{b['setting']}: {1 / b['work']:.2f}÷, {b['speedup']:.2f}×, {b['psnr_min']:.1f} dB" if b else "-"
            )
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: the packaged default model)")
    ap.add_argument("--images", type=int, default=16, help="held-out requests")
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds (methods alternate within each)")
    ap.add_argument("--out", help="also write the markdown here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    from diffusers.utils import logging as dlog

    dlog.set_verbosity_error()
    model = resolve_model(args.model, None)
    family = load_family(model)
    requests = _requests(args.images, None, True, None)
    plist = [family.resolve(p) for p, _ in requests]
    scenes = [s for _, s in requests]
    conds = [family.encode(p) for p in plist]
    counter = WorkCounter(family.pipe.transformer)
    ms = methods(family, model, plist[0].steps)
    t0 = time.perf_counter()
    for m in ms:  # warm-up: first calls of each path and hook are slow; also records outputs and work
        run_round(family, m, plist, conds, counter, keep=True)
        m.times.clear()
    for r in range(args.repeats):
        for m in ms if r % 2 == 0 else ms[::-1]:  # alternate, and reverse the order every other round
            run_round(family, m, plist, conds, counter, keep=False)
        print(f"round {r + 1}/{args.repeats} done", file=sys.stderr)
    rows = score(family, plist, scenes, ms)
    p0 = plist[0]
    head = (
        f"{family.name} default model, {p0.width}x{p0.height}, {p0.steps} steps, guidance {p0.guidance:g}, "
        f"{len(plist)} held-out requests, {args.repeats} timed rounds ({time.perf_counter() - t0:.0f} s wall). "
        f"Uncached denoise (thread CPU, all requests): "
        + ", ".join(f"{m.path} {min(m.times):.2f} s" for m in ms if m.group == "uncached")
    )
    cmd = " ".join(["python", "benchmarks/denoiser_cache.py", *(argv if argv is not None else sys.argv[1:])])
    md = f"`{cmd}`\n\n{head}\n\n{table(rows)}\n\nBest point per method (largest saving; forwards ÷, denoise ×, worst PSNR):\n\n{summary(rows)}\n"
    print(md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
