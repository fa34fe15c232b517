"""One chat reply for the Responses and Messages routes: the very engine request chat
completions makes (template check, tool plan, window check, `Engine.chat`), and the reply's text
and tool calls as they become safe to send.

The two APIs differ only in how they name things; what they ask of the engine is a list of
chat messages, function tools with a tool choice, and sampling overrides.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from localchat import FinishEvent, ReplyStream, TokenEvent
from localchat.errors import ContextWindowError, InvalidRequestError
from localchat.server.openai_api import ToolPlan, check_window, uses_tools
from localchat.server.pool import LoadedModel
from localchat.server.state import ServerState
from localchat.server.streaming import Tracker, merged
from localchat.server.tools import Tool, ToolCall, call_format, parse_calls, streamable

Events = AsyncIterator[tuple[int, TokenEvent | FinishEvent]]


@dataclass
class ChatRun:
    """A started reply and what its route needs to answer (release `loaded` when done)."""

    loaded: LoadedModel
    stream: ReplyStream
    events: Events
    tracker: Tracker
    plan: ToolPlan | None
    prompt_tokens: int  # the whole prompt, counted before the reply started

    @property
    def engine(self) -> Any:
        return self.loaded.engine


@dataclass
class Params:
    """How an API names the request's parts, for its error messages."""

    input: str  # the messages ("input", "messages")
    max_tokens: str  # the reply's token limit ("max_output_tokens", "max_tokens")
    response_format: str = "response_format"  # the constrained-output parameter
    tools: str = "tools"
    think: str = "think"  # the thinking switch ("reasoning", "thinking")


@dataclass(frozen=True)
class Thought:
    """A piece of a reasoning model's thinking, streamed before the answer it leads to."""

    text: str


@dataclass
class Finished:
    """The end of a reply: its content (the text sent, tool calls cut out), its calls, and
    how it ended ("stop", "length", "cancelled" or "tool_calls")."""

    text: str
    calls: list[ToolCall]
    event: FinishEvent
    reason: str

    @property
    def reasoning(self) -> str:
        """The thinking of a reasoning model ("" when there was none)."""
        return self.event.reply.reasoning

    @property
    def input_tokens(self) -> int:
        """The whole prompt: what was prefilled plus what the prefix cache held."""
        stats = self.event.reply.stats
        return stats.prompt_tokens + stats.reused_tokens

    @property
    def cached_tokens(self) -> int:
        return self.event.reply.stats.reused_tokens

    @property
    def output_tokens(self) -> int:
        return self.event.reply.stats.completion_tokens


async def start_chat(state: ServerState, model: str, messages: list[dict[str, Any]],
                     tools: list[Tool], mode: str, callable_tools: list[Tool],
                     overrides: dict[str, Any], params: Params,
                     overflow: str | None = None, think: bool | None = None) -> ChatRun:
    """Acquire `model` and start one reply to `messages` as chat completions does; the
    caller releases the model (`state.pool.release(run.loaded)`) once the reply is done."""
    started = time.perf_counter()
    loaded = await state.pool.acquire(model)
    try:
        engine = loaded.engine
        template = engine.template
        if (tools or uses_tools(messages)) and not template.supports_tools:
            raise InvalidRequestError(
                f"the model {loaded.ref} cannot call tools: its chat template "
                f"({template.name}) does not render them", params.tools if tools
                else params.input)
        plan: ToolPlan | None = None
        overrides = dict(overrides)
        if mode != "none":
            plan = ToolPlan(template.tool_call_style, callable_tools)
            call_fmt = call_format(plan.style, mode, callable_tools)
            if call_fmt is not None:
                overrides["response_format"] = call_fmt
        defs = [t.definition for t in tools] or None
        prompt_tokens = engine.count_tokens(messages, tools=defs, think=think)
        max_tokens = overrides.get("max_tokens")
        if max_tokens is not None and overflow is None:
            check_window(engine, prompt_tokens, max_tokens, params.max_tokens, params.input)
        extra = {"overflow": overflow} if overflow else {}
        try:
            stream = engine.chat(messages, tools=defs, think=think, **extra, **overrides)
        except ContextWindowError as exc:
            window = exc.context_window or engine.context_window
            raise ContextWindowError(
                f"This model's maximum context length is {window} tokens. However, your "
                f"{params.input} need {exc.prompt_tokens} tokens (with room for the reply). "
                f"Please reduce the length of the {params.input}.",
                prompt_tokens=exc.prompt_tokens, context_window=window,
                param=params.input) from None
        except InvalidRequestError as exc:
            if exc.param == "think" and params.think != "think":
                raise InvalidRequestError(str(exc).replace("thinking unset", f"{params.think} "
                                          "unset"), params.think) from None
            if exc.param != "response_format" or params.response_format == "response_format":
                raise
            raise InvalidRequestError(
                str(exc).replace("response_format", params.response_format, 1),
                params.response_format) from None
        tracker = Tracker(state.metrics, loaded.ref, started)
        return ChatRun(loaded, stream, merged([stream], tracker), tracker, plan, prompt_tokens)
    except BaseException:
        await state.pool.release(loaded)
        raise


