"""``run_head`` returns on SIGTERM, so what ``serve`` started is stopped by its ``finally`` blocks.

uvicorn raises the signal again after its graceful shutdown; under the default handler the process
died there, and ``serve``'s vLLM servers were left to their parent-death signal (a vLLM server still
answered /health after ``serve`` had exited: tests/e2e/test_chat_vllm.py's teardown)."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile

import httpx

from tests.e2e.http_support import free_port, wait_for

SCRIPT = """
import sys
from pathlib import Path
from fastapi import FastAPI
from triptych.head.serve import run_head
from triptych.head.state import HeadConfig

app = FastAPI()
app.get("/up")(lambda: "up")
try:
    code = run_head(app, HeadConfig(data_dir=Path(sys.argv[2])), "127.0.0.1", int(sys.argv[1]))
finally:
    print("cleaned up", flush=True)
print("returned", code, flush=True)
"""


def test_sigterm_ends_run_head_and_the_finally_blocks_run():
    port = free_port()
    with tempfile.TemporaryDirectory() as data:
        proc = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(port), data],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:

            def up():
                assert proc.poll() is None, proc.communicate()[1][-2000:]
                try:
                    return httpx.get(f"http://127.0.0.1:{port}/up", timeout=2).status_code == 200
                except httpx.HTTPError:
                    return False

            wait_for(up, "the head to answer", 60)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, (proc.returncode, err[-2000:])
    assert "cleaned up" in out and "returned 0" in out, out
