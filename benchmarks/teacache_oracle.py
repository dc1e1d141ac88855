"""TeaCache with an oracle decision on the default model: each row accumulates its TRUE uncached output
rel-L1 change (what the calibrated polynomial estimates from the modulated input) instead of the
estimate, on the 32 held-out requests of ``triptych quality``. If the oracle does no better than the
polynomial at equal savings, a better fit (or "fitting on the model output") cannot fix the decision.

    PYTHONPATH=. nice -n 10 python benchmarks/teacache_oracle.py   # about 320 images; prints a table

An experiment, not a product path: it subclasses ``TeaCache._decide`` and reads its per-request state.
"""

import dataclasses

from triptych.accel.teacache import BranchState, Decision, TeaCache
from triptych.accel.teacache_profile import find_profile
from triptych.calibration.batch import Cases, run_cases
from triptych.calibration.collect import Trajectory, _Recorder
from triptych.calibration.quality import _requests
from triptych.calibration.sweep import fidelity, world_adherence
from triptych.engine import DenoiserEngine, EngineConfig
from triptych.families.models import resolve_model
from triptych.families.registry import load_family


def oracle_changes(family, plan, cases) -> dict[tuple[int, str], dict[int, float]]:
    """(case index, branch) -> {step: true uncached output rel-L1 change since the step before}."""
    traj: dict = {}
    rec = _Recorder(plan, traj)
    engine = DenoiserEngine(family, EngineConfig(max_batch_requests=4), wrap=lambda _: rec)  # as run_cases batches
    for start in range(0, len(cases), 4):
        for i in range(start, min(start + 4, len(cases))):
            st = family.prepare(f"o-{i}", cases.params[i], cases.cond(i))
            for b in st.branches():
                traj[(st.request_id, b)] = Trajectory(st.request_id, "", 0, b)
            engine.add(st)
        engine.run_until_done()
    return {(int(k[0].split("-")[1]), k[1]): dict(zip(t.steps, t.output_rel)) for k, t in traj.items()}


class Oracle(TeaCache):
    """TeaCache whose accumulated value is the row's true uncached output change (``table``)."""

    def __init__(self, plan, table, **kwargs):
        super().__init__(plan, **kwargs)
        self.table = table

    def _decide(self, steps, active, modulated):
        compute = [True] * len(steps)
        for i in active:
            s, cfg = steps[i], self._settings[steps[i].request_id]
            st = self._states.get_or_create(s.request_id, s.branch, BranchState)
            edge = s.step < cfg.warmup or s.step >= cfg.num_steps - cfg.cooldown
            if edge or st.residual is None:
                st.accumulated = 0.0
            else:
                st.accumulated += self.table[(int(s.request_id.split("-")[1]), s.branch)][s.step]
                capped = cfg.max_skips is not None and st.run >= cfg.max_skips
                if st.accumulated < cfg.threshold and not capped:
                    compute[i] = False
                else:
                    st.accumulated = 0.0
            self.last_decisions.append(Decision(s.request_id, s.branch, s.step, compute[i], st.accumulated))
        return compute


def main() -> None:
    model = resolve_model(None)
    family = load_family(model)
    plan = family.teacache_plan()
    reqs = _requests(32, None, True, None)
    scenes = [s for _, s in reqs]
    cases = Cases(family, [p for p, _ in reqs])
    oracle = oracle_changes(family, plan, cases)
    base = find_profile(model, 20, family.name)
    plain, _ = run_cases(cases, 0.0, batch_size=4, tag="p")
    pa = world_adherence([o.frames for o in plain], scenes)
    print("| oracle threshold | warmup | cap | skipped | forwards ÷ | PSNR mean / worst | SSIM worst | adherence |")
    for warmup, cap in [(1, None), (4, None), (4, 2)]:
        prof = dataclasses.replace(base, warmup=warmup, max_skips=cap)
        for t in [0.1, 0.2, 0.3, 0.5]:
            got, _ = run_cases(cases, t, Oracle(plan, oracle, profiles=lambda n, p=prof: p), 4, tag="x")
            fid = fidelity(got, plain)
            comp = sum(o.computed for o in got)
            tot = sum(o.computed + o.skipped for o in got)
            adh = world_adherence([o.frames for o in got], scenes)
            print(
                f"| {t} | {warmup} | {cap or '-'} | {1 - comp / tot:.0%} | {tot / comp:.2f} "
                f"| {fid['psnr_mean']:.1f} / {fid['psnr_min']:.1f} | {fid['ssim_min']:.3f} | {pa:.0%} → {adh:.0%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
