"""``--cluster ray`` on a simulated 2-node Ray cluster (``ray.cluster_utils.Cluster``), on loopback.

Node A advertises ``{"enc_dec": 2}``, node B ``{"denoise": 2}``; the server asks for
``--encoder-resource enc_dec=1 --decoder-resource enc_dec=1 --denoiser-resource denoise=1`` and
runs 1 encoder, 2 denoisers, 1 decoder (tiny FLUX) as Ray actors. Checked: the openai SDK gets
images equal to ``run_request`` within the batching tolerance of ``tests/e2e/test_server_batching.py``
(concurrent requests may share a denoiser's forward); each actor sits on the node its resources
name; every listener of the Ray processes is on 127.0.0.1; a kill -9 of a denoiser actor's process
is restarted by Ray (a new instance to the head) and the requests in flight complete through retry.
Node B also declares 2 GPUs (none are real): a 2-rank denoiser's actor is handed both, and a 2-rank
Ulysses denoiser served as a Ray placement group (CPU, gloo) matches the single-rank image.
Needs the ray extra (``pip install 'triptych[ray]'``; ``./install.sh`` installs it).
"""

from __future__ import annotations

import base64
import functools
import os
import socket
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import pytest

from tests.extras import module_needs  # noqa: E402

pytestmark = module_needs("ray")

import openai  # noqa: E402
import ray  # noqa: E402
from ray_support import is_loopback, listeners  # noqa: E402

from tests.e2e.http_support import decode_pixels, serve, wait_for  # noqa: E402
from triptych.calibration.metrics import psnr  # noqa: E402
from triptych.control.orchestrator import OrchestratorConfig  # noqa: E402
from triptych.deploy.config import ClusterConfig, RoleResources  # noqa: E402
from triptych.deploy.launch import EmbeddedBackend, TopologyConfig  # noqa: E402
from triptych.deploy.placement import actor_options, bundles, group_strategy  # noqa: E402
from triptych.deploy.ray_backend import LOOPBACK_SWITCH, RayWorkers, init_ray  # noqa: E402
from triptych.engine.runner import run_request  # noqa: E402
from triptych.families.base import GenerationParams  # noqa: E402
from triptych.families.registry import load_family  # noqa: E402
from triptych.head.app import HeadConfig, create_app  # noqa: E402

SIZE, STEPS = 64, 6
MAX_DIFF = 2  # uint8 levels, as tests/e2e/test_server_batching.py (measured 1 there)
MIN_PSNR = 65.0  # dB, same source


@pytest.fixture(scope="module")
def before_ray():
    """The listeners this test process held before any Ray process started: not Ray's. (A Mooncake
    engine an earlier test left in the process listens on all interfaces, docs/reliability.md.)"""
    return set(listeners(pids=[os.getpid()]))


@pytest.fixture(scope="module")
def nodes(before_ray):
    """Two Ray nodes on loopback: (cluster, node id of A, node id of B)."""
    os.environ[LOOPBACK_SWITCH] = "0"  # inherited by the nodes' processes
    from ray.cluster_utils import Cluster

    common = {"num_cpus": 2, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}
    cluster = Cluster(
        initialize_head=True, head_node_args={**common, "include_dashboard": False, "resources": {"enc_dec": 2}}
    )
    try:
        cluster.add_node(**common, num_gpus=2, resources={"denoise": 2})  # GPUs: declared, not real
        init_ray(ClusterConfig(cluster="ray", ray_address=cluster.address), 0)
        by_resource = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        a = next(i for i, r in by_resource.items() if "enc_dec" in r)
        b = next(i for i, r in by_resource.items() if "denoise" in r)
        yield cluster, a, b
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def server(nodes, tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("flux")
    config = ClusterConfig(
        cluster="ray",
        ray_max_restarts=2,
        encoder=RoleResources(cpus=1, resources=("enc_dec=1",)),
        denoiser=RoleResources(cpus=1, resources=("denoise=1",)),
        decoder=RoleResources(cpus=1, resources=("enc_dec=1",)),
    )
    backend = EmbeddedBackend(
        model,
        OrchestratorConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0),
        TopologyConfig(denoisers=2, transfer="zmq", capacity=4, torch_threads=1, start_timeout_s=240),
        pool=functools.partial(RayWorkers, config),
    )
    with serve(create_app(backend, HeadConfig(data_dir=tmp_path_factory.mktemp("head"))), 240) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        yield model, backend, client


def generate(client, seed: int) -> np.ndarray:
    out = client.images.generate(
        prompt=f"object {seed}", size=f"{SIZE}x{SIZE}", extra_body={"seed": seed, "num_inference_steps": STEPS}
    )
    return decode_pixels(base64.b64decode(out.data[0].b64_json))


def reference(model, seed: int) -> np.ndarray:
    params = GenerationParams(prompt=f"object {seed}", seed=seed, steps=STEPS, height=SIZE, width=SIZE)
    return run_request(load_family(model), params)[0].to_uint8()[0]


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    diff = np.abs(got.astype(np.int16) - want.astype(np.int16)).max()
    db = psnr(got, want, data_range=255.0)
    assert diff <= MAX_DIFF and db >= MIN_PSNR, (diff, db)


def nodes_of(backend) -> dict[str, str]:
    return {iid: w["node"] for iid, w in backend.workers.describe()["workers"].items() if not w["retired"]}


def test_no_ray_listener_binds_a_non_loopback_address(server, before_ray):
    found = [f for f in listeners() if f not in before_ray]
    names = {name for _, name, _, _ in found}
    assert {"gcs_server", "raylet"} <= names, names  # the Ray processes were looked at
    assert [f for f in found if not is_loopback(f[2])] == []


