"""``triptych serve --chat-engine vllm`` on the packaged default model: one serve (one vLLM start) for
the module. The encoder encodes each image through its mm-hash cache and sends vLLM the embeddings
with the mm-hash as the item's ``uuid``; vLLM decodes. vLLM's copy of the vision tower is NaN
(``--vllm-vision-weights nan``), so an answer that matches the built-in engine token for token was
decoded from Triptych's embeddings: vLLM's tower did not run.

Needs the vllm extra (``.venv-vllm``, ``./install.sh --vllm``): skipped naming it without; ``.ci/run``
installs it and requires it in its second phase.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import httpx
import openai
import psutil
import pytest

from shapeworld import render, sample_scenes
from tests.e2e.http_support import free_port, wait_for
from tests.extras import ROOT, VLLM_PYTHON, needs_extra
from triptych.families.models import PACKAGED_DEFAULT

pytestmark = needs_extra("vllm")
QUESTION = "What is in this image?"


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(image) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


def vllm_metric(url: str, name: str, label: str = "") -> float:
    """The sum of vLLM's Prometheus samples of ``name`` (those whose labels hold ``label``)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and label in line:
            total += float(line.split()[-1])
    return total


class Served(NamedTuple):
    base: str  # the head
    vllm_url: str  # the vLLM server serve started
    pid: int  # serve's process (vLLM's processes are in its tree)
    vllm_log: Path  # vLLM's log (with --enable-log-requests: each request added and aborted)

    def logged(self, what: str) -> int:
        return self.vllm_log.read_text(errors="replace").count(what)

    def engine_core(self) -> psutil.Process:
        """vLLM's engine process (``VLLM::EngineCore``, a child of its API server), in serve's tree."""
        found = [p for p in psutil.Process(self.pid).children(recursive=True) if "EngineCore" in p.name()]
        assert len(found) == 1, f"vLLM's EngineCore among serve's processes: {found}"
        return found[0]


CONTEXT = 2048  # vLLM's --max-model-len here (the head's max_chat_tokens, 2048, bounds max_tokens)
LONG = 1900  # max_tokens of the answers a client leaves
LENGTH = 'finished_reason="length"'  # an answer that ran to max_tokens (an abort is not counted)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    port, vllm_port = free_port(), free_port()
    data = tmp_path_factory.mktemp("vllm-serve")
    cmd = [sys.executable, "-m", "triptych.cli", "serve", "--model", f"default={PACKAGED_DEFAULT}"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data), "--threads", "1"]
    cmd += ["--encoders", "1", "--denoisers", "0", "--decoders", "0", "--capacity", "8", "--transfer", "zmq"]
    cmd += ["--chat-engine", "vllm", "--vllm-python", str(VLLM_PYTHON), "--vllm-port", str(vllm_port)]
    # A 2048-token context: a cancelled answer of up to 1900 tokens is long enough that
    # the cancel reaches vLLM before it ends, even on an idle machine.
    cmd += ["--vllm-vision-weights", "nan", "--vllm-max-model-len", str(CONTEXT)]
    cmd += ["--vllm-args=--enable-log-requests"]  # vLLM logs each request it adds and aborts
    log = data / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base, vllm_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{vllm_port}"

    def healthy():  # its encoder registered (the 503 names the roles it runs without: denoiser, decoder)
        assert proc.poll() is None, f"serve exited {proc.returncode}: {log.read_text()[-3000:]}"
        try:
            return "encoder" not in httpx.get(f"{base}/health", timeout=2).json().get("missing_roles", ["encoder"])
        except (httpx.HTTPError, ValueError):
            return False

    try:
        wait_for(healthy, "serve --chat-engine vllm healthy", deadline_s=900, every_s=0.5)  # vLLM's load: 1-3 min
        yield Served(base, vllm_url, proc.pid, data / "vllm" / "default.log")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with pytest.raises(httpx.HTTPError):  # serve stopped its vLLM server
        httpx.get(f"{vllm_url}/health", timeout=2)


@pytest.fixture(scope="module")
def builtin():
    """The built-in engine on the same model, in this process (greedy: no seed involved)."""
    import torch

    from triptych.families.registry import load_family

    torch.set_num_threads(1)
    return load_family(PACKAGED_DEFAULT).chat_model()


def builtin_answer(chat, images, content):
    from triptych.chat import ChatParams, ChatTurn

    parts, n = [], 0
    for part in content:
        if part["type"] == "text":
            parts.append(part["text"])
        else:
            parts.append(n)
            n += 1
    return chat.run(ChatParams((ChatTurn("user", tuple(parts)),), tuple(images), max_tokens=32))


def test_greedy_answers_are_the_builtin_engines_token_for_token(served, builtin):
    base, vllm_url = served.base, served.vllm_url
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    scenes = sample_scenes(4, "vllm-chat", "heldout")
    cases = [[render(s, 64)] for s in scenes[:3]] + [[render(scenes[3], 64), render(scenes[0], 64)]]
    for images in cases:
        content = [image_part(im) for im in images] + [{"type": "text", "text": QUESTION}]
        out = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": content}], max_tokens=32, temperature=0
        )
        ref = builtin_answer(builtin, images, content)
        assert out.choices[0].message.content == ref.text
        assert out.usage.prompt_tokens == ref.prompt_tokens and out.usage.completion_tokens == ref.completion_tokens
        assert out.choices[0].finish_reason == ref.finish_reason
    text = [{"type": "text", "text": "Say something."}]
    out = client.chat.completions.create(model="default", messages=[{"role": "user", "content": text}], max_tokens=16)
    assert out.choices[0].message.content == builtin_answer(builtin, [], text).text
    # vLLM's multimodal processor never saw an item to process (measured: 0 queries for 5 images)
    assert vllm_metric(vllm_url, "vllm:mm_cache_queries_total") == 0


