"""The models one head serves: ``ServedModel`` (one model: its id, its backend with its own pools, its
admission counter, the sizes it was trained at) and ``ServedModels`` (a request's ``model`` field and
the endpoint's job kind → which one).

Routing: a named model must be served, or be an alias of one (``--model-alias ALIAS=MODEL``; else 404
naming the served ids); a request without ``model``
goes to the first served model that can do the job (``JOB_KINDS``), or to the first model at all when
none can (its own family check then says why it cannot). Each model's ``Admission`` counts only its
own jobs, so a flood of video jobs does not refuse image requests.

NOTE: torch-free (the head imports it); a backend's ``family`` is read, never loaded here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.exceptions import HTTPException

from shapeworld.vocabulary import prompt_warning
from triptych.core.errors import shown
from triptych.families.geometry import model_defaults, size_warning, trained_sizes
from triptych.head.admission import Admission, AdmissionLimits
from triptych.head.api_models import ModelCard
from triptych.lora.catalog import LoraCatalog
from triptych.lora.config import LoraConfig
from triptych.lora.formats import LoraFormat
from triptych.lora.journal import LoraJournal

if TYPE_CHECKING:
    from triptych.control.backend import GenerationBackend
    from triptych.families.base import Family

#: The job kinds a request can ask for (the endpoint says which).
JOB_KINDS = ("image", "edit", "video", "chat")


@dataclass
class ServedModel:
    """One model at the head. Owns nothing but its admission counter; the head starts and closes its
    backend."""

    name: str
    backend: GenerationBackend
    admission: Admission
    trained: tuple[tuple[int, int], ...] = field(default=())
    """(width, height) sizes the model was trained at (its ``triptych.json``); empty = unknown."""
    lora: LoraCatalog = field(default_factory=lambda: LoraCatalog(LoraConfig(), Path(".")))
    """The adapters requests for this model may name (``serve --lora``)."""
    vocabulary: str | None = None
    """The ``prompt_normaliser`` its ``triptych.json`` names (the shipped models' words); None: any words."""

    @property
    def family(self) -> Family:
        return self.backend.family

    @property
    def kind(self) -> str:
        f = self.family
        if f.is_video:
            return "video"
        return "image-edit" if f.requires_image else "image+edit" if f.accepts_image else "image"

    def can(self, job_kind: str) -> bool:
        """Whether this model does ``job_kind`` (one of ``JOB_KINDS``)."""
        f = self.family
        return {
            "image": not f.is_video and not f.requires_image,
            "edit": not f.is_video and f.accepts_image,
            "video": f.is_video,
            "chat": bool(getattr(f, "supports_chat", False)),
        }[job_kind]

    def card(self) -> ModelCard:
        f = self.family
        cards = self.lora.cards()
        instances = self.backend.describe().get("instances", ()) if cards else ()  # no adapters: no describe
        held = [(i["id"], set(i.get("loras", ()))) for i in instances]
        loras = [dict(c, loaded_on=[iid for iid, names in held if c["name"] in names]) for c in cards]
        return ModelCard(id=self.name, created=0, family=f.name, kind=self.kind, chat=self.can("chat"), loras=loras)

    def size_warning(self, width: int, height: int) -> str | None:
        return size_warning(self.name, self.trained, width, height)

    def prompt_warning(self, prompt: str, edit: bool = False) -> str | None:
        """A note naming the prompt's words the model does not know (``shapeworld.vocabulary``)."""
        return prompt_warning(self.name, self.vocabulary, prompt, edit)


class ServedModels:
    """The head's models, in serving order (the first of a kind is that kind's default)."""

    def __init__(
        self,
        backends: Mapping[str, GenerationBackend],
        limits: AdmissionLimits,
        aliases: Mapping[str, str] | None = None,
        lora: LoraConfig = LoraConfig(),
        data_dir: Path | None = None,
    ):
        """``data_dir``: where each model's run-time adapters are kept across restarts (none: not kept)."""
        if not backends:
            raise ValueError("a head serves at least one model")
        self.by_name: dict[str, ServedModel] = {
            name: ServedModel(
                name,
                b,
                Admission(limits),
                trained_sizes(b.family.model_dir),
                LoraCatalog(
                    lora,
                    b.family.model_dir,
                    name,
                    LoraFormat.of(b.family),
                    journal=LoraJournal(data_dir, name) if data_dir else None,
                ),
                vocabulary=model_defaults(b.family.model_dir).get("prompt_normaliser"),
            )
            for name, b in backends.items()
        }
        self.aliases = dict(aliases or {})
        """Other names of served models (``HeadConfig.model_aliases``): alias → served id."""
        for alias, target in self.aliases.items():
            if alias in self.by_name or target not in self.by_name:
                served = ", ".join(repr(n) for n in self.by_name)
                raise ValueError(
                    f"model alias {alias}={target}: the alias must not be, and the model must be, one of {served}"
                )

    def served_name(self, model: str) -> str:
        """The served id a request's ``model`` names (itself, or what its alias maps to)."""
        return self.aliases.get(model, model)

    def __iter__(self):
        return iter(self.by_name.values())

    @property
    def first(self) -> ServedModel:
        return next(iter(self.by_name.values()))

    def pick(self, model: str | None, job_kind: str) -> ServedModel:
        """The model a request names, or the first that can do ``job_kind``; 404 for an unknown name."""
        assert job_kind in JOB_KINDS, job_kind
        if model is not None:
            found = self.by_name.get(self.served_name(model))
            if found is None:
                served = ", ".join(repr(n) for n in self.by_name)
                raise HTTPException(404, f"model {shown(model)} is not served here; this server serves {served}")
            return found
        return next((m for m in self if m.can(job_kind)), self.first)
