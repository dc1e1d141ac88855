"""``triptych worker``: its parsed flags → ``WorkerConfig`` (the TeaCache profiles directory resolved
here, as every command resolves it: ``cli_profiles.user_profiles_dir``), and the command itself. The
parser is ``cli/serve.py``'s."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def worker_config(args: argparse.Namespace):
    """The ``WorkerConfig`` of parsed ``triptych worker`` flags (TeaCache: the user's profiles first)."""
    from triptych.cli.profiles import user_profiles_dir
    from triptych.core.devices import device_config_from_args
    from triptych.families.models import resolve_model

    flags = args.worker_flags  # cli.worker_flags.WorkerFlags
    model_dir = Path(resolve_model(args.model, os.environ.get("TRIPTYCH_CACHE")))
    return args.config_flags.build(  # WorkerConfig's own flags (cli.serve._add_worker_flags)
        args,
        args.parser,
        token=args.token,
        model_dir=model_dir,
        teacache_profiles_dir=user_profiles_dir(model_dir),
        transfer_max_bytes=flags.transfer_config(args).max_bytes,
        device=device_config_from_args(args),
        engine=flags.engine_config(args),
        parallel=flags.parallel_config(args),
        mm_cache=flags.mm_cache_config(args),
        chat=flags.chat_config(args),
        lora=flags.lora_config(args),
        speed=flags.speed_config(args),
    )


def cmd_worker(args) -> int:
    from triptych.worker.process import run_worker

    if len(args.token) < 16:
        print("triptych worker: --token (or $TRIPTYCH_TOKEN) must be the head's control-plane token", file=sys.stderr)
        return 2
    return run_worker(worker_config(args))
