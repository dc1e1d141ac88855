"""One Qwen-Image checkpoint that both generates and edits, over one set of weights.

A Qwen-Image model whose ``triptych.json`` says ``"edits": true`` was trained for both jobs (the
packaged default: its edit variant ``assets/default_edit`` links every component of it). Served as
two models it would load its text encoder, VAE and transformer twice, in two sets of pools; served
as this family it is one model with one set of pools that answers ``images.generate`` (no image) and
``images.edit`` (an image), as OpenAI's image models do. Each worker loads its role's components once
and builds both diffusers pipelines over the same modules: ``QwenImageEditPipeline`` (``self.pipe``,
loaded) and ``QwenImagePipeline`` (``self.t2i_pipe``, constructed from the same components).

Every stage picks the pipeline by the request: a request without an image runs exactly as
``QwenImageFamily`` (``QwenImagePipeline``'s template, latents and reference), with an image exactly
as ``QwenImageEditFamily``. The two never share a forward (``compat_key``: an edit's key also holds
its condition image's shape). TeaCache profiles are fitted on text-to-image requests (family
``qwen-image``); an edit asking for TeaCache is refused rather than run on a profile not fitted for it.
"""

from __future__ import annotations

import torch
from diffusers import QwenImagePipeline

from triptych.core.errors import InvalidParam
from triptych.families.base import Conditioning, DenoiseState, GenerationParams, Role
from triptych.families.qwenimage import encode as enc
from triptych.families.qwenimage.family import QwenImageEditFamily, QwenImageFamily


class QwenImageGenerateEditFamily(QwenImageEditFamily):
    name = "qwen-image"  # its TeaCache profiles and metrics are the text-to-image model's
    requires_image = False
    role_components = {
        Role.ENCODER: ("text_encoder", "tokenizer", "processor", "vae"),
        Role.DENOISER: ("transformer",),
        Role.DECODER: ("vae",),
    }

    def _post_load(self) -> None:
        super()._post_load()
        components = {k: v for k, v in self.pipe.components.items() if k != "processor"}
        t2i = QwenImagePipeline(**components)  # the same modules: nothing is loaded twice
        for name in ("vae_scale_factor", "image_processor", "latent_channels"):  # geometry _post_load read
            setattr(t2i, name, getattr(self.pipe, name))
        t2i.set_progress_bar_config(disable=True)
        self.t2i_pipe = t2i

    def resolve(self, p: GenerationParams) -> GenerationParams:
        if p.image is None:
            return QwenImageFamily.resolve(self, p)
        if p.teacache_threshold:
            raise InvalidParam(
                "teacache_threshold",
                p.teacache_threshold,
                f"TeaCache on {self.model_dir.name} is calibrated for text-to-image only; an edit runs without it (0)",
            )
        return super().resolve(p)

    def sequence_tokens(self, p: GenerationParams) -> int:
        return QwenImageFamily.sequence_tokens(self, p) if p.image is None else super().sequence_tokens(p)

    def compat_key(self, state: DenoiseState) -> tuple:
        if "image_shape" not in state.cond.shared:
            return QwenImageFamily.compat_key(self, state)
        return super().compat_key(state)

    @torch.no_grad()
    def encode(self, params: GenerationParams) -> Conditioning:
        if params.image is None:
            params = params.replace(prompt=self.encoder_prompt(params.prompt))
            return enc.encode_text(
                self.t2i_pipe, params, self.uses_cfg(params), self.max_sequence_length, self.execution_device
            )
        return super().encode(params)

    def reference_call(self, params: GenerationParams, output_type: str = "np"):
        if params.image is None:
            kwargs = QwenImageFamily._reference_kwargs(self, params)
            return self.t2i_pipe(**kwargs, output_type=output_type).images
        return super().reference_call(params, output_type)
