"""TeaCache: per-request, per-CFG-branch reuse of the transformer blocks' residual between steps.

Paper: Liu et al., "Timestep Embedding Tells: It's Time to Cache for Video Diffusion Model"
(TeaCache), https://arxiv.org/abs/2411.19108.

How it decides. For every row (one request's one CFG branch at its current step) the family computes
the *modulated input*: the timestep-embedding-modulated input of the first transformer block (for
FLUX: ``x_embedder`` + time/guidance/text embedding → first block's ``norm1``). The relative L1
change of that input since the row's previous step, ``mean|m_t - m_{t-1}| / mean|m_{t-1}|``, is
rescaled by a calibrated polynomial (the estimated relative change of the model output) and
accumulated. While the accumulated value stays below the request's threshold the row *skips* the
block stack: its hidden state is the embedded input plus the residual (``blocks(x) - x``) cached the
last time it computed, or, with the profile's ``forecast`` 1, the line through the residuals of its
last two computed steps extrapolated to the current step (TaylorSeer's first order, Liu et al.,
https://arxiv.org/abs/2503.06923; the last residual alone while only one is known); the output head
(final norm with the row's current timestep embedding, then the projection) always runs. When the
sum reaches the threshold the row computes and the sum resets. The first ``warmup`` and last
``cooldown`` steps of a request always compute, and a profile may cap the run of consecutive skips
of a row (``max_skips``). A threshold of ``AUTO_THRESHOLD`` (``"auto"``) means the profile's
recommended threshold, resolved when the request is admitted.

Ownership and lifetime. A :class:`TeaCache` is owned by whoever runs
the batch (the denoiser engine), one per loaded family; it never stores anything on the transformer
module. Its state is keyed by ``(request_id, cfg_branch)`` (:class:`RequestStateStore`), created the
first time a request with a threshold > 0 appears, and dropped by ``release(request_id)``, which the
engine calls when the request finishes, fails or is aborted. Rows whose threshold is 0 create no
state; a batch where no row uses TeaCache goes through the family's own ``forward`` unchanged, so
threshold 0 is the baseline bit for bit.

Batching. Within one call the rows that compute (threshold-0 rows included) run the block stack as
ONE call over that sub-batch; skipping rows only add their cached residual. The decision of a row
depends only on that row's own inputs and state, so a request makes the same decisions alone or in a
batch (up to batch-composition rounding of ~1e-7 in the rel-L1 values).

Adding a family: write ``triptych/families/<family>/teacache.py`` with ``make_plan(transformer) ->
TeaCachePlan`` (see the FLUX one: ``describe`` is family-independent and can be reused), test that
``head(e, blocks(e, None))`` equals the family's ``forward``, return it from the family's
``Family.teacache_plan`` and set ``teacache=True`` on its entry in ``triptych.families.registry``.
Modulated inputs used by the TeaCache reference code: Qwen-Image, the first block's ``img_mod(temb)``
shift/scale applied to ``img_norm1(hidden)``; Wan 2.1, the timestep embedding after ``time_projection``
(``e0``) or before it (``e``), per the paper's two variants.

The polynomial comes from a calibration profile for the family and step schedule
(:mod:`triptych.accel.teacache_profile`: the file format, its loader and lookup); without one a request
with a threshold > 0 is refused unless it brings its coefficients.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from triptych.accel.hooks import RequestStateStore
from triptych.accel.teacache_profile import TeaCacheProfile
from triptych.accel.teacache_settings import RequestSettings, TeaCacheConfig, resolve_settings

logger = logging.getLogger(__name__)


# ---- what a family hands the cache ---------------------------------------------------------------
@dataclass(frozen=True)
class RowStep:
    """What TeaCache needs to know about one row; produced by the family plan's ``describe``."""

    request_id: str
    branch: str
    step: int  # index of the step this row is at
    num_steps: int  # the request's total steps
    threshold: float  # the request's teacache_threshold; 0 = off
    coefficients: tuple[float, ...] | None = None  # explicit per-request coefficients (overrides a profile)


class Embedded(Protocol):
    """A family's embedded batch: ``hidden`` is the (rows, ...) input of the block stack."""

    hidden: torch.Tensor


