"""gpt-oss calls tools in OpenAI's harmony format (a message to `functions.<name>`), which the
engine keeps out of the reply's text (`Reply.tool_calls`); the server returns those calls as
OpenAI `tool_calls`, Anthropic `tool_use` blocks and Ollama `tool_calls`.

Through a real `localchat serve` and the official clients, with a tiny random gpt-oss whose
tokenizer has the harmony markers and whose template renders tools as gpt-oss's does
(tests/harmony_chat_fixtures.py). A random model calls nothing of itself, so the calls here are
forced (a named function, "required", Anthropic's "tool"): the grammar over the harmony special
tokens opens the reply with the call, and the arguments must meet the function's schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from serve_helpers import Server, home_of, openai_client, start_server, stop_server

from localchat.engine.harmony import HarmonyCall
from localchat.server.tools import (
    call_format,
    check_tools,
    harmony_tool_calls,
    parse_calls,
    streamable,
)

from harmony_chat_fixtures import COUNT, PICK, harmony_chat_model

MODEL = "gpt-oss-tiny"
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (PICK, COUNT)}
QUESTION = [{"role": "user", "content": "Which side?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("serve-harmony")
    server = start_server(home_of(root, {MODEL: harmony_chat_model()}), root / "server.log")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def oai(srv: Server) -> openai.OpenAI:
    return openai_client(srv)


def check_call(name: str, arguments: str | dict[str, Any]) -> None:
    """A call to a known function whose arguments meet its schema."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert name in SCHEMAS, name
    jsonschema.validate(args, SCHEMAS[name])


def no_harmony_text(text: str | None) -> None:
    assert not text or ("<|" not in text and "functions." not in text), text


def test_a_named_function_is_called(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[PICK, COUNT], temperature=0,  # type: ignore
        tool_choice={"type": "function", "function": {"name": "pick"}}, max_tokens=120)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "pick" and call.id.startswith("call_")
    check_call("pick", call.function.arguments)
    no_harmony_text(choice.message.content)


def test_required_streams_one_call(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[PICK, COUNT], tool_choice="required",  # type: ignore
        temperature=0, max_tokens=120, stream=True)
    calls: list[Any] = []
    content, reasons = "", []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls"
    (call,) = calls
    check_call(call.function.name, call.function.arguments)
    no_harmony_text(content)


def test_a_call_and_its_result_go_back_to_the_model(oai: openai.OpenAI) -> None:
    """The history renders through the template (the call as a message to functions.pick, its
    result from functions.pick); the next reply is plain text or another call, no headers."""
    messages = [*QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "pick", "arguments": '{"side": "left"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "left it is"}]
    reply = oai.chat.completions.create(model=MODEL, messages=messages,  # type: ignore
                                        tools=[PICK], temperature=0, max_tokens=8)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    no_harmony_text(choice.message.content)
    for call in choice.message.tool_calls or []:
        check_call(call.function.name, call.function.arguments)


def test_anthropic_tool_use(srv: Server) -> None:
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0,
                                 timeout=300)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in (PICK, COUNT)]
    message = client.messages.create(model=MODEL, max_tokens=120, tools=tools,  # type: ignore
                                     tool_choice={"type": "tool", "name": "count"},
                                     messages=QUESTION)  # type: ignore
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "count"
    check_call("count", use.input)  # type: ignore[arg-type]


# -- the server's reading of harmony calls, piece by piece ----------------------------------
TOOLS = check_tools([PICK, COUNT])


def test_calls_openai_can_return() -> None:
    calls = [
        HarmonyCall("functions.pick", "commentary", "json", '{"side": "left"}', True),
        HarmonyCall("functions.pick", "commentary", "json", '{"side": "ri', False),  # cut
        HarmonyCall("functions.unknown", "commentary", "json", "{}", True),
        HarmonyCall("browser.search", "commentary", None, '{"q": "x"}', True),  # not ours
        HarmonyCall("functions.count", "commentary", "json", "not json", True),
        HarmonyCall("functions.count", "commentary", "json", "[1]", True),  # not an object
        HarmonyCall("functions.count", "commentary", "json", '{"n": 2}', True),
    ]
    found = harmony_tool_calls(calls, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in found] == [
        ("pick", {"side": "left"}), ("count", {"n": 2})]
    assert len({c.id for c in found}) == 2
    content, parsed = parse_calls(" Let me check. ", "harmony", TOOLS, calls[:1])
    assert content == "Let me check." and [c.name for c in parsed] == ["pick"]
    assert parse_calls("answer", "harmony", TOOLS, calls[1:3]) == ("answer", [])


def test_harmony_text_is_never_held_and_auto_is_unconstrained() -> None:
    text = 'Sure: <tool_call>\n{"name": "pick"'  # another family's call syntax: plain text
    assert streamable(text, "harmony") == len(text)
    assert call_format("harmony", "auto", TOOLS) is None
    grammar = call_format("harmony", "required", TOOLS)
    assert grammar is not None and grammar["type"] == "grammar"
    assert "<|constrain|>" in grammar["grammar"] and '"count"' in grammar["grammar"]
