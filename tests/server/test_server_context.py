"""Honest context on `localchat serve`: a prompt the window cannot hold is refused with the
token counts on every endpoint, unless the request asks to truncate (then the oldest turns go,
and the response says so); Ollama's `options.num_ctx` sets the window (clamped to the model's);
`--log-requests` logs one line per request.

A server of its own, run with a 256-token window (`--context-length 256`): prompts that
overflow it are short to send and to prefill."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import ollama
import openai
import pytest
from serve_helpers import MODEL, Server, make_home, start_server, stop_server

WINDOW = 256
TRUNCATED = "x-localchat-truncated-tokens"
LONG = "word " * 300  # about 300 tokens: more than the window alone
# eight earlier turns (about 600 tokens) and a short question: fits once the oldest turns go
HISTORY = [m for i in range(8) for m in (
    {"role": "user", "content": f"Question {i}: " + "tell me about the colour blue " * 4},
    {"role": "assistant", "content": "Blue is the colour of the sky and the sea. " * 3})]
LONG_CHAT = [{"role": "system", "content": "You are brief."}, *HISTORY,
             {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = make_home(tmp_path_factory.mktemp("context"))
    log = tmp_path_factory.mktemp("context-log") / "server.log"
    srv = start_server(home, log, "--model", MODEL, "--context-length", str(WINDOW),
                       "--log-requests", "--max-concurrency", "2")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def oai(small: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{small.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oll(small: Server) -> ollama.Client:
    return ollama.Client(host=small.url, timeout=120)


def counts(message: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", message)]


def test_an_overlong_prompt_is_refused_with_the_counts_on_every_endpoint(
        oai: openai.OpenAI, oll: ollama.Client) -> None:
    user = [{"role": "user", "content": LONG}]
    for call in (lambda: oai.chat.completions.create(model=MODEL, messages=user, max_tokens=2),
                 lambda: oai.chat.completions.create(model=MODEL, messages=user),
                 lambda: oai.completions.create(model=MODEL, prompt=LONG, max_tokens=2)):
        with pytest.raises(openai.BadRequestError) as err:
            call()
        body = err.value.body
        assert err.value.status_code == 400 and body["code"] == "context_length_exceeded"
        assert str(WINDOW) in body["message"]
        assert any(n > WINDOW for n in counts(body["message"])), body["message"]
    for call in (lambda: oll.chat(model=MODEL, messages=user, options={"num_predict": 2}),
                 lambda: oll.generate(model=MODEL, prompt=LONG, options={"num_predict": 2}),
                 lambda: oll.generate(model=MODEL, prompt=LONG, raw=True,
                                      options={"num_predict": 2})):
        with pytest.raises(ollama.ResponseError) as oerr:
            call()
        assert oerr.value.status_code == 400
        assert f"holds {WINDOW}" in oerr.value.error
        assert any(n > WINDOW for n in counts(oerr.value.error)), oerr.value.error
        assert "num_ctx" in oerr.value.error  # what would make it fit


def test_a_long_conversation_is_refused_unless_it_asks_to_truncate(
        oai: openai.OpenAI, small: Server) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=LONG_CHAT, max_tokens=2)
    assert "truncation" in err.value.body["message"]  # the way out is named
    raw = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=LONG_CHAT, max_tokens=2, temperature=0,
        extra_body={"truncation": "auto"})
    reply = raw.parse()
    dropped = int(raw.headers[TRUNCATED])
    assert dropped > 300 and int(raw.headers["x-localchat-truncated-messages"]) >= 8
    assert reply.choices[0].message.content
    # what is left fits: the prompt counted in usage is the kept one
    assert reply.usage.prompt_tokens + 2 <= WINDOW
    # the same as a stream, and with the `truncate` spelling
    with httpx.stream("POST", f"{small.url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": LONG_CHAT, "max_tokens": 2, "temperature": 0,
            "truncate": True, "stream": True}) as r:
        assert r.status_code == 200 and int(r.headers[TRUNCATED]) == dropped
        assert "".join(r.iter_text()).rstrip().endswith("data: [DONE]")
    # never silently: the server's log says what was dropped
    assert f"dropped the {raw.headers['x-localchat-truncated-messages']} oldest messages " \
           f"({dropped} tokens)" in small.log.read_text(errors="replace")
    # a prompt that fits says nothing
    short = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=LONG_CHAT[-1:], max_tokens=2, extra_body={"truncation": "auto"})
    assert TRUNCATED not in short.headers


def test_ollama_truncate_top_level_or_in_options(oll: ollama.Client, small: Server) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        oll.chat(model=MODEL, messages=LONG_CHAT, options={"num_predict": 2})
    assert err.value.status_code == 400 and '"truncate": true' in err.value.error
    reply = oll.chat(model=MODEL, messages=LONG_CHAT,
                     options={"num_predict": 2, "temperature": 0, "truncate": True})
    assert reply.done and reply.message.content
    r = httpx.post(f"{small.url}/api/chat", timeout=120, json={
        "model": MODEL, "messages": LONG_CHAT, "truncate": True, "stream": False,
        "options": {"num_predict": 2, "temperature": 0}})
    assert r.status_code == 200 and int(r.headers[TRUNCATED]) > 300
    assert r.json()["message"]["content"] == reply.message.content


def test_truncation_cannot_shorten_the_last_message_or_a_text_prompt(
        oai: openai.OpenAI, oll: ollama.Client) -> None:
    too_long = [*LONG_CHAT[:-1], {"role": "user", "content": LONG}]
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=too_long, max_tokens=2,
                                    extra_body={"truncation": "auto"})
    assert "even with the oldest turns dropped" in err.value.body["message"]
    assert any(n > WINDOW for n in counts(err.value.body["message"]))
    with pytest.raises(ollama.ResponseError) as oerr:
        oll.chat(model=MODEL, messages=too_long, options={"num_predict": 2, "truncate": True})
    assert oerr.value.status_code == 400 and "last message" in oerr.value.error
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=MODEL, prompt=LONG, max_tokens=2,
                               extra_body={"truncation": "auto"})
    assert "text prompt has none" in err.value.body["message"]


def test_num_ctx_sets_the_window_up_to_the_models(oll: ollama.Client, oai: openai.OpenAI,
                                                  small: Server) -> None:
    question = [{"role": "user", "content": "Hi"}]
    oll.chat(model=MODEL, messages=question, options={"num_predict": 1, "num_ctx": 512})
    [running] = oll.ps().models
    assert running.context_length == 512
    assert "num_ctx 512" in oll.show(MODEL).parameters
    assert oll.show(MODEL).modelinfo["llama.context_length"] == 8192  # the model's own
    # the larger window takes what the server's 256 refused
    reply = oll.chat(model=MODEL, messages=[{"role": "user", "content": "word " * 200}],
                     options={"num_predict": 1, "num_ctx": 512})
    assert reply.done and reply.prompt_eval_count
    # over the model's window: clamped to it, and the log says so
    oll.chat(model=MODEL, messages=question, options={"num_predict": 1, "num_ctx": 100_000})
    assert oll.ps().models[0].context_length == 8192
    assert "requested context window 100000 exceeds the model's 8192" in small.log.read_text(
        errors="replace")
    with pytest.raises(ollama.ResponseError) as err:
        oll.chat(model=MODEL, messages=question, options={"num_ctx": 1})
    assert err.value.status_code == 400 and "num_ctx" in err.value.error
    # a request that does not say runs with the server's default again
    oai.chat.completions.create(model=MODEL, messages=question, max_tokens=1)
    assert oll.ps().models[0].context_length == WINDOW
    assert f"num_ctx {WINDOW}" in oll.show(MODEL).parameters


def logged(server: Server, pattern: str, timeout_s: float = 10.0) -> bool:
    """Whether a line of the server's log matches `pattern` (waits a little: a request's line
    is written once its response has gone, so it may come just after the client has it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = server.log.read_text(errors="replace").splitlines()
        if any(re.search(pattern, line) for line in lines):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def test_log_requests_writes_one_line_per_request(small: Server, oai: openai.OpenAI) -> None:
    oai.models.list()
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="no-such-model", messages=[
            {"role": "user", "content": "Hi"}], max_tokens=1)
    assert logged(small, r'"GET /v1/models" 200 \d+\.\d+s model=-$')
    assert logged(small, r'"POST /v1/chat/completions" 404 \d+\.\d+s model=no-such-model$')
    assert logged(small, rf'"POST /api/chat" 200 \d+\.\d+s model={MODEL}$')
    # a name that could forge a line is written escaped
    httpx.post(f"{small.url}/api/show", json={"model": "evil\nINFO: forged"})
    assert logged(small, r'"POST /api/show" 404 .* model=evil\\x0aINFO: forged$')
