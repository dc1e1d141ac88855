"""``triptych serve`` (head + embedded local workers) and ``triptych worker`` (one role process).

``serve`` serves every ``--model [NAME=]DIR`` (default: ``triptych.families.models.builtin_models()``) behind
one head, each model with its own orchestrator and local pools (``build_backends``); the topology,
engine and control-plane flags apply to each model's pools alike.

The flags of the configs both commands build come from the config dataclasses themselves
(``triptych.core.config_flags``): on ``serve`` every ``AdmissionLimits`` limit and every ``HeadConfig``,
``TopologyConfig``, ``OrchestratorConfig`` and ``StateTimeouts`` setting; on both the
``EngineConfig`` batch limits, the transfer pool size, the ``ParallelConfig`` degrees of a
denoiser, the mm-hash cache budget (``MMCacheConfig``), the encoder's chat engine
(``ChatEngineConfig``) and the device flags (``DeviceConfig``).
``serve`` passes the engine, transfer, cache and chat flags on to its local workers
(``TopologyConfig.extra_args``; the device and parallel flags travel as ``TopologyConfig`` fields),
so a local and a remote worker read them the same way. Environment variables only supply defaults
(``$TRIPTYCH_API_KEYS``, ``$TRIPTYCH_TOKEN``, ``$TRIPTYCH_MM_CACHE_MB``).

NOTE: the config flags are added when ``serve`` or ``worker`` is used (``add_flags_later``): the
engine and transfer config modules import torch, which ``triptych --help`` and the other
subcommands should not pay for.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from triptych.cli.worker import cmd_worker
from triptych.cli.worker_flags import WorkerFlags
from triptych.control.auth import write_token
from triptych.control.dispatch import POLICIES
from triptych.core.config_flags import ConfigFlags, add_flags_later
from triptych.core.startup import STARTUP_LOGGER, startup_log
from triptych.vllm_chat.launch import chat_engines

if TYPE_CHECKING:
    from triptych.control.orchestrator import OrchestratorConfig
    from triptych.deploy.launch import TopologyConfig
    from triptych.head.state import HeadConfig

logger = logging.getLogger(__name__)

HEAD_FLAGS = {"data_dir": "--data-dir", "api_keys": "--api-key", "teacache_profiles_root": None}
HEAD_RENAMED = {"model_aliases": "model-alias", "tenant_policies": "tenant-policy"}


@dataclass(frozen=True)
class ServeFlags:
    """``serve``'s config flags and the configs built from them."""

    parser: argparse.ArgumentParser
    head: ConfigFlags
    limits: ConfigFlags
    topology: ConfigFlags
    orchestrator: ConfigFlags
    timeouts: ConfigFlags
    workers: WorkerFlags
    cluster: ConfigFlags
    roles: dict[str, ConfigFlags]  # role -> its RoleResources flags (--denoiser-cpus, ...)
    autoscale: ConfigFlags
    vllm: ConfigFlags  # the chat engine (VllmConfig)

    @classmethod
    def add(cls, parser: argparse.ArgumentParser) -> ServeFlags:
        from triptych.control.orchestrator import OrchestratorConfig
        from triptych.control.request_state import StateTimeouts
        from triptych.core.kinds import ROLES
        from triptych.deploy.config import AutoscaleConfig, ClusterConfig, RoleResources
        from triptych.deploy.launch import MOONCAKE_LOG_LEVELS, TopologyConfig
        from triptych.head.admission import AdmissionLimits
        from triptych.head.state import HeadConfig
        from triptych.vllm_chat import VllmConfig

        def group(title: str):
            return parser.add_argument_group(title)

        return cls(
            parser,
            head=ConfigFlags(group("head (HeadConfig)"), HeadConfig, explicit=HEAD_FLAGS, rename=HEAD_RENAMED),
            limits=ConfigFlags(group("admission limits (AdmissionLimits)"), AdmissionLimits),
            topology=ConfigFlags(
                group("local workers (TopologyConfig)"),
                TopologyConfig,
                rename={"torch_threads": "threads"},
                choices={"mooncake_log_level": MOONCAKE_LOG_LEVELS},
                explicit={"extra_args": None, "parallel": None, "device": None},  # the worker flags below
            ),
            orchestrator=ConfigFlags(
                group("control plane (OrchestratorConfig)"),
                OrchestratorConfig,
                rename={"host": "control-host", "max_queued": "orchestrator-max-queued"},
                choices={"dispatch": sorted(POLICIES)},
            ),
            timeouts=ConfigFlags(group("request state timeouts (StateTimeouts)"), StateTimeouts, prefix="timeout-"),
            workers=WorkerFlags.add(parser),
            cluster=ConfigFlags(
                group("cluster placement (ClusterConfig)"),
                ClusterConfig,
                explicit={role: None for role in ROLES},
                rename={"ray_max_restarts": "ray-max-restarts"},
            ),
            roles={
                role: ConfigFlags(
                    group(f"Ray resources of each {role} (RoleResources)"),
                    RoleResources,
                    prefix=f"{role}-",
                    rename={"resources": f"{role}-resource"},
                )
                for role in ROLES
            },
            autoscale=ConfigFlags(
                group("autoscaling (AutoscaleConfig)"),
                AutoscaleConfig,
                prefix="autoscale-",
                rename={"pools": "autoscale"},
            ),
            vllm=ConfigFlags(group("chat engine (VllmConfig)"), VllmConfig),
        )

    def cluster_config(self, args: argparse.Namespace):
        roles = {role: flags.build(args, self.parser) for role, flags in self.roles.items()}
        return self.cluster.build(args, self.parser, **roles)

    def autoscale_config(self, args: argparse.Namespace):
        return self.autoscale.build(args, self.parser)

    def head_config(self, args: argparse.Namespace, default_data_dir: Path) -> HeadConfig:
        from triptych.cli.profiles import user_profiles_root  # calibrate's directory, as generate reads it

        env_keys = os.environ.get("TRIPTYCH_API_KEYS", "").split(",")
        keys = [*args.api_key, *(k for k in env_keys if k.strip())]
        return self.head.build(
            args,
            self.parser,
            data_dir=Path(args.data_dir) if args.data_dir else default_data_dir,
            limits=self.limits.build(args, self.parser),
            api_keys=tuple(k.strip() for k in keys),
            teacache_profiles_root=user_profiles_root(),
            lora=self.workers.lora_config(args),
        )

    def topology_config(self, args: argparse.Namespace) -> TopologyConfig:
        from triptych.core.devices import device_config_from_args

        return self.topology.build(
            args,
            self.parser,
            extra_args=self.workers.argv(args),
            parallel=self.workers.parallel_config(args),
            device=device_config_from_args(args),
        )

    def orchestrator_config(self, args: argparse.Namespace) -> OrchestratorConfig:
        return self.orchestrator.build(args, self.parser, timeouts=self.timeouts.build(args, self.parser))


