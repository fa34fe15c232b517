"""The output of the Anthropic Messages API: the message (text and `tool_use` blocks, stop
reason, usage) and the server-sent events of a streamed one, in the order Anthropic's clients
read them: message_start, content blocks (start, ping after the first, deltas, stop),
message_delta, message_stop."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from localchat.errors import LocalchatError
from localchat.server.chat_run import Finished, Thought

log = logging.getLogger("localchat.server")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               415: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}


def stop_reason(finished: Finished, stop_sequence: str | None) -> str:
    """Anthropic's stop_reason for how a reply ended."""
    if finished.calls:
        return "tool_use"
    if finished.reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def usage(finished: Finished) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the ones prefilled, the prefix cache's are
    cache_read_input_tokens (their sum is the whole prompt)."""
    return {"input_tokens": finished.input_tokens - finished.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": finished.cached_tokens,
            "output_tokens": finished.output_tokens}


def tool_use_blocks(finished: Finished) -> list[dict[str, Any]]:
    """The reply's calls as `tool_use` blocks (input an object, as the schema made it)."""
    return [{"type": "tool_use", "id": f"toolu_{call.id.removeprefix('call_')}",
             "name": call.name, "input": json.loads(call.arguments)} for call in finished.calls]


def message_body(message_id: str, model: str, finished: Finished,
                 stop_sequence: str | None) -> dict[str, Any]:
    """The whole message of a finished reply (a reasoning model's thinking as a `thinking`
    block first; its signature is empty: nothing here signs it)."""
    text = [{"type": "text", "text": finished.text}] if finished.text else []
    if finished.reasoning:
        text.insert(0, {"type": "thinking", "thinking": finished.reasoning, "signature": ""})
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": text + tool_use_blocks(finished),
            "stop_reason": stop_reason(finished, stop_sequence), "stop_sequence": stop_sequence,
            "usage": usage(finished)}


def sse(kind: str, data: dict[str, Any]) -> str:
    """One event: its `event:` line names the type the data carries."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def message_events(parts: AsyncIterator[str | Thought | Finished], message_id: str,
                         model: str,
                         prompt_tokens: int,
                         finish: Callable[[Finished], dict[str, Any]]) -> AsyncIterator[str]:
    """The events of a streamed message; `finish` makes the whole message from the finished
    reply (its content, stop reason and usage go into the last events)."""
    start = {"id": message_id, "type": "message", "role": "assistant", "model": model,
             "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
    yield sse("message_start", {"message": start})
    blocks = 0  # content blocks started so far
    text_open = False
    thinking_open = False

    def begin(block: dict[str, Any]) -> list[str]:
        nonlocal blocks
        events = [sse("content_block_start", {"index": blocks, "content_block": block})]
        if blocks == 0:
            events.append(sse("ping", {}))
        blocks += 1
        return events

    try:
        async for part in parts:
            if isinstance(part, Thought):
                if not thinking_open:
                    for event in begin({"type": "thinking", "thinking": "", "signature": ""}):
                        yield event
                    thinking_open = True
                yield sse("content_block_delta", {"index": blocks - 1, "delta": {
                    "type": "thinking_delta", "thinking": part.text}})
                continue
            if thinking_open:  # the thinking is over once anything else comes
                yield sse("content_block_stop", {"index": blocks - 1})
                thinking_open = False
            if isinstance(part, str):
                if not text_open:
                    for event in begin({"type": "text", "text": ""}):
                        yield event
                    text_open = True
                yield sse("content_block_delta", {"index": blocks - 1, "delta": {
                    "type": "text_delta", "text": part}})
                continue
            message = finish(part)
            if text_open:
                yield sse("content_block_stop", {"index": blocks - 1})
            for block in message["content"]:
                if block["type"] != "tool_use":
                    continue
                index = blocks
                for event in begin({**block, "input": {}}):
                    yield event
                yield sse("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
                yield sse("content_block_stop", {"index": index})
            if blocks == 0:
                yield sse("ping", {})
            yield sse("message_delta", {
                "delta": {"stop_reason": message["stop_reason"],
                          "stop_sequence": message["stop_sequence"]},
                "usage": message["usage"]})
            yield sse("message_stop", {})
    except Exception as exc:  # noqa: BLE001 - the status is sent: report in the stream
        log.error("a streamed message failed: %s: %s", type(exc).__name__, exc)
        status = getattr(exc, "http_status", 500) if isinstance(exc, LocalchatError) else 500
        message_text = str(exc) if isinstance(exc, LocalchatError) else \
            f"internal server error ({type(exc).__name__})"
        yield sse("error", {"error": {"type": ERROR_TYPES.get(status, "api_error"),
                                      "message": message_text}})
