"""The OpenAI Responses API: POST /v1/responses (plain or streamed), and GET and DELETE of a
stored response by id.

A request becomes the chat messages, function tools and sampling overrides chat completions
would send the engine (chat_run.py). Responses are kept in memory, newest last, within a
count and a byte budget, for `previous_response_id` (a later turn continues the stored
conversation) and for GET; `store: false` keeps none.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from localchat.errors import InvalidRequestError
from localchat.server import protocol as p
from localchat.server.chat_run import Finished, Params, finish_of, new_id, reply_parts, start_chat
from localchat.server.errors import APIError
from localchat.server.openai_api import SSE_HEADERS, sampling
from localchat.server.responses_events import output_items, response_events, usage
from localchat.server.state import read_body, state_of
from localchat.server.streaming import ReplyStreamingResponse, cancel_on_disconnect, prepend
from localchat.server.tools import Tool, check_tools, chosen_tools, tool_messages

router = APIRouter()
PARAMS = Params(input="input", max_tokens="max_output_tokens", response_format="text.format",
                think="reasoning")
MAX_STORED = 256
MAX_STORED_BYTES = 64 * 2**20
TEXT_PARTS = ("input_text", "output_text", "text")
# Values that ask for nothing (a client may send them); anything else is unsupported here.
NO_OP_INCLUDES = ("reasoning.encrypted_content",)


class ResponsesRequest(BaseModel):
    """The body of POST /v1/responses. Unknown fields are ignored, as OpenAI-compatible
    servers do; fields of features this server does not have are a 400 when they ask for
    one (see `unsupported`)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None


def reasoning_switch(body: ResponsesRequest) -> bool | None:
    """The thinking switch `reasoning.effort` asks for: "none" is off, another effort on (a
    reasoning model thinks as long as it thinks: the effort is not a budget); None: unset."""
    effort = (body.reasoning or {}).get("effort")
    if effort is None:
        return None
    if effort not in ("none", "minimal", "low", "medium", "high"):
        raise InvalidRequestError(f"reasoning.effort must be none, minimal, low, medium or "
                                  f"high, got {effort!r}", "reasoning")
    return effort != "none"


def unsupported(body: ResponsesRequest) -> None:
    """A 400 naming the first parameter that asks for a feature this server does not have."""
    if body.background:
        raise InvalidRequestError("background responses are not supported; leave background "
                                  "unset or false", "background")
    if body.conversation is not None:
        raise InvalidRequestError("conversations are not supported; chain turns with "
                                  "previous_response_id", "conversation")
    if body.prompt is not None:
        raise InvalidRequestError("stored prompt templates are not supported", "prompt")
    for value in body.include or ():
        if value not in NO_OP_INCLUDES:
            raise InvalidRequestError(f"include {value!r} is not supported", "include")
    if body.top_logprobs:
        raise InvalidRequestError("top_logprobs is not supported on /v1/responses (use "
                                  "/v1/chat/completions)", "top_logprobs")
    if body.max_tool_calls is not None and body.max_tool_calls < 1:
        raise InvalidRequestError(f"max_tool_calls must be at least 1, got "
                                  f"{body.max_tool_calls}", "max_tool_calls")


# -- input ---------------------------------------------------------------------------------------
def _text(content: Any, where: str) -> str:
    """The text of a message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "refusal":
            texts.append(str(part.get("refusal", "")))
            continue
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                f"{where}[{j}]: only text content (input_text) is supported, got {kind!r}",
                f"{where}[{j}].type")
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's `input` as chat messages: message items, and function calls and their
    outputs as an assistant's `tool_calls` and `tool` messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(
                    f"{where}.role must be user, assistant, system or developer, got {role!r}",
                    f"{where}.role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise InvalidRequestError(f"{where}.{key} must be a string", f"{where}.{key}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":  # one turn's calls go together
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequestError(f"{where}.call_id must be a string",
                                          f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output"), f"{where}.output")})
        else:
            raise InvalidRequestError(
                f"{where}: input items of type {kind!r} are not supported (message, "
                f"function_call and function_call_output are)", f"{where}.type")
    return out


# -- tools and text format -----------------------------------------------------------------------
def function_tools(tools: list[Any] | None) -> list[Tool]:
    """The request's function tools, checked as chat completions checks its tools."""
    chat_form = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind != "function":
            raise InvalidRequestError(
                f"tools[{i}]: tools of type {kind!r} are not supported; only function tools "
                f"(built-in tools such as web_search run on OpenAI's servers)", f"tools[{i}].type")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        chat_form.append({"type": "function", "function": fn})
    try:
        return check_tools(chat_form)
    except InvalidRequestError as exc:  # name the flat fields this API has
        param = exc.param.replace(".function", "") if exc.param else None
        raise InvalidRequestError(str(exc).replace(".function", ""), param) from None


def chat_tool_choice(choice: Any) -> Any:
    """A Responses `tool_choice` in chat completions' form."""
    if not isinstance(choice, Mapping):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise InvalidRequestError(
        f'tool_choice {{"type": {choice.get("type")!r}}} is not supported: give "none", "auto", '
        f'"required" or {{"type": "function", "name": ...}}', "tool_choice")