def test_the_listener_check_can_fail():
    sock = socket.socket()
    sock.bind(("0.0.0.0", 0))
    sock.listen()
    try:
        mine = [f for f in listeners(pids=[os.getpid()]) if f[3] == sock.getsockname()[1]]
        assert len(mine) == 1 and not is_loopback(mine[0][2])
    finally:
        sock.close()


def test_121_on_two_nodes_matches_generate_and_sits_where_asked(server, nodes):
    model, backend, client = server
    _, node_a, node_b = nodes
    seeds = [1, 2, 3, 4]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda s: generate(client, s), seeds))
    for seed, image in zip(seeds, got):
        assert_close(image, reference(model, seed))
    placed = wait_for(lambda: len(n := nodes_of(backend)) == 4 and all(n.values()) and n, "actor infos")
    assert {i: n for i, n in placed.items() if i.startswith("denoiser")} == {
        "denoiser-0": node_b,
        "denoiser-1": node_b,
    }
    assert placed["encoder-0"] == node_a and placed["decoder-0"] == node_a
    served = {i["id"]: i["assigned"] for i in backend.describe()["instances"]}
    assert served["denoiser-0"] > 0 and served["denoiser-1"] > 0  # both denoisers took work


def test_a_killed_denoiser_actor_is_restarted_and_requests_complete(server, nodes):
    model, backend, client = server
    _, _, node_b = nodes
    before = backend.describe()["stats"].get("retries", 0)
    seeds = list(range(10, 18))
    with ThreadPoolExecutor(len(seeds)) as pool:
        futures = [pool.submit(generate, client, s) for s in seeds]
        victim = wait_for(
            lambda: next(
                (i["id"] for i in backend.describe()["instances"] if i["role"] == "denoiser" and i["held"]), None
            ),
            "a denoiser holding a request",
        )
        actor_pid = backend.workers.node_info(victim)["pid"]
        backend.workers.kill(victim)
        got = [f.result(300) for f in futures]
    for seed, image in zip(seeds, got):
        assert_close(image, reference(model, seed))
    desc = backend.describe()
    assert desc["stats"].get("retries", 0) > before  # the killed one's requests went elsewhere
    assert victim not in {i["id"] for i in desc["instances"]}
    restarted = wait_for(
        lambda: [i for i in backend.describe()["instances"] if i["id"].startswith(f"{victim}.")], "restarted actor", 120
    )
    info = backend.workers.node_info(victim)
    assert info["pid"] != actor_pid and info["node_id"] == node_b and info["instance_id"] == restarted[0]["id"]
    assert backend.describe()["local_workers"]["restarts"] >= 1
    assert_close(generate(client, 42), reference(model, 42))  # the pool serves again


def test_rank_zero_of_a_multi_rank_instance_sees_the_gpus_of_every_rank(nodes):
    """A 2-rank denoiser with ``--denoiser-gpus 1``: placed as ``RayWorkers.spawn`` places it (the
    placement helpers, bundle 0), its actor is handed both GPUs of node B, so the follower rank it
    spawns (a child process, inheriting ``CUDA_VISIBLE_DEVICES``) gets its own. With a bundle per
    rank it would see one, and both ranks would share it (NCCL refuses that)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote
    class Probe:
        def seen(self):
            return ray.get_runtime_context().get_node_id(), ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")

    res = RoleResources(cpus=0, gpus=1)  # no CPU: node B's are held by the module's server
    group = ray.util.placement_group(bundles(res, 2), strategy=group_strategy(2))
    try:
        ray.get(group.ready(), timeout=60)
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
        probe = Probe.options(**actor_options(res, 0, ranks=2), scheduling_strategy=strategy).remote()
        node, ids, visible = ray.get(probe.seen.remote(), timeout=60)
        ray.kill(probe)
    finally:
        ray.util.remove_placement_group(group)
    assert node == nodes[2] and len(ids) == 2 and sorted(visible.split(",")) == sorted(str(i) for i in ids)


def test_a_two_rank_ulysses_denoiser_served_as_a_ray_placement_group_matches_generate(nodes, tiny_model_dir, tmp_path):
    """The whole multi-rank path under Ray on CPU (gloo): rank 0's actor in a STRICT_PACK group on
    node B spawns its follower rank, and the 1:1:1 server's image equals the single-rank
    ``run_request`` within the module's tolerance. Resources: none beyond the node (cpus=0), so it
    fits beside the module's other server."""
    from triptych.parallel import ParallelConfig

    model = tiny_model_dir("flux")
    none = RoleResources(cpus=0)
    denoiser = RoleResources(cpus=0, gpus=1)
    config = ClusterConfig(cluster="ray", ray_max_restarts=0, encoder=none, decoder=none, denoiser=denoiser)
    backend = EmbeddedBackend(
        model,
        OrchestratorConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=10.0),
        TopologyConfig(
            transfer="zmq", capacity=2, torch_threads=1, start_timeout_s=240, parallel=ParallelConfig(ulysses=2)
        ),
        pool=functools.partial(RayWorkers, config),
    )
    with serve(create_app(backend, HeadConfig(data_dir=tmp_path / "head")), 240) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        got = generate(client, 11)
        assert nodes_of(backend)["denoiser-0"] == nodes[2]  # the only node with GPUs
        worker = psutil.Process(backend.workers.node_info("denoiser-0")["worker_pid"])
        followers = [p for p in worker.children() if "triptych.worker.ranks.follower" in " ".join(p.cmdline())]
        assert len(followers) == 1  # rank 1, spawned by rank 0 inside the actor
    assert_close(got, reference(model, 11))
