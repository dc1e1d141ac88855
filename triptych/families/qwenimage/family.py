"""Qwen-Image and Qwen-Image-Edit adapters over diffusers' QwenImagePipeline / QwenImageEditPipeline.

``guidance`` is the pipelines' ``true_cfg_scale``. They run CFG only when it is > 1 *and* a negative
prompt is given; a request with guidance > 1 and no negative prompt gets ``DEFAULT_NEGATIVE_PROMPT``
(the model card's " "), so guidance alone turns CFG on, and ``reference_call`` passes the same
negative prompt, so the reference runs the same CFG. A negative prompt with guidance <= 1 would be
ignored by the pipeline and is refused instead.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from diffusers import QwenImageEditPipeline, QwenImagePipeline
from diffusers.image_processor import VaeImageProcessor

from triptych.accel.step_graphs import GraphCall
from triptych.accel.teacache import TeaCachePlan
from triptych.core.errors import InvalidParam, TriptychError
from triptych.core.identity import model_identity
from triptych.families.base import (
    COND,
    UNCOND,
    Conditioning,
    DenoiseState,
    Family,
    Frames,
    GenerationParams,
    Role,
    Row,
)
from triptych.families.geometry import model_defaults, vae_config
from triptych.families.qwenimage import decode as dec
from triptych.families.qwenimage import denoise as den
from triptych.families.qwenimage import encode as enc
from triptych.families.qwenimage import fast
from triptych.families.qwenimage import teacache as tea

DEFAULT_NEGATIVE_PROMPT = " "


class QwenImageFamily(Family):
    name = "qwen-image"
    attention_masks = True  # prompts of different lengths in one forward: a text padding mask
    true_cfg_is_guidance = True
    pipeline_class = QwenImagePipeline
    all_components = ("vae", "text_encoder", "tokenizer", "transformer")
    role_components = {
        Role.ENCODER: ("text_encoder", "tokenizer"),
        Role.DENOISER: ("transformer",),
        Role.DECODER: ("vae",),
    }
    #: the pipelines' ``__call__`` default; t2i truncates prompt embeddings to it, edit ignores it.
    max_sequence_length = 512
    default_steps = 50  # the pipelines' default num_inference_steps
    default_guidance = 4.0  # the pipelines' default true_cfg_scale
    #: The encoder's mm-hash cache of vision-tower outputs (``triptych.mmcache.cache``), shared by edit
    #: encodes and chat; None without a text encoder or with ``MMCacheConfig(max_mb=0)``.
    mm_cache = None

    def _post_load(self) -> None:
        # Without the VAE loaded the pipeline guesses its geometry: read the real one.
        vae = vae_config(self.model_dir)
        scale = 2 ** len(vae["temperal_downsample"])
        self.pipe.vae_scale_factor = scale
        self.pipe.image_processor = VaeImageProcessor(vae_scale_factor=scale * 2)
        self.pipe.latent_channels = vae["z_dim"]
        defaults = model_defaults(self.model_dir)
        size = self.pipe.default_sample_size * scale
        self.defaults = {
            "height": defaults.get("height", size),
            "width": defaults.get("width", size),
            "steps": defaults.get("steps", self.default_steps),
            "guidance": defaults.get("guidance", self.default_guidance),
        }
        #: Edit only: pixel area the condition image is resized to (the pipeline's 1 MP unless the
        #: model's triptych.json says otherwise).
        self.condition_area = int(defaults.get("condition_area", enc.EDIT_CONDITION_AREA))
        #: The Qwen2.5-VL processor (edit: the pipeline's own; text-to-image: ``processor/`` when the
        #: model ships one), used by edit encodes and by chat.
        self.processor = getattr(self.pipe, "processor", None)
        if self.processor is None and Role.ENCODER in self.roles and self.supports_chat:
            from triptych.families.qwenimage.processor import load_processor

            self.processor = load_processor(self.model_dir / "processor")
        from triptych.mmcache import cache as mm

        visual = mm.vision_encoder(self.pipe.text_encoder) if self.pipe.text_encoder is not None else None
        budget = self.mm_cache_config.max_bytes
        if visual is not None and budget > 0:
            scope = model_identity(self.model_dir, ("text_encoder",))
            processor_tier = shared = None
            image_processor = getattr(self.processor, "image_processor", None)
            if image_processor is not None and self.mm_cache_config.processor_bytes > 0:
                from triptych.mmcache import processor as mm_processor

                tier = mm_processor.ProcessorCache(self.mm_cache_config.processor_bytes)
                processor_tier = mm_processor.install(image_processor, tier)
            if self.mm_cache_config.shared_dir:
                from triptych.mmcache.shared import SharedStore

                shared_bytes = int(self.mm_cache_config.shared_mb * (1 << 20))
                shared = SharedStore(self.mm_cache_config.shared_dir, shared_bytes)
            cache = mm.MMEmbeddingCache(budget, scope=scope, processor=processor_tier, shared=shared)
            self.mm_cache = mm.install(visual, cache)
        self._chat = None

    @functools.cached_property
    def supports_chat(self) -> bool:
        """The model can answer ``/v1/chat/completions``: its text encoder is a Qwen2.5-VL and it ships
        the processor with a chat template (read from the files alone, so a weightless adapter can tell;
        once: the head asks on every chat request, on its event loop)."""
        from triptych.families.qwenimage.processor import chat_template_of

        return (self.model_dir / "processor").is_dir() and chat_template_of(self.model_dir / "processor") is not None

    def chat_model(self):
        """The encoder's Qwen2.5-VL as a ``ChatModel`` (same weights, same mm-hash cache), or None
        when this instance has no text encoder or the model no processor."""
        if (
            self._chat is None
            and self.pipe.text_encoder is not None
            and self.processor is not None
            and self.supports_chat
        ):
            from triptych.chat.vlm import ChatModel

            # The shipped default captioner knows image-then-text only: its triptych.json says
            # "chat_parts": "image-first" (a user's model does not, and gets its messages as sent).
            image_first = model_defaults(self.model_dir).get("chat_parts") == "image-first"
            self._chat = ChatModel(self.pipe.text_encoder, self.processor, image_first=image_first)
        return self._chat

    def vision_images(self, params) -> list:
        """The images this request hands the vision tower, in the order it does (the encoder layer
        encodes them ahead, batched with other requests'): a chat's, in message order."""
        from triptych.chat import ChatParams

        if isinstance(params, ChatParams):
            return [params.images[p] for t in params.turns for p in t.parts if isinstance(p, int)]
        return []

    def vllm_export(self, out, vision: str = "copy"):
        from triptych.families.qwenimage.vllm import export_vllm_folder

        return export_vllm_folder(self.model_dir, out, vision)

    def vllm_inputs(self, chat):
        from triptych.families.qwenimage.vllm import embedding_items

        model = self.chat_model()
        if model is None:
            raise TriptychError(f"{self.name} at {self.model_dir} has no VLM to chat with")
        scope = self.mm_cache.scope if self.mm_cache is not None else model_identity(self.model_dir, ("text_encoder",))
        return embedding_items(model, chat, scope)

    @property
    def multiple(self) -> int:
        """Height and width must be multiples of this (VAE scale × 2×2 patches)."""
        return self.pipe.vae_scale_factor * 2

    def sequence_tokens(self, p: GenerationParams) -> int:
        return (p.height // self.multiple) * (p.width // self.multiple)

    def resolve(self, p: GenerationParams) -> GenerationParams:
        p = p.replace(**{k: v for k, v in self._defaults_for(p).items() if getattr(p, k) is None})
        self._check_common(p, self.multiple)
        if p.steps < 2 and self.pipe.scheduler.config.get("shift_terminal"):
            # sigmas are stretched so the last equals shift_terminal: with one step that is 0/0.
            raise InvalidParam("steps", p.steps, "must be >= 2 (a one-step shift_terminal schedule is NaN)")
        if p.guidance < 1:
            raise InvalidParam("guidance", p.guidance, "must be >= 1 (the true-CFG scale; 1 disables CFG)")
        if p.true_cfg != 1.0:
            raise InvalidParam("true_cfg", p.true_cfg, f"{self.name} takes its CFG scale from guidance")
        if p.negative_prompt is not None and p.guidance <= 1:
            raise InvalidParam("negative_prompt", p.negative_prompt, "is used only with guidance > 1")
        if p.negative_prompt is None and p.guidance > 1:
            p = p.replace(negative_prompt=DEFAULT_NEGATIVE_PROMPT)
        return p.replace(frames=1)

    def _defaults_for(self, p: GenerationParams) -> dict[str, Any]:
        return self.defaults

    def uses_cfg(self, p: GenerationParams) -> bool:
        """The pipelines' ``do_true_cfg``."""
        return p.guidance > 1 and p.negative_prompt is not None

    @torch.no_grad()
    def encode(self, params: GenerationParams) -> Conditioning:
        params = params.replace(prompt=self.encoder_prompt(params.prompt))
        return enc.encode_text(
            self.pipe, params, self.uses_cfg(params), self.max_sequence_length, self.execution_device
        )

    cuda_graph_stack = True  # --cuda-graphs: the fast path's compiled block stack (fast_stack.py)
    compile_vae_decoder = True  # its one-frame decoder, ~4x per decode on the default model (benchmarks/RESULTS.md)

    def warmup_latents(self, params: GenerationParams) -> torch.Tensor:
        """Packed latents, (1, tokens, 4 · z_dim), as ``prepare_latents`` makes them."""
        tokens = self.sequence_tokens(params)
        return torch.randn(1, tokens, 4 * self.pipe.latent_channels, dtype=self.dtype, device=self.device)

    def warmup_conditioning(self, params: GenerationParams, lengths: tuple[int, int]) -> Conditioning | None:
        if self.requires_image:  # edit only: it needs the condition image's latents (not built here)
            return None
        width = self.pipe.transformer.config.joint_attention_dim
        embeds = [torch.randn(1, n, width, dtype=self.dtype, device=self.device) for n in lengths]
        return Conditioning(branches={COND: {"prompt_embeds": embeds[0]}, UNCOND: {"prompt_embeds": embeds[1]}})

    #: Compute each request's per-step constants at ``prepare`` and run the step without them
    #: (``qwenimage/fast.py``); False = the transformer's own forward at every step (the benchmark's peer).
    step_tables = True

    def prepare(self, request_id: str, params: GenerationParams, cond: Conditioning) -> DenoiseState:
        state = den.prepare(self, request_id, params, cond.to(self.device))
        if self.step_tables and not params.lora:
            state.step_consts = self._fast.tables(state)
        return state

    @functools.cached_property
    def _fast(self) -> fast.FastForward:
        device = self.device if self.speed.compile else None  # --compile: the block stack as one graph
        return fast.FastForward(
            self.pipe.transformer, self.pipe.vae_scale_factor, self._idle_hooks, device, self.speed.cuda_graphs
        )

    def teacache_plan(self) -> TeaCachePlan:
        """Rows with step tables take the fast forward's pieces in the plan, as they take it in ``forward``."""
        quick = self._fast if self.step_tables else None
        return tea.make_plan(self.pipe.transformer, self.pipe.vae_scale_factor, self.name, quick)

    def _idle_hooks(self) -> frozenset[int]:
        """The LoRA runtime's hooks: they add nothing to a forward without adapter rows (``fast.usable``)."""
        return self.lora.rows.hook_ids() if self.lora is not None else frozenset()

    @torch.no_grad()
    def forward(self, rows: Sequence[Row]) -> torch.Tensor:
        if rows[0].state.step_consts is not None and fast.usable(self.pipe.transformer, rows):
            return self._fast(rows)
        with self.lora_plan(rows):
            return den.forward(self.pipe.transformer, rows, self.pipe.vae_scale_factor)

    def graph_call(self, rows: Sequence[Row]) -> GraphCall:
        return den.graph_call(self.pipe.transformer, rows, self.pipe.vae_scale_factor)

    def combine(self, state: DenoiseState, preds: dict[str, torch.Tensor]) -> torch.Tensor:
        return den.combine(state, preds)

    def decode(self, latents: torch.Tensor, params: GenerationParams) -> Frames:
        with self.vae_mode(params):
            return dec.decode(self.pipe, latents.to(self.device), params, self.frame_decoder)

    def _reference_kwargs(self, params: GenerationParams) -> dict[str, Any]:
        return dict(
            prompt=self.encoder_prompt(params.prompt),
            negative_prompt=params.negative_prompt,
            true_cfg_scale=params.guidance,
            height=params.height,
            width=params.width,
            num_inference_steps=params.steps,
            generator=self.generator(params.seed),
            max_sequence_length=self.max_sequence_length,
        )

    def reference_call(self, params: GenerationParams, output_type: str = "np"):
        return self.pipe(**self._reference_kwargs(params), output_type=output_type).images


class QwenImageEditFamily(QwenImageFamily):
    """Edit: the encoder role also runs the processor (vision tokens) and the VAE (condition latents)."""

    name = "qwen-image-edit"
    pipeline_class = QwenImageEditPipeline
    all_components = ("vae", "text_encoder", "tokenizer", "processor", "transformer")
    role_components = {
        Role.ENCODER: ("text_encoder", "tokenizer", "processor", "vae"),
        Role.DENOISER: ("transformer",),
        Role.DECODER: ("vae",),
    }
    accepts_image = True
    requires_image = True

    def _build_components(self, wanted: frozenset[str]) -> dict[str, Any]:
        # NOTE: real checkpoints declare transformers' Qwen2VLProcessor, which cannot be built without
        # torchvision; the processor is always rebuilt from its files without the video processor.
        if "processor" not in wanted:
            return {}
        from triptych.families.qwenimage.processor import load_processor

        return {"processor": load_processor(self.model_dir / "processor")}

    def _defaults_for(self, p: GenerationParams) -> dict[str, Any]:
        defaults = dict(self.defaults)
        if not (self.model_dir / "triptych.json").exists() and _is_image(p.image):
            # The pipeline's own default: the condition image's ~1 MP size, floored to the multiple.
            height, width = enc.condition_size(p.image, self.condition_area)
            defaults["height"] = height // self.multiple * self.multiple
            defaults["width"] = width // self.multiple * self.multiple
        return defaults

    def resolve(self, p: GenerationParams) -> GenerationParams:
        if p.image is not None and not _is_image(p.image):
            raise InvalidParam("image", type(p.image).__name__, "must be a PIL image")
        if _is_image(p.image):
            self._check_condition_size(p.image)
        return super().resolve(p)

    def sequence_tokens(self, p: GenerationParams) -> int:
        """The output's tokens plus the condition image's (resized to ``condition_area``)."""
        height, width = enc.condition_size(p.image, self.condition_area)
        return super().sequence_tokens(p) + (height // self.multiple) * (width // self.multiple)

    def _check_condition_size(self, image) -> None:
        """The pipeline resizes the condition image to ``condition_area`` keeping its aspect ratio;
        an extreme ratio rounds one side below one latent patch (0 px at worst), which fails in the
        VAE. Refuse it here, naming the size it would get."""
        height, width = enc.condition_size(image, self.condition_area)
        if min(height, width) < self.multiple:
            w, h = image.size
            raise InvalidParam(
                "image",
                f"{w}x{h}",
                f"aspect ratio {max(w, h) / min(w, h):.0f}:1 is too extreme: the model resizes it to "
                f"{width}x{height} and each side must be at least {self.multiple} px",
            )

    def vision_images(self, params) -> list:
        """An edit's condition image as its prompt encoding resizes it (``enc.encode_edit``)."""
        if isinstance(params, GenerationParams) and _is_image(params.image):
            height, width = enc.condition_size(params.image, self.condition_area)
            return [self.pipe.image_processor.resize(params.image, height, width)]
        return super().vision_images(params)

    def compat_key(self, state: DenoiseState) -> tuple:
        """Rows also share the condition image's latent shape (it is part of the sequence)."""
        return super().compat_key(state) + (tuple(state.cond.shared["image_shape"].tolist()),)

    @torch.no_grad()
    def encode(self, params: GenerationParams) -> Conditioning:
        params = params.replace(prompt=self.encoder_prompt(params.prompt, edit=True))
        return enc.encode_edit(
            self.pipe,
            params,
            self.uses_cfg(params),
            self.max_sequence_length,
            self.dtype,
            self.execution_device,
            self.condition_area,
        )

    def _reference_kwargs(self, params: GenerationParams) -> dict[str, Any]:
        return dict(
            super()._reference_kwargs(params), prompt=self.encoder_prompt(params.prompt, edit=True), image=params.image
        )


def _is_image(obj: Any) -> bool:
    from PIL import Image

    return isinstance(obj, Image.Image)
