"""A reasoning model's thinking through the APIs: a real `localchat serve` on the tiny Qwen3
"chain" model (its greedy reply to any chat is `<think>ka lo</think>mi su`) and on the same
tokenizer with random weights under a grammar, hit by the official openai, ollama and anthropic
clients, plain and streamed."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import ollama
import openai
import pytest
from reasoning_fixtures import CHAIN_ANSWER, CHAIN_THINKING, qwen3_think_model, think_grammar
from serve_helpers import Server, start_server, stop_server

CHAIN = "qwen3-chain"  # the store names the server knows
RANDOM = "qwen3-random"
HI = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("serve-reasoning")
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


def test_openai_reasoning_content(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(model=CHAIN, messages=HI, temperature=0)
    message = reply.choices[0].message
    assert message.content == CHAIN_ANSWER
    assert message.model_extra["reasoning_content"] == CHAIN_THINKING
    thinking, answer = "", ""
    saw_thinking_before_answer = False
    for chunk in oai.chat.completions.create(model=CHAIN, messages=HI, temperature=0,
                                             stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        piece = (delta.model_extra or {}).get("reasoning_content")
        if piece:
            assert not answer  # all thinking comes before the answer
            thinking += piece
            saw_thinking_before_answer = True
        answer += delta.content or ""
    assert saw_thinking_before_answer
    assert (thinking, answer) == (CHAIN_THINKING, CHAIN_ANSWER)


def test_openai_grammar_forced_thinking_on_a_random_model(oai: openai.OpenAI) -> None:
    ids = (999, 1000)  # <think> and </think> in the tiny tokenizer (VOCAB - 2, VOCAB - 1)
    fmt = think_grammar(ids=ids)
    plain = oai.chat.completions.create(model=RANDOM, messages=HI, temperature=0, max_tokens=40,
                                        response_format=fmt)  # type: ignore[arg-type]
    message = plain.choices[0].message
    thinking = message.model_extra["reasoning_content"]
    assert thinking and message.content and "think>" not in thinking + message.content
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in oai.chat.completions.create(model=RANDOM, messages=HI, temperature=0,
                                             max_tokens=40, response_format=fmt,  # type: ignore
                                             stream=True):
        for choice in chunk.choices:
            streamed["reasoning_content"] += (choice.delta.model_extra or {}).get(
                "reasoning_content") or ""
            streamed["content"] += choice.delta.content or ""
    assert streamed == {"reasoning_content": thinking, "content": message.content}


def test_openai_thinking_switch_reaches_the_template(oai: openai.OpenAI, srv: Server) -> None:
    # the chain model thinks even with thinking off; the prompt is what the switch changes
    usage = {}
    for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}}, {"think": False}):
        reply = oai.chat.completions.create(model=CHAIN, messages=HI, temperature=0,
                                            extra_body=extra)
        usage[str(extra)] = reply.usage.prompt_tokens
    on, off_vllm, off = usage.values()
    assert off_vllm == off > on  # `<think>\n\n</think>\n\n` added to the prompt
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=CHAIN, messages=HI,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": 1}})
    assert info.value.body["param"] == "chat_template_kwargs"
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
        "model": CHAIN, "messages": HI, "think": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "think"


def test_ollama_thinking(srv: Server) -> None:
    client = ollama.Client(host=srv.url, timeout=120)
    reply = client.chat(model=CHAIN, messages=HI, think=True, options={"temperature": 0})
    assert reply.message.thinking == CHAIN_THINKING
    assert reply.message.content == CHAIN_ANSWER
    thinking, answer = "", ""
    for part in client.chat(model=CHAIN, messages=HI, think=True, stream=True,
                            options={"temperature": 0}):
        if part.message.thinking:
            assert not answer
            thinking += part.message.thinking
        answer += part.message.content or ""
    assert (thinking, answer) == (CHAIN_THINKING, CHAIN_ANSWER)
    generated = client.generate(model=CHAIN, prompt="hello", think=True,
                                options={"temperature": 0})
    assert (generated.thinking, generated.response) == (CHAIN_THINKING, CHAIN_ANSWER)
    thinking = "".join(p.thinking or "" for p in client.generate(
        model=CHAIN, prompt="hello", think=True, stream=True, options={"temperature": 0}))
    assert thinking == CHAIN_THINKING
    # think=False reaches the template (the prompt grows by the empty think block)
    on = client.chat(model=CHAIN, messages=HI, options={"temperature": 0})
    off = client.chat(model=CHAIN, messages=HI, think=False, options={"temperature": 0})
    assert off.prompt_eval_count > on.prompt_eval_count


def test_responses_and_messages(oai: openai.OpenAI, srv: Server) -> None:
    response = oai.responses.create(model=CHAIN, input="hello", temperature=0)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    assert response.output[0].summary[0].text == CHAIN_THINKING
    assert response.output_text == CHAIN_ANSWER
    events = list(oai.responses.create(model=CHAIN, input="hello", temperature=0, stream=True))
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.type for e in done] == ["reasoning", "message"]
    assert [e.output_index for e in done] == [0, 1]
    assert done[0].item.summary[0].text == CHAIN_THINKING
    claude = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    message = claude.messages.create(model=CHAIN, max_tokens=32, messages=HI,
                                     thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == CHAIN_THINKING
    assert message.content[1].text == CHAIN_ANSWER
    with claude.messages.stream(model=CHAIN, max_tokens=32, messages=HI) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == CHAIN_THINKING


def test_client_sends_thinking_back(oai: openai.OpenAI, srv: Server) -> None:
    history = [*HI, {"role": "assistant", "content": CHAIN_ANSWER,
                     "reasoning_content": CHAIN_THINKING}, {"role": "user", "content": "again"}]
    reply = oai.chat.completions.create(model=CHAIN, messages=history,  # type: ignore[arg-type]
                                        temperature=0)
    assert reply.choices[0].message.content == CHAIN_ANSWER
    client = ollama.Client(host=srv.url, timeout=120)
    back = [*HI, {"role": "assistant", "content": CHAIN_ANSWER, "thinking": CHAIN_THINKING},
            {"role": "user", "content": "again"}]
    assert client.chat(model=CHAIN, messages=back, options={"temperature": 0}
                       ).message.content == CHAIN_ANSWER
