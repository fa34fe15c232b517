"""`localchat --server URL` against another OpenAI-compatible server: llama-cpp-python's own
(`python -m llama_cpp.server`) serving the SmolLM2-135M-Instruct Q4_1 GGUF the tests already
use. The UI's remote backend (`localchat.tui.remote`) must work with it unchanged: the model
listed, a reply streamed with its settings sent as request fields, store actions refused with
a clear message (the server has no Ollama API).

Skipped when llama-cpp-python (with its `server` extra) is not installed; build it as
../shared/design.md says under "Peers" (about 6 minutes on 2 cores)."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from localchat import FinishEvent, TokenEvent
from localchat.tui.remote import RemoteBackend
from localchat.tui.settings import ChatSettings

from fixtures import smollm2_gguf

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None
    or importlib.util.find_spec("sse_starlette") is None,
    reason="llama-cpp-python with its server extra is not installed (pip install "
           "'llama-cpp-python[server]', CMAKE_ARGS as in ../shared/design.md 'Peers')")

ALIAS = "smollm2-gguf"
START_TIMEOUT_S = 120


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llamacpp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`python -m llama_cpp.server` on the Q4_1 GGUF, on a free loopback port; its URL."""
    gguf = smollm2_gguf()
    port = _free_port()
    log = tmp_path_factory.mktemp("llamacpp") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
             "--model_alias", ALIAS, "--host", "127.0.0.1", "--port", str(port),
             "--n_threads", "2", "--n_ctx", "512", "--chat_format", "chatml"],
            stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                why = (" (SIGILL: llama-cpp-python was built for instructions this CPU lacks; "
                       "rebuild it with -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF)"
                       if proc.returncode == -signal.SIGILL else "")
                raise RuntimeError(f"llama_cpp.server exited ({proc.returncode}){why}:\n"
                                   f"{_tail(log)}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama_cpp.server did not start:\n{_tail(log)}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(log: Path, n: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


@pytest.fixture
def backend(llamacpp_server: str) -> Iterator[RemoteBackend]:
    b = RemoteBackend(llamacpp_server)
    yield b
    b.close()


def test_the_model_is_listed_and_store_actions_are_not_offered(backend: RemoteBackend) -> None:
    [info] = backend.models()
    assert info.ref == ALIAS and info.name == ALIAS
    assert not backend.manages_store  # no Ollama API there: no pull, no delete
    assert backend.catalog() == []
    model = backend.load(ALIAS)
    assert model.name == ALIAS and model.context_window == 0  # no /api/show: unknown


def test_a_reply_streams_with_the_settings_as_request_fields(backend: RemoteBackend) -> None:
    model = backend.load(ALIAS)
    settings = ChatSettings(system="You are brief.", temperature=0.0, top_k=40, min_p=0.05,
                            repetition_penalty=1.1, max_tokens=8, seed=1)
    stream = model.reply("k", [{"role": "user", "content": "Name three colours."}], settings)
    tokens: list[str] = []
    finish = None
    for event in stream:
        if isinstance(event, TokenEvent):
            tokens.append(event.text)
        elif isinstance(event, FinishEvent):
            finish = event
    assert finish is not None and finish.reply is not None
    assert tokens and finish.reply.text == "".join(tokens)
    stats = finish.reply.stats
    assert stats.ttft_s > 0
    # the settings reach the server: max_tokens cuts the reply (no equality with a second
    # greedy reply: llama.cpp's reuse of its cached prompt may change a near tie)
    assert finish.reply.finish_reason == "length" and stats.completion_tokens == 8
    short = model.reply("k", [{"role": "user", "content": "Name three colours."}],
                        ChatSettings(temperature=0.0, max_tokens=2))
    assert len([e for e in short if isinstance(e, TokenEvent)]) <= 2


def test_cancel_stops_a_reply_keeping_its_text(backend: RemoteBackend) -> None:
    model = backend.load(ALIAS)
    stream = model.reply("k", [{"role": "user", "content": "Tell a long story."}],
                         ChatSettings(temperature=0.0, max_tokens=200))
    seen = []
    for event in stream:
        if isinstance(event, TokenEvent):
            seen.append(event.text)
            if len(seen) == 3:
                stream.cancel()
        elif isinstance(event, FinishEvent):
            assert event.reply is not None and event.reply.finish_reason == "cancelled"
            assert event.reply.text == "".join(seen)
            break
    # the server is still there for the next request
    assert [m.ref for m in backend.models()] == [ALIAS]