def text_format(text: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(engine overrides, the format echoed in the response) for the request's `text`."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return {}, {"type": "text"}
    if not isinstance(fmt, Mapping):
        raise InvalidRequestError("text.format must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return {}, dict(fmt)
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}, dict(fmt)
    if kind == "json_schema":
        if fmt.get("schema") is None:
            raise InvalidRequestError('text.format of type "json_schema" needs a "schema"',
                                      "text.format.schema")
        spec = {"name": fmt.get("name"), "schema": fmt["schema"]}
        return {"response_format": {"type": "json_schema", "json_schema": spec}}, dict(fmt)
    raise InvalidRequestError(f"text.format.type must be text, json_object or json_schema, got "
                              f"{kind!r}", "text.format.type")


# -- the store -----------------------------------------------------------------------------------
@dataclass
class Stored:
    """A stored response: its body, and the conversation through its output (without its
    instructions, which a later turn does not inherit)."""

    body: dict[str, Any]
    history: list[dict[str, Any]]
    size: int


class ResponseStore:
    """The latest responses, by id: at most `max_items` and `max_bytes` of JSON; the least
    recently used go first."""

    def __init__(self, max_items: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, body: dict[str, Any], history: list[dict[str, Any]]) -> None:
        """Keep a response (a response bigger than the whole budget is not kept)."""
        size = len(json.dumps(body, default=str)) + len(json.dumps(history, default=str))
        if size > self.max_bytes:
            return
        self.delete(body["id"])
        self._items[body["id"]] = Stored(body, history, size)
        self.bytes += size
        while len(self._items) > self.max_items or self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size

    def get(self, response_id: str) -> Stored | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self._items.pop(response_id, None)
        if stored is not None:
            self.bytes -= stored.size
        return stored is not None


def store_of(request: Request) -> ResponseStore:
    """The application's response store (made on first use)."""
    app_state = request.app.state
    store = getattr(app_state, "localchat_responses", None)
    if store is None:
        store = app_state.localchat_responses = ResponseStore()
    return store


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"No response found with id {response_id!r}.", param="response_id")


# -- routes --------------------------------------------------------------------------------------
@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    """Create a response (see the module docstring)."""
    state = state_of(request)
    body = ResponsesRequest.model_validate_json(await read_body(request))
    unsupported(body)
    store = store_of(request)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise InvalidRequestError(
                f"Previous response with id {body.previous_response_id!r} not found (it was "
                f"not stored, was deleted, or is no longer kept).", "previous_response_id")
        history = previous.history
    if body.input is None and not history:
        raise InvalidRequestError("missing required parameter: 'input'", "input")
    new = input_messages(body.input if body.input is not None else [])
    conversation = [*history, *new]
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages = tool_messages([*system, *conversation])
    if not messages:
        raise InvalidRequestError("input must not be empty", "input")
    tools = function_tools(body.tools)
    mode, callable_tools = chosen_tools(tools, chat_tool_choice(body.tool_choice))
    fmt, fmt_echo = text_format(body.text)
    if fmt and mode != "none":
        raise InvalidRequestError('text.format cannot be combined with tool calls (set '
                                  'tool_choice to "none" or leave out tools)', "text.format")
    params = p.SamplingParams(model=body.model, temperature=body.temperature, top_p=body.top_p)
    overrides = {**sampling(params, body.max_output_tokens, "max_output_tokens"), **fmt}
    run = await start_chat(state, body.model, messages, tools, mode, callable_tools, overrides,
                           PARAMS, "truncate" if body.truncation == "auto" else None,
                           think=reasoning_switch(body))
    release = True
    try:
        config = run.engine.config
        response_id, created = new_id("resp_"), int(time.time())
        shell = {
            "id": response_id, "object": "response", "created_at": created,
            "status": "in_progress", "background": False, "error": None,
            "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "max_tool_calls": body.max_tool_calls,
            "model": body.model, "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": body.store,
            "temperature": body.temperature if body.temperature is not None
            else config.temperature,
            "text": {"format": fmt_echo}, "tool_choice": body.tool_choice or "auto",
            "tools": list(body.tools or []),
            "top_p": body.top_p if body.top_p is not None else config.top_p,
            "truncation": body.truncation or "disabled", "usage": None, "user": body.user,
            "metadata": body.metadata or {}}
        message_id = new_id("msg_")

        def finish(finished: Finished) -> dict[str, Any]:
            output = output_items(finished, message_id)
            incomplete = finished.reason == "length"
            result = {**shell, "status": "incomplete" if incomplete else "completed",
                      "incomplete_details": {"reason": "max_output_tokens"} if incomplete
                      else None, "output": output, "usage": usage(finished),
                      "completed_at": int(time.time())}
            if body.store and finished.reason != "cancelled":
                reply: dict[str, Any] = {"role": "assistant", "content": finished.text}
                if finished.calls:
                    reply["tool_calls"] = [c.to_dict() for c in finished.calls]
                store.put(result, [*conversation, reply])
            return result

        if not body.stream:
            async with cancel_on_disconnect(request, [run.stream]):
                finished = await finish_of(run.events, run.plan)
            return JSONResponse(finish(finished))
        async with cancel_on_disconnect(request, [run.stream]):
            first = await anext(run.events)  # an error before any token is still a status
        parts = reply_parts(prepend(first, run.events), run.plan)
        events = response_events(parts, shell, message_id, finish)
        response = ReplyStreamingResponse(events, [run.stream], headers=SSE_HEADERS,
                                          on_close=lambda: state.pool.release(run.loaded))
        release = False
        return response
    finally:
        if release:
            await state.pool.release(run.loaded)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> JSONResponse:
    """A stored response."""
    stored = store_of(request).get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return JSONResponse(stored.body)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    """Forget a stored response."""
    if not store_of(request).delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
