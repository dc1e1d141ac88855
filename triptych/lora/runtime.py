"""One component's LoRA runtime (a denoiser's transformer, an encoder's text encoder): the served
adapters, the byte-budgeted store, the per-row hooks.

A request's adapters are acquired when it joins the engine and released when it leaves
(``acquire``/``release``); each forward runs inside ``plan(specs)`` with one spec per row,
``((name, scale), ...)``. The family builds one per adapted component (``Family.enable_lora``) with
its own reader, so the adapter files are read and checked against that module (modules, shapes)
before any row uses them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path

import torch

from triptych.core.errors import InvalidParam
from triptych.lora.adapter import Adapter
from triptych.lora.config import LoraConfig
from triptych.lora.rows import RowLora
from triptych.lora.store import AdapterStore

#: A row's adapters by name: ``((name, scale), ...)``.
NamedSpec = tuple[tuple[str, float], ...]


class LoraRuntime:
    def __init__(self, module: torch.nn.Module, config: LoraConfig, read: Callable[[str, Path], Adapter]) -> None:
        """``read(name, path)``: the adapter's part for ``module`` on its device and dtype, checked to fit."""
        self.config = config
        self.paths = dict(config.adapters)
        self.rows = RowLora(module)
        self.store = AdapterStore(config.budget_bytes, self._load, on_load=self.rows.attach)
        self._read = read

    @property
    def stats(self):
        return self.store.stats

    def add_path(self, name: str, path: Path) -> None:
        """Serve one more adapter (``generate --lora DIR``)."""
        self.paths[name] = Path(path)

    def _load(self, name: str) -> Adapter:
        if name not in self.paths:
            raise InvalidParam("lora", name, f"is not a served adapter (served: {sorted(self.paths)})")
        return self._read(name, self.paths[name])

    def acquire(self, request_id: str, spec: NamedSpec) -> None:
        self.store.acquire(request_id, [name for name, _ in spec])

    def release(self, request_id: str) -> None:
        self.store.release(request_id)

    def plan(self, specs: Sequence[NamedSpec]):
        """The context one forward over rows with these specs runs in (a no-op when none has one).
        An adapter with no module in this component (a transformer-only file on the text encoder, or
        the reverse) is left out of the rows: it changes nothing here."""
        rows = [tuple((a, s) for a, s in ((self.store.get(n), s) for n, s in spec) if a.modules) for spec in specs]
        if not any(rows):
            return nullcontext()
        if len({tuple((a.name, s) for a, s in row) for row in rows}) > 1:
            self.store.stats.mixed_batches += 1
        return self.rows.plan(rows)
