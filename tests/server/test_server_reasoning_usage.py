"""What the APIs say about a reasoning model beyond its text: OpenAI usage's reasoning tokens
(chat completions plain and streamed with include_usage, the Responses API plain and streamed)
and Ollama's `/api/show` capabilities, from a real `localchat serve` on the tiny Qwen3 "chain"
model (greedy reply `<think>ka lo</think>mi su`: a think block of 4 tokens, tags included), hit
by the official openai and ollama clients."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import ollama
import openai
import pytest
from reasoning_fixtures import CHAIN_ANSWER, qwen3_think_model
from serve_helpers import Server, start_server, stop_server

CHAIN = "qwen3-chain"
RANDOM = "qwen3-random"
HI = [{"role": "user", "content": "hello"}]
THINK_BLOCK = 4  # <think> ka ␣lo </think>


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("serve-reasoning-usage")
    home = root / "home"
    for name, path in ((CHAIN, qwen3_think_model(chain=True)), (RANDOM, qwen3_think_model())):
        (home / "models" / name).mkdir(parents=True)
        (home / "models" / name / "q0f32").symlink_to(path, target_is_directory=True)
    server = start_server(home, root / "server.log", "--model", CHAIN)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def oai(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def test_chat_usage_counts_the_think_block(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(model=CHAIN, messages=HI, temperature=0)
    assert reply.choices[0].message.content == CHAIN_ANSWER
    usage = reply.usage
    assert usage.completion_tokens_details.reasoning_tokens == THINK_BLOCK
    assert usage.completion_tokens > THINK_BLOCK  # the answer's tokens are not reasoning
    chunks = list(oai.chat.completions.create(model=CHAIN, messages=HI, temperature=0,
                                              stream=True,
                                              stream_options={"include_usage": True}))
    assert [c.usage is not None for c in chunks].count(True) == 1
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == THINK_BLOCK
    assert chunks[-1].usage.completion_tokens == usage.completion_tokens
    # a reply without a think block (a grammar keeps it out): no reasoning tokens
    plain = oai.chat.completions.create(
        model=RANDOM, messages=HI, temperature=0, max_tokens=12,
        response_format={"type": "grammar", "grammar": "start: /[a-z]{2,6}/\n"})  # type: ignore
    assert plain.usage.completion_tokens > 0
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0


def test_responses_usage_counts_the_think_block(oai: openai.OpenAI) -> None:
    response = oai.responses.create(model=CHAIN, input="hello", temperature=0)
    assert response.usage.output_tokens_details.reasoning_tokens == THINK_BLOCK
    assert response.usage.output_tokens > THINK_BLOCK
    events = list(oai.responses.create(model=CHAIN, input="hello", temperature=0, stream=True))
    done = [e for e in events if e.type == "response.completed"]
    assert done[0].response.usage.output_tokens_details.reasoning_tokens == THINK_BLOCK


def test_ollama_show_capabilities(srv: Server) -> None:
    client = ollama.Client(host=srv.url, timeout=120)
    # CHAIN is loaded (its engine answers), RANDOM is read from its files
    for name in (CHAIN, RANDOM):
        caps = client.show(name).capabilities
        assert caps == ["completion", "tools", "thinking"], name


def _model_dir(root: Path, config: dict, tokenizer: dict | None = None) -> Path:
    root.mkdir()
    (root / "localchat-config.json").write_text(json.dumps(config))
    if tokenizer is not None:
        (root / "tokenizer.json").write_text(json.dumps(tokenizer))
    return root


def test_capabilities_of_models_that_do_not_think(tmp_path: Path) -> None:
    """A plain chat template: completion only; one that renders tools: tools too; think tags
    as tokens of the vocabulary: thinking (as the engine's ThinkTags decides); an embedding
    model: embedding only."""
    from localchat.server.ollama_api import capabilities

    plain = _model_dir(tmp_path / "plain", {"template": "chatml"})
    assert capabilities(plain, {"template": "chatml"}, None) == ["completion"]
    tags = {"added_tokens": [{"id": 5, "content": "<think>"}, {"id": 6, "content": "</think>"}],
            "model": {"vocab": {}}}
    tagged = _model_dir(tmp_path / "tagged", {"template": "chatml"}, tags)
    assert capabilities(tagged, {"template": "chatml"}, None) == ["completion", "thinking"]
    half = _model_dir(tmp_path / "half", {"template": "chatml"},
                      {"added_tokens": [{"id": 5, "content": "<think>"}]})
    assert capabilities(half, {"template": "chatml"}, None) == ["completion"]
    tools = qwen3_think_model()  # Qwen3's own template: tools and think blocks
    config = json.loads((tools / "localchat-config.json").read_text())
    assert capabilities(tools, config, None) == ["completion", "tools", "thinking"]
    embedding = {"template": "chatml", "embedding": {"pooling": "mean"}}
    assert capabilities(_model_dir(tmp_path / "emb", embedding), embedding, None) == [
        "embedding"]
