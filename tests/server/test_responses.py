"""The OpenAI Responses API of `localchat serve` (/v1/responses), through the official `openai`
client against a real server: plain and streamed text, JSON Schema output, function calls,
multi-turn with previous_response_id, the store, and errors."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from serve_helpers import KEYED_SERVER_KEY, MODEL, MODEL_REF, Server
from test_server_structured import TOOL_MODEL, WEATHER

from localchat.server.responses_api import ResponseStore

KEY = KEYED_SERVER_KEY
QUESTION = "Name three colours."
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}
FN = WEATHER["function"]
WEATHER_TOOL = {"type": "function", "name": FN["name"], "description": FN["description"],
                "parameters": FN["parameters"]}


@pytest.fixture(scope="module")
def srv(keyed_server: Server) -> Server:
    return keyed_server  # shared with the other keyed tests (tests/server/conftest.py)


@pytest.fixture(scope="module")
def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def count(srv: Server, messages: list[dict]) -> int:
    r = httpx.post(f"{srv.url}/tokenize", json={"model": MODEL, "messages": messages},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_plain_response_matches_chat_completions(client: openai.OpenAI, srv: Server) -> None:
    r = client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                max_output_tokens=8)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert r.output_text and item.content[0].type == "output_text"
    assert r.usage.input_tokens == count(srv, [{"role": "user", "content": QUESTION}])
    assert 0 < r.usage.output_tokens <= 8
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.usage.output_tokens == 8:
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    # the same engine request as chat completions: the same greedy text
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8,
                                          messages=[{"role": "user", "content": QUESTION}])
    assert r.output_text == chat.choices[0].message.content
    # instructions are a system message; input items with text parts; either model spelling
    items = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    steered = client.responses.create(model=MODEL_REF, input=items, instructions="Be brief.",
                                      temperature=0, max_output_tokens=8)
    assert steered.model == MODEL_REF
    assert steered.usage.input_tokens == count(srv, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])
    assert steered.instructions == "Be brief." and steered.temperature == 0


def test_streamed_deltas_join_to_the_final_text(client: openai.OpenAI, srv: Server) -> None:
    whole = client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                    max_output_tokens=12)
    events = list(client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                          max_output_tokens=12, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         "response.output_text.delta"]
    ending = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", ending]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 2
    final = events[-1].response
    assert "".join(deltas) == final.output_text == whole.output_text == events[-4].text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    assert len({e.item_id for e in events if hasattr(e, "item_id")}) == 1
    # on the wire: each event's `event:` line names the type its data carries
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/responses", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert len(lines) % 2 == 0 and len(lines) >= 2 * 9
    for name, data in zip(lines[::2], lines[1::2], strict=True):
        assert json.loads(data.removeprefix("data: "))["type"] == name.removeprefix("event: ")


def test_json_schema_output_validates(client: openai.OpenAI) -> None:
    fmt = {"format": {"type": "json_schema", "name": "flag", "schema": FLAG, "strict": True}}
    r = client.responses.create(model=MODEL, input="Is the sky blue? Answer in JSON.",
                                text=fmt, temperature=0, max_output_tokens=16)
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), FLAG)
    assert r.text.format.type == "json_schema"
    streamed = client.responses.create(model=MODEL, input="Is grass green? JSON please.",
                                       text=fmt, temperature=0.7, max_output_tokens=16,
                                       stream=True)
    final = [e for e in streamed if e.type == "response.completed"][0].response
    jsonschema.validate(json.loads(final.output_text), FLAG)


def test_required_function_call_and_its_output(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.responses.create(model=TOOL_MODEL, input=ask, tools=[WEATHER_TOOL],
                                tool_choice="required", temperature=0, max_output_tokens=48)
    assert r.status == "completed"
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), FN["parameters"])
    # streamed: the same call, its arguments in the typed events
    events = list(client.responses.create(model=TOOL_MODEL, input=ask, tools=[WEATHER_TOOL],
                                          tool_choice="required", temperature=0,
                                          max_output_tokens=48, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == call.arguments
    assert not [e for e in events if e.type == "response.output_text.delta"]
    # the call and its output go back as input items; the model answers in text
    follow = [*ask, r.output[0].model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id,
               "output": '{"temperature": 21}'}]
    answer = client.responses.create(model=TOOL_MODEL, input=follow, tools=[WEATHER_TOOL],
                                     tool_choice="none", temperature=0, max_output_tokens=12)
    assert answer.output[0].type == "message" and answer.output_text
    assert answer.usage.input_tokens > r.usage.input_tokens + 20


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI,
                                                         srv: Server) -> None:
    first = client.responses.create(model=MODEL, input="My name is Ann.", temperature=0,
                                    max_output_tokens=8)
    second = client.responses.create(model=MODEL, input="What is my name?", temperature=0,
                                     max_output_tokens=8, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # exactly the two turns, rendered as one conversation
    assert second.usage.input_tokens == count(srv, [
        {"role": "user", "content": "My name is Ann."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    # stored: retrieved as returned, then deleted
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="Again?", max_output_tokens=8,
                                previous_response_id=first.id)
    assert info.value.body["param"] == "previous_response_id"
    # store: false keeps nothing
    unstored = client.responses.create(model=MODEL, input="Hi.", store=False,
                                       max_output_tokens=8)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_errors_are_the_clients_exceptions(client: openai.OpenAI, srv: Server) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="no-such-model", input=QUESTION, max_output_tokens=8)
    assert info.value.body["code"] == "model_not_found"
    cases = [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image",
                                                   "image_url": "http://x/y.png"}]}]},
         "input[0].content[0].type"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"temperature": 3}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"tools": [WEATHER_TOOL]}, "tools"),  # SmolLM2's own template renders no tools
        ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ]
    for extra, param in cases:
        body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 8, **extra}
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(**body)
        assert info.value.body["param"] == param, info.value.body
        assert info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/responses", body={"model": MODEL}, cast_to=object)
    assert info.value.body["param"] == "input"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).responses.create(
            model=MODEL, input=QUESTION, max_output_tokens=8)


def test_store_keeps_the_newest_within_its_bounds() -> None:
    def body(i: int, text: str = "x") -> dict:
        return {"id": f"resp_{i}", "output": text}

    store = ResponseStore(max_items=3, max_bytes=10_000)
    for i in range(5):
        store.put(body(i), [{"role": "user", "content": str(i)}])
    assert len(store) == 3 and store.get("resp_0") is None and store.get("resp_4") is not None
    store.get("resp_2")  # used: now the newest
    store.put(body(5), [])
    assert store.get("resp_3") is None and store.get("resp_2") is not None
    big = ResponseStore(max_items=100, max_bytes=1_000)
    big.put(body(0, "y" * 300), [])
    each = big.bytes
    for i in range(1, 10):
        big.put(body(i, "y" * 300), [])
    assert big.bytes <= 1_000 and len(big) == 1_000 // each < 10
    assert big.get("resp_9") is not None and big.get("resp_0") is None
    big.put(body(99, "z" * 2_000), [])  # bigger than the whole budget: not kept
    assert big.get("resp_99") is None and len(big) == 1_000 // each
    assert big.delete("resp_9") and not big.delete("resp_9")


def test_stored_response_routes_have_their_own_metrics_label() -> None:
    from localchat.server.app import route_label

    assert route_label("/v1/responses/resp_abc") == "/v1/responses/{id}"
    assert route_label("/v1/responses") == "/v1/responses"
    assert route_label("/v1/nowhere") == "other"
