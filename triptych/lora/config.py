"""LoRA settings: which adapters a deployment serves, the denoiser's memory for them, the scale range."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LoraConfig:
    lora: tuple[str, ...] = ()
    """Adapters to serve, each ``NAME=DIR`` (a folder with diffusers' pytorch_lora_weights.safetensors,
    or a .safetensors file); repeat the flag for several. Requests name them in their ``lora`` field."""

    lora_budget_mb: float = 256.0
    """Memory a denoiser keeps adapters in (MiB); unused ones are evicted least recently used first,
    one used by a running request never."""

    lora_max_scale: float = 4.0
    """Largest absolute scale a request may give an adapter."""

    lora_root: str = ""
    """Folder adapters may be loaded from at run time (``POST /v1/loras``); empty = no run-time loading."""

    def __post_init__(self) -> None:
        for entry in self.lora:
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora={entry!r}: must be NAME=DIR")
        names = [e.partition("=")[0] for e in self.lora]
        if len(set(names)) != len(names):
            raise ValueError(f"lora: adapter names repeat in {names}; give each adapter its own name")
        if self.lora_budget_mb <= 0:
            raise ValueError(f"lora_budget_mb={self.lora_budget_mb}: must be > 0")
        if self.lora_max_scale <= 0:
            raise ValueError(f"lora_max_scale={self.lora_max_scale}: must be > 0")

    @property
    def adapters(self) -> dict[str, Path]:
        """Name → path of every served adapter."""
        return {name: Path(path) for name, _, path in (e.partition("=") for e in self.lora)}

    @property
    def budget_bytes(self) -> int:
        return int(self.lora_budget_mb * (1 << 20))


def shipped_adapters(model_dirs) -> tuple[tuple[str, ...], list[str]]:
    """``NAME=DIR`` of every adapter the models ship (each model's ``lora/<name>/`` folder), for a
    ``serve`` given no ``--lora``; a name two models ship is served from the first (the second is
    returned as a note)."""
    entries: dict[str, str] = {}
    notes = []
    for model_dir in model_dirs:
        folder = Path(model_dir) / "lora"
        for adapter in sorted(folder.iterdir()) if folder.is_dir() else ():
            if not adapter.is_dir():
                continue
            if adapter.name in entries:
                notes.append(
                    f"adapter {adapter.name!r} of {model_dir} not served: {entries[adapter.name]} has the name"
                )
                continue
            entries[adapter.name] = str(adapter)
    return tuple(f"{name}={path}" for name, path in entries.items()), notes


def lora_args(
    values: list[str], max_scale: float = LoraConfig.lora_max_scale, shipped: Path | None = None
) -> tuple[LoraConfig, tuple]:
    """``generate --lora NAME_OR_DIR[:SCALE]`` values → the config serving them and the request's
    ``((name, scale), ...)``; the name is the folder's (or file's stem). A bare name that is no path is
    an adapter the model ships in ``shipped`` (its ``lora/`` folder). ``InvalidParam`` names the value."""
    from triptych.core.errors import InvalidParam

    entries, spec = [], []
    for value in values:
        path, scale = value, 1.0
        head, sep, tail = value.rpartition(":")
        if sep and not Path(value).exists():
            try:
                path, scale = head, float(tail)
            except ValueError:
                pass
        if not Path(path).exists() and shipped is not None and (shipped / path).is_dir() and "/" not in path:
            path = str(shipped / path)
        if not Path(path).exists():
            known = sorted(d.name for d in shipped.iterdir() if d.is_dir()) if shipped and shipped.is_dir() else []
            rule = "must be an adapter folder or .safetensors file, optionally :SCALE"
            raise InvalidParam("lora", value, rule + (f", or an adapter the model ships: {known}" if known else ""))
        if not -max_scale <= scale <= max_scale:
            raise InvalidParam("lora", value, f"scale must be between -{max_scale} and {max_scale}")
        name = Path(path).stem if Path(path).is_file() else Path(path).resolve().name
        if name in (n for n, _ in spec):
            raise InvalidParam("lora", value, f"adapter {name!r} is given twice")
        entries.append(f"{name}={path}")
        spec.append((name, scale))
    return LoraConfig(lora=tuple(entries), lora_max_scale=max_scale), tuple(spec)
