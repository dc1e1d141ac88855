"""The settings of the vLLM chat engine (``triptych serve --chat-engine vllm``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

CHAT_ENGINES = ("builtin", "vllm")


@dataclass(frozen=True)
class VllmConfig:
    """Which engine answers chats, and how the vLLM one is started."""

    chat_engine: Literal["builtin", "vllm"] = "builtin"
    """builtin: each encoder answers chats with its own VLM (no extra dependency). vllm: the head starts
    a vLLM OpenAI server on the model's VLM and the encoders send it their image embeddings."""
    vllm_python: Path = Path(".venv-vllm/bin/python")
    """The Python of vLLM's own environment (``./install_vllm.sh`` makes ``.venv-vllm``)."""
    vllm_port: int = 0
    """vLLM's port on 127.0.0.1; 0 = a free one."""
    vllm_max_model_len: int = 1024
    """vLLM's context (prompt + answer tokens); a chat that does not fit is a 400 naming max_tokens."""
    vllm_block_size: int = 32
    """KV cache block size in tokens (on CPU a multiple of 32); prefix caching reuses whole blocks."""
    vllm_kv_cache_gb: int = 1
    """CPU only: GiB of KV cache (``VLLM_CPU_KVCACHE_SPACE``)."""
    vllm_dtype: str = "float32"
    """vLLM's weight dtype (float32 matches the built-in engine on CPU)."""
    vllm_vision_weights: Literal["copy", "nan"] = "copy"
    """What vLLM's copy of the vision tower holds. Triptych sends embeddings, so vLLM never runs it:
    nan fills it with NaN, so any run of it would show in the answers (a check; copy otherwise)."""
    vllm_start_timeout_s: float = 900.0
    """How long the head waits for vLLM to load and answer /health."""
    vllm_args: tuple[str, ...] = ()
    """Extra flags for vLLM's api_server (repeat the flag once per word)."""

    def __post_init__(self) -> None:
        if self.chat_engine not in CHAT_ENGINES:
            raise ValueError(f"chat_engine={self.chat_engine!r} must be one of {', '.join(CHAT_ENGINES)}")
        if not 0 <= self.vllm_port < 65536:
            raise ValueError(f"vllm_port={self.vllm_port} must be 0 (a free port) or a port number")
        if self.vllm_max_model_len < 16:
            raise ValueError(f"vllm_max_model_len={self.vllm_max_model_len} must be >= 16")
        if self.vllm_block_size < 1 or self.vllm_block_size % 16:
            raise ValueError(f"vllm_block_size={self.vllm_block_size} must be a positive multiple of 16 (32 on CPU)")
        if self.vllm_kv_cache_gb < 1:
            raise ValueError(f"vllm_kv_cache_gb={self.vllm_kv_cache_gb} must be >= 1")
        if self.vllm_start_timeout_s <= 0:
            raise ValueError(f"vllm_start_timeout_s={self.vllm_start_timeout_s} must be > 0")
