"""Which components a family's LoRA files may carry, and the rule a key of another one breaks.

A diffusers LoRA file prefixes each key with the pipeline component it adapts (``transformer.``,
``text_encoder.``); the family's pipeline class lists the ones its ``load_lora_weights`` reads
(``_lora_loadable_modules``: FLUX ``transformer`` and ``text_encoder``, the CLIP encoder; Qwen-Image
``transformer``; Wan ``transformer`` and ``transformer_2``). Triptych applies the family's
``lora_components`` (``Family.lora_components``), a subset of those. Torch-free: the head checks
adapter headers with it, the encoders and denoisers the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoraFormat:
    family: str = "the model"
    applied: tuple[str, ...] = ("transformer",)  # components Triptych applies adapters to
    loadable: tuple[str, ...] = ("transformer",)  # components the family's diffusers format carries

    @classmethod
    def of(cls, family) -> LoraFormat:
        """The format of a ``Family`` (class or instance; a stand-in without the attributes: transformer only)."""
        applied = tuple(getattr(family, "lora_components", ("transformer",)))
        pipeline = getattr(family, "pipeline_class", None)
        loadable = tuple(getattr(pipeline, "_lora_loadable_modules", applied))
        return cls(str(getattr(family, "name", "the model")), applied, loadable)

    def refusal(self, key: str) -> str | None:
        """Why ``key`` cannot be applied (its component is not one this family's adapters may carry),
        or None when its component is applied."""
        component = key.partition(".")[0]
        if component in self.applied:
            return None
        carried = ", ".join(self.loadable)
        if component in self.loadable:
            return (
                f"key {key!r} is {component!r} LoRA, which Triptych does not apply on {self.family} yet "
                f"(it applies: {', '.join(self.applied)})"
            )
        if component.startswith("text_encoder"):
            encoders = [c for c in self.loadable if c.startswith("text_encoder")]
            has = f"text-encoder LoRA for {', '.join(encoders)} only" if encoders else "no text-encoder LoRA"
            return (
                f"key {key!r} is {component!r} LoRA, but {self.family}'s diffusers LoRA format has {has} "
                f"(it carries: {carried})"
            )
        return f"key {key!r} is not a LoRA key of {self.family}'s diffusers format (keys start with one of: {carried})"
