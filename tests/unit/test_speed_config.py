"""``SpeedConfig`` and its startup checks: what cannot run is refused naming the flag and the reason."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from triptych.accel import SpeedConfig
from triptych.accel.apply import check_speed
from triptych.cli.accel_flags import add_speed_flags, speed_config
from triptych.core.errors import InvalidParam


@pytest.mark.parametrize("bad", ["vae=int8-dynamic", "transformer=int4", "transformer", "transformer=fp8,x"])
def test_bad_quantize_spec_is_refused(bad):
    with pytest.raises(ValueError, match="COMPONENT=MODE"):
        SpeedConfig(quantize=(bad,))


def test_a_component_named_twice_is_refused():
    with pytest.raises(ValueError, match="named twice"):
        SpeedConfig(quantize=("transformer=int8-dynamic", "transformer=int8-weight-only"))


def test_fp8_on_cpu_is_refused_with_the_reason():
    with pytest.raises(InvalidParam, match="fp8 needs a CUDA device"):
        check_speed(SpeedConfig(quantize=("transformer=fp8",)), "cpu")


def test_quantize_without_torchao_names_the_extra(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(InvalidParam, match=r"triptych\[quant\]"):
        check_speed(SpeedConfig(quantize=("transformer=int8-dynamic",)), "cpu")


def test_flags_build_the_config_with_the_cache_dir_under_the_cache_root(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # as if torchao were installed
    parser = argparse.ArgumentParser()
    flags = add_speed_flags(parser)
    args = parser.parse_args(
        ["--compile", "--quantize", "transformer=int8-dynamic", "--quantize", "text_encoder=int8-weight-only"]
    )
    config = speed_config(flags, args, parser, cache_root=tmp_path)
    assert config.compile and config.compile_cache_dir == tmp_path / "inductor"
    assert config.quantized == {"transformer": "int8-dynamic", "text_encoder": "int8-weight-only"}
    assert flags.argv(config)[:1] == ["--compile"]


def test_serve_passes_compile_and_its_cache_dir_on_to_its_workers(tmp_path, monkeypatch):
    from triptych.cli.worker_flags import WorkerFlags

    monkeypatch.setenv("TRIPTYCH_CACHE", str(tmp_path))
    parser = argparse.ArgumentParser()
    flags = WorkerFlags.add(parser)
    argv = flags.argv(parser.parse_args(["--compile"]))
    assert "--compile" in argv
    assert argv[argv.index("--compile-cache-dir") + 1] == str(tmp_path / "inductor")
    # A multi-rank denoiser gets them too (its rank 0 sends them to its followers in RankSetup).
    argv = flags.argv(parser.parse_args(["--compile", "--ulysses", "2"]))
    assert "--compile" in argv and argv[argv.index("--compile-cache-dir") + 1] == str(tmp_path / "inductor")


def test_cuda_graphs_without_compile_or_off_cuda_are_refused_with_the_reason():
    with pytest.raises(InvalidParam, match="needs --compile") as err:
        check_speed(SpeedConfig(cuda_graphs=True), "cuda:0")
    assert err.value.field == "--cuda-graphs"
    with pytest.raises(InvalidParam, match="needs a CUDA device; this is cpu"):
        check_speed(SpeedConfig(compile=True, cuda_graphs=True), "cpu")
    check_speed(SpeedConfig(compile=True), "cpu")  # compile alone runs here


def test_serve_passes_cuda_graphs_on_to_its_workers(tmp_path, monkeypatch):
    from triptych.cli.worker_flags import WorkerFlags

    monkeypatch.setenv("TRIPTYCH_CACHE", str(tmp_path))
    parser = argparse.ArgumentParser()
    argv = WorkerFlags.add(parser).argv(parser.parse_args(["--compile", "--cuda-graphs", "--device", "cuda"]))
    assert "--compile" in argv and "--cuda-graphs" in argv


def test_cuda_graphs_on_a_family_without_the_block_stack_is_refused_before_it_compiles(tiny_model_dir):
    """FLUX compiles regional blocks, which do not replay as CUDA graphs: refused naming the flag,
    before anything compiles (ahead of the device check, so a CPU machine sees it too)."""
    from triptych.families.registry import load_family

    with pytest.raises(InvalidParam, match="has no compiled block stack") as err:
        load_family(tiny_model_dir("flux"), speed=SpeedConfig(compile=True, cuda_graphs=True))
    assert err.value.field == "--cuda-graphs"


def test_serve_refuses_cuda_graphs_for_a_model_without_the_block_stack_before_any_worker(tiny_model_dir, capsys):
    """``triptych serve --cuda-graphs`` with a FLUX model: one line naming the flag and the model, exit
    2, before a worker is spawned (the default model's family passes the same check)."""
    from triptych.cli import main
    from triptych.cli.serve import check_cuda_graphs
    from triptych.families.models import default_model_dir

    flux = tiny_model_dir("flux")
    code = main(["serve", "--model", f"tinyflux={flux}", "--device", "cuda", "--compile", "--cuda-graphs"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--cuda-graphs" in err and "model tinyflux is" in err and "no compiled block stack" in err
    check_cuda_graphs({"default": default_model_dir()}, SpeedConfig(compile=True, cuda_graphs=True))


def test_step_graph_flags_build_the_config_and_reach_the_workers(tmp_path, monkeypatch):
    from triptych.cli.worker_flags import WorkerFlags

    parser = argparse.ArgumentParser()
    flags = add_speed_flags(parser)
    args = parser.parse_args(
        ["--step-graphs", "--graph-buckets", "1", "--graph-buckets", "3", "--graph-max", "4", "--graph-pool-mib", "512"]
        + ["--graph-policy", "refuse"]
    )
    config = flags.build(args, parser)
    assert config.step_graphs and config.graph_buckets == (1, 3) and config.graph_max == 4
    assert config.graph_pool_mib == 512 and config.graph_policy == "refuse"
    monkeypatch.setenv("TRIPTYCH_CACHE", str(tmp_path))
    parser = argparse.ArgumentParser()
    worker = WorkerFlags.add(parser)
    monkeypatch.setattr("triptych.accel.apply.check_speed", lambda config, device="cpu": None)  # no GPU here
    argv = worker.argv(parser.parse_args(["--step-graphs", "--graph-max", "3"]))
    assert "--step-graphs" in argv and argv[argv.index("--graph-max") + 1] == "3"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("graph_buckets", (), "one or more"), ("graph_buckets", (0, 2), "one or more"), ("graph_max", 0, ">= 1")]
    + [("graph_pool_mib", 0, ">= 1")],
)
def test_bad_step_graph_bounds_are_refused_naming_the_value(field, value, message):
    with pytest.raises(ValueError, match=message):
        SpeedConfig(**{field: value})


def test_step_graphs_off_cuda_are_refused_with_the_reason():
    with pytest.raises(InvalidParam, match="needs a CUDA device; this is cpu") as err:
        check_speed(SpeedConfig(step_graphs=True), "cpu")
    assert err.value.field == "--step-graphs"
    with pytest.raises(InvalidParam, match="pick one of the two"):
        check_speed(SpeedConfig(step_graphs=True, compile=True, cuda_graphs=True), "cuda:0")


def test_step_graphs_for_bounds_the_runner_as_the_config_says():
    from triptych.accel import step_graphs_for

    graphs = step_graphs_for(SpeedConfig(graph_buckets=(4, 1, 2), graph_max=3, graph_pool_mib=2, graph_policy="refuse"))
    assert graphs.buckets == (1, 2, 4) and graphs.max_graphs == 3
    assert graphs.pool_bytes == 2 * 2**20 and graphs.policy == "refuse"
