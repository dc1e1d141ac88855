"""A first-block residual skip criterion (FBCache / cache-dit DBCache ``Fn B0``) on the default model, against
the calibration target.

Issue 44 item 1 asks for a skip criterion beyond TeaCache's modulated-input distance. This one runs the first
``k`` transformer blocks of every row each step and compares the image stream's residual of those blocks
(``H_k - H_0``) with the same residual at the row's last fully computed step (relative L1,
``mean|d - d_c| / mean|d_c|``); below the threshold the row skips blocks ``k..N``: its hidden state is its own
``H_k`` plus the remaining blocks' residual (``H_N - H_k``) of its last computed step (``forecast`` 0, reuse) or
the line through the last two computed ones extrapolated in the step index (``forecast`` 1, as
``TeaCache._residual_at``). Per CFG branch (row), with warm-up (first ``W`` steps computed), the shipped
profile's cool-down (last step computed) and a cap on consecutive skips. "skipped" is the share of the block
forwards not run (the first ``k`` blocks always run).

Same requests as the sweeps in benchmarks/RESULTS.md: the 50 evaluation requests of ``triptych calibrate``
(train-split captions, seeds 2000-2049), run through ``run_cases`` in batches of ``--batch`` requests
(fused CFG, as the shipped sweep), scored with the calibration's ``fidelity``, adherence and ``Target``.
A threshold written ``sSTEPS`` (e.g. ``1:s7-8:0:0:1``) skips exactly those steps instead (a fixed schedule
over the same approximation, to see which steps can be skipped at all). ``--heldout N`` runs the listed settings on ``triptych quality``'s held-out prompts instead (seeds 0..N-1).

An experiment, not a product path: it subclasses ``TeaCache.forward`` and runs the default model's blocks
eagerly (the fast path's ``joint_block`` or the modules, as ``FastForward.run`` does, split at block ``k``).

    PYTHONPATH=. nice -n 10 python benchmarks/teacache_first_block.py [--images 50] [--settings K:T:W:C:F ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from teacache_cfg_delta import steps  # noqa: E402  (a sibling script: "0-3,6" -> {0, 1, 2, 3, 6})

from triptych.accel.teacache import BranchState, Decision, TeaCache  # noqa: E402
from triptych.accel.teacache_profile import find_profile  # noqa: E402
from triptych.calibration.batch import Cases, run_cases  # noqa: E402
from triptych.calibration.fit import DEFAULT_PROMPTS, eval_requests  # noqa: E402
from triptych.calibration.quality import _requests  # noqa: E402
from triptych.calibration.sweep import fidelity, world_adherence  # noqa: E402
from triptych.calibration.target import Target  # noqa: E402
from triptych.families.base import GenerationParams, Role  # noqa: E402
from triptych.families.models import default_model_dir  # noqa: E402
from triptych.families.qwenimage import fast  # noqa: E402
from triptych.families.qwenimage.fast_block import joint_block  # noqa: E402
from triptych.families.registry import load_family  # noqa: E402

#: K:T:W:C:F. With 6 blocks, 20 steps and the last step computed, 50% of the block forwards needs 60% of the
#: rows skipped at k = 1 (at least 12 of 20 steps: warm-up <= 4 with a cap >= 3, or warm-up 2 with a cap >= 2)
#: and 75% at k = 2 (15 of 20: warm-up <= 2 and a cap >= 5); the grid covers those, and a few lower-share
#: rows (warm-up 6, cap 1-2) for context.
DEFAULT_SETTINGS = (
    [f"1:{t}:{w}:{c}:{f}" for w in (2, 4, 1, 3) for c in (2, 3, 4, 0) for t in (0.2, 0.3, 0.4, 0.6) for f in (0, 1)]
    + [f"2:{t}:{w}:{c}:{f}" for w in (1, 2) for c in (4, 8, 0) for t in (0.15, 0.3, 0.5) for f in (0, 1)]
    + [f"{k}:{t}:6:{c}:{f}" for k in (1, 2) for c in (1, 2) for t in (0.2, 0.3) for f in (0, 1)]
)


@dataclass
class FirstBlockState(BranchState):
    """TeaCache's branch state plus the first blocks' residual of the last computed step."""

    first: torch.Tensor | None = None


def block_range(t, ops, e, hidden, txt, idx, lo: int, hi: int):
    """Blocks ``lo..hi-1`` on rows ``idx`` (None: all) of ``e`` from ``(hidden, txt)`` (already those rows'):
    the same operators as ``FastForward.run`` / the plain plan's ``blocks`` for those blocks."""
    if isinstance(e, fast.FastEmbedded):
        assert e.stack is None, "the compiled stack runs all blocks at once"
        mask, joint, temb, mods = e.mask, e.joint_mask, e.temb, e.mods
        if idx is not None:
            temb = temb[idx]
            mask, joint = (x[idx] if x is not None else None for x in (mask, joint))
            mods = mods[:, :, :, idx] if mods is not None and mods.dim() == 6 else mods
        flat = None if mods is None else mods.reshape(-1, *mods.shape[3:]).unbind(0)
        for i in range(lo, hi):
            block = t.transformer_blocks[i]
            if flat is not None and ops[i] is not None:
                mod = (flat[12 * i : 12 * i + 6], flat[12 * i + 6 : 12 * i + 12])
                hidden, txt = joint_block(ops[i], hidden, txt, joint, mod, e.rope[2])
            else:
                txt, hidden = block(
                    hidden_states=hidden,
                    encoder_hidden_states=txt,
                    encoder_hidden_states_mask=mask,
                    temb=temb,
                    image_rotary_emb=e.rope[3],
                    joint_attention_kwargs={},
                    modulate_index=None,
                )
        return hidden, txt
    mask, temb = e.mask, e.temb
    assert e.modulate_index is None, "zero_cond_t is not covered by this experiment"
    if idx is not None:
        mask = mask[idx] if mask is not None else None
        temb = temb[idx]
    for i in range(lo, hi):
        txt, hidden = t.transformer_blocks[i](
            hidden_states=hidden,
            encoder_hidden_states=txt,
            encoder_hidden_states_mask=mask,
            temb=temb,
            image_rotary_emb=e.rotary,
            joint_attention_kwargs={},
            modulate_index=None,
        )
    return hidden, txt


class FirstBlock(TeaCache):
    """The first-block residual criterion (module docstring) over TeaCache's state store and counters."""

    def __init__(
        self,
        plan,
        family,
        k: int,
        threshold: float,
        warmup: int,
        cap: int | None,
        forecast: int,
        joint=False,
        only=None,
        **kw,
    ):
        """``joint``: a request's CFG rows skip only together (each computes when any of them would).
        ``only``: skip exactly these steps (every row, the criterion unused): a fixed schedule."""
        super().__init__(plan, **kw)
        self.joint, self.only = joint, only
        self.t, self.k, self.thr, self.warmup, self.cap, self.forecast = (
            family.pipe.transformer,
            k,
            threshold,
            warmup,
            cap,
            forecast,
        )
        self.quick = family._fast if family.step_tables else None
        self.skips: dict[str, list[int]] = {}  # request/branch -> skipped steps
        self.rel_log: list[tuple[str, str, int, float]] = []  # (request, branch, step, rel) of every compared row

    @torch.no_grad()
    def forward(self, rows, base_forward):
        steps = [self.plan.describe(r) for r in rows]
        self.last_decisions = []
        if not any(s.threshold > 0 for s in steps):
            return base_forward(rows)
        with self._adapters(rows):
            e = self.plan.embed(rows)  # refreshes the fast path's operands first
            ops = self.quick.ops if self.quick is not None else None
            txt0 = e.txt if isinstance(e, fast.FastEmbedded) else e.encoder_hidden
            hk, txtk = block_range(self.t, ops, e, e.hidden, txt0, None, 0, self.k)
        first = hk - e.hidden
        n, nblocks = len(rows), len(self.t.transformer_blocks)
        compute = [True] * n
        states = {}
        for i, s in enumerate(steps):
            if s.threshold <= 0:
                continue
            st = self._states.get_or_create(s.request_id, s.branch, FirstBlockState)
            states[i] = st
            edge = s.step < self.warmup or s.step >= s.num_steps - 1  # the shipped profile's cooldown 1
            capped = self.cap is not None and st.run >= self.cap
            if not edge and st.first is not None and st.residual is not None:
                d, c = first[i : i + 1].float(), st.first.float()
                rel = float((d - c).abs().mean() / c.abs().mean())
                self.rel_log.append((s.request_id, s.branch, s.step, rel))
                compute[i] = capped or rel >= self.thr if self.only is None else s.step not in self.only
        if self.joint:
            anyone = {s.request_id for i, s in enumerate(steps) if compute[i]}
            compute = [s.request_id in anyone for s in steps]
        idx = [i for i in range(n) if compute[i]]
        out = {}
        if idx:
            sub = None if len(idx) == n else torch.tensor(idx, device=hk.device)
            h, tx = (hk, txtk) if sub is None else (hk[sub], txtk[sub])
            with self._adapters([rows[i] for i in idx]):
                hn, _ = block_range(self.t, ops, e, h, tx, sub, self.k, nblocks)
            out = {i: hn[j : j + 1] for j, i in enumerate(idx)}
        pieces = []
        for i, s in enumerate(steps):
            st = states.get(i)
            if compute[i]:
                pieces.append(out[i])
                if st is not None:
                    self._keep(st, out[i] - hk[i : i + 1], s.step, self.forecast)
                    st.first = first[i : i + 1].clone()
                    st.computed += 1
                    st.run = 0
            else:
                pieces.append(hk[i : i + 1] + self._residual_at(st, s.step))
                st.skipped += 1
                st.run += 1
                self.skips.setdefault(f"{s.request_id}/{s.branch}", []).append(s.step)
            if st is not None:
                self.last_decisions.append(Decision(s.request_id, s.branch, s.step, compute[i], 0.0))
        self.stats.rows_computed += len(idx)
        self.stats.rows_skipped += n - len(idx)
        with self._adapters(rows):
            return self.plan.head(e, torch.cat(pieces))


def score(got, plain, scenes, plain_adh, k: int, nblocks: int) -> dict:
    fid = fidelity(got, plain)
    adh = world_adherence([o.frames for o in got], scenes)
    rows = sum(o.computed + o.skipped for o in got)
    skipped_rows = sum(o.skipped for o in got)
    return {
        **fid,
        "adherence": adh,
        "plain_adherence": plain_adh,
        "rows_skipped": skipped_rows / rows,
        "blocks_skipped": skipped_rows * (nblocks - k) / (rows * nblocks),
        "below": [j for j, p in enumerate(fid["psnr_each"]) if p < 30],
        "failures": Target().failures({**fid, "adherence": adh, "plain_adherence": plain_adh}),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=50)
    ap.add_argument("--batch", type=int, default=4, help="requests a tick (the shipped profile's sweep: 4)")
    ap.add_argument(
        "--settings", nargs="*", metavar="K:T:W:C:F", help="first blocks, threshold, warmup, cap (0: none), forecast"
    )
    ap.add_argument("--heldout", type=int, default=0, help="run on N of triptych quality's held-out prompts instead")
    ap.add_argument("--joint", action="store_true", help="a request's CFG rows skip together (not per branch)")
    ap.add_argument("--detail", action="store_true", help="per failing image: its index, PSNR and skipped steps")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = default_model_dir()
    family = load_family(model, roles=(Role.ENCODER, Role.DENOISER, Role.DECODER))
    plan, shipped = family.teacache_plan(), find_profile(model, 20, family.name)
    nblocks = len(family.pipe.transformer.transformer_blocks)
    if args.heldout:
        requests, what = _requests(args.heldout, 20, True, None), f"{args.heldout} held-out requests (triptych quality)"
    else:
        base = GenerationParams(prompt="-", steps=20)
        requests = eval_requests(model, args.images, list(DEFAULT_PROMPTS), base)
        what = f"{args.images} evaluation requests (triptych calibrate)"
    cases, scenes = Cases(family, [p for p, _ in requests]), [s for _, s in requests]
    plain, _ = run_cases(cases, 0.0, batch_size=args.batch, tag="plain")
    plain_adh = world_adherence([o.frames for o in plain], scenes)
    how = "a request's CFG rows together" if args.joint else "per CFG branch"
    print(
        f"default model ({nblocks} blocks), 20 steps, {what}, batch {args.batch}, {how}; plain adherence {plain_adh:.0%}"
    )
    print(
        "| k | threshold | warmup | cap | forecast | blocks skipped | rows skipped | PSNR mean / worst dB | SSIM worst "
        "| adherence | < 30 dB | target |"
    )
    print("|---|---|---|---|---|---:|---:|---|---:|---:|---:|---|")
    prof = dataclasses.replace(shipped, warmup=0, max_skips=None)
    for spec in DEFAULT_SETTINGS if args.settings is None else args.settings:
        k, t, w, c, f = spec.split(":")
        only = steps(t[1:]) if t.startswith("s") else None  # "s7-8": skip steps 7 and 8 only
        cache = FirstBlock(
            plan,
            family,
            int(k),
            1.0 if only else float(t),
            int(w),
            int(c) or None,
            int(f),
            args.joint,
            only,
            profiles=lambda n: prof,
        )
        t0 = time.time()
        got, _ = run_cases(cases, 1.0, cache, args.batch, tag="fb")
        r = score(got, plain, scenes, plain_adh, int(k), nblocks)
        print(
            f"| {k} | {t} | {w} | {c if c != '0' else '-'} | {['reuse', 'linear'][int(f)]} | {r['blocks_skipped']:.1%} "
            f"| {r['rows_skipped']:.1%} | {r['psnr_mean']:.1f} / {r['psnr_min']:.1f} | {r['ssim_min']:.3f} "
            f"| {r['adherence']:.0%} | {len(r['below'])} | {'; '.join(r['failures']) or '**meets**'} |",
            flush=True,
        )
        if args.detail:
            for j in r["below"]:
                sk = {b: cache.skips.get(f"fb-{j}/{b}", []) for b in ("cond", "uncond")}
                print(
                    f"    image {j} ({cases.params[j].prompt!r}, seed {cases.params[j].seed}): "
                    f"{r['psnr_each'][j]:.1f} dB, skipped steps {sk}",
                    flush=True,
                )
        print(f"    ({time.time() - t0:.0f} s)", flush=True) if args.detail else None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
