"""``triptych serve --chat-engine vllm``: one vLLM server per distinct VLM among the served models.

``start_servers`` exports each chat-capable model's VLM (``family.vllm_export``) into the head's data
directory and starts a ``VllmServer`` on it; models whose VLM is the same (the built-in image model
and its edit variant share one Qwen2.5-VL) share a server, which serves it under each of their
names. The caller stops
the servers (``stop_servers``) when it stops serving; ``chat_engines`` does both around a block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path

from triptych.core.identity import model_revision
from triptych.vllm_chat.config import VllmConfig
from triptych.vllm_chat.server import VllmServer

logger = logging.getLogger(__name__)


def _vlm_key(model_dir: Path) -> str:
    weights = sorted((model_dir / "text_encoder").glob("*.safetensors"))
    sizes = ",".join(f"{p.name}:{p.stat().st_size}" for p in weights)
    return f"{model_revision(model_dir, ('text_encoder', 'processor'))}|{sizes}"


def start_servers(config: VllmConfig, models: dict[str, Path], data_dir: Path) -> dict[str, VllmServer]:
    """Model id → the started server answering its chats (models without a VLM are left out)."""
    from triptych.families.registry import family_class

    groups: dict[str, list[tuple[str, Path]]] = {}
    for name, model_dir in models.items():
        family = family_class(model_dir)(model_dir, roles=())
        if family.supports_chat:
            groups.setdefault(_vlm_key(Path(model_dir)), []).append((name, Path(model_dir)))
    servers: dict[str, VllmServer] = {}
    try:
        for i, members in enumerate(groups.values()):
            first, model_dir = members[0]
            family = family_class(model_dir)(model_dir, roles=())
            folder = family.vllm_export(data_dir / "vllm" / first, config.vllm_vision_weights)
            port = config.vllm_port + i if config.vllm_port else 0
            names = [n for n, _ in members]
            server = VllmServer(
                dataclasses.replace(config, vllm_port=port), folder, names, data_dir / "vllm" / f"{first}.log"
            )
            server.start()
            for name in names:
                servers[name] = server
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: dict[str, VllmServer]) -> None:
    for server in {id(s): s for s in servers.values()}.values():
        server.stop()


@contextlib.contextmanager
def chat_engines(config: VllmConfig, models: dict[str, Path], data_dir: Path, topology):
    """With ``--chat-engine vllm``: the servers run for the block, which gets each model's topology
    (its workers told ``--vllm-url``); builtin: the topology as it is, nothing started."""
    servers = start_servers(config, models, data_dir) if config.chat_engine == "vllm" else {}
    try:
        topologies = {}
        for name in models:
            extra = ("--vllm-url", servers[name].url) if name in servers else ()
            topologies[name] = dataclasses.replace(topology, extra_args=(*topology.extra_args, *extra))
            if name in servers:
                logger.info("chats of %s: vLLM at %s", name, servers[name].url)
        yield topologies
    finally:
        stop_servers(servers)
