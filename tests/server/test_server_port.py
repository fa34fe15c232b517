"""`localchat serve`'s address: Ollama's port 11434 by default (an `ollama.Client()` with no
host finds it), and a taken port is one error line naming who holds it, before any banner,
pull or model load."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import ollama
import pytest
from serve_helpers import MODEL, Server, start_server, stop_server

from localchat.server.app import run
from localchat.server.config import DEFAULT_PORT, ServerConfig
from localchat.server.listen import AddressError


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def default_server(server_home: Path, tmp_path: Path,
                   monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    if not port_is_free(DEFAULT_PORT):
        pytest.skip(f"port {DEFAULT_PORT} is taken on this machine")
    monkeypatch.delenv("OLLAMA_HOST", raising=False)  # ollama.Client() must use its default
    srv = start_server(server_home, tmp_path / "server.log", "--max-concurrency", "1",
                       default_port=True)
    yield srv
    stop_server(srv)


def test_ollama_client_with_no_host_finds_the_default_port(default_server: Server) -> None:
    assert default_server.url == "http://127.0.0.1:11434"
    client = ollama.Client(timeout=120)
    assert [m.model for m in client.list().models] == [MODEL]
    reply = client.chat(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                        options={"temperature": 0, "num_predict": 2})
    assert reply.done and reply.message.content
    assert httpx.head(default_server.url).status_code == 200


@pytest.fixture
def ollama_like() -> Iterator[int]:
    """A stdlib HTTP server answering `GET /` the way Ollama does."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            body = b"Ollama is running"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A socket that accepts connections and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def serve_on(port: int, home: Path) -> subprocess.CompletedProcess[str]:
    """`localchat serve --port PORT` as a user runs it (the console script's module)."""
    env = {**os.environ, "LOCALCHAT_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "localchat.cli", "serve", "--port", str(port)],
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("holder, says", [
    ("server", "a localchat server is listening there"),
    ("ollama_like", "Ollama is listening there"),
    ("silent_listener", "another program is listening there"),
])
def test_a_taken_port_is_one_line_and_no_banner(holder: str, says: str, tmp_path: Path,
                                                request: pytest.FixtureRequest) -> None:
    taken = request.getfixturevalue(holder)
    port = urlsplit(taken.url).port if isinstance(taken, Server) else taken
    result = serve_on(port, tmp_path)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"localchat: error: 127.0.0.1:{port} is already in use ({says}); "
        f"pass --port N to use another port"]


def test_run_binds_before_preparing_or_announcing() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        # bound but not listening: still taken, and nobody answers the probe
        done: list[str] = []
        with pytest.raises(AddressError, match=rf"127\.0\.0\.1:{port} is already in use "
                                               r"\(another program holds it\)"):
            run(ServerConfig(port=port), announce=done.append,
                prepare=lambda: done.append("prepared"))
        assert done == []


def test_port_zero_announces_the_port_it_got(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    served: list[int] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets: served.append(
        sockets[0].getsockname()[1]))
    lines: list[str] = []
    run(ServerConfig(port=0), announce=lines.append, prepare=lambda: lines.append("prepared"))
    assert lines[0] == "prepared" and served and served[0] != 0
    assert lines[1].startswith(f"localchat serve: http://127.0.0.1:{served[0]} ")
