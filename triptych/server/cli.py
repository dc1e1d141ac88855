"""``triptych serve`` (head + embedded local workers) and ``triptych worker`` (one role process)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

from triptych.server.dispatch import POLICIES

logger = logging.getLogger(__name__)


def add_server_commands(sub) -> None:
    p = sub.add_parser("serve", help="run the head with local encoder/denoiser/decoder workers")
    p.add_argument("--model", help="diffusers model directory (default: the built-in model)")
    p.add_argument("--encoders", type=int, default=1, help="local encoder processes (0: remote only)")
    p.add_argument("--denoisers", type=int, default=1, help="local denoiser processes (0: remote only)")
    p.add_argument("--decoders", type=int, default=1, help="local decoder processes (0: remote only)")
    p.add_argument("--transfer", choices=["auto", "mooncake", "zmq"], default="auto")
    p.add_argument("--dispatch", choices=sorted(POLICIES), default="round_robin")
    p.add_argument("--capacity", type=int, default=4, help="slots per local worker")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--control-host", default="127.0.0.1", help="address remote workers reach the head at")
    p.add_argument("--control-port", type=int, default=0, help="worker control port (0: a free port, logged)")
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

    w = sub.add_parser("worker", help="run one encoder/denoiser/decoder instance that registers with a head")
    w.add_argument("--role", required=True, choices=["encoder", "denoiser", "decoder"])
    w.add_argument("--head", required=True, help="head control address, tcp://HOST:PORT")
    w.add_argument("--model", help="diffusers model directory (must match the head's)")
    w.add_argument("--instance-id", default="", help="unique id (default: <role>-<random>)")
    w.add_argument("--capacity", type=int, default=4, help="requests this instance may hold at once")
    w.add_argument("--transfer", choices=["auto", "mooncake", "zmq"], default="auto")
    w.add_argument("--host", default="127.0.0.1", help="address peers push tensors to")
    w.add_argument(
        "--token",
        default=os.environ.get("TRIPTYCH_TOKEN", ""),
        help="the deployment's control-plane token (default: $TRIPTYCH_TOKEN); serve writes it to DATA_DIR/worker.token",
    )
    w.add_argument("--device", default="cpu")
    w.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    w.add_argument("--cfg-parallel", type=int, default=1, help="denoiser: CFG-parallel degree (1 or 2)")
    w.add_argument("--ulysses", type=int, default=1, help="denoiser: Ulysses sequence-parallel degree")
    w.add_argument("--ring", type=int, default=1, help="denoiser: ring-attention sequence-parallel degree")
    w.add_argument(
        "--collective-timeout", type=float, default=60.0, help="multi-rank denoiser: collective timeout, seconds"
    )
    w.add_argument("--max-batch-requests", type=int, default=8, help="denoiser: requests per forward")
    w.add_argument("--no-fuse-cfg", action="store_true", help="denoiser: one forward per CFG branch")
    w.add_argument(
        "--exit-with-parent",
        type=int,
        default=0,
        metavar="PID",
        help="exit when process PID (the spawning head) is gone, even after its kill -9",
    )
    w.set_defaults(func=cmd_worker)


def cmd_worker(args) -> int:
    from triptych.models import resolve_model
    from triptych.parallel import ParallelConfig
    from triptych.pipelines.base import Role
    from triptych.server.engine import EngineConfig
    from triptych.server.worker import WorkerConfig, run_worker

    if len(args.token) < 16:
        print("triptych worker: --token (or $TRIPTYCH_TOKEN) must be the head's control-plane token", file=sys.stderr)
        return 2
    config = WorkerConfig(
        role=Role(args.role),
        head=args.head,
        token=args.token,
        model_dir=Path(resolve_model(args.model)),
        instance_id=args.instance_id,
        capacity=args.capacity,
        transfer=args.transfer,
        host=args.host,
        device=args.device,
        torch_threads=args.threads,
        parent_pid=args.exit_with_parent,
        parallel=ParallelConfig(cfg=args.cfg_parallel, ulysses=args.ulysses, ring=args.ring),
        collective_timeout_s=args.collective_timeout,
        engine=EngineConfig(max_batch_requests=args.max_batch_requests, fuse_cfg=not args.no_fuse_cfg),
    )
    return run_worker(config)


def cmd_serve(args) -> int:
    from triptych.models import cache_dir, resolve_model
    from triptych.server.launch import EmbeddedBackend, TopologyConfig
    from triptych.server.orchestrator import OrchestratorConfig

    backend = EmbeddedBackend(
        resolve_model(args.model),
        OrchestratorConfig(host=args.control_host, control_port=args.control_port, dispatch=args.dispatch),
        TopologyConfig(
            encoders=args.encoders,
            denoisers=args.denoisers,
            decoders=args.decoders,
            transfer=args.transfer,
            capacity=args.capacity,
        ),
    )
    try:
        from triptych.server.http import HeadConfig, create_app
    except ImportError:
        logger.warning("no HTTP head (triptych.server.http) installed: serving the control plane only")
        return asyncio.run(_control_plane_only(backend))
    import uvicorn

    data_dir = Path(args.data_dir) if args.data_dir else cache_dir() / "head"
    keys = [*args.api_key, *(k for k in os.environ.get("TRIPTYCH_API_KEYS", "").split(",") if k.strip())]
    app = create_app(backend, HeadConfig(data_dir=data_dir, api_keys=tuple(k.strip() for k in keys)))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


async def _control_plane_only(backend) -> int:
    await backend.start()
    logger.warning("control plane at %s; Ctrl-C to stop", backend.control_address)
    try:
        await asyncio.Event().wait()
    finally:
        await backend.close()
    return 0
