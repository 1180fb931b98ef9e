"""Real `ggrun serve` subprocesses on free loopback ports, shared by the serve tests: SmolLM2 (4 slots, an API
key, metrics) and a synthetic tiny llama with f32 weights under --numerics f32 (whose results do not depend on
the batch; SmolLM2's quantized weights under f32 numerics evaluate prompts a hundred times slower than under
llama's). Plain HTTP goes through httpx without proxies from the environment."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

KEY = "sk-test-key"
START_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    key: str = KEY

    def client(self, key: str | None = KEY, timeout: float = 120.0):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout, trust_env=False)


def start_server(model, *args: str) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "ggrun.cli.app", "serve", "-m", str(model), "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "NO_PROXY": "127.0.0.1,localhost"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_S
    with httpx.Client(base_url=url, trust_env=False, timeout=5) as c:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"ggrun serve exited {proc.returncode}: {proc.stderr.read()}")
            try:
                if c.get("/health").status_code == 200:
                    return Server(url, proc)
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("ggrun serve did not become healthy")


def warm(server: Server) -> None:
    """One short completion before the tests: a server's first request of a shape may compile kernels (a
    minute on a fresh clone's cold cache), which no test means to time."""
    with server.client(timeout=300) as c:
        c.post("/completion", json={"prompt": "Hello", "n_predict": 2}).raise_for_status()


def stop_server(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(20)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()


@pytest.fixture(scope="session")
def server(smollm2_path):
    srv = start_server(smollm2_path, "-np", "4", "-c", "4096", "--api-key", KEY, "--metrics", "-t", "2")
    warm(srv)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_path):
    srv = start_server(tiny_llama_path, "--numerics", "f32", "-np", "8", "-c", "4096", "--api-key", KEY, "-t", "2",
                       "--chat-template", "chatml")
    yield srv
    stop_server(srv)
