"""``triptych serve`` / ``triptych worker`` flags: built from the config dataclasses, and the configs
they build reach the head and the workers."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from triptych.chat.config import ChatEngineConfig
from triptych.cli import build_parser
from triptych.cli.profiles import user_profiles_root
from triptych.control.orchestrator import OrchestratorConfig
from triptych.control.request_state import StateTimeouts
from triptych.core.devices import DeviceConfig
from triptych.deploy.config import AutoscaleConfig, ClusterConfig, RoleResources
from triptych.deploy.launch import TopologyConfig
from triptych.engine.config import EngineConfig
from triptych.head.admission import AdmissionLimits
from triptych.head.state import HeadConfig
from triptych.parallel import ParallelConfig
from triptych.transfer.base import TransferConfig

#: (config class, flag prefix, field -> flag where it is not --<prefix><field>); None: no flag of its own
SERVE_CONFIGS = [
    (AdmissionLimits, "", {}),
    (EngineConfig, "", {}),
    (
        HeadConfig,
        "",
        {
            "data_dir": "--data-dir",
            "api_keys": "--api-key",
            "limits": None,
            "model_aliases": "--model-alias",
            "tenant_policies": "--tenant-policy",
            "teacache_profiles_root": None,
        },
    ),
    (TopologyConfig, "", {"torch_threads": "--threads", "extra_args": None, "parallel": None, "device": None}),
    (ParallelConfig, "", {"cfg": "--cfg-parallel"}),
    (DeviceConfig, "", {}),
    (ChatEngineConfig, "", {}),
    (OrchestratorConfig, "", {"host": "--control-host", "max_queued": "--orchestrator-max-queued", "timeouts": None}),
    (StateTimeouts, "timeout-", {}),
    (ClusterConfig, "", {"encoder": None, "denoiser": None, "decoder": None}),
    (RoleResources, "denoiser-", {"resources": "--denoiser-resource"}),
    (RoleResources, "encoder-", {"resources": "--encoder-resource"}),
    (AutoscaleConfig, "autoscale-", {"pools": "--autoscale"}),
]


def flag(name: str, prefix: str = "") -> str:
    return "--" + (prefix + name).replace("_", "-")


def has_flag(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


def help_text(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([command, "--help"])
    assert exit_.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_serve_help_lists_every_setting_of_its_configs(capsys):
    text = help_text("serve", capsys)
    for cls, prefix, named in SERVE_CONFIGS:
        for f in dataclasses.fields(cls):
            name = named.get(f.name, flag(f.name, prefix))
            assert name is None or has_flag(text, name), f"{cls.__name__}.{f.name}: no serve flag"
    assert has_flag(text, "--no-fuse-cfg") and has_flag(text, "--transfer-max-bytes")
    assert (
        "Most images per request (n; OpenAI's range is 1-10); each image is one job" in text
    )  # the field's own docstring


def test_worker_help_lists_every_engine_setting(capsys):
    text = help_text("worker", capsys)
    for f in dataclasses.fields(EngineConfig):
        assert has_flag(text, flag(f.name)), f"EngineConfig.{f.name} has no worker flag"
    for old in ("--max-batch-requests", "--no-fuse-cfg", "--threads", "--capacity", "--transfer", "--host"):
        assert has_flag(text, old)


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_serve_flags_build_the_head_config(tmp_path, monkeypatch):
    monkeypatch.delenv("TRIPTYCH_API_KEYS", raising=False)
    args = serve_args()
    root = user_profiles_root()  # the user's TeaCache profiles (calibrate's), as generate reads them
    assert args.serve_flags.head_config(args, tmp_path) == HeadConfig(data_dir=tmp_path, teacache_profiles_root=root)

    monkeypatch.setenv("TRIPTYCH_API_KEYS", "env-key-123, env-key-456")
    args = serve_args(
        *("--max-n", "3", "--max-queued-requests", "5", "--retry-after-s", "2.5", "--max-pixels", "4096"),
        *("--video-ttl-s", "none", "--video-fps", "24", "--data-dir", str(tmp_path / "d")),
        *("--api-key", "flag-key-789"),
    )
    expected = HeadConfig(
        data_dir=tmp_path / "d",
        limits=AdmissionLimits(max_n=3, max_queued_requests=5, retry_after_s=2.5, max_pixels=4096),
        video_ttl_s=None,
        video_fps=24,
        api_keys=("flag-key-789", "env-key-123", "env-key-456"),
        teacache_profiles_root=root,
    )
    assert args.serve_flags.head_config(args, Path("unused")) == expected


def test_serve_flags_build_aliases_hosts_and_the_header_timeout(tmp_path, monkeypatch):
    monkeypatch.delenv("TRIPTYCH_API_KEYS", raising=False)
    args = serve_args(
        *("--model-alias", "gpt-image-1=default", "--model-alias", "dall-e-3=default"),
        *("--allowed-hosts", "gen.example.com", "--header-timeout-s", "5"),
    )
    expected = HeadConfig(
        data_dir=tmp_path,
        model_aliases=("gpt-image-1=default", "dall-e-3=default"),
        allowed_hosts=("gen.example.com",),
        header_timeout_s=5.0,
        teacache_profiles_root=user_profiles_root(),
    )
    assert args.serve_flags.head_config(args, tmp_path) == expected


def test_serve_flag_sizes_the_result_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TRIPTYCH_API_KEYS", raising=False)
    args = serve_args("--result-cache-mb", "64")
    assert args.serve_flags.head_config(args, tmp_path).result_cache_mb == 64.0
    args = serve_args("--result-cache-mb", "-1")
    with pytest.raises(SystemExit):
        args.serve_flags.head_config(args, tmp_path)
    assert "--result-cache-mb" in capsys.readouterr().err


def test_serve_flags_build_the_topology_and_control_plane():
    args = serve_args()
    assert args.serve_flags.topology_config(args) == TopologyConfig()
    assert args.serve_flags.orchestrator_config(args) == OrchestratorConfig()
    args = serve_args(
        *("--encoders", "2", "--decoders", "0", "--transfer", "zmq", "--capacity", "3", "--threads", "1"),
        *("--control-host", "0.0.0.0", "--control-port", "5555", "--dispatch", "max_free_slots"),
        *("--orchestrator-max-queued", "9", "--timeout-queued-s", "7.5", "--max-batch-requests", "2"),
    )
    topology = TopologyConfig(
        encoders=2, decoders=0, transfer="zmq", capacity=3, torch_threads=1, extra_args=("--max-batch-requests", "2")
    )
    assert args.serve_flags.topology_config(args) == topology
    orchestrator = OrchestratorConfig(
        host="0.0.0.0", control_port=5555, dispatch="max_free_slots", max_queued=9, timeouts=StateTimeouts(queued_s=7.5)
    )
    assert args.serve_flags.orchestrator_config(args) == orchestrator


def test_serve_flags_build_the_cluster_and_autoscale_configs():
    args = serve_args()
    assert args.serve_flags.cluster_config(args) == ClusterConfig()
    assert args.serve_flags.autoscale_config(args) == AutoscaleConfig()
    args = serve_args(
        *("--cluster", "ray", "--ray-address", "127.0.0.1:6379", "--ray-max-restarts", "5"),
        *("--denoiser-cpus", "2", "--denoiser-gpus", "1", "--denoiser-resource", "a=1", "--denoiser-resource", "b=2"),
        *("--encoder-memory-mb", "256", "--autoscale", "denoiser=1:4", "--autoscale-down-idle-s", "3"),
    )
    assert args.serve_flags.cluster_config(args) == ClusterConfig(
        cluster="ray",
        ray_address="127.0.0.1:6379",
        ray_max_restarts=5,
        denoiser=RoleResources(cpus=2, gpus=1, resources=("a=1", "b=2")),
        encoder=RoleResources(memory_mb=256),
    )
    assert args.serve_flags.autoscale_config(args) == AutoscaleConfig(pools=("denoiser=1:4",), down_idle_s=3.0)


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--max-n", "9", "--max-queued-requests", "8"], "--max-n"),
        (["--max-steps", "0"], "--max-steps"),
        (["--video-fps", "500"], "--video-fps"),
        (["--api-key", "short"], "--api-key"),
        (["--heartbeat-timeout-s", "0.5"], "--heartbeat-timeout-s"),
        (["--encoders", "-1"], "--encoders"),
        (["--denoiser-threads", "-1"], "--denoiser-threads"),
        (["--threads", "-2"], "--threads"),
        (["--timeout-decoding-s", "0"], "--timeout-decoding-s"),
        (["--autoscale", "denoiser=4:1"], "--autoscale"),
        (["--ray-node-ip", "somewhere"], "--ray-node-ip"),
        (["--decoder-resource", "x"], "--decoder-resource"),
    ],
)
def test_a_bad_serve_setting_exits_2_naming_its_flag(tmp_path, monkeypatch, capsys, argv, named):
    monkeypatch.delenv("TRIPTYCH_API_KEYS", raising=False)
    args = serve_args(*argv)
    with pytest.raises(SystemExit) as exit_:
        args.serve_flags.head_config(args, tmp_path)
        args.serve_flags.topology_config(args)
        args.serve_flags.orchestrator_config(args)
        args.serve_flags.cluster_config(args)
        args.serve_flags.autoscale_config(args)
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"triptych serve: error: argument {named}: ")


def worker_config(*argv: str):
    from triptych.cli.worker import worker_config

    token = ("--token", "a-deployment-token-for-tests")
    return worker_config(
        build_parser().parse_args(["worker", "--role", "denoiser", "--head", "tcp://h:1", *token, *argv])
    )


def test_serve_passes_engine_and_transfer_flags_to_its_workers():
    args = serve_args("--max-batch-requests", "3", "--no-fuse-cfg", "--max-batch-tokens", "512")
    assert serve_args().serve_flags.workers.argv(serve_args()) == ()
    config = worker_config(*args.serve_flags.workers.argv(args), "--transfer-max-bytes", "4096")
    assert config.engine == EngineConfig(max_batch_requests=3, max_batch_tokens=512, fuse_cfg=False)
    assert config.transfer_max_bytes == 4096


def test_serve_passes_the_chat_engine_flags_to_its_encoders():
    args = serve_args("--max-running-chats", "3", "--prefix-cache-mb", "0")
    config = worker_config(*args.serve_flags.workers.argv(args))
    assert config.chat == ChatEngineConfig(max_running_chats=3, prefix_cache_mb=0.0)
    assert worker_config().chat == ChatEngineConfig()


def test_worker_defaults_and_existing_flags():
    config = worker_config()
    assert config.engine == EngineConfig()
    assert config.transfer_max_bytes == TransferConfig().max_bytes
    config = worker_config("--max-batch-requests", "4", "--no-fuse-cfg", "--threads", "2", "--capacity", "3")
    assert config.engine == EngineConfig(max_batch_requests=4, fuse_cfg=False)
    assert (config.torch_threads, config.capacity) == (2, 3)


def test_building_the_command_line_imports_no_torch():
    """The serve/worker config flags are added when those commands are used, not for ``--help``."""
    code = (
        "import sys\nfrom triptych.cli import build_parser\nbuild_parser().format_help()\n"
        "print(sorted(m for m in ('torch', 'transformers', 'diffusers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_encoder_layer_flags_reach_the_config_and_the_workers_argv(capsys):
    import argparse

    from triptych.cli.serve import WorkerFlags
    from triptych.mmcache.cache import MMCacheConfig

    parser = argparse.ArgumentParser()
    flags = WorkerFlags.add(parser)
    argv = ["--mm-processor-cache-mb", "8", "--encoder-step-images", "4", "--encoder-step-vision-tokens", "512"]
    config = flags.mm_cache_config(parser.parse_args(argv))
    assert config == MMCacheConfig(processor_mb=8.0, step_images=4, step_vision_tokens=512)
    assert flags.mm_cache.argv(config) == ["--mm-processor-cache-mb", "8.0", *argv[2:]]
    with pytest.raises(SystemExit):
        flags.mm_cache_config(parser.parse_args(["--encoder-step-images", "0"]))
    assert "step_images" in capsys.readouterr().err


def test_a_bare_serve_serves_the_adapters_the_models_ship(tmp_path, caplog):
    """No ``--lora``: each model's ``lora/`` folders, as ``--lora NAME=DIR`` would give them (the head's
    catalog and the workers' argv); a ``--lora`` serves only what it names."""
    from triptych.cli.serve import serve_shipped_adapters, served_models
    from triptych.lora.catalog import LoraCatalog

    models = served_models([])  # the packaged defaults
    default = next(iter(models.values()))
    shipped = sorted(d.name for d in (default / "lora").iterdir() if d.is_dir())
    assert shipped, "the default model ships adapters"
    args = serve_args()
    with caplog.at_level("INFO", logger="triptych.startup"):
        serve_shipped_adapters(args, models)
    lora = args.serve_flags.head_config(args, tmp_path).lora
    assert sorted(lora.adapters) == shipped and all(p.parent == default / "lora" for p in lora.adapters.values())
    assert [c["name"] for c in LoraCatalog(lora, default).cards()] == shipped  # they fit the model they came with
    assert worker_config(*args.serve_flags.workers.argv(args)).lora == lora
    assert any("packaged LoRA adapters" in r.getMessage() for r in caplog.records)

    mine = tmp_path / "mine"
    given = serve_args("--lora", f"mine={mine}")
    serve_shipped_adapters(given, models)
    assert given.lora == [f"mine={mine}"]


def test_the_400_for_an_adapter_not_served_says_how_to_serve_one(tmp_path):
    from triptych.core.errors import InvalidParam
    from triptych.lora.catalog import LoraCatalog
    from triptych.lora.config import LoraConfig

    with pytest.raises(InvalidParam) as refused:
        LoraCatalog(LoraConfig(), tmp_path).check("invert")
    assert refused.value.field == "lora" and "triptych serve --lora NAME=DIR" in refused.value.rule
    assert "POST /v1/loras" in refused.value.rule