@dataclass
class _Held:
    """A reply's text so far and how much of it was sent (tool calls possible)."""

    text: str = ""
    sent: int = 0
    pieces: list[str] = field(default_factory=list)


async def reply_parts(events: Events,
                      plan: ToolPlan | None) -> AsyncIterator[str | Thought | Finished]:
    """The reply's text as it becomes safe to send (a reasoning model's thinking as `Thought`s
    before it), then one `Finished`.

    With tool calls possible, text that could open a call is held back (as chat completions
    does), and so is leading white space, so that a reply that is only a call sends no text.
    """
    held = _Held()
    async for _, event in events:
        if event.reasoning:
            yield Thought(event.reasoning)
        held.text += event.text
        if isinstance(event, TokenEvent):
            safe = len(held.text) if plan is None else streamable(held.text, plan.style)
            piece = held.text[held.sent:safe]
            if piece and (plan is None or held.text[:safe].strip()):
                held.pieces.append(piece)
                held.sent = safe
                yield piece
            continue
        calls: list[ToolCall] = []
        if plan is not None:
            _, calls = parse_calls(held.text, plan.style, plan.tools, event.reply.tool_calls)
        end = streamable(held.text, plan.style) if calls and plan is not None else len(
            held.text)
        rest = held.text[held.sent:end]
        if calls:
            rest = rest.rstrip()
        if rest and (not calls or held.text[:end].strip()):
            held.pieces.append(rest)
            yield rest
        reason = "tool_calls" if calls else event.finish_reason
        yield Finished("".join(held.pieces), calls, event, reason)
        return


async def finish_of(events: Events, plan: ToolPlan | None) -> Finished:
    """The whole reply (not streamed)."""
    async for part in reply_parts(events, plan):
        if isinstance(part, Finished):
            return part
    raise RuntimeError("the reply ended without its finish event")


def stop_sequence_of(finished: Finished, tokenizer: Any, stops: tuple[str, ...]) -> str | None:
    """The stop sequence that ended a reply, if one did (the engine cuts it from the text; the
    generated tokens still spell it after the text)."""
    if finished.reason != "stop" or not stops:
        return None
    reply = finished.event.reply
    spelled = tokenizer.decode(list(reply.token_ids))
    at = spelled.find(reply.text) if reply.text else 0
    after = spelled[at + len(reply.text):] if at >= 0 else ""
    found = [s for s in stops if after.startswith(s)]
    return max(found, key=len) if found else None


def new_id(prefix: str) -> str:
    """A fresh id like OpenAI's and Anthropic's (`resp_...`, `msg_...`)."""
    return f"{prefix}{uuid.uuid4().hex}"