def add_server_commands(sub) -> None:
    p = sub.add_parser("serve", help="run the head with local encoder/denoiser/decoder workers")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="[NAME=]DIR",
        help="a diffusers model directory to serve, as NAME (default: the directory's name); repeat for "
        "several, each with its own pools; a request's model field picks one, and one without it goes to "
        "the first that does the job. Default: the built-in image model, its edit variant and the "
        "built-in video model when shipped",
    )
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--data-dir", help="head state: job records, videos, url files")
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' (repeat for several keys; also $TRIPTYCH_API_KEYS, "
        "comma-separated); default: no authentication",
    )
    p.set_defaults(func=cmd_serve)
    add_flags_later(p, lambda parser: parser.set_defaults(serve_flags=ServeFlags.add(parser)))

    w = sub.add_parser("worker", help="run one encoder/denoiser/decoder instance that registers with a head")
    w.add_argument("--model", help="diffusers model directory (must match the head's; default: the built-in model)")
    w.add_argument(
        "--token",
        default=os.environ.get("TRIPTYCH_TOKEN", ""),
        help="the deployment's control-plane token (default: $TRIPTYCH_TOKEN; serve writes its token to "
        "DATA_DIR/worker.token for remote workers)",
    )
    w.set_defaults(func=cmd_worker)
    add_flags_later(w, _add_worker_flags)


def _add_worker_flags(parser: argparse.ArgumentParser) -> None:
    """``triptych worker``'s own flags from ``WorkerConfig``, then the flags it shares with ``serve``."""
    from triptych.control.worker_config import WORKER_FLAGS, WorkerConfig

    group = parser.add_argument_group("worker (WorkerConfig)")
    parser.set_defaults(config_flags=ConfigFlags(group, WorkerConfig, **WORKER_FLAGS))
    parser.set_defaults(worker_flags=WorkerFlags.add(parser))


def served_models(specs: list[str], cache_root: str | None = None) -> dict[str, Path]:
    """``--model`` values (``NAME=DIR`` or ``DIR``) → model id → directory, in order; none given: the
    built-in models (``triptych.families.models.builtin_models``). Raises ``InvalidParam`` on a repeated id."""
    from triptych.core.errors import InvalidParam
    from triptych.families.models import builtin_models

    if not specs:
        return builtin_models(cache_root)
    out: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        model_dir = Path(path if sep else spec)
        name = name if sep else model_dir.resolve().name
        if not name or name in out:
            raise InvalidParam("model", spec, "needs a non-empty model id used once (write NAME=DIR)")
        out[name] = model_dir
    return out


