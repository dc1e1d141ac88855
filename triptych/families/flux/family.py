"""FLUX.1 adapter: dev-style (guidance embedding) and schnell-style (no guidance) checkpoints."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers import FluxPipeline
from diffusers.image_processor import VaeImageProcessor

from triptych.accel.step_graphs import GraphCall
from triptych.accel.teacache import TeaCachePlan
from triptych.core.errors import InvalidParam
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
from triptych.families.flux import decode as dec
from triptych.families.flux import denoise as den
from triptych.families.flux import encode as enc
from triptych.families.flux import fast
from triptych.families.flux import teacache as tea
from triptych.families.geometry import model_defaults, read_json, vae_config


class FluxFamily(Family):
    name = "flux"
    pipeline_class = FluxPipeline
    all_components = (
        "vae",
        "text_encoder",
        "tokenizer",
        "text_encoder_2",
        "tokenizer_2",
        "transformer",
        "image_encoder",
        "feature_extractor",
    )
    role_components = {
        Role.ENCODER: ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"),
        Role.DENOISER: ("transformer",),
        Role.DECODER: ("vae",),
    }
    max_sequence_length = 512
    lora_components = ("transformer", "text_encoder")  # FluxPipeline's format: the CLIP encoder, not T5

    def _post_load(self) -> None:
        # Without the VAE loaded the pipeline guesses a scale factor of 8: read the real one.
        scale = 2 ** (len(vae_config(self.model_dir)["block_out_channels"]) - 1)
        self.pipe.vae_scale_factor = scale
        self.pipe.image_processor = VaeImageProcessor(vae_scale_factor=scale * 2)
        transformer_cfg = read_json(self.model_dir / "transformer" / "config.json")
        self.guidance_distilled = bool(transformer_cfg.get("guidance_embeds", False))
        defaults = model_defaults(self.model_dir)
        size = self.pipe.default_sample_size * scale
        self.defaults = {
            "height": defaults.get("height", size),
            "width": defaults.get("width", size),
            "steps": defaults.get("steps", 28 if self.guidance_distilled else 4),
            "guidance": defaults.get("guidance", 3.5),
        }

    def resolve(self, p: GenerationParams) -> GenerationParams:
        p = p.replace(**{k: v for k, v in self.defaults.items() if getattr(p, k) is None})
        self._check_common(p, self.pipe.vae_scale_factor * 2)
        if p.true_cfg < 1:
            raise InvalidParam("true_cfg", p.true_cfg, "must be >= 1 (1 disables true CFG)")
        if p.negative_prompt is not None and p.true_cfg <= 1:
            raise InvalidParam(
                "negative_prompt", p.negative_prompt, "FLUX uses a negative prompt only with true_cfg > 1"
            )
        return p.replace(frames=1)

    def sequence_tokens(self, p: GenerationParams) -> int:
        m = self.pipe.vae_scale_factor * 2
        return (p.height // m) * (p.width // m)

    def uses_true_cfg(self, p: GenerationParams) -> bool:
        return p.true_cfg > 1 and p.negative_prompt is not None

    @torch.no_grad()
    def encode(self, params: GenerationParams) -> Conditioning:
        with self.text_lora_plan([params]):
            return enc.encode(
                self.pipe, params, self.max_sequence_length, self.uses_true_cfg(params), self.execution_device
            )

    @torch.no_grad()
    def encode_many(self, params: Sequence[GenerationParams]) -> list[Conditioning]:
        """``encode`` of several requests, their prompts in one text-encoder forward (each row with its
        own request's text-encoder adapters), their negative prompts in one more where true CFG."""
        with self.text_lora_plan(params):
            conds = [
                Conditioning(branches={COND: b})
                for b in enc.encode_rows(
                    self.pipe, [p.prompt for p in params], self.max_sequence_length, self.execution_device
                )
            ]
        negative = [i for i, p in enumerate(params) if self.uses_true_cfg(p)]
        if negative:
            with self.text_lora_plan([params[i] for i in negative]):
                rows = enc.encode_rows(
                    self.pipe,
                    [params[i].negative_prompt for i in negative],
                    self.max_sequence_length,
                    self.execution_device,
                )
            for i, branch in zip(negative, rows):
                conds[i].branches[UNCOND] = branch
        return conds

    #: Compute each request's RoPE and text context at ``prepare`` (``flux/fast.py``); False = the
    #: transformer's own forward at every step (the benchmark's peer).
    step_tables = True

    def prepare(self, request_id: str, params: GenerationParams, cond: Conditioning) -> DenoiseState:
        state = den.prepare(self, request_id, params, cond.to(self.device))
        if self.step_tables and not params.lora:
            state.step_consts = fast.request_tables(self.pipe.transformer, state)
        return state

    def teacache_plan(self) -> TeaCachePlan:
        return tea.make_plan(self.pipe.transformer)

    @torch.no_grad()
    def forward(self, rows: Sequence[Row]) -> torch.Tensor:
        if rows[0].state.step_consts is not None and fast.usable(self.pipe.transformer, rows):
            return fast.forward(self.pipe.transformer, rows)
        with self.lora_plan(rows):
            return den.forward(self.pipe.transformer, rows)

    def graph_call(self, rows: Sequence[Row]) -> GraphCall:
        return den.graph_call(self.pipe.transformer, rows)

    def combine(self, state: DenoiseState, preds: dict[str, torch.Tensor]) -> torch.Tensor:
        return den.combine(state, preds)

    def decode(self, latents: torch.Tensor, params: GenerationParams) -> Frames:
        with self.vae_mode(params):
            return dec.decode(self.pipe, latents.to(self.device), params)

    def reference_call(self, params: GenerationParams, output_type: str = "np"):
        return self.pipe(
            prompt=params.prompt,
            negative_prompt=params.negative_prompt,
            true_cfg_scale=params.true_cfg,
            height=params.height,
            width=params.width,
            num_inference_steps=params.steps,
            guidance_scale=params.guidance,
            generator=self.generator(params.seed),
            max_sequence_length=self.max_sequence_length,
            output_type=output_type,
        ).images
