"""The head's view of the served adapters: which exist, which fit which model, and the check of a
request's ``lora`` field (a 400 naming the field, the value and the rule, before any worker sees it).

Torch-free (the head imports it): shapes come from the safetensors headers of the adapter file and
of the model's ``transformer/`` (and, where the family applies text-encoder LoRA, ``text_encoder/``)
weights, never from loaded tensors. A key of a component the family's format has not (text-encoder
LoRA on Qwen-Image) is refused by rule (``lora.formats``). A file in a non-diffusers layout (keys
diffusers converts on load) cannot be checked from its header; it is marked unchecked and the
worker checks it when it loads it (the request then fails with the worker's message).
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from triptych.core.errors import InvalidParam, TriptychError
from triptych.lora.config import LoraConfig
from triptych.lora.formats import LoraFormat
from triptych.lora.journal import JournalState, LoraJournal
from triptych.lora.paths import weight_file

log = logging.getLogger(__name__)

MAX_ADAPTERS_PER_REQUEST = 4
#: what the 400 for an adapter that is not served says to do
HOW_TO_SERVE = (
    "serve one with `triptych serve --lora NAME=DIR` (a bare serve serves the adapters the models ship), "
    "or load one at run time with POST /v1/loras under --lora-root"
)


def header_shapes(file: Path) -> dict[str, list[int]]:
    """Tensor name → shape from a safetensors file's header (no tensor is read)."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def model_linear_shapes(model_dir: Path, component: str = "transformer") -> dict[str, tuple[int, int]]:
    """``<module>.weight`` 2-D shapes of a model's ``component`` folder: module → (out, in). A CLIP
    checkpoint's ``text_model.`` level is dropped (as the adapter's keys are: ``lora.files``)."""
    out = {}
    for file in sorted((Path(model_dir) / component).glob("*.safetensors")):
        for key, shape in header_shapes(file).items():
            if key.endswith(".weight") and len(shape) == 2:
                out[key.removesuffix(".weight").removeprefix("text_model.")] = (shape[0], shape[1])
    return out


def misfit(
    adapter_file: Path, shapes: Mapping[str, Mapping[str, tuple[int, int]]], fmt: LoraFormat = LoraFormat()
) -> str | None:
    """The rule an adapter breaks on this model (a key of a component the family's format has not;
    its first module that is no Linear here or has other shapes), or None when it fits or cannot be
    checked from headers. ``shapes``: component → module → (out, in)."""
    tensors = header_shapes(adapter_file)
    if not all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in tensors):
        return None  # another layout (kohya, xlabs...): the worker checks it when it converts it on load
    refusal = next((r for r in map(fmt.refusal, sorted(tensors)) if r is not None), None)
    if refusal is not None:
        return f"cannot be applied to {fmt.family}: {refusal}"
    for key, shape in sorted(tensors.items()):
        component, _, rest = key.partition(".")
        module, _, part = rest.rpartition(".lora_")
        module = module.removeprefix("text_model.")
        here = shapes.get(component, {})
        where = "this model" if component == "transformer" else f"this model's {component}"
        if module not in here:
            return f"is an adapter for another model: module {module!r} is not a Linear layer of {where}"
        out_f, in_f = here[module]
        if (part == "A.weight" and shape[1] != in_f) or (part == "B.weight" and shape[0] != out_f):
            return (
                f"is an adapter for another model: module {module!r} is ({out_f} out, {in_f} in) in {where} "
                f"but lora_{part[0]} is {tuple(shape)}"
            )
    return None


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    file: Path
    rank: int
    nbytes: int
    misfit: str | None  # the rule it breaks on this model; None = it fits (or is checked on load)


