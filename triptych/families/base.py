"""Stage protocol: every model family is split into encode → prepare → denoise_step → decode.

A family adapter (``triptych/families/<family>/``) wraps the family's diffusers pipeline class and
exposes four stages whose payloads are plain objects of tensors and scalars, ready to cross a
process boundary:

- ``encode(params) -> Conditioning``: prompt, negative prompt and condition images → tensors.
- ``prepare(params, cond) -> DenoiseState``: initial latents and a per-request sampler from the seed.
- ``denoise_step(states)``: advances a *batch of requests, each at its own step*, by one step.
- ``decode(latents, params) -> Frames``: final latents → frames (images are one frame).

Exactness contract: with ``fuse_cfg=False`` a single request runs
each CFG branch as its own forward, exactly as the diffusers pipeline's ``__call__`` does, so the
staged output is bit-identical to it in float32 on CPU. ``fuse_cfg=True`` stacks both branches (and
any number of requests) into one transformer forward; that changes kernel reduction order and is
held to a stated tolerance.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from shapeworld.prompts import normaliser
from triptych.accel import SpeedConfig, apply_speed, step_graphs_for
from triptych.core.devices import DeviceConfig
from triptych.core.errors import InvalidParam, TriptychError
from triptych.families.fastpath import model_hooked
from triptych.families.geometry import model_defaults
from triptych.families.placement import place, vae_tiling
from triptych.families.types import (  # noqa: F401 - re-exported: the stage protocol's values
    ALL_ROLES,
    BRANCH_ORDER,
    COND,
    UNCOND,
    Conditioning,
    DenoiseState,
    ForwardFn,
    Frames,
    GenerationParams,
    Role,
    Row,
    StepStats,
    to_frames,
)
from triptych.mmcache.cache import MMCacheConfig

if TYPE_CHECKING:
    from triptych.accel.step_graphs import GraphCall, StepGraphs
    from triptych.accel.teacache import TeaCachePlan

logger = logging.getLogger(__name__)


class Family(ABC):
    """A model family adapter over its diffusers pipeline class.

    Subclasses set ``name``, ``pipeline_class``, ``role_components`` and implement the abstract
    hooks. ``denoise_step`` is generic: it builds rows, groups them into forwards, calls
    ``forward`` (one transformer call per group) and lets each request combine guidance and step
    its own scheduler.
    """

    name: ClassVar[str]
    pipeline_class: ClassVar[type]
    #: pipeline components each role loads; the rest are passed as None to ``from_pretrained``.
    role_components: ClassVar[dict[Role, tuple[str, ...]]]
    #: every component name of the pipeline (scheduler is always loaded).
    all_components: ClassVar[tuple[str, ...]]
    accepts_image: ClassVar[bool] = False
    requires_image: ClassVar[bool] = False
    is_video: ClassVar[bool] = False
    #: ``guidance`` is what the family's diffusers pipeline calls ``true_cfg_scale`` (Qwen-Image): the
    #: head takes a request's ``true_cfg_scale`` as its ``guidance_scale``.
    true_cfg_is_guidance: ClassVar[bool] = False

    def __init__(
        self,
        model_dir: str | Path,
        roles=ALL_ROLES,
        device: str | DeviceConfig = "cpu",
        dtype: str | torch.dtype | None = None,
        mm_cache_config: MMCacheConfig = MMCacheConfig(),
        speed: SpeedConfig = SpeedConfig(),
    ):
        """``device``: a device name with ``dtype`` (a name, a ``torch.dtype`` or None = auto), or a
        whole ``DeviceConfig`` (then ``dtype`` must be None). Invalid values raise ``InvalidParam``.
        ``mm_cache_config``: the encoder's mm-hash cache, for families that have one. ``speed``:
        compile and quantization of the loaded components (``triptych.accel``)."""
        self.model_dir = Path(model_dir)
        self.mm_cache_config = mm_cache_config  # the encoder's mm-hash cache, for families that have one
        self.roles = frozenset(Role(r) for r in roles)
        self.device_config = as_device_config(device, dtype)
        self.device = self.device_config.torch_device
        self.dtype = self.device_config.torch_dtype
        if speed.cuda_graphs and (why := self.cuda_graphs_refusal(self.device_config.offload)):
            raise InvalidParam("--cuda-graphs", "on", why)  # before any weight loads
        wanted = {c for r in self.roles for c in self.role_components[r]}
        skipped = {c: None for c in self.all_components if c not in wanted}
        built = self._build_components(frozenset(wanted))
        self.pipe = self.pipeline_class.from_pretrained(str(self.model_dir), dtype=self.dtype, **skipped, **built)
        place(self.pipe, self.device_config, self.attention_masks)
        if self.device_config.offload != "none":
            # The step tables and fast forwards call the transformer's submodules directly, outside
            # the offload hooks that bring weights onto the device around its forward.
            self.step_tables = False
        self.speed = speed
        #: ``--compile``'s one-frame VAE decoder (``accel/frame_decode.py``) where the VAE has one; None: ``vae.decode``
        self.frame_decoder = apply_speed(self.pipe, speed, self.device_config.device, self.compile_vae_decoder)
        if speed.step_graphs and Role.DENOISER in self.roles:
            self.step_graphs = step_graphs_for(speed)
        # The device the encode stage hands diffusers' encode_prompt: the pipeline's own
        # ``_execution_device`` (offload hooks included), looked up once. NOTE: the property walks every
        # module's offload hooks on each read, a large part of a tiny model's prompt encode.
        self.execution_device = self.pipe._execution_device
        self.pipe.set_progress_bar_config(disable=True)
        # triptych.json's "prompt_normaliser": only the shipped shape-world models name one.
        self.prompt_normaliser = normaliser(model_defaults(self.model_dir).get("prompt_normaliser"))
        self._post_load()

    def encoder_prompt(self, prompt: str, edit: bool = False) -> str:
        """The prompt the text encoder gets: normalised (``shapeworld.prompts``) or as sent."""
        normal = self.prompt_normaliser is not None and isinstance(prompt, str)
        return self.prompt_normaliser(prompt, edit) if normal else prompt

    def vae_mode(self, params: GenerationParams):
        """Context for one VAE decode of ``params``' size: tiling on or off as the config says."""
        return vae_tiling(self.pipe.vae, self.device_config.tiling_for(params.height, params.width))

    def _post_load(self) -> None:
        """Hook for families that derive geometry from configs after loading."""

    #: the transformer may be passed attention masks (``--attention auto`` then keeps to mask-taking backends)
    attention_masks: ClassVar[bool] = False
    #: ``--compile`` also compiles the VAE decoder (``accel.compile.compile_decoder``): only where it
    #: was measured to pay (benchmarks/RESULTS.md, "--compile and --quantize").
    compile_vae_decoder: ClassVar[bool] = False
    #: whether ``--cuda-graphs`` applies: the family's compiled block stack replays as CUDA graphs
    cuda_graph_stack: ClassVar[bool] = False

    @classmethod
    def cuda_graphs_refusal(cls, offload: str = "none") -> str | None:
        """Why ``--cuda-graphs`` cannot run on this family with ``offload``; None when it can (the
        family's own load and ``serve``'s check before it starts a worker both ask)."""
        if not cls.cuda_graph_stack:
            return f"{cls.name} has no compiled block stack (only Qwen-Image's replays as CUDA graphs)"
        if offload != "none":
            return f"--offload {offload} runs the transformer's own forward"
        return None

    def teacache_plan(self) -> TeaCachePlan:
        """This instance's TeaCache plan (``triptych.accel.teacache.TeaCachePlan``: its transformer's
        forward split in four), for a loaded denoiser; raises ``ValueError`` where the family has none.
        A family with one overrides this and sets its entry's ``teacache`` in ``families.registry``."""
        raise ValueError(f"family {self.name!r} has no TeaCache plan")

    def warmup_latents(self, params: GenerationParams) -> torch.Tensor | None:
        """Random latents shaped like a denoised ``params`` request's, for warming up a compiled VAE
        decoder without a transformer (``engine/warmup.py``); None: no decoder warm-up."""
        return None

    #: Components a LoRA file may adapt here: a subset of the pipeline class's ``_lora_loadable_modules``
    #: (``triptych.lora.formats``); the other keys of that format are refused naming the key.
    lora_components: ClassVar[tuple[str, ...]] = ("transformer",)
    #: The denoiser's adapters (``triptych.lora.runtime``), after ``enable_lora``; None = no LoRA here.
    lora = None
    #: The encoder's text-encoder adapters, after ``enable_lora`` where ``lora_components`` has
    #: ``text_encoder`` and this instance loaded it; None = none.
    text_lora = None

    def enable_lora(self, config) -> None:
        """Serve the adapters of ``config`` (a ``LoraConfig``) on this instance's transformer and, where
        the family applies text-encoder LoRA, its text encoder (each component this instance loaded)."""
        from triptych.lora.adapter import check_fits, linear_shapes
        from triptych.lora.files import read_adapter
        from triptych.lora.formats import LoraFormat
        from triptych.lora.runtime import LoraRuntime

        fmt = LoraFormat.of(self)
        for component in self.lora_components:
            module = getattr(self.pipe, component, None)
            if module is None:
                continue
            shapes = linear_shapes(module)
            flat = not hasattr(module, "text_model")

            def read(name: str, path: Path, component=component, shapes=shapes, flat=flat):
                adapter = read_adapter(name, path, self.pipeline_class, component, fmt, flat)
                check_fits(adapter, shapes, f"{self.name}'s {component} at {self.model_dir}")
                return adapter.to(self.device, self.dtype)

            runtime = LoraRuntime(module, config, read)
            setattr(self, "lora" if component == "transformer" else "text_lora", runtime)

    def lora_plan(self, rows: Sequence[Row]):
        """The context one transformer forward over ``rows`` runs in: each row's adapters applied."""
        specs = [r.state.params.lora for r in rows]
        if self.lora is None:
            assert not any(specs), "a row names a LoRA on an instance without adapters"
            return contextlib.nullcontext()
        return self.lora.plan(specs)

    @contextlib.contextmanager
    def text_lora_plan(self, params: Sequence[GenerationParams]):
        """The context one text-encoder forward over one row per ``params`` runs in: each request's
        adapters acquired (loaded on a miss, a run-time adapter from its ``lora_paths``), applied to
        its row, and released after. A no-op without text-encoder LoRA here (``text_lora`` None)."""
        runtime = self.text_lora
        if runtime is None or not any(p.lora for p in params):
            yield
            return
        held = []
        try:
            for i, p in enumerate(params):
                for name, path in p.lora_paths:
                    runtime.add_path(name, Path(path))
                if p.lora:
                    holder = f"encode-{id(params)}-{i}"
                    runtime.acquire(holder, p.lora)
                    held.append(holder)
            with runtime.plan([p.lora for p in params]):
                yield
        finally:
            for holder in held:
                runtime.release(holder)

    @property
    def supports_chat(self) -> bool:
        """Whether the model answers chat (``/v1/chat/completions``) with its encoder's VLM."""
        return False

    def chat_model(self):
        """This instance's ``triptych.chat.vlm.ChatModel``, or None (no VLM loaded here)."""
        return None

    def vllm_export(self, out: Path, vision: str = "copy") -> Path:
        """Write the model folder a vLLM server loads to answer this model's chats (files only)."""
        raise TriptychError(f"{self.name} has no VLM that vLLM can serve")

    def vllm_inputs(self, chat) -> tuple[int, dict]:
        """A chat's prompt length and its images as vLLM embedding items (``pipelines/qwenimage/vllm``)."""
        raise TriptychError(f"{self.name} has no VLM to encode a chat's images for vLLM")

    def _build_components(self, wanted: frozenset[str]) -> dict[str, Any]:
        """Components the family constructs itself instead of letting ``from_pretrained`` load them.

        For a component whose declared class cannot be built here (e.g. a processor that needs
        torchvision); none by default. Only called with the components this instance's roles need.
        """
        return {}

    # ---- stage 0: validation -------------------------------------------------------------
    @abstractmethod
    def resolve(self, params: GenerationParams) -> GenerationParams:
        """Fill defaults and check every rule; raise ``InvalidParam`` naming field, value, rule."""

    def _check_common(self, p: GenerationParams, multiple: int) -> None:
        if not isinstance(p.prompt, str) or not p.prompt.strip():
            raise InvalidParam("prompt", p.prompt, "must be a non-empty string")
        for name in ("height", "width"):
            v = getattr(p, name)
            if v < multiple or v % multiple:
                raise InvalidParam(name, v, f"must be a positive multiple of {multiple} for {self.name}")
        if p.steps < 1:
            raise InvalidParam("steps", p.steps, "must be >= 1")
        if p.guidance is not None and p.guidance < 0:
            raise InvalidParam("guidance", p.guidance, "must be >= 0")
        if p.image is None and self.requires_image:
            raise InvalidParam("image", None, f"{self.name} needs a condition image")
        if p.image is not None and not self.accepts_image:
            raise InvalidParam("image", "<image>", f"{self.name} is text-only and takes no image")
        if not self.is_video and p.frames not in (None, 1):
            raise InvalidParam("frames", p.frames, f"{self.name} generates images; frames must be 1")

    @abstractmethod
    def sequence_tokens(self, params: GenerationParams) -> int:
        """Tokens of one row of the transformer's image stream for resolved ``params`` (latent patches ×
        latent frames, plus an edit's condition tokens), from the model's own geometry: the cost unit
        the head limits (``AdmissionLimits.max_tokens``). Needs no weights."""

    # ---- stage 1: encode -----------------------------------------------------------------
    @abstractmethod
    def encode(self, params: GenerationParams) -> Conditioning: ...

    # ---- stage 2: prepare ----------------------------------------------------------------
    @abstractmethod
    def prepare(self, request_id: str, params: GenerationParams, cond: Conditioning) -> DenoiseState: ...

    def new_scheduler(self):
        """A scheduler owned by one request (multistep schedulers keep per-request history)."""
        return copy.deepcopy(self.pipe.scheduler)

    def generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device="cpu" if self.device.type == "mps" else self.device).manual_seed(seed)

    def warmup_conditioning(self, params: GenerationParams, lengths: tuple[int, int]) -> Conditioning | None:
        """Random conditioning shaped like ``encode``'s, prompt lengths ``lengths`` (cond, uncond), for
        warming up a compiled transformer without an encoder (``engine/warmup.py``); None: no warm-up."""
        return None

    # ---- stage 3: denoise ----------------------------------------------------------------
    @abstractmethod
    def forward(self, rows: Sequence[Row]) -> torch.Tensor:
        """One transformer call over the stacked rows; returns noise predictions, one per row."""

    #: ``--step-graphs``' runner (``accel/step_graphs.py``) on a denoiser; None: every forward eager.
    step_graphs: StepGraphs | None = None

    def graph_call(self, rows: Sequence[Row]) -> GraphCall | None:
        """The transformer's own forward over ``rows`` as a step graph replays it (``forward``'s
        output for the same rows); None: this family has none."""
        return None

    def graph_refusal(self, rows: Sequence[Row]) -> str | None:
        """Why ``rows`` must run eagerly although step graphs are on; None when a graph may run them.
        A row's adapter is applied by hooks that choose per call which rows they change, and a hook
        on the model (offload, context parallel, a diffusers cache) expects its forward to run."""
        if any(r.state.params.lora for r in rows):
            return "a LoRA row (per-row adapter hooks)"
        if model_hooked(self.pipe.transformer):
            return "a hook on the transformer (offload, context parallel or a cache)"
        return None

    def step_forward(self, rows: Sequence[Row]) -> torch.Tensor:
        """``forward``, replayed from a step graph where ``step_graphs`` can (the padded rows sliced
        off); any other call runs ``forward`` and is counted under its reason."""
        graphs = self.step_graphs
        if graphs is None:
            return self.forward(rows)
        why = self.graph_refusal(rows)
        call = None if why else self.graph_call(rows)
        if call is None:
            graphs.fallback(why or f"{self.name} has no graph call")
            return self.forward(rows)
        out = graphs.run(call)
        return self.forward(rows) if out is None else out

    @abstractmethod
    def combine(self, state: DenoiseState, preds: dict[str, torch.Tensor]) -> torch.Tensor:
        """Guidance: turn the per-branch predictions of one request into its noise prediction."""

    def scheduler_step(self, state: DenoiseState, noise_pred: torch.Tensor) -> torch.Tensor:
        return state.scheduler.step(noise_pred, state.timestep, state.latents, return_dict=False)[0]

    def predict_x0(self, state: DenoiseState, noise_pred: torch.Tensor) -> torch.Tensor:
        """The clean latents this step predicts (before the scheduler steps): for flow matching, which
        every family here uses (``x_t = (1 - s) x0 + s noise``, the model predicts ``noise - x0``),
        ``x0 = x_t - s * pred`` with ``s`` the step's sigma. A new tensor; ``state`` is unchanged."""
        sigma = state.scheduler.sigmas[state.step].to(noise_pred.device, noise_pred.dtype)
        return state.latents - sigma * noise_pred

    def row_tokens(self, state: DenoiseState) -> int:
        """Latent tokens of one row of ``state`` (the engine's ``max_batch_tokens`` unit): packed
        latents are (batch, sequence, channels)."""
        return int(state.latents[0].numel() // state.latents.shape[-1])

    def compat_key(self, state: DenoiseState) -> tuple:
        """Requests with equal keys may share one forward (family, size, frames, dtype)."""
        p = state.params
        return (self.name, p.height, p.width, p.frames or 1, str(self.dtype))

    @torch.no_grad()
    def denoise_step(
        self, states: Sequence[DenoiseState], fuse_cfg: bool = False, forward: ForwardFn | None = None
    ) -> StepStats:
        """Advance every state by one step.

        ``fuse_cfg=False`` runs one forward per CFG branch over all requests (diffusers' order, so a
        single request is bit-identical to the pipeline). ``fuse_cfg=True`` runs one forward over
        every row. ``forward`` lets an acceleration (e.g. TeaCache) wrap the transformer call.
        """
        states = [s for s in states if not s.done]
        if not states:
            return StepStats()
        keys = {self.compat_key(s) for s in states}
        assert len(keys) == 1, f"incompatible requests in one batch: {keys}"
        run = forward or self.step_forward
        rows = [Row(s, b) for b in BRANCH_ORDER for s in states if b in s.cond.branches]
        groups = [rows] if fuse_cfg else [[r for r in rows if r.branch == b] for b in BRANCH_ORDER]
        preds: dict[tuple[int, str], torch.Tensor] = {}
        stats = StepStats()
        for group in groups:
            if not group:
                continue
            out = run(group)
            stats.forwards += 1
            stats.rows += len(group)
            for row, pred in zip(group, out.split(1)):
                preds[(id(row.state), row.branch)] = pred
        for s in states:
            noise = self.combine(s, {b: preds[(id(s), b)] for b in s.branches()})
            if s.step + 1 in s.preview_steps:
                s.x0 = self.predict_x0(s, noise)
            s.latents = self.scheduler_step(s, noise)
            s.step += 1
        return stats

    # ---- stage 4: decode -----------------------------------------------------------------
    @abstractmethod
    def decode(self, latents: torch.Tensor, params: GenerationParams) -> Frames: ...

    # ---- reference ------------------------------------------------------------------------
    @abstractmethod
    def reference_call(self, params: GenerationParams, output_type: str = "np") -> Any:
        """Run the diffusers pipeline's own ``__call__`` for the same request (tests, benchmarks)."""


def as_device_config(device: str | DeviceConfig, dtype: str | torch.dtype | None = None) -> DeviceConfig:
    """A ``DeviceConfig`` from a config, or from a device name and dtype (name or ``torch.dtype``)."""
    if isinstance(device, DeviceConfig):
        assert dtype is None, "pass the dtype inside the DeviceConfig"
        return device
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    return DeviceConfig(device=str(device), dtype=dtype)