def test_vllms_own_vision_tower_is_poisoned(served, builtin):
    """The check above can fail: the same image sent to vLLM as pixels runs its NaN tower."""
    vllm_url = served.vllm_url
    image = render(sample_scenes(1, "vllm-chat", "heldout")[0], 64)
    content = [image_part(image), {"type": "text", "text": QUESTION}]
    direct = openai.OpenAI(base_url=f"{vllm_url}/v1", api_key="unused", max_retries=0)
    out = direct.chat.completions.create(
        model="default", messages=[{"role": "user", "content": content}], max_tokens=32, temperature=0
    )
    assert out.choices[0].message.content != builtin_answer(builtin, [image], content).text


def test_streaming_gives_the_same_answer_in_pieces(served):
    base = served.base
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    image = render(sample_scenes(2, "vllm-stream", "heldout")[1], 64)
    messages = [{"role": "user", "content": [image_part(image), {"type": "text", "text": QUESTION}]}]
    whole = client.chat.completions.create(model="default", messages=messages, max_tokens=32)
    chunks = list(client.chat.completions.create(model="default", messages=messages, max_tokens=32, stream=True))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == whole.choices[0].message.content


def test_the_mm_hash_keys_vllms_prefix_cache(served):
    """Two questions about one image: the second reuses the blocks over the image (keyed by its uuid)."""
    base, vllm_url = served.base, served.vllm_url
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    image = render(sample_scenes(3, "vllm-prefix", "heldout")[2], 64)
    before = vllm_metric(vllm_url, "vllm:prefix_cache_hits_total")
    for question in (QUESTION, "What colour is the background?"):
        content = [image_part(image), {"type": "text", "text": question}]
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": content}], max_tokens=4)
    assert vllm_metric(vllm_url, "vllm:prefix_cache_hits_total") - before >= 32  # one block (32 tokens) at least


async def _until(cond, every_s: float = 0.02) -> None:
    while not cond():
        await asyncio.sleep(every_s)


async def _leave_once_added(url: str, body: dict, served: Served, added: int) -> None:
    """Post ``body`` and leave (close the connection) once vLLM has added it (its log says so)."""
    async with httpx.AsyncClient(timeout=60) as http:
        task = asyncio.create_task(http.post(url, json=body))
        await asyncio.wait_for(_until(lambda: task.done() or served.logged("Added request") > added), 60)
        assert not task.done(), f"answered while vLLM's engine was frozen: {task.result().text}"
        task.cancel()  # closes the connection: the head cancels the chat
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_frees_vllm_and_the_head(served, stream):
    """The client leaves while vLLM holds its chat: streamed, after the first piece (vLLM is decoding
    it); whole, once vLLM added it. vLLM's engine process is frozen (SIGSTOP) from before the client
    leaves until vLLM's server has logged the abort, so the answer cannot end first (this tiny model
    decodes the 1900 tokens in 0.2-0.5 s); resumed, the engine drops it before its next step. A cancel
    that never reaches vLLM logs no abort (the wait fails) and, resumed, runs to max_tokens.

    NOTE: streamed, vLLM can finish the answer between its first piece and the freeze; such an
    attempt (vLLM counted the request a success) proves nothing and another is made, up to 8."""
    base, vllm_url = served.base, served.vllm_url
    engine = served.engine_core()
    image = render(sample_scenes(1, "vllm-cancel", "heldout")[0], 64)
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": [image_part(image), {"type": "text", "text": QUESTION}]}],
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": stream,
    }
    outcomes = []
    for _ in range(8):
        generated = vllm_metric(vllm_url, "vllm:generation_tokens_total")
        finished = vllm_metric(vllm_url, "vllm:request_success_total", LENGTH)
        aborted, added = served.logged("Aborted request"), served.logged("Added request")
        try:
            if stream:
                with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as resp:
                    assert resp.status_code == 200
                    next(line for line in resp.iter_lines() if line.startswith("data: "))
                    engine.suspend()
            else:
                engine.suspend()
                asyncio.run(_leave_once_added(f"{base}/v1/chat/completions", body, served, added))
            wait_for(
                lambda: (
                    served.logged("Aborted request") > aborted
                    or vllm_metric(vllm_url, "vllm:request_success_total", LENGTH) > finished
                ),
                "vLLM's server aborting the chat the client left",
                60,
            )
            ended_first = served.logged("Aborted request") == aborted
        finally:
            engine.resume()
        wait_for(lambda: vllm_metric(vllm_url, "vllm:num_requests_running") == 0, "vLLM's request ended", 60)
        wait_for(lambda: httpx.get(f"{base}/health").json()["in_flight"] == 0, "the head's chat ended", 60)
        produced = vllm_metric(vllm_url, "vllm:generation_tokens_total") - generated
        outcomes.append((ended_first, produced))
        if not ended_first:
            break
    assert not ended_first, f"vLLM ended every answer before the freeze (ended first, tokens): {outcomes}"
    assert produced < LONG, f"vLLM decoded on after the abort (ended first, tokens): {outcomes}"


def test_a_chat_past_vllms_context_is_a_400_naming_max_tokens(served):
    base = served.base
    image = render(sample_scenes(1, "vllm-long", "heldout")[0], 64)
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": [image_part(image), {"type": "text", "text": QUESTION}]}],
        "max_tokens": CONTEXT,
    }
    resp = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "max_tokens" and f"context of {CONTEXT} tokens" in error["message"], error
