"""The head sends a LoRA request to the denoiser that already holds its adapter (two real denoiser
processes, one encoder, one decoder; the default round-robin dispatch underneath).

Four requests naming adapter ``a``, one after another: round robin alone would alternate them over
the two denoisers and load ``a`` on both; with the preference, the first loads it on one denoiser
and the next three go there (stats reports every 0.2 s; each request waits for the report that
shows the adapter before the next is sent), so ``a`` is loaded once and hit three times. Then a request with no adapter still goes round robin.
"""

from __future__ import annotations

import dataclasses

import pytest
from orchestrator_support import Cluster, job, nothing_held

from triptych.deploy.launch import TopologyConfig
from triptych.families.registry import load_family, make_tiny
from triptych.lora.synthetic import write_random_lora


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from diffusers import QwenImageTransformer2DModel

    root = tmp_path_factory.mktemp("lora-routing")
    path = make_tiny("qwen-image", root / "model")
    transformer = QwenImageTransformer2DModel.from_pretrained(f"{path}/transformer")
    write_random_lora(root / "a", transformer, ("attn.to_q",), rank=2, seed=1)
    topology = TopologyConfig(
        encoders=1,
        denoisers=2,
        decoders=1,
        transfer="zmq",
        capacity=2,
        torch_threads=1,
        extra_args=("--lora", f"a={root / 'a'}"),
    )
    c = Cluster(path, topology)
    try:
        yield c, load_family(path, roles=())
    finally:
        c.close()


def denoisers(desc: dict) -> list[dict]:
    return sorted((i for i in desc["instances"] if i["role"] == "denoiser"), key=lambda i: i["id"])


def metric(text: str, name: str) -> float:
    (line,) = [x for x in text.splitlines() if x.startswith(name + " ")]
    return float(line.split()[1])


def reported_finished(c: Cluster, n: int, timeout: float = 60.0) -> None:
    """Wait until the denoisers' stats reports count ``n`` finished requests (a liveness bound)."""

    def finished() -> int:
        insts = c.backend.orchestrator.registry.instances.values()
        return sum(i.stats.engine.finished for i in insts if i.stats is not None and i.stats.engine is not None)

    c.wait_until(lambda _: c.on_loop(finished) >= n, f"stats reports counting {n} finished requests", timeout)


def test_requests_go_to_the_denoiser_holding_their_adapter(cluster):
    c, family = cluster
    before = {d["id"]: d["assigned"] for d in denoisers(c.describe())}
    for n in range(4):
        j = job(family, f"lora-{n}", seed=n, steps=2)
        j = dataclasses.replace(j, params=dataclasses.replace(j.params, lora=(("a", 1.0),)))
        c.submit(j).result(600)
        c.wait_until(lambda d: any("a" in i["loras"] for i in denoisers(d)), "a denoiser reporting adapter a")
    desc = c.wait_until(nothing_held, "every slot back")
    assigned = {d["id"]: d["assigned"] - before[d["id"]] for d in denoisers(desc)}
    holders = [d["id"] for d in denoisers(desc) if "a" in d["loras"]]
    assert len(holders) == 1, denoisers(desc)
    assert assigned[holders[0]] == 4, assigned
    reported_finished(c, 4)  # the stats reports (every 0.2 s) that cover all four requests are in
    text = c.backend.metrics.render().decode()
    counts = {n: metric(text, f"triptych_denoiser_lora_{n}_total") for n in ("loaded", "misses", "hits")}
    assert counts == {"loaded": 1, "misses": 1, "hits": 3}, counts

    # Without an adapter, round robin spreads the requests again.
    for n in range(2):
        c.submit(job(family, f"plain-{n}", seed=n, steps=2)).result(600)
    desc = c.wait_until(nothing_held, "every slot back")
    assert all(d["assigned"] - before[d["id"]] - assigned[d["id"]] == 1 for d in denoisers(desc)), denoisers(desc)
