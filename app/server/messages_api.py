"""The Anthropic Messages API: POST /v1/messages (plain or streamed) and
POST /v1/messages/count_tokens.

A request becomes the chat messages, function tools and sampling overrides chat completions
would send the engine (chat_run.py): `system` a system message, `tool_use` blocks an
assistant's tool calls, `tool_result` blocks tool messages. Every error of these routes has
Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from localchat.errors import InvalidRequestError, LocalchatError
from localchat.server.chat_run import (
    Finished,
    Params,
    finish_of,
    new_id,
    reply_parts,
    start_chat,
    stop_sequence_of,
)
from localchat.server.errors import validation_error
from localchat.server.messages_events import ERROR_TYPES, message_body, message_events
from localchat.server.openai_api import SSE_HEADERS, uses_tools
from localchat.server.state import read_body, state_of
from localchat.server.streaming import ReplyStreamingResponse, cancel_on_disconnect, prepend
from localchat.server.tools import Tool, check_tools, chosen_tools, tool_messages

log = logging.getLogger("localchat.server")
PARAMS = Params(input="messages", max_tokens="max_tokens",
                response_format="output_config.format", think="thinking")


def anthropic_error(error: LocalchatError) -> JSONResponse:
    """An error in Anthropic's shape, with the status its class names."""
    status = int(getattr(error, "http_status", 500) or 500)
    message = str(error)
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    body = {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}
    return JSONResponse(body, status_code=status)


class AnthropicRoute(APIRoute):
    """A route whose every failure is answered in Anthropic's error shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except LocalchatError as exc:
                if exc.http_status >= 500:
                    log.error("%s %s failed: %s", request.method, request.url.path, exc)
                return anthropic_error(exc)
            except (ValidationError, RequestValidationError) as exc:
                return anthropic_error(validation_error(exc))
            except Exception as exc:  # noqa: BLE001 - never a traceback
                log.exception("%s %s: unexpected error", request.method, request.url.path)
                return anthropic_error(LocalchatError(
                    f"internal server error ({type(exc).__name__})"))

        return route


router = APIRouter(route_class=AnthropicRoute)


class CountRequest(BaseModel):
    """The body of /v1/messages/count_tokens (and the prompt part of /v1/messages). Unknown
    fields are ignored; fields of features this server does not have are a 400 when they ask
    for one."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None


class MessagesRequest(CountRequest):
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


# -- the request ---------------------------------------------------------------------------------
def _text(content: Any, where: str) -> str:
    """The text of a string or of a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} must be a string or a list of text blocks", where)
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise InvalidRequestError(f"{where}[{j}]: only text blocks are supported here, got "
                                      f"{kind!r}", f"{where}[{j}].type")
        texts.append(block["text"])
    return "\n".join(texts)


def _tool_call(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A `tool_use` block as an assistant's tool call (OpenAI's shape, as the templates take)."""
    for key in ("id", "name"):
        if not isinstance(block.get(key), str):
            raise InvalidRequestError(f"{where}.{key} must be a string", f"{where}.{key}")
    if not isinstance(block.get("input"), Mapping):
        raise InvalidRequestError(f"{where}.input must be an object", f"{where}.input")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": dict(block["input"])}}


def _message(i: int, message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One Messages API message as chat messages (a user's tool results are tool messages)."""
    where = f"messages[{i}]"
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise InvalidRequestError(f"{where}.role must be 'user' or 'assistant', got {role!r}",
                                  f"{where}.role")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list) or not content:
        raise InvalidRequestError(f"{where}.content must be a string or a non-empty list of "
                                  f"content blocks", f"{where}.content")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, at))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # an earlier reply's thinking: not fed to the model again
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise InvalidRequestError(f"{at}.tool_use_id must be a string",
                                          f"{at}.tool_use_id")
            text = _text(block.get("content", ""), f"{at}.content")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": f"Error: {text}" if block.get("is_error") else text})
        else:
            raise InvalidRequestError(
                f"{at}: {kind!r} blocks are not supported in {role} messages (text; tool_use "
                f"from the assistant; tool_result from the user)", f"{at}.type")
    if role == "assistant":
        reply: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
        if calls:
            reply["tool_calls"] = calls
        return [reply]
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def thinking_switch(body: CountRequest) -> bool | None:
    """The thinking switch `thinking` asks for: {"type": "enabled", ...} on, "disabled" off (a
    reasoning model thinks as long as it thinks: budget_tokens is not enforced)."""
    if body.thinking is None:
        return None
    kind = body.thinking.get("type")
    if kind not in ("enabled", "disabled"):
        raise InvalidRequestError(f"thinking.type must be 'enabled' or 'disabled', got {kind!r}",
                                  "thinking.type")
    return kind == "enabled"


