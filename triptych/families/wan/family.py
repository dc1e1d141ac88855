"""Wan 2.1 adapters: text-to-video (``WanPipeline``) and image-to-video (``WanImageToVideoPipeline``).

Wan 2.2 checkpoints (two transformers split at ``boundary_ratio``, or ``expand_timesteps``) are not
supported and are refused at load time.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Sequence

import torch
from diffusers import WanImageToVideoPipeline, WanPipeline
from diffusers.video_processor import VideoProcessor

from triptych.accel.step_graphs import GraphCall
from triptych.accel.teacache import TeaCachePlan
from triptych.core.errors import InvalidParam
from triptych.families.base import Conditioning, DenoiseState, Family, Frames, GenerationParams, Role, Row
from triptych.families.geometry import model_defaults, read_json, vae_config
from triptych.families.wan import decode as dec
from triptych.families.wan import denoise as den
from triptych.families.wan import encode as enc
from triptych.families.wan import fast
from triptych.families.wan import teacache as tea

# Pipeline ``__call__`` defaults, for checkpoints without a ``triptych.json``.
PIPELINE_DEFAULTS = {"height": 480, "width": 832, "frames": 81, "steps": 50, "guidance": 5.0}


class WanFamily(Family):
    """Wan 2.1 text-to-video. ``guidance`` is the CFG scale (CFG runs when it is > 1).

    The scheduler (UniPC with flow sigmas in real checkpoints) is multistep: each request steps its
    own copy of a pristine prototype taken at load time, never ``pipe.scheduler`` itself.
    """

    name = "wan-t2v"
    pipeline_class = WanPipeline
    all_components = ("vae", "text_encoder", "tokenizer", "transformer", "transformer_2")
    role_components = {
        Role.ENCODER: ("text_encoder", "tokenizer"),
        Role.DENOISER: ("transformer",),
        Role.DECODER: ("vae",),
    }
    is_video = True
    #: text embeddings are zero-padded to this length (both pipelines' ``__call__`` default; tiny
    #: checkpoints record a shorter one in ``triptych.json``).
    max_sequence_length = 512

    def _post_load(self) -> None:
        index = read_json(self.model_dir / "model_index.json")
        if index.get("boundary_ratio") is not None or index.get("expand_timesteps"):
            raise ValueError(f"{self.model_dir}: Wan 2.2 checkpoints are not supported by {self.name}")
        # Without the VAE loaded the pipeline guesses its scale factors: read the real ones.
        vae_cfg = vae_config(self.model_dir)
        self.pipe.vae_scale_factor_spatial = vae_cfg.get("scale_factor_spatial") or 8
        self.pipe.vae_scale_factor_temporal = vae_cfg.get("scale_factor_temporal") or 4
        self.pipe.video_processor = VideoProcessor(vae_scale_factor=self.pipe.vae_scale_factor_spatial)
        self.latent_channels = vae_cfg.get("z_dim", 16)
        transformer_cfg = read_json(self.model_dir / "transformer" / "config.json")
        patch = transformer_cfg.get("patch_size", (1, 2, 2))
        self.patch_size = tuple(patch)
        #: RoPE tables cover this many positions per axis (frames, height, width in patches).
        self.rope_max_seq_len = int(transformer_cfg.get("rope_max_seq_len", 1024))
        # The pipelines require multiples of 16 and patchify by vae scale * patch size.
        self.size_multiple = math.lcm(16, self.pipe.vae_scale_factor_spatial * patch[1])
        self.size_multiple = math.lcm(self.size_multiple, self.pipe.vae_scale_factor_spatial * patch[2])
        defaults = model_defaults(self.model_dir)
        self.defaults = {k: defaults.get(k, v) for k, v in PIPELINE_DEFAULTS.items()}
        self.max_sequence_length = defaults.get("max_sequence_length", self.max_sequence_length)
        self._scheduler_proto = copy.deepcopy(self.pipe.scheduler)

    def new_scheduler(self):
        return copy.deepcopy(self._scheduler_proto)

    # ---- validation ---------------------------------------------------------------------------
    def resolve(self, p: GenerationParams) -> GenerationParams:
        p = p.replace(**{k: v for k, v in self.defaults.items() if getattr(p, k) is None})
        self._check_common(p, self.size_multiple)
        temporal = self.pipe.vae_scale_factor_temporal
        if not isinstance(p.frames, int) or p.frames < 1 or (p.frames - 1) % temporal:
            raise InvalidParam(
                "frames", p.frames, f"must be 1 + a multiple of {temporal} (e.g. 1, {1 + temporal}, {1 + 2 * temporal})"
            )
        self._check_rope_range(p)
        if p.true_cfg != 1.0:
            raise InvalidParam("true_cfg", p.true_cfg, f"{self.name} has no true_cfg; set guidance > 1 for CFG")
        if p.negative_prompt is not None and not self.uses_cfg(p):
            raise InvalidParam(
                "negative_prompt", p.negative_prompt, f"{self.name} uses a negative prompt only with guidance > 1"
            )
        if self.accepts_image:
            self._check_image(p.image)
        return p

    def row_tokens(self, state: DenoiseState) -> int:
        """Latents are (batch, channels, frames, height, width): one token per latent position."""
        return int(state.latents[0, 0].numel())

    def sequence_tokens(self, p: GenerationParams) -> int:
        temporal, spatial = self.pipe.vae_scale_factor_temporal, self.pipe.vae_scale_factor_spatial
        pt, ph, pw = self.patch_size
        latent_frames = (p.frames - 1) // temporal + 1
        return (latent_frames // pt) * (p.height // (spatial * ph)) * (p.width // (spatial * pw))

    def _check_rope_range(self, p: GenerationParams) -> None:
        """Each axis of the latent patch grid must fit the transformer's RoPE tables; past them the
        denoiser fails mid-request (the model was never built for that length)."""
        temporal, spatial = self.pipe.vae_scale_factor_temporal, self.pipe.vae_scale_factor_spatial
        pt, ph, pw = self.patch_size
        limit = self.rope_max_seq_len
        axes = {
            "frames": (p.frames, ((p.frames - 1) // temporal + 1) // pt, temporal * pt),
            "height": (p.height, p.height // (spatial * ph), spatial * ph),
            "width": (p.width, p.width // (spatial * pw), spatial * pw),
        }
        for name, (value, positions, per_position) in axes.items():
            if positions > limit:
                most = 1 + (limit * pt - 1) * temporal if name == "frames" else limit * per_position
                raise InvalidParam(
                    name, value, f"must be at most {most} for this model (its RoPE covers {limit} positions per axis)"
                )

    def _check_image(self, image) -> None:
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise InvalidParam("image", type(image).__name__, "must be a decoded image (PIL.Image)")

    @staticmethod
    def uses_cfg(p: GenerationParams) -> bool:
        return p.guidance > 1.0  # the pipelines' do_classifier_free_guidance

    # ---- stages -------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, params: GenerationParams) -> Conditioning:
        params = params.replace(prompt=self.encoder_prompt(params.prompt))
        return enc.encode_text(
            self.pipe, params, self.uses_cfg(params), self.max_sequence_length, self.dtype, self.execution_device
        )

    #: Compute each request's text-side constants at ``prepare`` (``wan/fast.py``); False = the
    #: transformer's own forward at every step (the benchmark's peer).
    step_tables = True

    def prepare(self, request_id: str, params: GenerationParams, cond: Conditioning) -> DenoiseState:
        state = den.prepare(self, request_id, params, cond.to(self.device))
        if self.step_tables and not params.lora:
            state.step_consts = fast.request_tables(self.pipe.transformer, state)
        return state

    @functools.cached_property
    def _fast(self) -> fast.FastForward:
        return fast.FastForward(self.pipe.transformer)

    def teacache_plan(self) -> TeaCachePlan:
        """Rows with step tables take the fast forward's pieces in the plan, as they take it in ``forward``."""
        quick = self._fast if self.step_tables else None
        return tea.make_plan(self.pipe.transformer, self.name, quick)

    @torch.no_grad()
    def forward(self, rows: Sequence[Row]) -> torch.Tensor:
        if rows[0].state.step_consts is not None and fast.usable(self.pipe.transformer, rows):
            return self._fast(rows, den.hidden_of(self.pipe.transformer, rows))
        with self.lora_plan(rows):
            return den.forward(self.pipe.transformer, rows)

    def graph_call(self, rows: Sequence[Row]) -> GraphCall:
        return den.graph_call(self.pipe.transformer, rows)

    def combine(self, state: DenoiseState, preds: dict[str, torch.Tensor]) -> torch.Tensor:
        return den.combine(state, preds)

    def decode(self, latents: torch.Tensor, params: GenerationParams) -> Frames:
        with self.vae_mode(params):
            return dec.decode(self.pipe, latents.to(self.device), params)

    # ---- reference ----------------------------------------------------------------------------
    def _reference_kwargs(self, params: GenerationParams, output_type: str) -> dict:
        return dict(
            prompt=self.encoder_prompt(params.prompt),
            negative_prompt=params.negative_prompt,
            height=params.height,
            width=params.width,
            num_frames=self._pipeline_num_frames(params.frames),
            num_inference_steps=params.steps,
            guidance_scale=params.guidance,
            generator=self.generator(params.seed),
            max_sequence_length=self.max_sequence_length,
            output_type=output_type,
        )

    def _pipeline_num_frames(self, frames: int) -> int:
        """The ``num_frames`` for which the pipeline makes ``frames`` frames. NOTE: WanPipeline
        rounds ``num_frames`` to ``k * temporal + 1`` whenever ``num_frames % temporal != 1``; with a
        VAE that does not compress time (temporal 1, the shape world's video model) every count is
        0 mod 1, so it adds one frame to every request."""
        return frames - 1 if self.pipe.vae_scale_factor_temporal == 1 else frames

    @torch.no_grad()
    def reference_call(self, params: GenerationParams, output_type: str = "np"):
        """``pipe(...).frames``: for ``np``, shape (1, frames, H, W, 3)."""
        return self.pipe(**self._reference_kwargs(params, output_type)).frames


