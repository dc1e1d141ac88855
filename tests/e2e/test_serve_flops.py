"""Slow (``--run-slow``): one request of the default model over the disaggregated ``EmbeddedBackend``
(worker processes) raises the head's ``triptych_<role>_flops_total`` by what ``triptych plan``
predicts for it, and the MFU gauges read a fraction in (0, 1]."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

import triptych
from tests.e2e.http_support import serve, wait_for

pytestmark = pytest.mark.slow
DEFAULT = Path(triptych.__file__).parent / "assets" / "default"
ROLES = ("encoder", "denoiser", "decoder")
STEPS = 4


def _metrics(base: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith("triptych_denoiser_steps_total"):
            out["steps"] = out.get("steps", 0.0) + float(line.split()[-1])
        for role in ROLES:
            for kind in ("flops_total", "mfu"):
                if line.startswith(f"triptych_{role}_{kind}"):
                    out[f"{role}_{kind}"] = out.get(f"{role}_{kind}", 0.0) + float(line.split()[-1])
    return out


def _prediction() -> dict:
    """``plan`` for the request, its prompts' token counts read from the model's own encoder."""
    from triptych.families.base import COND, UNCOND, GenerationParams
    from triptych.families.registry import load_family
    from triptych.plan.model_plan import Request, plan

    family = load_family(DEFAULT, roles=["encoder"])
    cond = family.encode(family.resolve(GenerationParams(prompt="a red circle", steps=STEPS)))
    tokens = {b: v["prompt_embeds"].shape[1] for b, v in cond.branches.items()}
    return plan(DEFAULT, Request(steps=STEPS, text_tokens=tokens[COND], negative_text_tokens=tokens[UNCOND]))


def test_a_served_request_raises_the_flop_counters_by_the_plan(tmp_path):
    from triptych.control.orchestrator import OrchestratorConfig
    from triptych.deploy.launch import EmbeddedBackend
    from triptych.head.app import HeadConfig, create_app

    predicted = _prediction()
    backend = EmbeddedBackend(DEFAULT, OrchestratorConfig(host="127.0.0.1", control_port=0))
    with serve(create_app(backend, HeadConfig(data_dir=tmp_path / "data"))) as base:
        body = {"prompt": "a red circle", "seed": 1, "num_inference_steps": STEPS}
        resp = httpx.post(f"{base}/v1/images/generations", json=body, timeout=300)
        assert resp.status_code == 200, resp.text
        # worker reports reach the head's metrics periodically: until the denoiser's report that holds
        # the last step has arrived, and the encoder's and decoder's
        got = wait_for(
            lambda: (
                (m := _metrics(base)).get("steps", 0) >= STEPS and all(m.get(f"{r}_flops_total") for r in ROLES) and m
            ),
            what="every role's FLOP report",
            deadline_s=60,
            every_s=0.2,
        )
    s = predicted["stages"]
    # measured: equal to the plan (the same modules and shapes traced); 2% allowed
    assert got["denoiser_flops_total"] == pytest.approx(STEPS * s["denoise_step"]["flops"], rel=0.02)
    assert got["encoder_flops_total"] == pytest.approx(s["encode"]["flops"], rel=0.02)
    assert got["decoder_flops_total"] == pytest.approx(s["decode"]["flops"], rel=0.02)
    total = sum(got[f"{r}_flops_total"] for r in ROLES)
    assert total == pytest.approx(predicted["request_flops"], rel=0.02)
    for role in ROLES:
        assert 0 < got[f"{role}_mfu"] <= 1, (role, got)
