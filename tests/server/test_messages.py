"""The Anthropic Messages API of `localchat serve` (/v1/messages, /v1/messages/count_tokens),
through the official `anthropic` client against a real server: plain and streamed text, a
system prompt, stop sequences, tool use and tool results, token counting, the API key in
`x-api-key`, and errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from serve_helpers import KEYED_SERVER_KEY, MODEL, MODEL_REF, Server
from test_server_structured import TOOL_MODEL, WEATHER

KEY = KEYED_SERVER_KEY
HELLO = [{"role": "user", "content": "Name three colours."}]
FN = WEATHER["function"]
WEATHER_TOOL = {"name": FN["name"], "description": FN["description"],
                "input_schema": FN["parameters"]}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
# this client has no sampling arguments (newer Claude models fix them); the API still takes them
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def srv(keyed_server: Server) -> Server:
    return keyed_server  # shared with the other keyed tests (tests/server/conftest.py)


@pytest.fixture(scope="module")
def client(srv: Server) -> anthropic.Anthropic:
    # the client sends the key as x-api-key
    return anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=120)


def test_plain_message_matches_chat_completions(client: anthropic.Anthropic,
                                                srv: Server) -> None:
    m = client.messages.create(model=MODEL, max_tokens=8, **GREEDY, messages=HELLO)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == MODEL
    (block,) = m.content
    assert block.type == "text" and block.text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert 0 < m.usage.output_tokens <= 8
    assert (m.stop_reason == "max_tokens") == (m.usage.output_tokens == 8)
    counted = client.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == counted
    # the same engine request as chat completions (a Bearer key works too): the same text
    chat = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0)
    reply = chat.chat.completions.create(model=MODEL, messages=HELLO, temperature=0,
                                         max_tokens=8)
    assert block.text == reply.choices[0].message.content
    assert counted == reply.usage.prompt_tokens


def test_system_prompt_and_text_blocks(client: anthropic.Anthropic) -> None:
    blocks = [{"role": "user", "content": [{"type": "text", "text": "Name three colours."}]}]
    a = client.messages.create(model=MODEL_REF, max_tokens=8, **GREEDY,
                               system="Answer briefly.", messages=blocks)
    b = client.messages.create(model=MODEL, max_tokens=8, **GREEDY,
                               system=[{"type": "text", "text": "Answer briefly."}],
                               messages=HELLO)
    plain = client.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens
    steered = client.messages.count_tokens(model=MODEL, messages=HELLO,
                                           system="Answer briefly.").input_tokens
    assert a.model == MODEL_REF and a.content[0].text == b.content[0].text
    assert steered != plain  # the system prompt replaced the template's default one
    assert a.usage.input_tokens + (a.usage.cache_read_input_tokens or 0) == steered


def test_streamed_message_equals_the_plain_one(client: anthropic.Anthropic,
                                               srv: Server) -> None:
    whole = client.messages.create(model=MODEL, max_tokens=12, **GREEDY, messages=HELLO)
    with client.messages.stream(model=MODEL, max_tokens=12, **GREEDY,
                                messages=HELLO) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 2 and "".join(pieces) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # the raw events, in Anthropic's order, each named by its `event:` line
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "messages": HELLO,
            "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/messages", json=body, timeout=120,
                      headers={"x-api-key": KEY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[::2]]
    data = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert [d["type"] for d in data] == names
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert data[-2]["delta"]["stop_reason"] == "max_tokens"
    assert data[-2]["usage"]["output_tokens"] == 6


def test_stop_sequences(client: anthropic.Anthropic) -> None:
    full = client.messages.create(model=MODEL, max_tokens=16, **GREEDY,
                                  messages=HELLO).content[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[1]
    m = client.messages.create(model=MODEL, max_tokens=16, **GREEDY, messages=HELLO,
                               stop_sequences=["zzzz", stop])
    assert m.content[0].text == full[: full.index(stop)]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop


def test_output_config_json_schema(client: anthropic.Anthropic) -> None:
    flag = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}
    m = client.messages.create(model=MODEL, max_tokens=16, **GREEDY,
                               messages=[{"role": "user", "content": "Is the sky blue? JSON."}],
                               output_config={"format": {"type": "json_schema", "schema": flag}})
    assert m.stop_reason == "end_turn", m.content
    jsonschema.validate(json.loads(m.content[0].text), flag)


def test_tool_use_and_tool_result(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model=TOOL_MODEL, max_tokens=48, **GREEDY,
                               messages=ASK_WEATHER, tools=[WEATHER_TOOL],
                               tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use"
    (use,) = m.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, FN["parameters"])
    # streamed: the same call as input_json_delta, accumulated by the client
    with client.messages.stream(model=TOOL_MODEL, max_tokens=48, **GREEDY,
                                messages=ASK_WEATHER, tools=[WEATHER_TOOL],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].input == use.input
    # the tool_use and its tool_result go back; the model answers in text
    follow = [*ASK_WEATHER, {"role": "assistant", "content": [use.model_dump()]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                            "content": '{"temperature": 21}'}]}]
    answer = client.messages.create(model=TOOL_MODEL, max_tokens=12, **GREEDY,
                                    messages=follow, tools=[WEATHER_TOOL])
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    assert answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0) == \
        client.messages.count_tokens(model=TOOL_MODEL, messages=follow,
                                     tools=[WEATHER_TOOL]).input_tokens
    assert client.messages.count_tokens(model=TOOL_MODEL, messages=ASK_WEATHER,
                                        tools=[WEATHER_TOOL]).input_tokens > \
        client.messages.count_tokens(model=TOOL_MODEL, messages=ASK_WEATHER).input_tokens + 40


def test_errors_have_anthropics_shape(client: anthropic.Anthropic, srv: Server) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:  # max_tokens is required
        client.messages.create(model=MODEL, messages=HELLO, max_tokens=anthropic.NOT_GIVEN)
    assert info.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "missing required parameter: 'max_tokens'"}}
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="no-such-model", max_tokens=8, messages=HELLO)
    assert info.value.body["error"]["type"] == "not_found_error"
    cases = [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0]"),
        ({"messages": [*HELLO, {"role": "assistant", "content": "Red,"}]}, "prefill"),
        ({"extra_body": {"temperature": 1.5}}, "temperature"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
        ({"tools": [WEATHER_TOOL]}, "cannot call tools"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
         "output_config.format: the JSON schema does not compile"),
    ]
    for extra, words in cases:
        body = {"model": MODEL, "max_tokens": 8, "messages": HELLO, **extra}
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(**body)
        error = info.value.body["error"]
        assert error["type"] == "invalid_request_error" and words in error["message"], error
    r = httpx.post(f"{srv.url}/v1/messages", headers={"x-api-key": KEY}, content=b"{",
                   timeout=30)
    assert r.status_code == 415 and r.json()["type"] == "error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=HELLO)
    r = httpx.post(f"{srv.url}/v1/messages", json={"model": MODEL}, timeout=30)
    assert r.status_code == 401  # no key at all, refused before the route: Anthropic's shape too
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