def chat_messages(body: CountRequest) -> list[dict[str, Any]]:
    """The request's system prompt and messages as the engine's chat messages."""
    thinking_switch(body)  # checked before anything runs
    if body.mcp_servers:
        raise InvalidRequestError("MCP servers are not supported", "mcp_servers")
    out: list[dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": _text(body.system, "system")})
    for i, message in enumerate(body.messages):
        out += _message(i, message)
    if body.messages[-1].get("role") == "assistant":
        raise InvalidRequestError(
            f"messages[{len(body.messages) - 1}]: a final assistant message (a prefill to "
            f"continue) is not supported; end with a user message",
            f"messages[{len(body.messages) - 1}].role")
    return tool_messages(out)


def client_tools(tools: list[Any] | None) -> list[Tool]:
    """The request's tools (name, description, input_schema), checked as chat completions
    checks its tools."""
    chat_form = []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, Mapping) else "?"
        if kind not in (None, "custom"):
            raise InvalidRequestError(
                f"{where}: tools of type {kind!r} are not supported; only client tools with an "
                f"input_schema (server tools such as web search run on Anthropic's servers)",
                f"{where}.type")
        if not isinstance(tool.get("input_schema"), Mapping):
            raise InvalidRequestError(f"{where}.input_schema must be a JSON Schema object",
                                      f"{where}.input_schema")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        chat_form.append({"type": "function", "function": fn})
    try:
        return check_tools(chat_form)
    except InvalidRequestError as exc:  # name the fields this API has
        def rename(text: str) -> str:
            return text.replace(".function.parameters", ".input_schema").replace(
                ".function", "")

        raise InvalidRequestError(rename(str(exc)), rename(exc.param or "") or None) from None


def chat_tool_choice(choice: dict[str, Any] | None) -> Any:
    """A Messages `tool_choice` in chat completions' form."""
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    known = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in known:
        raise InvalidRequestError(f"tool_choice.type must be auto, any, tool or none, got "
                                  f"{kind!r}", "tool_choice.type")
    return known[kind]


def sampling(body: MessagesRequest) -> dict[str, Any]:
    """The engine overrides for the request's sampling fields (the engine checks ranges)."""
    if body.max_tokens < 1:
        raise InvalidRequestError(f"max_tokens must be at least 1, got {body.max_tokens}",
                                  "max_tokens")
    out: dict[str, Any] = {"max_tokens": body.max_tokens}
    if body.temperature is not None:
        if not 0 <= body.temperature <= 1:
            raise InvalidRequestError(f"temperature must be in [0, 1], got {body.temperature}",
                                      "temperature")
        out["temperature"] = body.temperature
    if body.top_p is not None:
        out["top_p"] = body.top_p
    if body.top_k is not None:
        out["top_k"] = body.top_k
    if body.stop_sequences:
        if any(not s for s in body.stop_sequences):
            raise InvalidRequestError("stop_sequences must not hold empty strings",
                                      "stop_sequences")
        out["stop"] = tuple(body.stop_sequences)
    return out


def output_format(config: dict[str, Any] | None) -> dict[str, Any]:
    """The engine override for `output_config.format` (structured output: a JSON Schema the
    reply follows, through the same grammar machinery as OpenAI's response_format)."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema" or not isinstance(
            fmt.get("schema"), Mapping):
        raise InvalidRequestError('output_config.format must be {"type": "json_schema", '
                                  '"schema": {...}}', "output_config.format")
    return {"response_format": {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}}


# -- routes --------------------------------------------------------------------------------------
@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    """Create a message (see the module docstring)."""
    state = state_of(request)
    body = MessagesRequest.model_validate_json(await read_body(request))
    messages = chat_messages(body)
    tools = client_tools(body.tools)
    mode, callable_tools = chosen_tools(tools, chat_tool_choice(body.tool_choice))
    fmt = output_format(body.output_config)
    if fmt and mode != "none":
        raise InvalidRequestError('output_config.format cannot be combined with tool use (set '
                                  'tool_choice to {"type": "none"} or leave out tools)',
                                  "output_config.format")
    run = await start_chat(state, body.model, messages, tools, mode, callable_tools,
                           {**sampling(body), **fmt}, PARAMS, think=thinking_switch(body))
    release = True
    try:
        message_id = new_id("msg_")
        stops = tuple(body.stop_sequences or ())
        tokenizer = run.engine.tokenizer

        def finish(finished: Finished) -> dict[str, Any]:
            return message_body(message_id, body.model, finished,
                                stop_sequence_of(finished, tokenizer, stops))

        if not body.stream:
            async with cancel_on_disconnect(request, [run.stream]):
                finished = await finish_of(run.events, run.plan)
            return JSONResponse(finish(finished))
        async with cancel_on_disconnect(request, [run.stream]):
            first = await anext(run.events)  # an error before any token is still a status
        parts = reply_parts(prepend(first, run.events), run.plan)
        events = message_events(parts, message_id, body.model, run.prompt_tokens, finish)
        response = ReplyStreamingResponse(events, [run.stream], headers=SSE_HEADERS,
                                          on_close=lambda: state.pool.release(run.loaded))
        release = False
        return response
    finally:
        if release:
            await state.pool.release(run.loaded)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> JSONResponse:
    """The prompt's tokens for a Messages request, as /v1/messages would render it."""
    state = state_of(request)
    body = CountRequest.model_validate_json(await read_body(request))
    messages = chat_messages(body)
    tools = client_tools(body.tools)
    chosen_tools(tools, chat_tool_choice(body.tool_choice))
    loaded = await state.pool.acquire(body.model)
    try:
        template = loaded.engine.template
        if (tools or uses_tools(messages)) and not template.supports_tools:
            raise InvalidRequestError(
                f"the model {loaded.ref} cannot call tools: its chat template "
                f"({template.name}) does not render them", "tools" if tools else "messages")
        defs = [t.definition for t in tools] or None
        return JSONResponse({"input_tokens": loaded.engine.count_tokens(
            messages, tools=defs, think=thinking_switch(body))})
    finally:
        await state.pool.release(loaded)