@dataclass(frozen=True)
class TeaCachePlan:
    """The family's pieces (``triptych/families/<family>/teacache.py`` builds one).

    Contract: ``head(e, blocks(e, None))`` over ``e = embed(rows)`` equals the family's ``forward(rows)``
    (bit-identical for FLUX; tests check it).
    """

    family: str
    describe: Callable[[Any], RowStep]  # row -> RowStep
    embed: Callable[[Sequence[Any]], Embedded]  # rows -> embedded batch (one call)
    modulated_input: Callable[[Embedded], torch.Tensor]  # embedded -> (rows, ...) modulated input
    blocks: Callable[[Embedded, torch.Tensor | None], torch.Tensor]  # block stack on rows idx (None = all)
    head: Callable[[Embedded, torch.Tensor], torch.Tensor]  # (embedded, hidden of every row) -> output


# ---- config and state ----------------------------------------------------------------------------
@dataclass
class BranchState:
    """TeaCache state of one (request, CFG branch). Tensors are owned (no views into batch buffers);
    ``earlier_residual`` is kept only with a forecast (``RequestSettings.forecast`` 1)."""

    previous_input: torch.Tensor | None = None
    accumulated: float = 0.0
    residual: torch.Tensor | None = None
    residual_step: int = -1  # the step ``residual`` was computed at
    earlier_residual: torch.Tensor | None = None  # the computed residual before ``residual``
    earlier_step: int = -1
    computed: int = 0
    skipped: int = 0
    run: int = 0  # consecutive skips up to now


@dataclass(frozen=True)
class Decision:
    request_id: str
    branch: str
    step: int
    compute: bool
    accumulated: float  # value after this step (0 when it computed)


@dataclass
class TeaCacheStats:
    """Counters since construction; the engine turns them into metrics."""

    block_calls: int = 0  # block-stack calls made by TeaCache (one per call with a computing row)
    base_calls: int = 0  # calls handed to the family's forward unchanged (no TeaCache row)
    rows_computed: int = 0
    rows_skipped: int = 0
    overridden: int = 0  # rows whose own decision differed from the leader's (multi-rank only)