class LoraCatalog:
    """The adapters one served model may use (``serve --lora NAME=DIR``)."""

    def __init__(
        self,
        config: LoraConfig,
        model_dir: Path,
        model_name: str = "the model",
        fmt: LoraFormat | None = None,
        journal: LoraJournal | None = None,
    ):
        """``fmt``: the components the model's adapters may carry (``LoraFormat.of(family)``; default:
        the transformer only). ``journal``: where run-time adapters are kept across head restarts
        (replayed here)."""
        self.config = config
        self.journal = journal
        self.model_name = model_name
        self.fmt = fmt or LoraFormat(model_name)
        self.model_dir = Path(model_dir)
        self.adapters: dict[str, AdapterInfo] = {}
        self.added: dict[str, Path] = {}  # adapters loaded at run time (``add``): name → weight file
        self._ever: dict[str, Path] = {}  # every run-time name this head gave a file (names are not reused)
        self._shapes: dict[str, dict[str, tuple[int, int]]] | None = None
        for name, path in config.adapters.items():
            try:
                file = weight_file(path)
            except TriptychError as e:
                raise ValueError(f"--lora {name}={path}: {e}") from None
            self.adapters[name] = self._info(name, file)
        if journal is not None:
            self._replay(journal.load())

    def _replay(self, state: JournalState) -> None:
        """Serve again what a previous head loaded at run time, each checked as a new ``add`` is."""
        self._ever.update(state.ever)
        for name, file in state.added.items():
            try:
                self.add(name, str(file), save=False)
            except TriptychError as e:
                log.warning("run-time LoRA %r (%s) not served again: %s", name, file, e)
        self._save()

    def _save(self) -> None:
        if self.journal is not None:
            self.journal.save(JournalState(dict(self.added), dict(self._ever)))

    def _info(self, name: str, file: Path) -> AdapterInfo:
        if self._shapes is None:
            self._shapes = {c: model_linear_shapes(self.model_dir, c) for c in self.fmt.applied}
        tensors = header_shapes(file)
        ranks = [s[0] for k, s in tensors.items() if k.endswith("lora_A.weight")]
        why = misfit(file, self._shapes, self.fmt)
        return AdapterInfo(name, file, max(ranks, default=0), file.stat().st_size, why)

    def cards(self) -> list[dict]:
        """What ``/v1/models`` lists: each adapter that fits this model."""
        return [
            {"name": a.name, "rank": a.rank, "bytes": a.nbytes, "source": "api" if a.name in self.added else "flag"}
            for a in self.adapters.values()
            if a.misfit is None
        ]

    def add(self, name: str, path: str, save: bool = True) -> AdapterInfo:
        """Serve one more adapter from under ``lora_root`` (``POST /v1/loras``), checked as ``--lora``
        adapters are; ``InvalidParam`` naming the field, the value and the rule."""
        from triptych.lora.registration import check_name, resolve_under_root

        check_name(name)
        if name in self.adapters:
            raise InvalidParam("name", name, "is already served; unload it first or choose another name")
        file = resolve_under_root(self.config.lora_root, path)
        if self._ever.get(name, file) != file:
            raise InvalidParam("name", name, f"was served from {self._ever[name]} earlier; choose another name")
        try:
            info = self._info(name, file)
        except (OSError, ValueError) as e:
            raise InvalidParam("path", path, f"must be a readable safetensors adapter: {e}") from None
        if info.misfit is not None:
            raise InvalidParam("path", path, f"{info.misfit} ({self.model_name})")
        self.adapters[name] = info
        self.added[name] = self._ever[name] = file
        if save:
            self._save()
        return info

    def remove(self, name: str) -> bool:
        """Stop serving a run-time adapter (new requests naming it get a 400); False if unknown."""
        if name not in self.added:
            return False
        del self.added[name], self.adapters[name]
        self._save()
        return True

    def paths(self, spec) -> tuple[tuple[str, str], ...]:
        """The weight files of a request's run-time adapters, for denoisers that load them on a miss."""
        return tuple((n, str(self.added[n])) for n, _ in spec if n in self.added)

    def check(self, value) -> tuple[tuple[str, float], ...]:
        """A request's ``lora`` (a name, or a list of ``{"name", "scale"}``) as ``((name, scale), ...)``;
        ``InvalidParam`` naming the field, the value and the rule."""
        if value is None:
            return ()
        items = [{"name": value, "scale": 1.0}] if isinstance(value, str) else value
        if not isinstance(items, Sequence) or not items:
            raise InvalidParam("lora", value, "must be an adapter name or a non-empty list of {name, scale}")
        if len(items) > MAX_ADAPTERS_PER_REQUEST:
            raise InvalidParam("lora", len(items), f"at most {MAX_ADAPTERS_PER_REQUEST} adapters per request")
        out = []
        limit = self.config.lora_max_scale
        for item in items:
            name, scale = item["name"], float(item.get("scale", 1.0))
            info = self.adapters.get(name)
            if info is None:
                served = sorted(self.adapters) or "none"
                raise InvalidParam("lora", name, f"is not a served adapter (served: {served}); {HOW_TO_SERVE}")
            if info.misfit is not None:
                raise InvalidParam("lora", name, f"{info.misfit} ({self.model_name})")
            if not -limit <= scale <= limit:
                raise InvalidParam("lora.scale", scale, f"must be between -{limit} and {limit} (adapter {name!r})")
            if name in (n for n, _ in out):
                raise InvalidParam("lora", name, "is named twice; give each adapter once with its scale")
            out.append((name, scale))
        return tuple(out)
