"""Sequence parallel (Ulysses, ring) for a diffusers transformer: diffusers' context parallel, applied
to the instance's own mesh.

What diffusers provides and this module only calls: ``ContextParallelConfig``, the model's
``_cp_plan`` (which inputs split along the sequence, where outputs gather), the split/gather hooks
(``enable_parallelism`` → ``apply_context_parallel``) and the templated Ulysses/ring attention.
What it adds: the mesh (``ParallelGroups.mesh``, so a CFG dimension can sit beside the sequence
dimensions), the CPU device-count shim, the log-sum-exp attention backend ring needs on CPU
(``triptych.parallel.attention``), an output gather that works with uneven shards on gloo and a
mask gather for uneven Ulysses shards (``triptych.parallel.gather``), uneven Ulysses attention kept out
of compiled graphs (``keep_ulysses_anything_eager``), and ``remove`` (diffusers 0.42.1 has no
``disable_parallelism``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from diffusers import ContextParallelConfig
from diffusers.hooks import HookRegistry
from diffusers.hooks.context_parallel import (
    _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE,
    _get_submodule_by_name,
    remove_context_parallel,
)
from diffusers.models._modeling_parallel import ContextParallelOutput

import triptych.parallel.attention as attention
from triptych.parallel.gather import UnevenGatherHook, fix_ulysses_anything_mask
from triptych.parallel.groups import ParallelGroups

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def cpu_device_count_shim() -> Iterator[None]:
    """While inside, a machine with no accelerator reports one device.

    NOTE: diffusers 0.42.1 resolves a rank's device in ``ModelMixin._resolve_parallel_config`` as
    ``torch.device(accelerator_type, rank % torch.accelerator.device_count())``, which divides by
    zero where there is no accelerator (the accelerator type is then ``cpu``, and ``cpu:0`` is the
    right answer). This is the one place Triptych patches torch: ``torch.accelerator.device_count``
    for the duration of an ``enable_parallelism`` call, restored on exit; with an accelerator present
    it patches nothing. Not thread-safe: call it from the rank's main thread.
    """
    original = torch.accelerator.device_count
    if original() > 0:
        yield
        return
    torch.accelerator.device_count = lambda *args, **kwargs: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = original


def context_parallel_backend(backend):
    """``backend`` where diffusers' context parallel runs it, else native (logged): ``--attention
    auto`` picks flash attention 3 on Hopper, which diffusers 0.42.1 does not run context parallel
    (nor ``_native_math`` / ``_native_efficient``). None (the process-wide backend) is looked up."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    name = backend if backend is not None else _AttentionBackendRegistry.get_active_backend()[0]
    if AttentionBackendName(name) in _AttentionBackendRegistry._supports_context_parallel:
        return backend
    logger.warning("attention %s has no context-parallel support in diffusers: native on this instance", name)
    return AttentionBackendName.NATIVE


def keep_ulysses_anything_eager() -> None:
    """Run diffusers' uneven Ulysses attention outside compiled graphs (``--compile``'s blocks call it).

    NOTE: diffusers 0.42.1 marks the all-to-all helpers of ``TemplatedUlyssesAnythingAttention``
    ``allow_in_graph``: dynamo puts them into a block's graph as opaque calls and runs them on fake
    tensors while tracing, where the process group is a fake object, and the trace fails ("Tried to
    call __getattr__ with attr 'allgather' on a FakeScriptObject"; every compiled Ulysses-3 step of
    the default model failed so). Wrapped in ``torch.compiler.disable``, that attention (its size
    all-gathers, all-to-alls, the attention between them, and ``fix_ulysses_anything_mask``'s mask
    gather) runs eagerly between the compiled pieces of the block; an eager run is unchanged.
    Even-shard Ulysses and ring attention are traced as they are. Applied once per process, kept.
    """
    from diffusers.models import attention_dispatch

    cls = attention_dispatch.TemplatedUlyssesAnythingAttention
    if getattr(cls.forward, "_triptych_eager", False):
        return
    forward = torch.compiler.disable(cls.forward)
    forward._triptych_eager = True
    cls.forward = staticmethod(forward)


