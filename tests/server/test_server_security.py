"""A second server with an API key, CORS, one sequence and a queue of one, and no model loaded
at start: the key (with /health and the / heartbeat open), CORS, 503 when the queue is full,
lazy loading and Ollama's keep_alive."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from serve_helpers import MODEL, Server, start_server, stop_server

KEY = "s3cret-key"
ORIGIN = "http://app.example"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def locked(server_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("locked-log") / "server.log"
    srv = start_server(server_home, log, "--api-key", KEY, "--cors-origin", ORIGIN,
                       "--max-concurrency", "1", "--max-queue", "1")
    yield srv
    stop_server(srv)


def test_key_required_but_health_and_heartbeat_open(locked: Server) -> None:
    assert httpx.get(f"{locked.url}/health").status_code == 200
    assert httpx.head(f"{locked.url}/").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(f"{locked.url}/v1/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(f"{locked.url}/api/tags")
    assert r.status_code == 401 and isinstance(r.json()["error"], str)
    bad = openai.OpenAI(base_url=f"{locked.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{locked.url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == [MODEL]


def test_cors(locked: Server, server: Server) -> None:
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(f"{locked.url}/v1/chat/completions", headers=preflight)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.options(f"{locked.url}/v1/chat/completions",
                      headers={**preflight, "Origin": "http://evil.example"})
    assert r.headers.get("access-control-allow-origin") is None
    r = httpx.get(f"{locked.url}/v1/models", headers={**AUTH, "Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    # CORS is off unless origins are given
    r = httpx.get(f"{server.url}/v1/models", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in r.headers


def test_lazy_load_keep_alive_and_a_full_queue(locked: Server) -> None:
    assert httpx.get(f"{locked.url}/health").json()["models"] == []
    client = ollama.Client(host=locked.url, headers=AUTH, timeout=120)
    assert client.ps().models == []
    reply = client.chat(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                        options={"temperature": 0, "num_predict": 2})
    assert reply.message.content
    assert [m.model for m in client.ps().models] == [MODEL]

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story."}],
            "max_tokens": 24, "temperature": 0, "logit_bias": {"2": -100}}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=locked.url, headers=AUTH, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/chat/completions", json=body)
                                          for _ in range(4)))

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert statuses[0] == 200 and statuses[-1] == 503, statuses
    for r in responses:
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "engine_busy"
            assert r.json()["error"]["type"] == "server_error"
    after = httpx.post(f"{locked.url}/v1/chat/completions", headers=AUTH, timeout=120,
                       json={**body, "max_tokens": 2})
    assert after.status_code == 200

    # keep_alive 0: unloaded as soon as the request ends
    client.generate(model=MODEL, prompt="Hi", options={"num_predict": 1}, keep_alive=0)
    assert client.ps().models == []
    assert httpx.get(f"{locked.url}/health").json() == {"status": "ok", "models": []}
