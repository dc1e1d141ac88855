"""All-gather of shards that may differ in length, on any backend, and the output hook that uses it.

diffusers gathers uneven shards (``ulysses_anything`` / ``ring_anything``) with a list
``all_gather`` of differently sized tensors; gloo refuses that ("invalid tensor size"), so on CPU
any odd token count (Qwen-Image at 48×48: 9 image tokens) failed at the model's output gather.
Here shards are zero-padded to the longest, gathered, and trimmed.

``output_gather(module)``: the gather a module's ``_cp_plan`` output entry puts after it, for code
that adds to that module's output from its local input (a LoRA delta: ``triptych.lora.rows``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from diffusers.hooks.context_parallel import _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE
from diffusers.hooks.hooks import ModelHook
from diffusers.models._modeling_parallel import ContextParallelOutput, gather_size_by_comm


def all_gather_uneven(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` in rank order; lengths along ``dim`` may differ
    (one small size all-gather, then one padded all-gather)."""
    sizes = gather_size_by_comm(tensor.shape[dim], group)
    longest = max(sizes)
    if tensor.shape[dim] < longest:
        pad = list(tensor.shape)
        pad[dim] = longest - tensor.shape[dim]
        tensor = torch.cat([tensor, tensor.new_zeros(pad)], dim=dim)
    gathered = [torch.empty_like(tensor) for _ in sizes]
    dist.all_gather(gathered, tensor.contiguous(), group=group)
    return torch.cat([g.narrow(dim, 0, n) for g, n in zip(gathered, sizes)], dim=dim)


class UnevenGatherHook(ModelHook):
    """Replaces diffusers' ``ContextParallelGatherHook`` on a ``_cp_plan`` output entry: the same
    gather, through ``all_gather_uneven``."""

    def __init__(self, outputs: list[ContextParallelOutput | None], group: dist.ProcessGroup):
        super().__init__()
        self.outputs = outputs
        self.group = group

    def post_forward(self, module, output):
        single = isinstance(output, torch.Tensor)
        items = [output] if single else list(output)
        if len(items) != len(self.outputs):
            raise ValueError(f"expected {len(self.outputs)} outputs to gather, got {len(items)}")
        for i, spec in enumerate(self.outputs):
            if spec is not None:
                items[i] = all_gather_uneven(items[i], spec.gather_dim, self.group)
        return items[0] if single else tuple(items)


_OUTPUT_HOOK_PREFIX = _CONTEXT_PARALLEL_OUTPUT_HOOK_TEMPLATE.format("")


def output_gather(module: torch.nn.Module):
    """``gather(tensor)`` when sequence parallel gathers ``module``'s output along the sequence (its
    input is this rank's shard, its output the whole sequence), else None. The gather is the one
    the output hook runs (diffusers' or ``UnevenGatherHook``): a collective over the sequence group."""
    registry = module.__dict__.get("_diffusers_hook")  # a plain attribute: no Module.__getattr__ miss
    if registry is None:
        return None
    for name, hook in registry.hooks.items():
        if name.startswith(_OUTPUT_HOOK_PREFIX):
            return lambda tensor: hook.post_forward(module, tensor)
    return None


def fix_ulysses_anything_mask() -> None:
    """Make diffusers' uneven Ulysses attention gather a local attention mask shard by shard.

    NOTE: diffusers 0.42.1's ``TemplatedUlyssesAnythingAttention`` pads every rank's mask to the
    longest shard, all-gathers, concatenates and trims the *end*: right only when at most the last
    shard is short. Ulysses 3 over 16 image tokens (6, 5, 5) with a text padding mask (fused CFG or a
    batch of prompts of different lengths) shifted the mask against the keys: the default model's
    image came out wrong (max abs 0.45; ``tests/pipelines/test_composition.py``). This wraps its
    ``forward``: a local mask is gathered here with ``all_gather_uneven`` (trimmed per shard) before
    diffusers sees it, so its own gather (taken only for a mask of the local length) is skipped.
    Where diffusers' gather is right the result is the same. Applied once per process, kept.
    """
    from diffusers.models import attention_dispatch

    cls = attention_dispatch.TemplatedUlyssesAnythingAttention
    original = cls.forward
    if getattr(original, "_triptych_mask_fix", False):
        return

    def forward(ctx, query, key, value, attn_mask, *args, **kwargs):
        # args: dropout_p, is_causal, scale, enable_gqa, return_lse, forward_op, backward_op, _parallel_config
        config = kwargs.get("_parallel_config", args[7] if len(args) > 7 else None)
        if attn_mask is not None and attn_mask.shape[-1] == key.shape[1]:
            group = config.context_parallel_config._ulysses_mesh.get_group()
            attn_mask = all_gather_uneven(attn_mask, attn_mask.dim() - 1, group)
        return original(ctx, query, key, value, attn_mask, *args, **kwargs)

    forward._triptych_mask_fix = True
    cls.forward = staticmethod(forward)
