"""Ollama's model lifecycle on `localchat serve`, through the official `ollama` client:
keep_alive (load, durations, forever, unload with 0), what `/api/ps` says of a loaded model,
`/api/copy`, and management requests that name no model (`../x`) answered with a 400.

A server of its own with no model loaded at start (models load on first use)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import httpx
import ollama
import pytest
from serve_helpers import MODEL, Server, make_home, start_server, stop_server

HI = [{"role": "user", "content": "Hi"}]
ONE = {"num_predict": 1, "temperature": 0}


@pytest.fixture(scope="module")
def lazy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = make_home(tmp_path_factory.mktemp("keepalive"))
    log = tmp_path_factory.mktemp("keepalive-log") / "server.log"
    srv = start_server(home, log, "--max-concurrency", "2")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(lazy: Server) -> ollama.Client:
    return ollama.Client(host=lazy.url, timeout=120)


def expires_in(client: ollama.Client) -> timedelta:
    """How long until the one loaded model is unloaded, as /api/ps says."""
    [running] = client.ps().models
    assert running.expires_at is not None
    return running.expires_at - datetime.now(timezone.utc)


def test_keep_alive_durations_forever_and_unload(client: ollama.Client) -> None:
    assert client.ps().models == []
    # an empty request with keep_alive 0 unloads; of a model not loaded, it loads nothing
    assert client.generate(model=MODEL, keep_alive=0).done_reason == "unload"
    assert client.ps().models == []
    # an empty request loads; the default keeps it 5 minutes once idle
    assert client.generate(model=MODEL).done_reason == "load"
    assert timedelta(minutes=4, seconds=50) < expires_in(client) <= timedelta(minutes=5)
    client.chat(model=MODEL, messages=HI, options=ONE, keep_alive="1h")
    assert timedelta(minutes=59) < expires_in(client) <= timedelta(hours=1)
    client.chat(model=MODEL, messages=HI, options=ONE, keep_alive=90)  # seconds
    assert timedelta(seconds=80) < expires_in(client) <= timedelta(seconds=90)
    # forever is Ollama's largest duration from now (its CLI shows "Forever")
    client.chat(model=MODEL, messages=HI, options=ONE, keep_alive=-1)
    assert expires_in(client) > timedelta(days=365 * 290)
    client.chat(model=MODEL, messages=HI, options=ONE, keep_alive="-1m")
    assert expires_in(client) > timedelta(days=365 * 290)
    # a request that does not say sets the default again, as in Ollama
    client.chat(model=MODEL, messages=HI, options=ONE)
    assert expires_in(client) <= timedelta(minutes=5)
    # an empty request with keep_alive 0 unloads a loaded model
    assert client.chat(model=MODEL, messages=[], keep_alive=0).done_reason == "unload"
    assert client.ps().models == []
    # a reply with keep_alive 0: unloaded as soon as it ends
    reply = client.generate(model=MODEL, prompt="Hi", options=ONE, keep_alive="0s")
    assert reply.done and client.ps().models == []


def test_a_short_keep_alive_expires(client: ollama.Client) -> None:
    client.generate(model=MODEL, prompt="Hi", options=ONE, keep_alive=1)
    assert [m.model for m in client.ps().models] == [MODEL]
    deadline = time.monotonic() + 30  # the reaper looks every 5 s
    while client.ps().models and time.monotonic() < deadline:
        time.sleep(0.5)
    assert client.ps().models == []


def test_ps_describes_the_loaded_model(client: ollama.Client, lazy: Server) -> None:
    client.generate(model=MODEL)
    [running] = client.ps().models
    assert running.model == MODEL and running.context_length == 8192
    assert running.details.parameter_size == "135M"  # SmolLM2-135M's 134.5 million weights
    assert running.details.quantization_level == "q0f32"
    assert running.size and running.size > 500_000_000 and running.size_vram == 0  # CPU
    # /api/tags and /api/show say the same size
    assert client.list().models[0].details.parameter_size == "135M"
    assert client.show(MODEL).modelinfo["general.parameter_count"] > 130_000_000


def test_bad_keep_alive_is_a_400(lazy: Server) -> None:
    for value in ("5 minutes", "soon", True, [1]):
        r = httpx.post(f"{lazy.url}/api/generate", json={"model": MODEL, "keep_alive": value})
        assert r.status_code == 400 and "keep_alive" in r.json()["error"], (value, r.text)


def test_copy_then_chat_with_the_new_name(client: ollama.Client, lazy: Server) -> None:
    assert client.copy(MODEL, "my-smollm").status == "success"
    assert sorted(m.model for m in client.list().models) == ["my-smollm", MODEL]
    reply = client.chat(model="my-smollm", messages=HI, options=ONE)
    assert reply.done and reply.message.content
    assert client.show("my-smollm").details.quantization_level == "q0f32"
    assert (lazy.home / "models" / "my-smollm" / "q0f32" / "localchat-config.json").is_file()
    # the destination is taken now; an unknown source is a 404
    for body, status, words in (
            ({"source": MODEL, "destination": "my-smollm"}, 400, "already in the store"),
            ({"source": "no-such-model", "destination": "x"}, 404, "not found"),
            ({"source": MODEL, "destination": "other:q4f32_1"}, 400, "quantization"),
            ({"source": MODEL}, 400, "destination is required")):
        r = httpx.post(f"{lazy.url}/api/copy", json=body)
        assert r.status_code == status and words in r.json()["error"], (body, r.text)
    client.delete("my-smollm")
    assert [m.model for m in client.list().models] == [MODEL]
    client.chat(model=MODEL, messages=HI, options=ONE)  # the source still runs


@pytest.mark.parametrize("name", ["../x", "../../etc/passwd", "/etc", "a/../b", "~root",
                                  ".hidden", "x\\y", "nul\0byte"])
def test_a_name_that_is_no_model_name_is_a_400(lazy: Server, name: str) -> None:
    r = httpx.request("DELETE", f"{lazy.url}/api/delete", json={"model": name})
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith(f"invalid model name {name!r}")
    for body in ({"source": name, "destination": "x"}, {"source": MODEL, "destination": name}):
        r = httpx.post(f"{lazy.url}/api/copy", json=body)
        assert r.status_code == 400 and "invalid model name" in r.json()["error"], r.text
    # the other routes that take a name answer with a 4xx too, never a 500
    for method, path, body in (("POST", "/api/show", {"model": name}),
                               ("POST", "/api/pull", {"model": name, "stream": False}),
                               ("POST", "/api/chat", {"model": name, "messages": HI}),
                               ("POST", "/v1/chat/completions", {"model": name,
                                                                 "messages": HI})):
        r = httpx.request(method, f"{lazy.url}{path}", json=body)
        assert 400 <= r.status_code < 500, (path, r.text)
    assert [m.model for m in ollama.Client(host=lazy.url).list().models] == [MODEL]
