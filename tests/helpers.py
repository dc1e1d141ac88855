"""Small helpers shared by tests: transformer call counting, pristine reference pipelines (and a
Qwen-Image call of one), a staged single-request run (through the serving engine), the Mooncake skip marker."""

from __future__ import annotations

import contextlib

from tests.extras import needs_extra
from triptych.chat.budget import StepCosts

#: Mooncake is optional on a developer machine (skipped naming the extra); .ci/run requires it.
NEEDS_MOONCAKE = needs_extra("mooncake")


@contextlib.contextmanager
def count_calls(module):
    """Count forward calls of ``module`` (and the batch size of each)."""
    calls: list[int] = []

    def hook(mod, args, kwargs):
        hs = kwargs.get("hidden_states", args[0] if args else None)
        calls.append(int(hs.shape[0]))

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def pristine_pipeline(model_dir, **components):
    """The exactness reference: diffusers' own pipeline freshly loaded from ``model_dir`` in float32,
    with none of Triptych's geometry settings, hooks or caches on it. ``components`` are passed to
    ``from_pretrained`` as a diffusers user would pass a component the checkpoint cannot load itself."""
    import torch
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(model_dir, dtype=torch.float32, **components)


def seeded(seed: int):
    """A CPU generator seeded as the pipelines' documented ``generator`` argument."""
    import torch

    return torch.Generator("cpu").manual_seed(seed)


def flux_reference(pipe, p, **extra):
    """A FLUX pipeline's ``__call__`` with a request's arguments (distilled ``guidance_scale``, true CFG
    when it has a negative prompt), as numpy images."""
    return pipe(
        prompt=p.prompt,
        negative_prompt=p.negative_prompt,
        true_cfg_scale=p.true_cfg,
        height=p.height,
        width=p.width,
        num_inference_steps=p.steps,
        guidance_scale=p.guidance,
        generator=seeded(p.seed),
        output_type="np",
        **extra,
    ).images


def qwen_reference(pipe, p, **extra):
    """A Qwen-Image(-Edit) pipeline's ``__call__`` with a request's arguments (guidance is Qwen's
    ``true_cfg_scale``), as numpy images."""
    return pipe(
        prompt=p.prompt,
        negative_prompt=p.negative_prompt,
        true_cfg_scale=p.guidance,
        height=p.height,
        width=p.width,
        num_inference_steps=p.steps,
        generator=seeded(p.seed),
        output_type="np",
        **extra,
    ).images


def staged(family, params, fuse_cfg=False):
    """One request through a family's stages in this process (``run_request``: the serving engine):
    (final state, decoded frames)."""
    from triptych.engine.runner import run_request

    states = []
    frames, _ = run_request(family, params, "r", on_step=states.append, fuse_cfg=fuse_cfg)
    return states[-1], frames


class EncoderPort:
    """A ``WorkerPort`` stand-in for driving an ``EncoderRunner`` in process: it records what the
    runner sends (``sent``; ``ChatDelta`` pieces too unless ``keep_deltas=False``) and fails
    (``failed``: request id, error, retryable), and holds the jobs it adopted (``jobs``)."""

    instance_id = "enc-0"

    def __init__(self, keep_deltas: bool = True):
        self.jobs, self.sent, self.failed = {}, [], []
        self.keep_deltas = keep_deltas

    def adopt(self, job):
        self.jobs[job.request_id] = job

    def owns(self, job):
        return self.jobs.get(job.request_id) is job

    def finish(self, job):
        self.jobs.pop(job.request_id, None)

    def reserve(self, *args):
        raise AssertionError("an encoder reserves nothing")

    def send(self, msg):
        from triptych.control import protocol as P

        if self.keep_deltas or not isinstance(msg, P.ChatDelta):
            self.sent.append(msg)

    def fail(self, job, error, retryable):
        self.jobs.pop(job.request_id, None)
        self.failed.append((job.request_id, error, retryable))

    def stopping(self):
        return False


def tiny_qwen_with_two_adapters(root):
    """A tiny seeded Qwen-Image at ``root/model`` and two random LoRA adapters for it, ``a`` (rank 4 on
    q, v and the image MLP) and ``b`` (rank 2 on k and the output projection): the model's folder and
    the ``LoraConfig`` serving both."""
    from triptych.families.qwenimage.tiny import make_tiny_qwen_image
    from triptych.lora.config import LoraConfig
    from triptych.lora.synthetic import write_random_lora

    model = make_tiny_qwen_image(root / "model", seed=0)
    transformer = pristine_pipeline(model).transformer
    write_random_lora(root / "a", transformer, ("attn.to_q", "attn.to_v", "img_mlp.net.2"), rank=4, seed=1, std=0.2)
    write_random_lora(root / "b", transformer, ("attn.to_k", "proj_out"), rank=2, seed=2, std=0.2)
    return model, LoraConfig(lora=(f"a={root / 'a'}", f"b={root / 'b'}"))


def denoise_job(request_id: str, params, progress: bool = False):
    """A denoiser ``Job`` as the head would hand it over (its ``DenoiseTask``: generation 1, encoder
    ``e0``, decoder ``dec0``), for driving a ``DenoiserRunner`` in process."""
    from triptych.control import protocol as P
    from triptych.control.wire import params_to_wire
    from triptych.worker.runners.base import Job

    task = P.DenoiseTask(
        request_id=request_id,
        generation=1,
        params=params_to_wire(params),
        specs={},
        source="e0",
        decoder="dec0",
        reserve_timeout_s=30.0,
        progress=progress,
    )
    return Job(request_id, 1, params, task=task)


def prepared_states(family, n: int, steps: int = 3):
    """``n`` prepared requests of different prompts and seeds (their prompt lengths may differ)."""
    prompts = ["a red circle", "a blue square on a green field", "two yellow triangles"]
    from triptych.families.base import GenerationParams

    out = []
    for i in range(n):
        image = None
        if family.requires_image:
            import numpy as np
            from PIL import Image

            image = Image.fromarray((np.random.default_rng(i).random((32, 32, 3)) * 255).astype("uint8"))
        p = family.resolve(GenerationParams(prompt=prompts[i % 3], seed=10 + i, steps=steps, guidance=4.0, image=image))
        out.append(family.prepare(f"r{i}", p, family.encode(p)))
    return out


class FixedCosts(StepCosts):
    """Chat step costs that never learn: seconds per unit fixed by the test."""

    def __init__(self, **per_unit: float):
        super().__init__()
        self.per_unit = dict(per_unit)

    def observe(self, kind, units, seconds, calls=1) -> None:
        pass


class DenoiserPort:
    """A ``WorkerPort`` stand-in for driving a ``DenoiserRunner`` in process: it owns every job and
    records what the runner sends (``sent``) and fails (``failed``: request id, error, retryable)."""

    instance_id = "d0"

    def __init__(self):
        self.sent, self.failed = [], []

    def send(self, msg):
        self.sent.append(msg)

    def owns(self, job):
        return True

    def fail(self, job, error, retryable):
        self.failed.append((job.request_id, str(error), retryable))
