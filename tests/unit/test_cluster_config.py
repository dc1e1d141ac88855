"""Cluster placement settings: per-role resources, Ray actor options and placement-group bundles
(no Ray needed), and ``--cluster ray`` without Ray installed."""

from __future__ import annotations

import importlib.util

import pytest

from triptych.deploy.config import ClusterConfig, RoleResources
from triptych.deploy.placement import actor_options, bundles, group_strategy


def test_role_resources_become_actor_options():
    res = RoleResources(cpus=2, gpus=1, memory_mb=512, resources=("denoise=1", "zone_a=0.5"))
    assert actor_options(res, max_restarts=3) == {
        "num_cpus": 2,
        "num_gpus": 1,
        "max_restarts": 3,
        "max_task_retries": 0,
        "memory": 512 << 20,
        "resources": {"denoise": 1.0, "zone_a": 0.5},
    }


def test_a_multi_rank_instance_is_one_strict_pack_group_of_one_bundle_with_every_rank():
    """Rank 0's actor holds the whole instance's resources (its followers are its child processes)."""
    res = RoleResources(cpus=2, gpus=1, resources=("denoise=1",))
    assert bundles(res, 2) == [{"CPU": 4, "GPU": 2, "denoise": 2.0}]
    opts = actor_options(res, max_restarts=0, ranks=2)
    assert (opts["num_cpus"], opts["num_gpus"], opts["resources"]) == (4, 2, {"denoise": 2.0})
    assert group_strategy(2) == "STRICT_PACK" and group_strategy(1) is None


@pytest.mark.parametrize("bad", [("denoise",), ("=1",), ("denoise=-1",), ("denoise=x",)])
def test_a_bad_custom_resource_is_refused(bad):
    with pytest.raises(ValueError, match="resources="):
        RoleResources(resources=bad)


def test_node_ip_must_be_an_address_and_loopback_is_known():
    assert ClusterConfig().loopback and not ClusterConfig(ray_node_ip="10.0.0.5").loopback
    with pytest.raises(ValueError, match="ray_node_ip="):
        ClusterConfig(ray_node_ip="my-host")


def test_cluster_ray_without_ray_exits_2_with_one_line(capsys, monkeypatch, tmp_path):
    from triptych.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    monkeypatch.setenv("TRIPTYCH_CACHE", str(tmp_path))
    assert main(["serve", "--cluster", "ray"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["triptych serve: --cluster ray needs Ray: pip install 'triptych[ray]'"]
