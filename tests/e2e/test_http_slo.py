"""Serving to an SLO over HTTP (issue 45): a bad ``priority`` is a 400 naming the field, the value and
the limit (the static range, and an API key's own from ``tenant_policies``); a ``deadline_s`` the
head estimates cannot be met is refused at once with 429 + Retry-After naming the deadline and the
estimate (a real orchestrator without workers: nothing is ever run; ``slo_prior_step_s`` prices the
steps), and so is a model's default deadline (``HeadConfig.slo``)."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.http_support import FakeBackend, FakeFamily, serve
from triptych.head.app import HeadConfig, create_app

KEY, BATCH_KEY = "sk-interactive-0001", "sk-batch-jobs-0002"
CHAT = [{"role": "user", "content": "what is drawn?"}]


def _post(base, path, body, key=KEY):
    return httpx.post(f"{base}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


@pytest.mark.parametrize(
    "path, body", [("/v1/images/generations", {"prompt": "a red circle"}), ("/v1/chat/completions", {"messages": CHAT})]
)
def test_a_bad_priority_is_a_400_naming_the_field_the_value_and_the_limit(tmp_path, path, body):
    backend = FakeBackend(FakeFamily(tmp_path, chat=True))
    policies = ("*:max=0", f"{BATCH_KEY}:priority=10,min=10")
    config = HeadConfig(data_dir=tmp_path / "data", api_keys=(KEY, BATCH_KEY), tenant_policies=policies)
    with serve(create_app(backend, config)) as base:
        for value, limit in [(500, "less than or equal to 100"), (-101, "greater than or equal to -100")]:
            resp = _post(base, path, {**body, "priority": value})
            error = resp.json()["error"]
            assert resp.status_code == 400 and error["param"] == "priority", resp.text
            assert f"priority={value}" in error["message"] and limit in error["message"], error
        resp = _post(base, path, {**body, "priority": 5})  # inside -100..100, outside this key's range
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority", resp.text
        assert "priority=5: must be between -100 and 0 for this API key" in resp.json()["error"]["message"]
        resp = _post(base, path, {**body, "priority": 3}, key=BATCH_KEY)
        assert "must be between 10 and 100 for this API key" in resp.json()["error"]["message"], resp.text
        assert _post(base, path, {**body, "priority": -7}).status_code == 200
        assert _post(base, path, body, key=BATCH_KEY).status_code == 200
    if path.startswith("/v1/images"):
        assert [j.params.priority for j in backend.jobs] == [-7, 10]  # the request's, the key's default


def test_an_impossible_deadline_is_a_429_naming_it_and_the_estimate(tmp_path, tiny_model_dir):
    from triptych.control.orchestrator import Orchestrator, OrchestratorConfig

    backend = Orchestrator(tiny_model_dir("flux"), OrchestratorConfig(slo_prior_step_s=0.5))
    config = HeadConfig(data_dir=tmp_path / "data")
    with serve(create_app(backend, config)) as base:
        body = {"prompt": "a red circle", "num_inference_steps": 4, "deadline_s": 0.3}
        resp = httpx.post(f"{base}/v1/images/generations", json=body, timeout=60)
        error = resp.json()["error"]
        assert resp.status_code == 429 and error["param"] == "deadline_s" and error["code"] == "deadline", resp.text
        assert "deadline_s=0.3 cannot be met" in error["message"] and "estimate to finish is 2.0s" in error["message"]
        assert resp.headers["retry-after"] == "2"  # ceil(2.0 - 0.3)
        bad = httpx.post(f"{base}/v1/images/generations", json={**body, "deadline_s": -1}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "deadline_s", bad.text
        assert backend.describe()["requests"] == {} and backend.counters.generations.deadline_refused == 1


def test_a_models_default_deadline_is_refused_the_same(tmp_path, tiny_model_dir):
    from triptych.control.orchestrator import Orchestrator

    backend = Orchestrator(tiny_model_dir("flux"))
    config = HeadConfig(data_dir=tmp_path / "data", slo=("0.01",))
    with serve(create_app(backend, config)) as base:
        resp = httpx.post(f"{base}/v1/images/generations", json={"prompt": "a red circle"}, timeout=60)
        assert resp.status_code == 429 and "deadline_s=0.01 cannot be met" in resp.json()["error"]["message"]


def test_real_workers_run_a_priority_and_teach_the_head_the_step_cost(tmp_path, tiny_model_dir):
    """Over real worker processes (tiny FLUX): a request with a priority and a deadline it can meet
    is served; the denoiser's report (``DenoiseDone.tick_s`` at its ``occupancy``, one request alone)
    replaces the prior for that size;
    an impossible deadline is refused without being run."""
    from triptych.control.orchestrator import OrchestratorConfig
    from triptych.deploy.launch import EmbeddedBackend, TopologyConfig

    backend = EmbeddedBackend(
        tiny_model_dir("flux"),
        OrchestratorConfig(slo_prior_step_s=0.001),
        TopologyConfig(transfer="zmq", capacity=2, torch_threads=1),
    )
    with serve(create_app(backend, HeadConfig(data_dir=tmp_path / "data"))) as base:
        body = {"prompt": "a red circle", "size": "64x64", "num_inference_steps": 2, "seed": 1}
        ok = httpx.post(f"{base}/v1/images/generations", json={**body, "priority": -3, "deadline_s": 600}, timeout=600)
        assert ok.status_code == 200, ok.text
        learned = backend.orchestrator.generations.costs.learned
        assert set(learned) == {(64, 64, 1)} and set(learned[(64, 64, 1)]) == {1} and learned[(64, 64, 1)][1] > 0
        resp = httpx.post(f"{base}/v1/images/generations", json={**body, "deadline_s": 1e-6}, timeout=60)
        assert resp.status_code == 429 and "deadline_s=1e-06 cannot be met" in resp.json()["error"]["message"]
        assert backend.orchestrator.counters.generations.done == 1


def test_an_slo_for_a_model_not_served_is_refused_at_startup(tmp_path):
    backend = FakeBackend(FakeFamily(tmp_path))
    with pytest.raises(ValueError, match=r"HeadConfig.slo names \['nope'\], not served here"):
        create_app(backend, HeadConfig(data_dir=tmp_path / "data", served_model_name="fake", slo=("nope=5",)))
