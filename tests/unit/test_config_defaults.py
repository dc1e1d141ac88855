"""Every command's flags come from the config dataclasses, each default written once: a command given
only its required flags builds the dataclass's defaults, and the command line the supervisor writes
for a worker parses back to the very ``WorkerConfig`` it was written from."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from triptych.cli import build_parser
from triptych.cli.worker import worker_config as parsed_worker_config
from triptych.control.worker_config import WORKER_FLAGS, WorkerConfig, worker_argv
from triptych.core.config_flags import ConfigFlags
from triptych.core.devices import DeviceConfig, add_device_flags, device_config_from_args
from triptych.core.kinds import Role, TransferKind
from triptych.deploy.launch import TopologyConfig
from triptych.deploy.supervisor import worker_command, worker_config
from triptych.engine.config import EngineConfig
from triptych.families.models import default_model_dir
from triptych.parallel import ParallelConfig

TOKEN = "a-deployment-token-for-tests"


def parse_worker(argv: list[str]) -> WorkerConfig:
    """``triptych worker ARGV`` as the spawned process reads it (the token from its environment)."""
    config = parsed_worker_config(build_parser().parse_args(["worker", *argv]))
    return dataclasses.replace(config, teacache_profiles_dir=None)  # the worker resolves it itself


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("TRIPTYCH_TOKEN", TOKEN)  # read as --token's default when the parser is built
    monkeypatch.delenv("TRIPTYCH_MM_CACHE_MB", raising=False)


def test_a_worker_given_only_its_required_flags_has_every_dataclass_default():
    model = default_model_dir()
    config = parse_worker(["--role", "encoder", "--head", "tcp://h:1", "--model", str(model)])
    assert config == WorkerConfig(role=Role.ENCODER, head="tcp://h:1", token=TOKEN, model_dir=model)


def test_every_worker_flag_default_is_its_fields_default():
    parser = argparse.ArgumentParser()
    flags = ConfigFlags(parser, WorkerConfig, **WORKER_FLAGS)
    fields = {f.name: f for f in dataclasses.fields(WorkerConfig)}
    nested = {"device", "engine", "parallel", "mm_cache", "chat", "lora", "speed"}  # their own flag groups
    assert set(flags.flags) == set(fields) - set(WORKER_FLAGS["explicit"]) - nested
    for action in parser._actions:
        name = next((n for n, d in flags.dests.items() if d == action.dest), None)
        if name is not None and not action.required:
            assert action.default == fields[name].default, name
    device = argparse.ArgumentParser()
    add_device_flags(device)  # written by hand in core/devices.py: held to DeviceConfig's defaults here
    assert device_config_from_args(device.parse_args([])) == DeviceConfig()


def test_local_workers_settings_default_to_the_workers_own():
    assert (TopologyConfig().capacity, TopologyConfig().transfer) == (WorkerConfig.capacity, WorkerConfig.transfer)


TOPOLOGIES = [
    (TopologyConfig(), Role.ENCODER, 0),
    (TopologyConfig(transfer="zmq", capacity=3, extra_args=("--max-batch-requests", "2")), Role.DENOISER, 2),
    (TopologyConfig(parallel=ParallelConfig(cfg=2, ulysses=2)), Role.DENOISER, 1),
    (TopologyConfig(parallel=ParallelConfig(ring=2)), Role.DECODER, 4),  # degrees are the denoiser's only
    (TopologyConfig(device=DeviceConfig(dtype="float32", vae_tiling=False, vae_slicing=True)), Role.DECODER, 1),
]


@pytest.mark.parametrize("topology, role, threads", TOPOLOGIES)
def test_the_supervisors_command_parses_back_to_the_config_it_wrote(topology, role, threads):
    model = default_model_dir()
    config = worker_config(topology, model, role, "tcp://127.0.0.1:9", f"{role}-3", threads, TOKEN, 4242)
    cmd = worker_command(config, topology.extra_args)
    assert cmd[1:4] == ["-m", "triptych.cli", "worker"] and TOKEN not in cmd
    assert parse_worker(cmd[4 : len(cmd) - len(topology.extra_args)]) == config  # the config's own flags
    engine = EngineConfig(max_batch_requests=2) if topology.extra_args else EngineConfig()
    parsed = parse_worker(cmd[4:])
    assert parsed == dataclasses.replace(config, engine=engine)
    assert parsed.parallel == (topology.parallel if role == Role.DENOISER else ParallelConfig())


def test_worker_argv_round_trips_every_field_it_writes():
    config = WorkerConfig(
        role=Role.DENOISER,
        head="tcp://10.0.0.1:7000",
        token=TOKEN,
        model_dir=default_model_dir(),
        instance_id="den-x",
        capacity=7,
        transfer=TransferKind.MOONCAKE,
        host="10.0.0.2",
        transfer_max_bytes=4096,
        device=DeviceConfig(dtype="float32", attention="native", vae_tiling=True),
        parallel=ParallelConfig(cfg=2, ring=2, uneven_sequences=not ParallelConfig().uneven_sequences),
        collective_timeout_s=12.5,
        chat_vllm_url="http://127.0.0.1:8001",
        register_timeout_s=9.0,
        torch_threads=3,
        parent_pid=77,
        parent_grace_s=2.0,
    )
    changed = {f.name for f in dataclasses.fields(WorkerConfig) if getattr(config, f.name) != f.default}
    assert len(changed) >= 15  # every field the argv writes was set away from its default
    assert parse_worker(worker_argv(config)) == config


def test_generate_given_only_its_required_flags_asks_for_the_dataclass_defaults():
    from triptych.cli import GENERATE_FIELDS
    from triptych.families.params import GenerationParams
    from triptych.mmcache.config import MMCacheConfig

    args = build_parser().parse_args(["generate", "--prompt", "a cat", "--out", "a.png"])
    assert GenerationParams(**{f: getattr(args, f) for f in GENERATE_FIELDS}) == GenerationParams("a cat")
    assert ParallelConfig(cfg=args.cfg_parallel, ulysses=args.ulysses, ring=args.ring) == ParallelConfig()
    assert args.mm_cache_mb == MMCacheConfig().max_mb
    assert device_config_from_args(args) == DeviceConfig()


def test_quality_degrees_default_to_parallel_configs():
    args = build_parser().parse_args(["quality", "--teacache-threshold", "0.1"])
    assert ParallelConfig(cfg=args.cfg_parallel, ulysses=args.ulysses, ring=args.ring) == ParallelConfig()


def test_chat_takes_its_sampling_flags_and_the_request_defaults_from_one_place():
    """``triptych chat``'s flags, ``ChatParams`` and the head's default ``max_tokens`` all read
    ``ChatSampling``: a default changed there changes all three."""
    from triptych.chat import ChatParams
    from triptych.core.chat_sampling import ChatSampling
    from triptych.head.routes_chat import DEFAULT_MAX_TOKENS

    args = build_parser().parse_args(["chat", "--prompt", "what is this?"])
    want = ChatSampling()
    assert {f.name: getattr(args, f.name) for f in dataclasses.fields(ChatSampling)} == dataclasses.asdict(want)
    params = ChatParams(turns=())
    assert {f.name: getattr(params, f.name) for f in dataclasses.fields(ChatSampling)} == dataclasses.asdict(want)
    assert DEFAULT_MAX_TOKENS == want.max_tokens


def test_a_follower_ranks_command_parses_back_to_what_rank_0_wrote():
    from triptych.worker.ranks.follower import FollowerArgs, follower_argv, parse_args

    args = FollowerArgs(
        rank=2, world=4, port=29511, parent_pid=123, cfg=2, ulysses=2, ring=1, device="cuda:1", timeout=20.0, threads=3
    )
    argv = follower_argv(args)
    assert argv[:2] == ["-m", "triptych.worker.ranks.follower"]
    assert parse_args(argv[2:]) == args
    defaults = FollowerArgs(rank=1, world=2, port=1, parent_pid=1, cfg=2, ulysses=1, ring=1)
    assert parse_args(follower_argv(defaults)[2:]) == defaults