def check_cuda_graphs(models: dict[str, Path], speed) -> None:
    """``--cuda-graphs`` refused before any worker starts for a served model whose family cannot
    run it (``Family.cuda_graphs_refusal``, which the worker's own load asks too)."""
    if not speed.cuda_graphs:
        return
    from triptych.core.errors import InvalidParam
    from triptych.families.registry import family_class

    for name, model_dir in models.items():
        if why := family_class(model_dir).cuda_graphs_refusal():
            raise InvalidParam("--cuda-graphs", "on", f"model {name} is not eligible: {why}")


def build_backends(
    models: dict[str, Path], orchestrator: OrchestratorConfig, topology: TopologyConfig, pool=None, autoscale=None
) -> dict:
    """One ``EmbeddedBackend`` (orchestrator + its pools: local processes, or ``pool``'s Ray actors) per
    model. They share one control-plane token; a fixed ``control_port`` P gives the models P, P+1, ...
    in order (0: each a free port). ``topology``: one for all, or model id → its own."""
    from triptych.control.auth import new_token
    from triptych.deploy.launch import EmbeddedBackend

    shared = dataclasses.replace(orchestrator, token=orchestrator.token or new_token())
    backends = {}
    for i, (name, model_dir) in enumerate(models.items()):
        port = shared.control_port + i if shared.control_port else 0
        config = dataclasses.replace(shared, control_port=port)
        extra = {} if pool is None else {"pool": pool}
        topo = topology[name] if isinstance(topology, dict) else topology
        backends[name] = EmbeddedBackend(model_dir, config, topo, autoscale=autoscale, **extra)
    return backends


def serve_shipped_adapters(args, models: dict[str, Path]) -> None:
    """No ``--lora``: serve the adapters the models ship (the default model's invert and resize), as
    if each were given as ``--lora NAME=DIR``; any ``--lora`` serves only what it names."""
    if args.lora is not None:
        return
    from triptych.lora.config import shipped_adapters

    args.lora, notes = shipped_adapters(models.values())
    for line in notes:
        startup_log.warning(line)
    if args.lora:
        startup_log.info("serving the packaged LoRA adapters: %s", ", ".join(e.partition("=")[0] for e in args.lora))


def cmd_serve(args) -> int:
    from triptych.families.models import cache_dir

    flags: ServeFlags = args.serve_flags
    cache_root = os.environ.get("TRIPTYCH_CACHE")
    models = served_models(args.model, cache_root)
    logging.getLogger(STARTUP_LOGGER).setLevel(logging.INFO)  # each worker's loading, each model's readiness
    serve_shipped_adapters(args, models)  # before the configs are built from args
    head_config = flags.head_config(args, default_data_dir=cache_dir(cache_root) / "head")
    if len(models) > 1 and head_config.served_model_name:
        print("triptych serve: --served-model-name names one model; with several use --model NAME=DIR", file=sys.stderr)
        return 2
    check_cuda_graphs(models, flags.workers.speed_config(args))
    topology, cluster, autoscale = flags.topology_config(args), flags.cluster_config(args), flags.autoscale_config(args)
    pool, stop_ray = None, None
    if cluster.cluster == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            print("triptych serve: --cluster ray needs Ray: pip install 'triptych[ray]'", file=sys.stderr)
            return 2
        from triptych.deploy.ray_backend import ray_pool

        pool, stop_ray = ray_pool(cluster, topology, autoscale, copies=len(models))
    try:
        with chat_engines(flags.vllm.build(args, flags.parser), models, head_config.data_dir, topology) as topologies:
            orchestrator = flags.orchestrator_config(args)
            backends = build_backends(models, orchestrator, topologies, pool=pool, autoscale=autoscale)
            for name, model_dir in models.items():
                startup_log.info("serving %s from %s", name, model_dir)
            write_token(head_config.data_dir, next(iter(backends.values())).orchestrator.token)
            return _serve_http(args, backends, head_config)
    finally:
        if stop_ray is not None:
            stop_ray()


def _serve_http(args, backends: dict, head_config) -> int:
    try:
        from triptych.head.app import create_app
    except ImportError:
        logger.warning("no HTTP head (triptych.head.app) installed: serving the control plane only")
        return asyncio.run(_control_plane_only(next(iter(backends.values()))))
    from triptych.head.serve import run_head

    if len(backends) == 1 and head_config.served_model_name:
        backends = next(iter(backends.values()))
    return run_head(create_app(backends, head_config), head_config, args.host, args.port)


async def _control_plane_only(backend) -> int:
    await backend.start()
    logger.warning("control plane at %s; Ctrl-C to stop", backend.control_address)
    try:
        await asyncio.Event().wait()
    finally:
        await backend.close()
    return 0