class RankComposition(Protocol):
    """How a multi-rank instance runs TeaCache's pieces (``triptych.parallel.cache`` builds one).

    Every rank runs the same ``TeaCache.forward`` on the same rows (the tick is broadcast); these
    three calls are where the ranks meet. Contract: ``blocks(run, idx)`` returns, on every rank, what
    ``run(idx)`` returns on one rank (the block stack of rows ``idx``; with sequence parallel, this
    rank's shard of the tokens); ``local(hidden)`` is this rank's shard of a block-stack input, the
    one the block stack's own split gives it (identity without sequence parallel); ``agree`` returns
    the leader's decisions and accumulated values for the rows, so every rank skips the same rows.
    """

    def blocks(self, run: Callable[[list[int]], torch.Tensor], idx: list[int]) -> torch.Tensor: ...

    def local(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def agree(self, compute: list[bool], accumulated: list[float]) -> tuple[list[bool], list[float]]: ...


# ---- the cache -----------------------------------------------------------------------------------
class TeaCache:
    """Wraps the family's transformer call for a batch of rows; see the module docstring.

    ``profiles(steps)`` returns the calibration for a step count or None (e.g.
    :class:`~triptych.accel.teacache_profile.ProfileIndex`).
    Engine use::

        tc = TeaCache(family.teacache_plan(), profiles=ProfileIndex(model_dir, family.name))
        tc.admit(rid, threshold=p.teacache_threshold, steps=p.steps)      # at join: raises InvalidParam
        family.denoise_step(batch, fuse_cfg=..., forward=tc.bind(family.forward))
        tc.release(rid)                                                    # finished / failed / aborted
    """

    def __init__(
        self,
        plan: TeaCachePlan,
        profiles: Callable[[int], TeaCacheProfile | None] | None = None,
        config: TeaCacheConfig | None = None,
        ranks: RankComposition | None = None,
        lora_plan: Callable[[Sequence[Any]], Any] | None = None,
    ):
        """``ranks``: the instance's composition when this cache runs on every rank of a multi-rank
        denoiser (``triptych.parallel.cache``); None on a single rank. ``lora_plan(rows)``: the context
        applying the rows' LoRA adapters (``Family.lora_plan``), around each piece of the forward."""
        self.plan = plan
        self.ranks = ranks
        self.lora_plan = lora_plan
        self.profiles = profiles or (lambda steps: None)
        self.config = config or TeaCacheConfig()
        self.stats = TeaCacheStats()
        self.last_decisions: list[Decision] = []
        self._settings: dict[str, RequestSettings] = {}
        self._states: RequestStateStore[BranchState] = RequestStateStore()

    # -- lifecycle ---------------------------------------------------------------------------------
    def resolve(self, threshold: float, steps: int, coefficients: Sequence[float] | None = None) -> RequestSettings:
        """Check a request's TeaCache parameters; raises ``InvalidParam`` (HTTP 400) when unusable."""
        return resolve_settings(self.plan.family, self.profiles, self.config, threshold, steps, coefficients)

    def admit(self, request_id: str, threshold: float, steps: int, coefficients: Sequence[float] | None = None) -> None:
        """Register a request before its first step (optional: ``forward`` admits unseen rows itself)."""
        if threshold == 0:
            return
        self._settings[request_id] = self.resolve(threshold, steps, coefficients)

    def release(self, request_id: str) -> None:
        """Drop every state of the request (finish, failure or abort); unknown ids are a no-op."""
        self._settings.pop(request_id, None)
        self._states.release(request_id)

    def request_states(self, request_id: str) -> list[BranchState]:
        """The request's branch states (what the engine parks with the request when it is preempted)."""
        return list(self._states.of(request_id).values())

    def active_requests(self) -> list[str]:
        return sorted(set(self._settings) | set(self._states.requests()))

    def num_states(self) -> int:
        """Number of (request, branch) states held (not ``__len__``: an empty cache must stay truthy)."""
        return len(self._states)

    def bind(self, base_forward: Callable[[Sequence[Any]], torch.Tensor]) -> Callable[[Sequence[Any]], torch.Tensor]:
        """A ``forward(rows)`` for ``Family.denoise_step`` that applies this cache around ``base_forward``."""
        return lambda rows: self.forward(rows, base_forward)

    # -- the step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, rows: Sequence[Any], base_forward: Callable[[Sequence[Any]], torch.Tensor]) -> torch.Tensor:
        """Noise predictions for ``rows`` (same contract as ``Family.forward``)."""
        steps = [self.plan.describe(r) for r in rows]
        active = [i for i, s in enumerate(steps) if s.threshold > 0]
        self.last_decisions = []
        if not active:
            self.stats.base_calls += 1
            return base_forward(rows)
        for i in active:
            s = steps[i]
            if s.request_id not in self._settings:
                self._settings[s.request_id] = self.resolve(s.threshold, s.num_steps, s.coefficients)
        with self._adapters(rows):
            emb = self.plan.embed(rows)
            compute = self._decide(steps, active, self.plan.modulated_input(emb))
        return self._run(emb, steps, compute, rows)

    def _adapters(self, rows: Sequence[Any]):
        """The rows' LoRA adapters applied to the pieces of the forward run here (``family.lora_plan``,
        which ``Family.forward`` applies itself on the plain path); a no-op without adapters."""
        return self.lora_plan(rows) if self.lora_plan is not None else contextlib.nullcontext()

    def _decide(self, steps: list[RowStep], active: list[int], modulated: torch.Tensor) -> list[bool]:
        compute = [True] * len(steps)
        states = [self._states.get_or_create(steps[i].request_id, steps[i].branch, BranchState) for i in active]
        have_prev = [k for k, st in enumerate(states) if st.previous_input is not None]
        rel: dict[int, float] = {}
        if have_prev:
            cur = modulated[[active[k] for k in have_prev]].float()
            prev = torch.cat([states[k].previous_input for k in have_prev]).float()
            dims = tuple(range(1, cur.ndim))
            values = ((cur - prev).abs().mean(dim=dims) / prev.abs().mean(dim=dims)).tolist()
            rel = dict(zip(have_prev, values))
        for k, (i, st) in enumerate(zip(active, states)):
            s, cfg = steps[i], self._settings[steps[i].request_id]
            edge = s.step < cfg.warmup or s.step >= cfg.num_steps - cfg.cooldown
            if edge or k not in rel or st.residual is None:
                st.accumulated = 0.0
            else:
                # NOTE: a negative polynomial value (outside the fitted range) counts as no change, not as
                # a credit against later steps.
                st.accumulated += max(0.0, float(np.polyval(cfg.coefficients, rel[k])))
                capped = cfg.max_skips is not None and st.run >= cfg.max_skips
                if st.accumulated < cfg.threshold and not capped:
                    compute[i] = False
                else:
                    st.accumulated = 0.0
            st.previous_input = modulated[i : i + 1].clone()
        if self.ranks is not None:
            self._agree(compute, active, states)
        for i, st in zip(active, states):
            s = steps[i]
            self.last_decisions.append(Decision(s.request_id, s.branch, s.step, compute[i], st.accumulated))
        return compute

    def _agree(self, compute: list[bool], active: list[int], states: list[BranchState]) -> None:
        """Adopt the leader's decisions (a multi-rank instance decides once, on rank 0)."""
        mine = [compute[i] for i in active]
        leader, accumulated = self.ranks.agree(mine, [st.accumulated for st in states])
        for k, (i, st) in enumerate(zip(active, states)):
            if leader[k] != mine[k]:
                self.stats.overridden += 1
                logger.debug("teacache: row %d follows the leader (%s)", i, "compute" if leader[k] else "skip")
            compute[i] = leader[k]
            st.accumulated = accumulated[k]

    def _run(self, emb: Embedded, steps: list[RowStep], compute: list[bool], rows: Sequence[Any]) -> torch.Tensor:
        n = len(steps)
        idx = [i for i in range(n) if compute[i]]
        computed = None
        if idx:
            computed = self._blocks(emb, idx, rows)
            self.stats.block_calls += 1
        self.stats.rows_computed += len(idx)
        self.stats.rows_skipped += n - len(idx)
        pos = {i: k for k, i in enumerate(idx)}
        pieces = []
        for i, s in enumerate(steps):
            if s.threshold > 0:
                st = self._states.get(s.request_id, s.branch)
                if compute[i]:
                    forecast = self._settings[s.request_id].forecast
                    self._keep(st, computed[pos[i] : pos[i] + 1] - self._local(emb.hidden[i : i + 1]), s.step, forecast)
                    st.computed += 1
                    st.run = 0
                else:
                    st.skipped += 1
                    st.run += 1
            if len(idx) < n:
                pieces.append(
                    computed[pos[i] : pos[i] + 1]
                    if compute[i]
                    else self._local(emb.hidden[i : i + 1]) + self._residual_at(st, s.step)
                )
        hidden = computed if len(idx) == n else torch.cat(pieces)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("teacache: %d/%d rows computed", len(idx), n)
        with self._adapters(rows):
            return self.plan.head(emb, hidden)

    @staticmethod
    def _keep(st: BranchState, residual: torch.Tensor, step: int, forecast: int) -> None:
        """Store a computed residual; a forecast also keeps the one before it."""
        if forecast:
            st.earlier_residual, st.earlier_step = st.residual, st.residual_step
        st.residual, st.residual_step = residual, step

    @staticmethod
    def _residual_at(st: BranchState, step: int) -> torch.Tensor:
        """What a row skipping ``step`` adds: the last residual, or its linear forecast when an earlier
        one is kept (``r1 + (r1 - r0) * (step - s1) / (s1 - s0)``, per rank on its local shard)."""
        if st.earlier_residual is None:
            return st.residual
        slope = (st.residual - st.earlier_residual) / (st.residual_step - st.earlier_step)
        return st.residual + slope * (step - st.residual_step)

    def _blocks(self, emb: Embedded, idx: list[int], rows: Sequence[Any]) -> torch.Tensor:
        n = len(rows)

        def run(sub: list[int]) -> torch.Tensor:
            every = len(sub) == n  # ascending and distinct: all n means sub == range(n)
            with self._adapters([rows[i] for i in sub]):
                return self.plan.blocks(emb, None if every else torch.tensor(sub, device=emb.hidden.device))

        return run(idx) if self.ranks is None else self.ranks.blocks(run, idx)

    def _local(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.ranks is None else self.ranks.local(hidden)
