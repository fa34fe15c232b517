"""The Ollama API of `localchat serve`, through the official `ollama` client."""

from __future__ import annotations

import httpx
import ollama
import pytest
from serve_helpers import MODEL, Server

QUESTION = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0, "num_predict": 8}


@pytest.fixture(scope="module")
def client(server: Server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=120)


def test_chat_streaming_equals_not_streaming(client: ollama.Client, server: Server) -> None:
    whole = client.chat(model=MODEL, messages=QUESTION, options=GREEDY, stream=False)
    assert whole.done and whole.message.role == "assistant" and whole.message.content
    assert whole.eval_count and whole.eval_count <= 8
    assert whole.prompt_eval_count and whole.prompt_eval_count > 5
    assert whole.total_duration and whole.total_duration > 0
    parts = list(client.chat(model=MODEL, messages=QUESTION, options=GREEDY, stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count
    # the same reply through the OpenAI route
    openai_reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 8}).json()
    assert openai_reply["choices"][0]["message"]["content"] == whole.message.content


def test_options_map_to_sampling(client: ollama.Client) -> None:
    def run(seed: int) -> str:
        return client.chat(model=MODEL, messages=QUESTION, options={
            "temperature": 1.0, "seed": seed, "num_predict": 8, "top_k": 40, "top_p": 0.9,
            "repeat_penalty": 1.1, "min_p": 0.01}).message.content

    assert run(5) == run(5)
    whole = client.chat(model=MODEL, messages=QUESTION, options=GREEDY).message.content
    stop = whole.split()[1]
    cut = client.chat(model=MODEL, messages=QUESTION,
                      options={**GREEDY, "stop": [stop]}).message.content
    assert stop not in cut and whole.startswith(cut)


def test_generate(client: ollama.Client) -> None:
    raw = client.generate(model=MODEL, prompt="The capital of France is", raw=True,
                          options=GREEDY, stream=False)
    assert raw.done and raw.response
    streamed = client.generate(model=MODEL, prompt="The capital of France is", raw=True,
                               options=GREEDY, stream=True)
    assert "".join(p.response for p in streamed) == raw.response
    templated = client.generate(model=MODEL, prompt="Name three colours.", options=GREEDY)
    chat = client.chat(model=MODEL, messages=QUESTION, options=GREEDY)
    assert templated.response == chat.message.content
    loaded = client.generate(model=MODEL)  # no prompt: load the model
    assert loaded.done and loaded.done_reason == "load"


def test_tags_show_ps_version(client: ollama.Client, server: Server) -> None:
    tags = client.list()
    assert [m.model for m in tags.models] == [MODEL]
    assert tags.models[0].details.quantization_level == "q0f32"
    assert tags.models[0].size > 0
    info = client.show(MODEL)
    assert info.details.family == "llama"
    assert info.modelinfo["llama.context_length"] == 8192
    assert "temperature" in info.parameters
    running = client.ps()
    assert [m.model for m in running.models] == [MODEL]
    assert running.models[0].context_length == 8192
    r = httpx.get(f"{server.url}/api/version")
    assert r.status_code == 200 and r.json()["version"]
    with pytest.raises(ollama.ResponseError) as info_err:
        client.show("no-such-model")
    assert info_err.value.status_code == 404


def test_heartbeat_answers_get_and_head(server: Server) -> None:
    root = httpx.get(f"{server.url}/")
    assert (root.status_code, root.text) == (200, "localchat is running")
    head = httpx.head(f"{server.url}/")
    assert head.status_code == 200 and head.content == b""
    for path in ("/api/version", "/api/tags"):
        assert httpx.head(f"{server.url}{path}").status_code == 200


def test_pull_of_an_unknown_name_is_404(server: Server) -> None:
    r = httpx.post(f"{server.url}/api/pull", json={"model": "no-such-model-anywhere"})
    assert r.status_code == 404 and isinstance(r.json()["error"], str)
    r = httpx.post(f"{server.url}/api/pull", json={"model": "../etc"})
    assert r.status_code == 404
