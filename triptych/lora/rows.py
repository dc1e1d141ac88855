"""Adapters as rows: one forward over a batch whose rows use different LoRAs (or several, or none).

``RowLora`` attaches a forward hook to each adapted ``nn.Linear`` of a transformer. A forward runs
inside ``rows.plan(specs)``, ``specs[i]`` being row i's ``((adapter, scale), ...)``; each hooked layer
then adds, for every adapter used in the batch, ``scale_row * module_scale * (x[rows] @ A.T) @ B.T``
to the rows that use it (a gather, two small matmuls, an ``index_add``: one segment per adapter,
not per row). Rows of one request's CFG branches carry the same specs, so both use its adapter, as
diffusers does. Outside a plan (or with no adapter in it) a hook returns at its first check: the base
layer's output is untouched, so a batch without adapters is bit-identical to the model without
hooks. The base weights are never changed: adapters are rows, never merged.

On a sequence-parallel rank (Ulysses, ring) a layer sees this rank's shard of the tokens; the delta
is per token, so the hook applies it to the shard. A layer whose output the split gathers (the
model's ``_cp_plan`` output, e.g. ``proj_out``) returns the whole sequence from a shard's input: its
delta is gathered the same way before it is added (``triptych.parallel.gather.output_gather``).
With CFG parallel each rank runs the forward over its half of the rows, planned for those rows.

Contract: the plan lives for one forward only (a context manager), on the ``RowLora`` object, never
on a request; the hooks read the adapters' tensors and hold no reference to them between forwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from triptych.lora.adapter import Adapter
from triptych.parallel.gather import output_gather

#: One row's adapters, in the order their deltas are added: ``((adapter, scale), ...)``.
RowSpec = tuple[tuple[Adapter, float], ...]


@dataclass
class Segment:
    """The rows of one forward that use one adapter: ``rows`` None = every row (no gather)."""

    adapter: Adapter
    rows: torch.Tensor | None
    scales: torch.Tensor | float  # per row of ``rows`` (a scalar when every row has the same)


class RowLora:
    """Per-row LoRA over one transformer. ``attach`` hooks the Linear layers an adapter targets
    (once per layer; layers no adapter targets never get a hook)."""

    def __init__(self, transformer: torch.nn.Module):
        self.transformer = transformer
        self._linears = {n: m for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}
        self._hooked: dict[str, object] = {}
        self._segments: list[Segment] | None = None

    def attach(self, adapter: Adapter) -> None:
        for name in adapter.modules:
            if name not in self._hooked:
                self._hooked[name] = self._linears[name].register_forward_hook(self._hook(name))

    def hook_ids(self) -> frozenset[int]:
        """Ids of the forward hooks ``attach`` registered; they return None (no change) outside ``plan``
        or for a plan without segments, so a forward with no adapter row may skip them."""
        return frozenset(h.id for h in self._hooked.values())

    def detach_all(self) -> None:
        for handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()

    @contextmanager
    def plan(self, specs: Sequence[RowSpec]):
        """Within it, the transformer's forward applies row i's adapters to row i."""
        segments = segments_of(specs, self.transformer.device if hasattr(self.transformer, "device") else None)
        self._segments = segments or None
        try:
            yield
        finally:
            self._segments = None

    def _hook(self, name: str):
        def hook(module, args, output):
            segments = self._segments
            if segments is None:
                return None
            x = args[0]
            gather = output_gather(module)
            for seg in segments:
                m = seg.adapter.modules.get(name)
                if m is None:
                    continue
                xs = x if seg.rows is None else x.index_select(0, seg.rows)
                delta = torch.nn.functional.linear(torch.nn.functional.linear(xs, m.a), m.b)
                if isinstance(seg.scales, float):
                    delta = delta * (seg.scales * m.scale)
                else:
                    delta = delta * (seg.scales * m.scale).view(-1, *([1] * (delta.dim() - 1))).to(delta.dtype)
                if gather is not None:
                    delta = gather(delta)
                output = output + delta if seg.rows is None else output.index_add(0, seg.rows, delta)
            return output

        # NOTE: the hook runs outside any compiled graph (``--compile``): traced, it would specialise on
        # the plan (which adapters, how many segments, the scales) and compile a graph per mix of
        # rows, falling back to eager after dynamo's recompile limit. Left to eager, the block's
        # graphs break around it once and hold for every mix (tests/pipelines/test_lora_compile.py).
        return torch.compiler.disable(hook)


def segments_of(specs: Sequence[RowSpec], device=None) -> list[Segment]:
    """Group rows by adapter (first use order). An adapter every row uses at one scale needs no gather."""
    by_name: dict[str, tuple[Adapter, list[int], list[float]]] = {}
    for i, spec in enumerate(specs):
        for adapter, scale in spec:
            entry = by_name.setdefault(adapter.name, (adapter, [], []))
            entry[1].append(i)
            entry[2].append(float(scale))
    out = []
    for adapter, rows, scales in by_name.values():
        if len(rows) == len(specs) and len(set(scales)) == 1:
            out.append(Segment(adapter, None, scales[0]))
        else:
            out.append(Segment(adapter, torch.tensor(rows, device=device), torch.tensor(scales, device=device)))
    return out
