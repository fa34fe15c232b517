"""Structured output and tool calling through `localchat serve`: response_format on the OpenAI
routes, Ollama's `format`, and tools/tool_choice (a round trip with the official `openai`
client) on SmolLM2's weights served under a Qwen2.5-style tool-capable chat template."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import ollama
import openai
import pytest
from serve_helpers import MODEL, Server, make_home, start_server, stop_server

from localchat import model_dir as md

from fixtures import converted, smollm2_hf_dir

TOOL_MODEL = "smollm2-tools"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "pets": {"type": "array", "maxItems": 2, "items": {"enum": ["cat", "dog"]}}},
    "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]

# Qwen2.5-Instruct's chat template (tools rendered in the system prompt, calls in <tool_call>).
QWEN25_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def tool_model_dir(root: Path) -> Path:
    """SmolLM2's converted model with the Qwen2.5 template in place of its own (links to the
    weights; the manifest records the new template)."""
    source = converted(smollm2_hf_dir(), "q0f32")
    out = root / "models" / TOOL_MODEL / "q0f32"
    out.mkdir(parents=True)
    for item in source.iterdir():
        if item.name not in ("chat_template.jinja", md.MANIFEST_FILE) and item.is_file():
            (out / item.name).symlink_to(item)
    (out / "chat_template.jinja").write_text(QWEN25_TEMPLATE, encoding="utf-8")
    manifest = json.loads((source / md.MANIFEST_FILE).read_text(encoding="utf-8"))
    manifest["files"]["chat_template.jinja"] = md.file_record(out / "chat_template.jinja")
    manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith("lib/")}
    (out / md.MANIFEST_FILE).write_text(json.dumps(manifest), encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with SmolLM2 under its own template and under the tool template, both loaded."""
    home = make_home(tmp_path_factory.mktemp("structured"))
    tool_model_dir(home)
    log = tmp_path_factory.mktemp("structured-log") / "server.log"
    server = start_server(home, log, "--model", MODEL, "--model", TOOL_MODEL,
                          "--max-models", "2", "--max-concurrency", "8")
    yield server
    stop_server(server)
    shutil.rmtree(home / "models" / TOOL_MODEL, ignore_errors=True)


@pytest.fixture(scope="module")
def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}