class WanImageToVideoFamily(WanFamily):
    """Wan 2.1 image-to-video: the first frame is given.

    The encoder role owns the CLIP image encoder and the VAE: it produces ``shared.image_embeds``
    and ``shared.condition`` (mask ‖ first-frame latents), which the denoiser concatenates to the
    noise latents on the channel axis at every step, as the pipeline does.
    """

    name = "wan-i2v"
    pipeline_class = WanImageToVideoPipeline
    all_components = (
        "vae",
        "text_encoder",
        "tokenizer",
        "image_encoder",
        "image_processor",
        "transformer",
        "transformer_2",
    )
    role_components = {
        Role.ENCODER: ("text_encoder", "tokenizer", "image_encoder", "image_processor", "vae"),
        Role.DENOISER: ("transformer",),
        Role.DECODER: ("vae",),
    }
    accepts_image = True
    requires_image = True

    def _post_load(self) -> None:
        super()._post_load()
        image_dim = read_json(self.model_dir / "transformer" / "config.json").get("image_dim")
        if image_dim is None:
            raise ValueError(f"{self.model_dir}: transformer has no image_dim; not a Wan 2.1 I2V checkpoint")

    @torch.no_grad()
    def encode(self, params: GenerationParams) -> Conditioning:
        cond = super().encode(params)
        cond.shared.update(enc.encode_image(self.pipe, params, self.dtype, self.execution_device))
        return cond

    @torch.no_grad()
    def reference_call(self, params: GenerationParams, output_type: str = "np"):
        return self.pipe(image=params.image, **self._reference_kwargs(params, output_type)).frames
