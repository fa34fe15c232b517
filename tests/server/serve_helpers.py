"""Starting a real `localchat serve` (python -m localchat.server) on a free loopback port,
serving the SmolLM2-135M test model from a store in a temporary LOCALCHAT_HOME."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from localchat.server.config import DEFAULT_PORT

from fixtures import converted, smollm2_hf_dir

MODEL = "smollm2"
KEYED_SERVER_KEY = "sk-keyed-server-test"  # the API key of the `keyed_server` fixture
MODEL_REF = "smollm2:q0f32"
START_TIMEOUT_S = 900  # the first run compiles the model's library
MAX_BODY = 100_000


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path
    home: Path
    health_seen: list[dict]

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kwargs)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_home(root: Path) -> Path:
    """A store under `root` holding the real SmolLM2 at q0f32 as MODEL."""
    return home_of(root, {MODEL: converted(smollm2_hf_dir(), "q0f32")})


def openai_client(server: Server, timeout: float = 300) -> openai.OpenAI:
    """The official openai client for `server` (no key, no retries)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=timeout)


def home_of(root: Path, models: dict[str, Path]) -> Path:
    """A store under `root` holding each converted model folder as `name` (its q0f32, linked)."""
    home = root / "home"
    for name, folder in models.items():
        (home / "models" / name).mkdir(parents=True)
        (home / "models" / name / "q0f32").symlink_to(folder, target_is_directory=True)
    return home


def start_server(home: Path, log: Path, *args: str, ready: bool = True,
                 env: dict[str, str | None] | None = None, default_port: bool = False) -> Server:
    """Start a server on `home` on a free port (default_port: with no --port, so on 11434);
    `env` adds to the environment (None: removes a variable)."""
    port = DEFAULT_PORT if default_port else free_port()
    merged = {**os.environ, "LOCALCHAT_HOME": str(home), **(env or {})}
    env = {k: v for k, v in merged.items() if v is not None}
    port_args = [] if default_port else ["--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "localchat.server", *port_args, "--device", "cpu", *args],
            env=env, stdout=out, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", proc, log, home, [])
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{server.log_tail()}")
        try:
            r = httpx.get(f"{server.url}/health", timeout=2)
            server.health_seen.append({**r.json(), "http": r.status_code})
            if r.status_code == 200 or (not ready and r.status_code == 503):
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    stop_server(server)
    raise RuntimeError(f"the server did not get ready:\n{server.log_tail()}")


def stop_server(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
