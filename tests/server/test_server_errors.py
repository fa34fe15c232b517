"""Malformed requests: each gets OpenAI's status and a complete error object naming the
parameter, and the server goes on serving."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_helpers import MAX_BODY, MODEL, Server

MSG = [{"role": "user", "content": "Hi"}]


def chat(**fields: object) -> dict:
    return {"model": MODEL, "messages": MSG, "max_tokens": 2, **fields}


CHAT = "/v1/chat/completions"
# (name, method, path, body (dict, or raw bytes), status, param, code)
CASES = [
    ("not json", "POST", CHAT, b"{nope", 400, None, None),
    ("json array", "POST", CHAT, b"[1, 2]", 400, None, None),
    ("empty body", "POST", CHAT, b"", 400, None, None),
    ("no model", "POST", CHAT, {"messages": MSG}, 400, "model", None),
    ("no messages", "POST", CHAT, {"model": MODEL}, 400, "messages", None),
    ("empty messages", "POST", CHAT, chat(messages=[]), 400, "messages", None),
    ("messages a string", "POST", CHAT, chat(messages="hi"), 400, "messages", None),
    ("unknown role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages[0].role", None),
    ("content a number", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400,
     "messages[0].content", None),
    ("image part", "POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400,
     "messages[0].content[0].type", None),
    ("tool result without a call", "POST", CHAT,
     chat(messages=[{"role": "tool", "content": "x"}]), 400, "messages", None),
    ("temperature a string", "POST", CHAT, chat(temperature="hot"), 400, "temperature", None),
    ("temperature > 2", "POST", CHAT, chat(temperature=3), 400, "temperature", None),
    ("top_p > 1", "POST", CHAT, chat(top_p=1.5), 400, "top_p", None),
    ("top_k < 0", "POST", CHAT, chat(top_k=-1), 400, "top_k", None),
    ("max_tokens 0", "POST", CHAT, chat(max_tokens=0), 400, "max_tokens", None),
    ("max_tokens a float", "POST", CHAT, chat(max_tokens=1.5), 400, "max_tokens", None),
    ("max_completion_tokens < 0", "POST", CHAT, chat(max_completion_tokens=-1), 400,
     "max_completion_tokens", None),
    ("n 0", "POST", CHAT, chat(n=0), 400, "n", None),
    ("5 stops", "POST", CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
    ("bias outside vocab", "POST", CHAT, chat(logit_bias={"99999999": 1}), 400, "logit_bias",
     None),
    ("bias too big", "POST", CHAT, chat(logit_bias={"5": 500}), 400, "logit_bias", None),
    ("presence_penalty 3", "POST", CHAT, chat(presence_penalty=3), 400, "presence_penalty",
     None),
    ("top_logprobs alone", "POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs", None),
    ("top_logprobs 50", "POST", CHAT, chat(logprobs=True, top_logprobs=50), 400,
     "top_logprobs", None),
    ("stream_options no stream", "POST", CHAT, chat(stream_options={"include_usage": True}),
     400, "stream_options", None),
    ("json_schema without a schema", "POST", CHAT, chat(response_format={"type": "json_schema"}),
     400, "response_format", None),
    ("response_format unknown type", "POST", CHAT, chat(response_format={"type": "yaml"}), 400,
     "response_format.type", None),
    ("tools", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "tools", None),
    ("stream with a bad value", "POST", CHAT, chat(stream=True, temperature=-1), 400,
     "temperature", None),
    ("unknown model", "POST", CHAT, chat(model="no-such-model"), 404, "model",
     "model_not_found"),
    ("path as model", "POST", CHAT, chat(model="/etc"), 404, "model", "model_not_found"),
    ("max_tokens over the window", "POST", CHAT, chat(max_tokens=100_000), 400, "max_tokens",
     "context_length_exceeded"),
    ("prompt over the window", "POST", CHAT,
     chat(messages=[{"role": "user", "content": "hello " * 9000}], max_tokens=None), 400,
     "messages", "context_length_exceeded"),
    ("completion prompt empty", "POST", "/v1/completions",
     {"model": MODEL, "prompt": [], "max_tokens": 2}, 400, "prompt", None),
    ("completion suffix", "POST", "/v1/completions",
     {"model": MODEL, "prompt": "a", "suffix": "b"}, 400, "suffix", None),
    ("completion prompt a dict", "POST", "/v1/completions",
     {"model": MODEL, "prompt": {"a": 1}}, 400, "prompt", None),
    ("detokenize outside vocab", "POST", "/detokenize", {"model": MODEL, "tokens": [10**9]},
     400, "tokens[0]", None),
    ("tokenize nothing", "POST", "/tokenize", {"model": MODEL}, 400, "prompt", None),
    ("wrong method", "GET", CHAT, None, 405, None, None),
    ("unknown route", "POST", "/v1/nothing", {}, 404, None, None),
    ("body too large", "POST", CHAT, b"x" * (MAX_BODY + 1), 413, None, None),
]


@pytest.fixture(scope="module")
def http(server: Server) -> httpx.Client:
    with server.client() as client:
        yield client


@pytest.mark.parametrize("name,method,path,body,status,param,code", CASES,
                         ids=[c[0] for c in CASES])
def test_malformed_request(http: httpx.Client, name: str, method: str, path: str,
                           body: object, status: int, param: str | None,
                           code: str | None) -> None:
    content = body if isinstance(body, bytes) else (json.dumps(body).encode()
                                                    if body is not None else None)
    r = http.request(method, path, content=content,
                     headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    if code == "context_length_exceeded":
        assert "8192" in error["message"]  # the window and the counts are in the message


def test_still_serving_after_the_errors(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    r = http.post(CHAT, json=chat(temperature=0))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_chunked_body_over_the_limit_is_413(server: Server) -> None:
    def chunks():
        for _ in range(MAX_BODY // 1000 + 5):
            yield b" " * 1000

    r = httpx.post(f"{server.url}{CHAT}", content=chunks(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_ollama_errors_are_strings(http: httpx.Client) -> None:
    r = http.post("/api/chat", json={"model": "no-such-model", "messages": MSG})
    assert r.status_code == 404 and isinstance(r.json()["error"], str)
    r = http.post("/api/generate", json={"model": MODEL, "prompt": "x",
                                         "options": {"temperature": "hot"}})
    assert r.status_code == 400 and "temperature" in r.json()["error"]
    r = http.post("/api/chat", json={"model": MODEL, "messages": MSG, "format": "xml"})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
