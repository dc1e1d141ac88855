"""``--compile``'s schedule tables on Qwen-Image's fast path: read at each step, bounded in size.

With ``--compile`` a request's ``prepare`` computes the timestep embedding, every block's modulation
and ``norm_out``'s (1 + scale, shift) for every step of its schedule in one batch
(``FastForward.schedule``), and the compiled stack's forward reads its step's row (``from_schedule``).
Such a table is ``steps x blocks x 12 x dim`` floats: 2.7 MB on the default model (20 steps), but
about 440 MB for a 60-block, 3072-wide checkpoint at 50 steps, per request. Above ``SCHEDULE_BYTES``
a request has none and each step computes its own row, as without ``--compile`` (``fits_schedule``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from triptych.families.base import DenoiseState

#: the largest schedule table (every step's temb, modulation and head's) a request keeps
SCHEDULE_BYTES = 64 << 20


def fits_schedule(transformer, steps: int) -> bool:
    """Whether ``steps`` rows of ``transformer``'s modulation table take at most ``SCHEDULE_BYTES``."""
    dim, blocks = transformer.img_in.weight.shape[0], len(transformer.transformer_blocks)
    per_step = (blocks * 12 + 3) * dim * transformer.img_in.weight.element_size()
    return steps * per_step <= SCHEDULE_BYTES


def from_schedule(states: Sequence[DenoiseState]) -> tuple | None:
    """The rows' (temb, modulation, norm_out's) at their steps from the schedule tables, shaped as
    ``FastForward.embed`` shapes its own; None when a state has none."""
    if any(s.step_consts.schedule is None for s in states):
        return None
    (temb, mods, head), step = states[0].step_consts.schedule, states[0].step
    if len(states) == 1:
        return temb[step : step + 1], mods[step], head[step]
    if all(s is states[0] for s in states):  # one request's rows (its CFG branches): its row, broadcast
        n, mods, head = len(states), mods[step][:, :, :, None, None], head[step][:, None, None]
        return temb[step : step + 1].expand(n, -1), mods.expand(-1, -1, -1, n, 1, -1), head.expand(-1, n, 1, -1)
    rows = [(s.step_consts.schedule, s.step) for s in states]
    temb, mods, head = (torch.stack([table[i][step] for table, step in rows]) for i in range(3))
    return temb, mods.permute(1, 2, 3, 0, 4).unsqueeze(4), head.permute(1, 0, 2).unsqueeze(2)