def _attention_processors(transformer: torch.nn.Module) -> list:
    return [
        m.processor
        for m in transformer.modules()
        if getattr(m, "processor", None) is not None and hasattr(m.processor, "_attention_backend")
    ]


def _replace_output_gathers(transformer: torch.nn.Module, plan: dict, group) -> None:
    """Swap diffusers' output gather hooks for ``UnevenGatherHook`` under the same names (so
    ``remove_context_parallel`` removes them): diffusers' uneven gather fails on gloo."""
    for module_id, entry in plan.items():
        if isinstance(entry, dict):
            continue
        outputs = [entry] if isinstance(entry, ContextParallelOutput) else list(entry)
        modules = _get_submodule_by_name(transformer, module_id)
        for module in modules if isinstance(modules, list) else [modules]:
            registry = HookRegistry.check_if_exists_or_initialize(module)
            name = _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE.format(module_id)
            registry.remove_hook(name)
            registry.register_hook(UnevenGatherHook(outputs, group), name)


class SequenceParallel:
    """Context parallel attached to one transformer; ``remove`` detaches it (exactly the old model).

    Contract: while attached, every call of the transformer is a collective over the rank's sequence
    group: all ranks of the group call it with the same full inputs and each gets the full output.
    """

    def __init__(self, transformer: torch.nn.Module, groups: ParallelGroups):
        config = groups.config
        if config.sequence_degree == 1:
            raise ValueError("sequence parallel needs ulysses > 1 or ring > 1")
        if getattr(transformer, "_cp_plan", None) is None:
            raise ValueError(f"{type(transformer).__name__} declares no _cp_plan: it cannot run sequence parallel")
        heads = getattr(transformer.config, "num_attention_heads", None)
        if heads is not None and heads % config.ulysses:
            raise ValueError(f"ulysses={config.ulysses} does not divide the {heads} attention heads of the model")
        self.transformer = transformer
        self.plan = transformer._cp_plan
        self._saved_backends = [p._attention_backend for p in _attention_processors(transformer)]
        self._uses_lse_backend = config.ring > 1
        for p in _attention_processors(transformer):
            p._attention_backend = context_parallel_backend(p._attention_backend)
        if self._uses_lse_backend:
            # NOTE: set before enable_parallelism, which checks the backend is context-parallel capable.
            # On CUDA too: diffusers' log-sum-exp backends there need flash-attn, sage or half precision.
            backend = attention.install()
            for p in _attention_processors(transformer):
                p._attention_backend = backend
        cp = ContextParallelConfig(
            ring_degree=config.ring,
            ulysses_degree=config.ulysses,
            mesh=groups.mesh,
            ulysses_anything=config.uneven_sequences and config.ring == 1,
            ring_anything=config.uneven_sequences and config.ulysses == 1 and config.ring > 1,
        )
        if cp.ulysses_anything:
            fix_ulysses_anything_mask()
            keep_ulysses_anything_eager()  # after the mask fix: its gather runs eagerly too
        try:
            with cpu_device_count_shim():
                transformer.enable_parallelism(config=cp)
            if config.uneven_sequences:
                _replace_output_gathers(transformer, self.plan, cp._flattened_mesh.get_group())
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Detach the split/gather hooks and parallel configs, restore the attention backends
        (safe on a half-applied attach: hooks that were never registered are skipped)."""
        t = self.transformer
        remove_context_parallel(t, self.plan)
        for p, backend in zip(_attention_processors(t), self._saved_backends):
            if hasattr(p, "_parallel_config"):
                p._parallel_config = None
            p._attention_backend = backend
        t._parallel_config = None
        if self._uses_lse_backend:
            attention.uninstall()
            self._uses_lse_backend = False
