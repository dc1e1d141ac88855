"""Ring attention on any device: an attention backend that also returns the log-sum-exp.

diffusers' ring attention (``TemplatedRingAttention``) merges per-chunk attention results through
their log-sum-exp, so it needs a backend whose forward op returns it. In diffusers 0.42.1 the
backends that do (flash, cuDNN, sage, NPU) are GPU-only; ``native`` refuses ``return_lse=True``.
Torch's CPU SDPA kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``, the one plain SDPA
runs on CPU) does return it, so this module registers a context-parallel-capable backend built on it.

Where it lives: diffusers' dispatcher only accepts backends named in its closed
``AttentionBackendName`` enum, so the backend takes the slot of ``_native_math``. ``install``
keeps that slot's original function and calls it whenever there is no parallel config, so the
math backend behaves exactly as before for everyone else; only context-parallel calls (and the
log-sum-exp it now returns) are new. Installs are counted: the last ``uninstall`` restores the
original registration.

Key padding masks under ring. Qwen-Image stacks prompts of different lengths with a key padding
mask; each rank holds the mask of its own key shard, and diffusers' ring passes that local mask
unchanged to every rotated key/value chunk (``ring_anything`` refuses a mask outright). With a
mask, this backend therefore gathers the ring group's key/value shards and masks once (the same
all-gather diffusers' ring does with ``rotate_method="allgather"``) and attends over them in one
call: exact, and no more communication than the rotation.
"""

from __future__ import annotations

import logging

import torch
from diffusers.models.attention_dispatch import (
    AttentionBackendName,
    _AttentionBackendRegistry,
    _templated_context_parallel_attention,
)

from triptych.parallel.gather import all_gather_uneven

logger = logging.getLogger(__name__)

LSE_BACKEND = AttentionBackendName._NATIVE_MATH
"""The dispatcher slot the log-sum-exp backend occupies while installed."""

_original: dict | None = None  # the slot's registration before ``install``; None when not installed
_users = 0  # installs not yet matched by an uninstall


def attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over ``(B, S, H, D)`` tensors → ``out (B, S_q, H, D)``, ``lse (B, S_q, H)`` in float32.

    On CPU: torch's fused CPU kernel (the same one SDPA uses, so without splitting it equals SDPA
    bit for bit). Elsewhere: explicit ``softmax(q kᵀ · scale + mask) v`` with ``logsumexp``.
    """
    q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~attn_mask, float("-inf"))
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=attn_mask, scale=scale)
    else:
        scores = (q.float() @ k.float().transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        if attn_mask is not None:
            scores = scores + attn_mask
        lse = torch.logsumexp(scores, dim=-1)
        out = (torch.exp(scores - lse[..., None]) @ v.float()).to(q.dtype)
    return out.permute(0, 2, 1, 3), lse.permute(0, 2, 1)


def _forward_op(
    ctx,
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    return_lse=False,
    _save_ctx=True,
    _parallel_config=None,
):
    """The forward op diffusers' templated ring/Ulysses attention calls once per key/value chunk."""
    if dropout_p or is_causal or enable_gqa:
        raise ValueError("the log-sum-exp attention backend supports no dropout, causal masking or GQA")
    out, lse = attention_with_lse(query, key, value, attn_mask, scale)
    return (out, lse) if return_lse else out


def _backward_op(ctx, grad_out, *args, **kwargs):
    raise NotImplementedError("the log-sum-exp attention backend is inference-only")


def _ring_with_key_mask(query, key, value, attn_mask, scale, return_lse, parallel_config):
    """Ring attention under a key padding mask: gather the ring group's key/value shards and masks
    (shards may differ in length by one token with ``ring_anything``), attend once."""
    cp = parallel_config.context_parallel_config
    if cp.ulysses_degree > 1:
        raise NotImplementedError("a key padding mask with ulysses × ring attention is not supported; use one of them")
    if attn_mask.shape[-1] != key.shape[1] or attn_mask.shape[-2] != 1:
        raise ValueError(f"expected a key padding mask (..., 1, {key.shape[1]}), got {tuple(attn_mask.shape)}")
    group = cp._ring_mesh.get_group()
    key, value = (all_gather_uneven(x, 1, group) for x in (key, value))
    attn_mask = all_gather_uneven(attn_mask, attn_mask.dim() - 1, group)
    out, lse = attention_with_lse(query, key, value, attn_mask, scale)
    return (out, lse) if return_lse else out


def _lse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config=None,
):
    if _parallel_config is None:
        if return_lse:
            out, lse = attention_with_lse(query, key, value, attn_mask, scale)
            return out, lse
        return _original["func"](
            query=query,
            key=key,
            value=value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    return _context_parallel_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, _parallel_config
    )


@torch.compiler.disable
def _context_parallel_attention(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, _parallel_config
):
    """Ring (or Ulysses × ring) attention across the sequence group; never traced by ``torch.compile``.

    NOTE: compiled blocks (``--compile``) call this between their compiled pieces, eagerly. Traced
    (torch 2.13, the default model under ring 2), a batch of prompts of different lengths failed in
    the compiled CPU attention kernel ("Attention mask is the same data type as query": the key
    padding mask path), and with the graph breaks moved, dynamo's trace of diffusers' uneven ring
    attention raised an internal assertion ("got unbound symbols"); one request without a mask ran.
    """
    if attn_mask is not None and _parallel_config.context_parallel_config.ring_degree > 1:
        return _ring_with_key_mask(query, key, value, attn_mask, scale, return_lse, _parallel_config)
    return _templated_context_parallel_attention(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        return_lse,
        forward_op=_forward_op,
        backward_op=_backward_op,
        _parallel_config=_parallel_config,
    )


def install() -> AttentionBackendName:
    """Register the log-sum-exp backend in ``LSE_BACKEND``'s slot (counted); returns the slot."""
    global _original, _users
    _users += 1
    registry = _AttentionBackendRegistry
    if _original is None:
        _original = dict(
            func=registry._backends[LSE_BACKEND],
            constraints=registry._constraints[LSE_BACKEND],
            arg_names=registry._supported_arg_names[LSE_BACKEND],
            context_parallel=LSE_BACKEND.value in registry._supports_context_parallel,
        )
        registry.register(LSE_BACKEND, constraints=_original["constraints"], supports_context_parallel=True)(
            _lse_attention
        )
        logger.debug("installed the log-sum-exp attention backend as %s", LSE_BACKEND.value)
    return LSE_BACKEND


def uninstall() -> None:
    """Undo one ``install``; the last one restores the slot's original registration."""
    global _original, _users
    if _original is None:
        return
    _users -= 1
    if _users > 0:
        return
    registry = _AttentionBackendRegistry
    registry._backends[LSE_BACKEND] = _original["func"]
    registry._constraints[LSE_BACKEND] = _original["constraints"]
    registry._supported_arg_names[LSE_BACKEND] = _original["arg_names"]
    if not _original["context_parallel"]:
        registry._supports_context_parallel.discard(LSE_BACKEND.value)
    _original = None


def installed() -> bool:
    return _original is not None
