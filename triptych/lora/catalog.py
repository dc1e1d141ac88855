"""The head's view of the served adapters: which exist, which fit which model, and the check of a
request's ``lora`` field (a 400 naming the field, the value and the rule, before any worker sees it).

Torch-free (the head imports it): shapes come from the safetensors headers of the adapter file and
of the model's ``transformer/`` weights, never from loaded tensors. A file in a non-diffusers layout
(keys diffusers converts on load) cannot be checked from its header; it is marked unchecked and the
denoiser checks it when it loads it (the request then fails with the denoiser's message).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from triptych.core.errors import InvalidParam, TriptychError
from triptych.lora.config import LoraConfig
from triptych.lora.paths import weight_file

PREFIX = "transformer."
MAX_ADAPTERS_PER_REQUEST = 4


def header_shapes(file: Path) -> dict[str, list[int]]:
    """Tensor name → shape from a safetensors file's header (no tensor is read)."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def model_linear_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """``<module>.weight`` 2-D shapes of a model's transformer: module → (out, in)."""
    out = {}
    for file in sorted((Path(model_dir) / "transformer").glob("*.safetensors")):
        for key, shape in header_shapes(file).items():
            if key.endswith(".weight") and len(shape) == 2:
                out[key.removesuffix(".weight")] = (shape[0], shape[1])
    return out


def misfit(adapter_file: Path, shapes: Mapping[str, tuple[int, int]]) -> str | None:
    """Why an adapter does not fit a model (its first bad module), or None when it fits or cannot be
    checked from headers."""
    tensors = header_shapes(adapter_file)
    if not all(k.startswith(PREFIX) and ".lora_" in k for k in tensors):
        return None
    for key, shape in sorted(tensors.items()):
        module, _, part = key[len(PREFIX) :].rpartition(".lora_")
        if module not in shapes:
            return f"module {module!r} is not a Linear layer of this model"
        out_f, in_f = shapes[module]
        if (part == "A.weight" and shape[1] != in_f) or (part == "B.weight" and shape[0] != out_f):
            return f"module {module!r} is ({out_f} out, {in_f} in) here but lora_{part[0]} is {tuple(shape)}"
    return None


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    file: Path
    rank: int
    nbytes: int
    misfit: str | None  # why it does not fit this model; None = it fits (or is checked on load)


class LoraCatalog:
    """The adapters one served model may use (``serve --lora NAME=DIR``)."""

    def __init__(self, config: LoraConfig, model_dir: Path, model_name: str = "the model"):
        self.config = config
        self.model_name = model_name
        self.model_dir = Path(model_dir)
        self.adapters: dict[str, AdapterInfo] = {}
        self.added: dict[str, Path] = {}  # adapters loaded at run time (``add``): name → weight file
        self._ever: dict[str, Path] = {}  # every run-time name this head gave a file (names are not reused)
        self._shapes: dict[str, tuple[int, int]] | None = None
        for name, path in config.adapters.items():
            try:
                file = weight_file(path)
            except TriptychError as e:
                raise ValueError(f"--lora {name}={path}: {e}") from None
            self.adapters[name] = self._info(name, file)

    def _info(self, name: str, file: Path) -> AdapterInfo:
        if self._shapes is None:
            self._shapes = model_linear_shapes(self.model_dir)
        tensors = header_shapes(file)
        ranks = [s[0] for k, s in tensors.items() if k.endswith("lora_A.weight")]
        return AdapterInfo(name, file, max(ranks, default=0), file.stat().st_size, misfit(file, self._shapes))

    def cards(self) -> list[dict]:
        """What ``/v1/models`` lists: each adapter that fits this model."""
        return [
            {"name": a.name, "rank": a.rank, "bytes": a.nbytes, "source": "api" if a.name in self.added else "flag"}
            for a in self.adapters.values()
            if a.misfit is None
        ]

    def add(self, name: str, path: str) -> AdapterInfo:
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
            raise InvalidParam("path", path, f"is an adapter for another model than {self.model_name}: {info.misfit}")
        self.adapters[name] = info
        self.added[name] = self._ever[name] = file
        return info

    def remove(self, name: str) -> bool:
        """Stop serving a run-time adapter (new requests naming it get a 400); False if unknown."""
        if name not in self.added:
            return False
        del self.added[name], self.adapters[name]
        return True

    def paths(self, spec) -> tuple[tuple[str, str], ...]:
        """The weight files of a request's run-time adapters, for denoisers that load them on a miss."""
        return tuple((n, str(self.added[n])) for n, _ in spec if n in self.added)

    def check(self, value, teacache_threshold: float = 0.0) -> tuple[tuple[str, float], ...]:
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
                raise InvalidParam("lora", name, f"is not a served adapter (served: {served})")
            if info.misfit is not None:
                raise InvalidParam(
                    "lora", name, f"is an adapter for another model than {self.model_name}: {info.misfit}"
                )
            if not -limit <= scale <= limit:
                raise InvalidParam("lora.scale", scale, f"must be between -{limit} and {limit} (adapter {name!r})")
            if name in (n for n, _ in out):
                raise InvalidParam("lora", name, "is named twice; give each adapter once with its scale")
            out.append((name, scale))
        if teacache_threshold > 0:
            raise InvalidParam(
                "teacache_threshold",
                teacache_threshold,
                "must be 0 with lora: a TeaCache profile is calibrated per model and is not shown to hold "
                "with an adapter",
            )
        return tuple(out)
