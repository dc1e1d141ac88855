"""CUDA graphs of the denoising step's transformer forward, one per (batch bucket, shapes, dtypes).

A family describes one transformer call over stacked rows as a ``GraphCall``: the function to run,
its tensor arguments, which of them are per row (dim 0 = rows), and the non-tensor settings the
function closes over (a graph replays them as they were at capture). ``StepGraphs`` decides, per
call, between replaying a captured graph and running the call eagerly:

- the rows are padded up to the smallest bucket that holds them (``SpeedConfig.graph_buckets``);
  more rows than the largest bucket run eagerly;
- a graph is keyed by the bucket, every tensor's shape without its batch dimension, dtype and
  device, and the call's settings: a new text length or image size is a new graph;
- each graph keeps its own static input buffers; a replay copies the rows in, fills the padding rows
  with copies of row 0 (a valid input, so padding cannot make a row non-finite), replays, and returns
  the first rows of the static output, cloned (the next replay overwrites it);
- captured graphs are bounded by count (``graph_max``) and by the bytes their pools took
  (``graph_pool_mib``): past either, ``lru`` drops the least recently replayed graph, ``refuse``
  runs the new key eagerly from then on;
- a call the backend refuses (a CPU tensor) or whose capture fails runs eagerly, and its key is not
  tried again.

Every eager call is counted under its reason (``StepGraphStats.fallbacks``). Rows are independent in
every supported transformer (attention, norms and modulation are per row), so a padded replay gives
the real rows what an unpadded forward gives them, up to the kernels' choice for a larger batch
(tests/pipelines/test_step_graph_padding.py measures it).

Ownership: ``StepGraphs`` owns its graphs, their buffers and pools; ``clear`` frees them all. The
capture itself is a ``CaptureBackend`` (``accel/cuda_capture.py`` on a GPU; a fake in tests), so
everything here runs on CPU.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)

#: The fallback reasons ``StepGraphStats.fallbacks`` counts (a family may add its own, e.g. ``lora``).
ABOVE_BUCKETS = "rows above the largest bucket"
LIMIT_REFUSED = "graph limit reached (policy refuse)"
TOO_LARGE = "one graph larger than graph_pool_mib"
UNCAPTURABLE = "capture refused or failed"


@dataclass(frozen=True)
class GraphCall:
    """One transformer call over ``rows`` stacked rows, as a graph can replay it."""

    fn: Callable[..., torch.Tensor]  # fn(rows, **tensors) -> (rows, ...) output; rows = the padded count
    tensors: Mapping[str, torch.Tensor | None]  # every tensor argument (None: passed as None)
    batched: frozenset[str]  # the names whose dim 0 is rows (the others are shared by every row)
    rows: int  # rows of this call
    settings: tuple = ()  # hashable: what else ``fn`` closes over that fixes the graph (sizes, flags)


class Captured(Protocol):
    """A recorded call: ``replay`` reruns it on the buffers it was recorded with."""

    output: torch.Tensor  # the static output the replay writes
    nbytes: int  # bytes its memory pool holds

    def replay(self) -> None: ...


class CaptureBackend(Protocol):
    def refusal(self, tensors: Mapping[str, torch.Tensor | None]) -> str | None:
        """Why these inputs cannot be captured (e.g. not on a CUDA device); None when they can."""

    def capture(self, run: Callable[[], torch.Tensor], device: torch.device) -> Captured:
        """Warm ``run`` (its inputs on ``device``) up and record it; raises ``RuntimeError`` when it
        cannot be recorded."""


@dataclass
class StepGraphStats:
    """Counts since the runner was made (the engine's stats and logs read them)."""

    captures: int = 0
    replays: int = 0
    evictions: int = 0
    padded_rows: int = 0  # padding rows replayed (work a bucket adds)
    pool_bytes: int = 0  # bytes the live graphs' pools hold now
    fallbacks: Counter = field(default_factory=Counter)  # reason -> eager calls


@dataclass
class _Graph:
    captured: Captured
    buffers: dict[str, torch.Tensor | None]


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``rows`` rows; None when none does."""
    return min((b for b in buckets if b >= rows), default=None)


def graph_key(call: GraphCall, bucket: int) -> tuple:
    """What fixes a graph: the bucket, each tensor's per-row shape, dtype and device, the settings."""
    shapes = []
    for name in sorted(call.tensors):
        t = call.tensors[name]
        if t is None:
            shapes.append((name, None))
            continue
        shape = tuple(t.shape[1:]) if name in call.batched else tuple(t.shape)
        shapes.append((name, name in call.batched, shape, t.dtype, str(t.device)))
    return (bucket, tuple(shapes), call.settings)


def pad_rows(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """``x`` (rows first) with rows appended up to ``bucket``, each a copy of row 0."""
    extra = bucket - x.shape[0]
    if extra <= 0:
        return x
    return torch.cat([x, x[:1].expand(extra, *x.shape[1:])])


class StepGraphs:
    """Replays ``GraphCall`` s from graphs captured per key (see the module docstring)."""

    def __init__(
        self,
        backend: CaptureBackend,
        buckets: tuple[int, ...] = (1, 2, 4, 8),
        max_graphs: int = 16,
        pool_bytes: int | None = None,
        policy: str = "lru",
    ):
        assert buckets and all(b >= 1 for b in buckets), buckets
        assert policy in ("lru", "refuse"), policy
        self.backend, self.buckets = backend, tuple(sorted(set(buckets)))
        self.max_graphs, self.pool_bytes, self.policy = max_graphs, pool_bytes, policy
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()  # least recently replayed first
        self._refused: dict[tuple, str] = {}  # keys that run eagerly from now on, and why
        self.stats = StepGraphStats()

    def __len__(self) -> int:
        return len(self._graphs)

    def keys(self) -> list[tuple]:
        """The captured keys, least recently replayed first."""
        return list(self._graphs)

    def graph_bytes(self) -> list[int]:
        """Each captured graph's pool bytes, least recently replayed first."""
        return [g.captured.nbytes for g in self._graphs.values()]

    def fallback(self, reason: str) -> None:
        """Count one eager call for ``reason`` (the caller runs it)."""
        logger.debug("step graphs: an eager forward (%s)", reason)
        self.stats.fallbacks[reason] += 1

    def run(self, call: GraphCall) -> torch.Tensor | None:
        """The call's output, rows ``call.rows``, from a graph (captured now if new); None when it must
        run eagerly (the reason counted)."""
        assert all(call.tensors[n] is None or call.tensors[n].shape[0] == call.rows for n in call.batched), call.rows
        bucket = bucket_for(call.rows, self.buckets)
        if bucket is None:
            return self._eager(ABOVE_BUCKETS)
        key = graph_key(call, bucket)
        if key in self._refused:
            return self._eager(self._refused[key])
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(key, call, bucket)
            if graph is None:
                return self._eager(self._refused.get(key, LIMIT_REFUSED))
        else:
            self._graphs.move_to_end(key)
        self._fill(graph.buffers, call, bucket)
        graph.captured.replay()
        self.stats.replays += 1
        self.stats.padded_rows += bucket - call.rows
        return graph.captured.output[: call.rows].clone()

    def clear(self) -> None:
        """Drop every graph (their pools go back to the allocator) and forget refused keys."""
        self._graphs.clear()
        self._refused.clear()
        self.stats.pool_bytes = 0

    def _eager(self, reason: str) -> None:
        self.fallback(reason)
        return None

    def _capture(self, key: tuple, call: GraphCall, bucket: int) -> _Graph | None:
        if self.policy == "refuse" and len(self._graphs) >= self.max_graphs:
            return None
        if why := self.backend.refusal(call.tensors):
            self._refused[key] = f"{UNCAPTURABLE}: {why}"
            return None
        if self.policy == "refuse" and self.pool_bytes is not None and self.stats.pool_bytes >= self.pool_bytes:
            return None
        while len(self._graphs) >= self.max_graphs:
            self._evict()
        buffers = {n: None if t is None else t.clone() for n, t in call.tensors.items()}
        for name in call.batched:
            if buffers.get(name) is not None:
                buffers[name] = pad_rows(buffers[name], bucket).contiguous()
        try:
            device = next(t.device for t in call.tensors.values() if t is not None)
            captured = self.backend.capture(lambda: call.fn(bucket, **buffers), device)
        except RuntimeError as e:
            logger.warning("step graph for %d rows not captured, running eagerly: %s", bucket, e)
            self._refused[key] = f"{UNCAPTURABLE}: {type(e).__name__}"
            return None
        if self.pool_bytes is not None and captured.nbytes > self.pool_bytes:
            self._refused[key] = TOO_LARGE
            return None
        graph = _Graph(captured, buffers)
        self._graphs[key] = graph
        self.stats.captures += 1
        self.stats.pool_bytes += captured.nbytes
        while self.pool_bytes is not None and self.stats.pool_bytes > self.pool_bytes:
            if self.policy == "refuse":
                self._drop(key)
                self._refused[key] = LIMIT_REFUSED
                return None
            self._evict()
        logger.info("step graph captured: %d rows (bucket %d), %d graphs live", call.rows, bucket, len(self._graphs))
        return graph

    def _evict(self) -> None:
        key = next(iter(self._graphs))
        self._drop(key)
        self.stats.evictions += 1

    def _drop(self, key: tuple) -> None:
        graph = self._graphs.pop(key)
        self.stats.pool_bytes -= graph.captured.nbytes

    @staticmethod
    def _fill(buffers: dict[str, Any], call: GraphCall, bucket: int) -> None:
        for name, t in call.tensors.items():
            buf = buffers[name]
            if t is None:
                continue
            if name in call.batched:
                buf[: call.rows].copy_(t)
                if bucket > call.rows:
                    buf[call.rows :].copy_(t[:1].expand(bucket - call.rows, *t.shape[1:]))
            else:
                buf.copy_(t)
