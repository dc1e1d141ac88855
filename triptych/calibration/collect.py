"""Reference trajectories for TeaCache calibration.

Runs uncached denoising (every step computes) for several prompts × seeds and records, per row
(request × CFG branch) and step, the relative L1 change since the previous step of

- the *modulated input* (what TeaCache measures at serving time, from the family's plan), and
- the transformer *output* (what TeaCache tries to predict).

``triptych.calibration.fit`` turns these pairs into a profile's polynomial.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from triptych.accel.teacache import TeaCachePlan
from triptych.families.base import Family, GenerationParams, Row

DEFAULT_PROMPTS = (
    "a red fox in a snowy forest at dawn",
    "a bowl of ramen on a wooden table, studio light",
    "an old lighthouse on a cliff during a storm",
    "a watercolor map of an imaginary island",
)


def rel_l1(cur: torch.Tensor, prev: torch.Tensor) -> float:
    """``mean|cur - prev| / mean|prev|`` in float32 (the same measure the cache uses)."""
    cur, prev = cur.float(), prev.float()
    return float((cur - prev).abs().mean() / prev.abs().mean())


@dataclass
class Trajectory:
    """One row's record: ``input_rel[k]``/``output_rel[k]`` compare step ``steps[k]`` with the step before."""

    request_id: str
    prompt: str
    seed: int
    branch: str
    steps: list[int] = field(default_factory=list)
    input_rel: list[float] = field(default_factory=list)
    output_rel: list[float] = field(default_factory=list)


class _Recorder:
    """A ``forward`` for ``denoise_step`` that runs the plan's uncached split forward and records."""

    def __init__(self, plan: TeaCachePlan, trajectories: dict[tuple[str, str], Trajectory]):
        self.plan = plan
        self.trajectories = trajectories
        self.previous: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def __call__(self, rows: Sequence[Row]) -> torch.Tensor:
        emb = self.plan.embed(rows)
        modulated = self.plan.modulated_input(emb)
        out = self.plan.head(emb, self.plan.blocks(emb, None))
        for i, row in enumerate(rows):
            key = (row.state.request_id, row.branch)
            cur = (modulated[i : i + 1].clone(), out[i : i + 1].clone())
            if key in self.previous:
                prev = self.previous[key]
                traj = self.trajectories[key]
                traj.steps.append(row.state.step)
                traj.input_rel.append(rel_l1(cur[0], prev[0]))
                traj.output_rel.append(rel_l1(cur[1], prev[1]))
            self.previous[key] = cur
        return out


def collect(
    family: Family,
    steps: int,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    seeds: Sequence[int] = (0, 1),
    base: GenerationParams | None = None,
    plan: TeaCachePlan | None = None,
    batch_size: int = 4,
) -> list[Trajectory]:
    """Uncached trajectories of ``prompts × seeds`` at ``steps``; ``base`` sets the other parameters
    (size, guidance, negative prompt / true CFG). Requests run ``batch_size`` at a time."""
    from triptych.engine import DenoiserEngine, EngineConfig

    plan = plan or family.teacache_plan()
    base = base or GenerationParams(prompt="-")
    jobs = [(p, s) for p in prompts for s in seeds]
    trajectories: dict[tuple[str, str], Trajectory] = {}
    recorder = _Recorder(plan, trajectories)
    engine = DenoiserEngine(family, EngineConfig(max_batch_requests=batch_size), wrap=lambda _: recorder)
    for start in range(0, len(jobs), batch_size):
        for n, (prompt, seed) in enumerate(jobs[start : start + batch_size], start):
            params = family.resolve(base.replace(prompt=prompt, seed=seed, steps=steps, teacache_threshold=0.0))
            state = family.prepare(f"calib-{n}", params, family.encode(params))
            for branch in state.branches():
                trajectories[(state.request_id, branch)] = Trajectory(state.request_id, prompt, seed, branch)
            engine.add(state)
        engine.run_until_done()  # the serving engine's ticks, the recorder as its forward
    return list(trajectories.values())
