"""The serve console: a served run whose workers move tensors over Mooncake shows none of Mooncake's
INFO lines (``TopologyConfig.mooncake_log_level``, default ERROR, sets the workers' ``MC_LOG_LEVEL``)."""

from __future__ import annotations

import re

import httpx
import openai

from tests.e2e.http_support import serve, wait_for
from tests.helpers import NEEDS_MOONCAKE
from triptych.head.app import HeadConfig, create_app

#: A Mooncake glog INFO line, e.g. ``I1201 12:36:17.388 27268 transfer_engine_impl.cpp:116] ...``
MOONCAKE_INFO = re.compile(r"^I\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+\.cpp:\d+\]", re.MULTILINE)
SEEN_BEFORE = "I1201 12:36:17.388204 27268 transfer_engine_impl.cpp:183] Transfer Engine RPC using P2P handshake"


@NEEDS_MOONCAKE
def test_a_served_run_over_mooncake_keeps_its_info_lines_off_the_console(tiny_model_dir, tmp_path, capfd):
    from triptych.control.orchestrator import OrchestratorConfig
    from triptych.deploy.launch import EmbeddedBackend, TopologyConfig

    backend = EmbeddedBackend(
        tiny_model_dir("flux"),
        OrchestratorConfig(host="127.0.0.1"),
        TopologyConfig(transfer="mooncake", torch_threads=1),
    )
    with serve(create_app(backend, HeadConfig(data_dir=tmp_path)), start_timeout_s=300) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        client.images.generate(prompt="a cube", extra_body={"seed": 1, "num_inference_steps": 2})
        moved = r'triptych_transfer_bytes_total\{backend="mooncake",model="\S+"\} (\S+)'
        wait_for(lambda: re.search(moved, httpx.get(f"{base}/metrics").text), "a Mooncake transfer reported")
    console = capfd.readouterr()
    assert MOONCAKE_INFO.search(SEEN_BEFORE)  # the pattern matches what Mooncake printed before the fix
    assert not MOONCAKE_INFO.search(console.out + console.err), MOONCAKE_INFO.search(console.out + console.err)
