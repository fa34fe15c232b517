"""The output of the OpenAI Responses API: output items (an assistant message, function calls),
usage, and the typed server-sent events of a streamed response, each with its
`sequence_number`, in the order OpenAI's clients read them."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from localchat.errors import LocalchatError
from localchat.server.chat_run import Finished, Thought
from localchat.server.tools import ToolCall

log = logging.getLogger("localchat.server")


def text_part(text: str) -> dict[str, Any]:
    """An `output_text` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """The assistant's message as an output item (no content while it is only opened)."""
    content = [] if text is None else [text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content}


def call_item(item_id: str, call: ToolCall) -> dict[str, Any]:
    """A function call as an output item (`call_id` is what its output item answers)."""
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": "completed"}


def reasoning_item(message_id: str, text: str) -> dict[str, Any]:
    """A reasoning model's thinking as a `reasoning` output item (its text as the summary)."""
    return {"type": "reasoning", "id": "rs_" + message_id.removeprefix("msg_"),
            "summary": [{"type": "summary_text", "text": text}], "status": "completed"}


def output_items(finished: Finished, message_id: str) -> list[dict[str, Any]]:
    """A finished reply's output: its thinking (a reasoning model's), its text as a message
    (unless the reply is only calls), then one item per call."""
    items: list[dict[str, Any]] = []
    if finished.reasoning:
        items.append(reasoning_item(message_id, finished.reasoning))
    if finished.text or not finished.calls:
        status = "incomplete" if finished.reason == "length" else "completed"
        items.append(message_item(message_id, finished.text, status))
    items += [call_item(f"fc_{call.id.removeprefix('call_')}", call) for call in finished.calls]
    return items


def usage(finished: Finished) -> dict[str, Any]:
    """The Responses API's usage object."""
    return {"input_tokens": finished.input_tokens,
            "input_tokens_details": {"cached_tokens": finished.cached_tokens},
            "output_tokens": finished.output_tokens,
            "output_tokens_details": {
                "reasoning_tokens": finished.event.reply.stats.reasoning_tokens},
            "total_tokens": finished.input_tokens + finished.output_tokens}


class EventCounter:
    """Numbers a stream's events: every event carries its `sequence_number`."""

    def __init__(self) -> None:
        self.number = 0

    def event(self, kind: str, **fields: Any) -> str:
        """One SSE event: the `event:` line names its type, as in the data."""
        data = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def response_events(parts: AsyncIterator[str | Thought | Finished],
                          shell: dict[str, Any], message_id: str,
                          finish: Callable[[Finished], dict[str, Any]]) -> AsyncIterator[str]:
    """The events of a streamed response. `shell` is the response while it runs; `finish`
    makes the final response from the finished reply (and stores it). A reasoning model's
    thinking is sent as one `reasoning` item, whole, before the message."""
    seq = EventCounter()
    where = {"item_id": message_id, "output_index": 0, "content_index": 0}
    thinking: list[str] = []

    def thought() -> list[str]:
        """The reasoning item's events, once its thinking is over (then the message is 1)."""
        if not thinking or where["output_index"] == 1:
            return []
        where["output_index"] = 1
        item = reasoning_item(message_id, "".join(thinking))
        return [seq.event("response.output_item.added", output_index=0,
                          item={**item, "summary": [], "status": "in_progress"}),
                seq.event("response.output_item.done", output_index=0, item=item)]

    def opened() -> list[str]:
        return [*thought(),
                seq.event("response.output_item.added", output_index=where["output_index"],
                          item=message_item(message_id, None, "in_progress")),
                seq.event("response.content_part.added", **where, part=text_part(""))]

    yield seq.event("response.created", response=shell)
    yield seq.event("response.in_progress", response=shell)
    started = False
    try:
        async for part in parts:
            if isinstance(part, Thought):
                thinking.append(part.text)
                continue
            if isinstance(part, str):
                if not started:
                    for event in opened():
                        yield event
                    started = True
                yield seq.event("response.output_text.delta", **where, delta=part, logprobs=[])
                continue
            final = finish(part)
            for index, item in enumerate(final["output"]):
                if item["type"] == "reasoning":
                    for event in thought():
                        yield event
                    continue
                if item["type"] == "message":
                    if not started:
                        for event in opened():
                            yield event
                    (content,) = item["content"]
                    yield seq.event("response.output_text.done", **where, text=content["text"],
                                    logprobs=[])
                    yield seq.event("response.content_part.done", **where, part=content)
                    yield seq.event("response.output_item.done", output_index=index, item=item)
                    continue
                yield seq.event("response.output_item.added", output_index=index,
                                item={**item, "arguments": "", "status": "in_progress"})
                yield seq.event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=index, delta=item["arguments"])
                yield seq.event("response.function_call_arguments.done", item_id=item["id"],
                                output_index=index, name=item["name"],
                                arguments=item["arguments"])
                yield seq.event("response.output_item.done", output_index=index, item=item)
            kind = "response.incomplete" if final["status"] == "incomplete" else \
                "response.completed"
            yield seq.event(kind, response=final)
    except Exception as exc:  # noqa: BLE001 - the status is sent: report in the stream
        log.error("a streamed response failed: %s: %s", type(exc).__name__, exc)
        error = exc if isinstance(exc, LocalchatError) else LocalchatError(
            f"internal server error ({type(exc).__name__})")
        yield seq.event("error", code=error.code or error.error_type, message=str(error),
                        param=error.param)