def check_person(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


def test_chat_json_schema_choices_validate(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person as JSON."}],
        response_format=schema_format(PERSON), temperature=0.8, seed=3, n=4, max_tokens=48)
    stopped = [c for c in reply.choices if c.finish_reason == "stop"]
    assert len(stopped) >= 3, [c.message.content for c in reply.choices]
    for choice in stopped:
        check_person(choice.message.content)
    for choice in reply.choices:
        assert choice.message.content.startswith("{")
        assert choice.message.tool_calls is None


def test_streamed_json_mode_is_an_object(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A cat as JSON."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=60, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and
               c.choices[0].finish_reason]
    assert reasons in (["stop"], ["length"])
    if reasons == ["stop"]:
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


def test_text_completion_takes_a_response_format(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt="A person record: ", max_tokens=48, temperature=0.7, seed=1, n=3,
        extra_body={"response_format": schema_format(PERSON)})
    assert any(c.finish_reason == "stop" for c in reply.choices)
    for choice in reply.choices:
        if choice.finish_reason == "stop":
            check_person(choice.text)


def test_bad_formats_are_400_naming_the_parameter(srv: Server) -> None:
    def post(**body: object) -> httpx.Response:
        return httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": ASK_WEATHER, "max_tokens": 4, **body})

    cases = [
        (post(response_format={"type": "json_schema"}), "response_format", "json_schema"),
        (post(response_format=schema_format({"type": "no-such-type"})), "response_format",
         "does not compile"),
        (post(response_format={"type": "grammar", "grammar": "root ::= nope"}),
         "response_format", "does not compile"),
        (post(response_format={"type": "xml"}), "response_format.type", "json_schema"),
        (post(tools=[WEATHER]), "tools", "cannot call tools"),
    ]
    for r, param, words in cases:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], error
        assert error["type"] == "invalid_request_error" and "Traceback" not in r.text
    # a grammar (our extension of response_format) holds on the API too
    r = post(response_format={"type": "grammar", "grammar": 'root ::= "yes" | "no"'},
             max_tokens=4)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_tool_errors_are_400(srv: Server) -> None:
    def post(**body: object) -> httpx.Response:
        return httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
            "model": TOOL_MODEL, "messages": ASK_WEATHER, "max_tokens": 4, **body})

    cases = [
        (post(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice"),
        (post(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
        (post(tool_choice="required"), "tool_choice"),
        (post(tools=[{"type": "retrieval"}]), "tools[0]"),
        (post(tools=[WEATHER, WEATHER]), "tools[1].function.name"),
        (post(tools=[WEATHER], response_format={"type": "json_object"}), "response_format"),
    ]
    for r, param in cases:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.json()


def test_tool_call_round_trip(client: openai.OpenAI) -> None:
    tools = [WEATHER, TIME]
    plain = client.chat.completions.create(model=TOOL_MODEL, messages=ASK_WEATHER,
                                           max_tokens=1, temperature=0)
    forced = client.chat.completions.create(
        model=TOOL_MODEL, messages=ASK_WEATHER, tools=tools, temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    # the template rendered the two tool definitions into the prompt
    assert forced.usage.prompt_tokens > plain.usage.prompt_tokens + 60
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    # the call and its result go back; the model answers in text
    follow = [*ASK_WEATHER, choice.message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = client.chat.completions.create(model=TOOL_MODEL, messages=follow, tools=tools,
                                            tool_choice="none", temperature=0, max_tokens=24)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    assert answer.usage.prompt_tokens > forced.usage.prompt_tokens + 20


def test_required_and_auto_calls_are_valid(client: openai.OpenAI) -> None:
    tools = [WEATHER, TIME]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    required = client.chat.completions.create(
        model=TOOL_MODEL, messages=[{"role": "user", "content": "What time is it in Oslo?"}],
        tools=tools, tool_choice="required", temperature=0.8, seed=2, n=2, max_tokens=48)
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls", choice
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    auto = client.chat.completions.create(model=TOOL_MODEL, messages=ASK_WEATHER, tools=tools,
                                          temperature=0.8, seed=4, n=2, max_tokens=40)
    for choice in auto.choices:  # the model decides: a valid call, or text without a call tag
        if choice.finish_reason == "tool_calls":
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments),
                                    schemas[call.function.name])
        else:
            assert "<tool_call>" not in (choice.message.content or "")


def test_streamed_tool_call(client: openai.OpenAI, srv: Server) -> None:
    stream = client.chat.completions.create(
        model=TOOL_MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
        temperature=0, max_tokens=60, stream=True)
    names, args, ids, reasons = "", "", set(), []
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                assert delta.index == 0
                ids.add(delta.id)
                names += delta.function.name or ""
                args += delta.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert reasons == ["tool_calls"] and names == "get_weather" and len(ids) == 1
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    whole = client.chat.completions.create(
        model=TOOL_MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
        temperature=0, max_tokens=60)
    assert whole.choices[0].message.tool_calls[0].function.arguments == args
    # tool_choice "auto" and a text answer: the text streams as it comes
    hello = [{"role": "user", "content": "Say hello to Ann."}]
    text = client.chat.completions.create(model=TOOL_MODEL, messages=hello, tools=[WEATHER],
                                          temperature=0, max_tokens=12)
    assert text.choices[0].finish_reason == "length", text.choices[0]
    pieces = [c.choices[0].delta.content for c in client.chat.completions.create(
        model=TOOL_MODEL, messages=hello, tools=[WEATHER], temperature=0, max_tokens=12,
        stream=True) if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 3 and "".join(pieces) == text.choices[0].message.content


def test_ollama_format_json_and_schema(srv: Server) -> None:
    client = ollama.Client(host=srv.url, timeout=120)
    opts = {"temperature": 0.8, "seed": 5, "num_predict": 60}
    reply = client.chat(model=MODEL, messages=[{"role": "user", "content": "A person, JSON."}],
                        format=PERSON, options=opts)
    assert reply.done_reason == "stop", reply.message.content
    check_person(reply.message.content)
    reply = client.generate(model=MODEL, prompt="A dog as JSON.", format="json",
                            options={"temperature": 0, "num_predict": 60})
    if reply.done_reason == "stop":
        assert isinstance(json.loads(reply.response), dict)
    else:
        assert reply.response.startswith("{")
    parts = list(client.chat(model=MODEL, messages=[{"role": "user", "content": "JSON!"}],
                             format=PERSON, options=opts, stream=True))
    text = "".join(p.message.content or "" for p in parts)
    assert parts[-1].done
    if parts[-1].done_reason == "stop":
        check_person(text)
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model=MODEL, messages=ASK_WEATHER, format={"type": "no-such-type"})
    assert info.value.status_code == 400 and "format: the JSON schema does not compile" in str(
        info.value.error)
    r = httpx.post(f"{srv.url}/api/generate", timeout=60,
                   json={"model": MODEL, "prompt": "hi", "format": "xml"})
    assert r.status_code == 400 and "format must be" in r.json()["error"]


# -- tools on Ollama's /api/chat ----------------------------------------------------------------
def _ollama_calls(message: ollama.Message) -> list[tuple[str, dict]]:
    return [(c.function.name, dict(c.function.arguments)) for c in message.tool_calls or ()]


def test_ollama_chat_tools_streamed_and_not(srv: Server) -> None:
    client = ollama.Client(host=srv.url, timeout=120)
    opts = {"temperature": 0, "num_predict": 60}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    # the second one makes SmolLM2 call: two earlier calls in the conversation show it how
    def weather_call(city: str) -> dict:
        return {"role": "assistant", "content": "", "tool_calls": [{"function": {
            "name": "get_weather", "arguments": {"city": city, "unit": "celsius"}}}]}

    two_shots = [{"role": "user", "content": "Weather in Paris?"}, weather_call("Paris"),
                 {"role": "user", "content": "Weather in Rome?"}, weather_call("Rome"),
                 {"role": "user", "content": "Weather in Oslo?"}]
    asks = [ASK_WEATHER, two_shots, [{"role": "user", "content": "Say hello to Ann."}]]
    called = 0
    for messages in asks:
        whole = client.chat(model=TOOL_MODEL, messages=messages, tools=[WEATHER, TIME],
                            options=opts)
        calls = _ollama_calls(whole.message)
        for name, args in calls:  # a call is valid under its function's schema
            jsonschema.validate(args, schemas[name])
        if not calls:
            assert "<tool_call>" not in whole.message.content
        called += bool(calls)
        content, streamed = "", []
        for part in client.chat(model=TOOL_MODEL, messages=messages, tools=[WEATHER, TIME],
                                options=opts, stream=True):
            content += part.message.content or ""
            streamed += _ollama_calls(part.message)
        assert (content.strip(), streamed) == (whole.message.content.strip(), calls)
    assert called, "no prompt led to a call: the test proves nothing about calls"


def test_ollama_tool_results_go_back_to_the_model(srv: Server) -> None:
    client = ollama.Client(host=srv.url, timeout=120)
    opts = {"temperature": 0, "num_predict": 16}
    follow = [*ASK_WEATHER,
              {"role": "assistant", "content": "", "tool_calls": [{"function": {
                  "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
              {"role": "tool", "content": '{"temperature": 21}', "tool_name": "get_weather"}]
    answer = client.chat(model=TOOL_MODEL, messages=follow, tools=[WEATHER], options=opts)
    # SmolLM2 echoes the result it was given: the call and the result were rendered
    assert answer.done and answer.message.role == "assistant"
    assert "21" in answer.message.content, answer.message


def test_ollama_tool_errors(srv: Server) -> None:
    cases = [
        ({"model": MODEL, "messages": ASK_WEATHER, "tools": [WEATHER]}, "does not support tools"),
        ({"model": TOOL_MODEL, "messages": ASK_WEATHER, "tools": [WEATHER], "format": "json"},
         "format cannot be combined with tools"),
        ({"model": TOOL_MODEL, "messages": ASK_WEATHER, "tools": [{"type": "retrieval"}]},
         "tools[0]"),
        ({"model": TOOL_MODEL, "messages": [{"role": "user", "content": "x",
                                             "tool_calls": [{"function": {"name": "f"}}]}]},
         "only assistant messages have tool_calls"),
        ({"model": TOOL_MODEL, "messages": [{"role": "assistant", "content": "",
                                             "tool_calls": ["f"]}]}, "tool_calls[0]"),
    ]
    for body, message in cases:
        r = httpx.post(f"{srv.url}/api/chat", json={**body, "stream": False}, timeout=60)
        assert r.status_code == 400, r.text
        assert message in r.json()["error"], r.json()
    assert httpx.get(f"{srv.url}/api/version", timeout=10).status_code == 200
