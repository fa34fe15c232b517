"""The OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models, and the
tokenizer helpers /tokenize and /detokenize."""

from __future__ import annotations

import copy
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from localchat import FinishEvent, ReplyStream, TokenEvent
from localchat.errors import ContextWindowError, InvalidRequestError, LocalchatError
from localchat.server import protocol as p
from localchat.server.state import ServerState, read_body, state_of
from localchat.server.streaming import (
    Choice,
    ReplyStreamingResponse,
    Tracker,
    cancel_on_disconnect,
    collect,
    merged,
    prepend,
)
from localchat.server.tools import (
    Tool,
    call_format,
    check_tools,
    chosen_tools,
    parse_calls,
    streamable,
    tool_messages,
)

router = APIRouter()
log = logging.getLogger("localchat.server")
FINGERPRINT = "fp_localchat"
_SPLICE = "\x00localchat-text\x00"  # stands for a delta's text in a serialized chunk
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
TRUNCATED_TOKENS_HEADER = "X-Localchat-Truncated-Tokens"
TRUNCATED_MESSAGES_HEADER = "X-Localchat-Truncated-Messages"


# -- request checks ------------------------------------------------------------------------------
def chat_messages(messages: Sequence[p.ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as the engine's {role, content} dicts (text only); an assistant's
    `tool_calls` and a tool result's `tool_call_id` are kept for a tool-capable template."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if role == "function":
            raise InvalidRequestError(
                f"messages[{i}]: role 'function' (deprecated) is not supported; use tools and "
                f"role 'tool'", f"messages[{i}].role")
        if m.tool_calls and role != "assistant":
            raise InvalidRequestError(f"messages[{i}]: only assistant messages have tool_calls",
                                      f"messages[{i}].tool_calls")
        content = m.content
        if content is None:
            if role != "assistant":
                raise InvalidRequestError(f"messages[{i}]: content is required",
                                          f"messages[{i}].content")
            content = ""
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(
                        f"messages[{i}].content[{j}]: only text parts are supported, got "
                        f"{part.type!r}", f"messages[{i}].content[{j}].type")
                texts.append(part.text)
            content = "\n".join(texts)
        message: dict[str, Any] = {"role": role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = list(m.tool_calls)
        if role == "tool" and m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if role == "assistant" and m.reasoning_content:
            message["reasoning_content"] = m.reasoning_content  # for a template that reads it
        out.append(message)
    return tool_messages(out)


def thinking_switch(body: p.ChatCompletionRequest) -> bool | None:
    """The request's thinking switch: `think`, else vLLM's
    `chat_template_kwargs.enable_thinking` (None: the template's default)."""
    kwargs = body.chat_template_kwargs or {}
    value = kwargs.get("enable_thinking")
    if value is not None and not isinstance(value, bool):
        raise InvalidRequestError(
            f"chat_template_kwargs.enable_thinking must be true or false, got {value!r}",
            "chat_template_kwargs")
    if body.think is not None and value is not None and body.think != value:
        raise InvalidRequestError("think and chat_template_kwargs.enable_thinking disagree",
                                  "think")
    return body.think if body.think is not None else value


def uses_tools(messages: Sequence[dict[str, Any]]) -> bool:
    """Whether messages hold tool calls or tool results (the template must render them)."""
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def response_format(value: p.ResponseFormat | None) -> dict[str, Any]:
    """The engine override for a request's response_format (checked by the engine)."""
    if value is None or value.type == "text":
        return {}
    return {"response_format": value.as_format()}


def sampling(body: p.SamplingParams, max_tokens: int | None, max_param: str) -> dict[str, Any]:
    """The engine overrides for a request's sampling fields."""
    out: dict[str, Any] = {}
    if body.temperature is not None and not 0 <= body.temperature <= 2:
        raise InvalidRequestError(f"temperature must be in [0, 2], got {body.temperature}",
                                  "temperature")
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value is not None:
            out[name] = value
    if body.logit_bias:
        out["logit_bias"] = dict(body.logit_bias)
    if body.seed is not None:
        out["seed"] = body.seed % 2**64
    if max_tokens is not None:
        if max_tokens < 1:
            raise InvalidRequestError(f"{max_param} must be at least 1, got {max_tokens}",
                                      max_param)
        out["max_tokens"] = max_tokens
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP:
        raise InvalidRequestError(f"stop takes at most {MAX_STOP} sequences, got {len(stop)}",
                                  "stop")
    if any(not s for s in stop):
        raise InvalidRequestError("stop sequences must not be empty", "stop")
    if stop:
        out["stop"] = tuple(stop)
    return out


def check_n(body: p.SamplingParams, state: ServerState) -> int:
    if not 1 <= body.n <= state.config.max_n:
        raise InvalidRequestError(f"n must be in [1, {state.config.max_n}], got {body.n}", "n")
    return body.n


def check_stream_options(body: p.SamplingParams) -> bool:
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true",
                                  "stream_options")
    return bool(body.stream_options and body.stream_options.include_usage)


def check_window(engine: Any, prompt_tokens: int, max_tokens: int | None, param: str,
                 what: str = "messages") -> None:
    """OpenAI's context-length error when the prompt plus max_tokens exceed the window."""
    window = engine.context_window
    if max_tokens is not None and prompt_tokens + max_tokens > window:
        total = prompt_tokens + max_tokens
        raise ContextWindowError(
            f"This model's maximum context length is {window} tokens. However, you requested "
            f"{total} tokens ({prompt_tokens} in the {what}, {max_tokens} in the completion). "
            f"Please reduce the length of the {what} or completion.",
            prompt_tokens=total, context_window=window, param=param)


@dataclass(frozen=True)
class Truncation:
    """What fitting a conversation into the context window dropped: whole messages (the
    oldest turns, never the system prompt or the last message) and the prompt tokens they
    held; `kept_tokens` is the prompt that is left."""

    messages: int
    tokens: int
    kept_tokens: int

    def headers(self) -> dict[str, str]:
        """The response headers that say so."""
        return {TRUNCATED_TOKENS_HEADER: str(self.tokens),
                TRUNCATED_MESSAGES_HEADER: str(self.messages)}


def truncation_headers(cut: Truncation | None) -> dict[str, str]:
    """The headers of a response whose prompt was (or was not: none) truncated."""
    return cut.headers() if cut is not None else {}


def wants_truncation(body: p.SamplingParams) -> bool:
    """Whether an OpenAI-style request allows dropping its oldest turns to fit the window
    (`"truncation": "auto"`, as OpenAI's Responses API says it, or `"truncate": true`)."""
    return bool(body.truncate) or body.truncation == "auto"


def fit_messages(engine: Any, messages: Sequence[dict[str, Any]], max_tokens: int | None,
                 tools: Sequence[dict[str, Any]] | None, *, truncate: bool,
                 model: str = "", think: bool | None = None,
                 ) -> tuple[list[dict[str, Any]], Truncation | None]:
    """The messages a reply is planned on, and what was dropped (None: nothing).

    Without `truncate` they are as given (the engine refuses a prompt that does not fit). With
    it, the engine's planner drops the oldest turns (its "truncate" overflow policy) until the
    prompt leaves room for the reply: max_tokens when given (at most half the window), else the
    engine's reply reserve; a ContextWindowError (with the counts) when the system prompt and
    the last message alone do not fit. A truncation is logged."""
    if not truncate:
        return list(messages), None
    planner = copy.copy(engine.planner)  # the engine's policy, reserving room for max_tokens
    if max_tokens is not None:
        planner.reply_reserve = max(planner.reply_reserve, max_tokens)
    plan = planner.plan(messages, max_tokens, overflow="truncate", tools=tools, think=think)
    if not plan.dropped:
        return list(messages), None
    full = planner.count(messages, tools=tools, think=think)
    cut = Truncation(plan.dropped, full - len(plan.new_ids), len(plan.new_ids))
    log.info("%s: truncated the prompt to fit the context window of %d: dropped the %d oldest "
             "messages (%d tokens), %d tokens left", model or engine.name,
             engine.context_window, cut.messages, cut.tokens, cut.kept_tokens)
    return plan.messages, cut


def has_older_turns(messages: Sequence[dict[str, Any]]) -> bool:
    """Whether truncation could drop anything: a turn before the last message, not counting
    a leading system prompt."""
    start = 1 if messages and messages[0].get("role") == "system" else 0
    return len(messages) - start >= 2


def messages_too_long(exc: ContextWindowError, engine: Any, truncate: bool,
                      turns: bool = True) -> ContextWindowError:
    """OpenAI's context-length error for messages the engine refused (with the counts), saying
    what truncation did or (`turns`: there are older turns to drop) could do."""
    window = exc.context_window or engine.context_window
    if truncate:
        return ContextWindowError(
            f"This model's maximum context length is {window} tokens. However, your messages "
            f"need {exc.prompt_tokens} tokens even with the oldest turns dropped (the system "
            f"prompt and the last message stay). Please reduce the length of the messages.",
            prompt_tokens=exc.prompt_tokens, context_window=window, param="messages")
    hint = ', or send "truncation": "auto" to drop the oldest turns' if turns else ""
    return ContextWindowError(
        f"This model's maximum context length is {window} tokens. However, your messages need "
        f"{exc.prompt_tokens} tokens (with room for the reply). Please reduce the length of the "
        f"messages{hint}.",
        prompt_tokens=exc.prompt_tokens, context_window=window, param="messages")


def prompt_too_long(exc: ContextWindowError, truncate: bool) -> ContextWindowError:
    """A text prompt's context error; truncation cannot help one (it drops whole turns of a
    conversation, and a text prompt has none), and the message says so when it was asked."""
    if not truncate:
        return exc
    return ContextWindowError(
        f"{str(exc).rstrip('.')}; truncation drops the oldest turns of a conversation, and a "
        f"text prompt has none: shorten the prompt", prompt_tokens=exc.prompt_tokens,
        context_window=exc.context_window, param=exc.param)


def submit(count: int, seed: int | None,
           start: Callable[[dict[str, Any]], ReplyStream]) -> list[ReplyStream]:
    """Start `count` replies (seeds seed, seed+1, ...); on a failure cancel the started ones."""
    streams: list[ReplyStream] = []
    try:
        for i in range(count):
            extra = {"seed": (seed + i) % 2**64} if seed is not None and i else {}
            streams.append(start(extra))
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise
    return streams


def finish_reason(event: FinishEvent | None) -> str:
    """OpenAI's finish_reason for how a reply ended ("length" or "stop")."""
    reason = event.finish_reason if event is not None else "stop"
    return "length" if reason == "length" else "stop"


def chat_message(text: str, event: FinishEvent | None, calls: ToolPlan | None,
                 reasoning: str = "") -> tuple[p.AssistantMessage, str]:
    """The assistant message and finish_reason of one finished choice (with its tool calls
    and a reasoning model's thinking)."""
    thought = reasoning or None
    if calls is not None:
        harmony = event.reply.tool_calls if event is not None else ()
        content, found = parse_calls(text, calls.style, calls.tools, harmony)
        if found:
            return (p.AssistantMessage(content=content or None, reasoning_content=thought,
                                       tool_calls=[c.to_dict() for c in found]), "tool_calls")
    return p.AssistantMessage(content=text, reasoning_content=thought), finish_reason(event)


class ToolPlan:
    """How a request's tool calls are written and which functions they may name."""

    def __init__(self, style: str, tools: list[Tool]) -> None:
        self.style = style
        self.tools = tools


def usage_of(choices: Sequence[Choice], prompts: int = 1) -> p.Usage:
    """Usage: the prompt counted once per distinct prompt, every choice's completion; prompt
    tokens the prefix cache held (not prefilled again) count too, and show as cached_tokens;
    the completion's think-block tokens show as reasoning_tokens."""
    finished = [c.finish for c in choices if c.finish is not None]
    step = max(1, len(choices) // max(1, prompts))
    firsts = [c.finish.reply.stats for c in choices[::step] if c.finish is not None]
    cached = sum(s.reused_tokens for s in firsts)
    prompt = sum(s.prompt_tokens for s in firsts) + cached
    completion = sum(f.reply.stats.completion_tokens for f in finished)
    # a reasoning model's think-block tokens (part of completion_tokens), as OpenAI counts them
    reasoning = sum(f.reply.stats.reasoning_tokens for f in finished)
    return p.Usage(prompt_tokens=prompt, completion_tokens=completion,
                   total_tokens=prompt + completion,
                   prompt_tokens_details={"cached_tokens": cached},
                   completion_tokens_details={"reasoning_tokens": reasoning})


def token_str(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprob(tokenizer: Any, event: TokenEvent) -> p.TokenLogprob:
    text = token_str(tokenizer, event.token_id)
    top = [p.TopLogprob(token=(t := token_str(tokenizer, tid)), logprob=lp,
                        bytes=list(t.encode("utf-8")))
           for tid, lp in (event.top_logprobs or ())]
    return p.TokenLogprob(token=text, logprob=float(event.logprob or 0.0),
                          bytes=list(text.encode("utf-8")), top_logprobs=top)


def sse(model: BaseModel | dict[str, Any], drop_none: Sequence[str] = ()) -> str:
    data = model.model_dump() if isinstance(model, BaseModel) else dict(model)
    for key in drop_none:
        if data.get(key) is None:
            data.pop(key, None)
    for choice in data.get("choices", []):  # a delta carries only what it changes
        if isinstance(choice.get("delta"), dict):
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def sse_error(exc: BaseException) -> str:
    """An error after the stream started (the status is sent): one `data:` error event."""
    log.error("a streamed reply failed: %s: %s", type(exc).__name__, exc)
    error = exc if isinstance(exc, LocalchatError) else LocalchatError(
        f"internal server error ({type(exc).__name__})")
    return f"data: {json.dumps({'error': error.to_dict()})}\n\n"


# -- chat ------------------------------------------------------------------------------------------
@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = state_of(request)
    started = time.perf_counter()
    body = p.ChatCompletionRequest.model_validate_json(await read_body(request))
    messages = chat_messages(body.messages)
    if body.functions or body.function_call is not None:
        raise InvalidRequestError("functions and function_call (deprecated) are not supported; "
                                  "use tools and tool_choice",
                                  "functions" if body.functions else "function_call")
    tools = check_tools(body.tools)
    mode, callable_tools = chosen_tools(tools, body.tool_choice)
    fmt = response_format(body.response_format)
    if fmt and mode != "none":
        raise InvalidRequestError("response_format cannot be combined with tool calls (set "
                                  "tool_choice to \"none\" or leave out tools)",
                                  "response_format")
    include_usage = check_stream_options(body)
    if body.max_completion_tokens is not None:
        max_tokens, max_param = body.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_param = body.max_tokens, "max_tokens"
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", "top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.top_logprobs}",
                "top_logprobs")
    overrides = {**sampling(body, max_tokens, max_param), **fmt}
    if body.logprobs:
        overrides["logprobs"] = body.top_logprobs or 0
    think = thinking_switch(body)
    n = check_n(body, state)
    loaded = await state.pool.acquire(body.model)
    release: Any = loaded
    try:
        engine = loaded.engine
        template = engine.template
        plan: ToolPlan | None = None
        if (tools or uses_tools(messages)) and not template.supports_tools:
            raise InvalidRequestError(
                f"the model {loaded.ref} cannot call tools: its chat template "
                f"({template.name}) does not render them", "tools" if tools else "messages")
        if mode != "none":
            plan = ToolPlan(template.tool_call_style, callable_tools)
            call_fmt = call_format(plan.style, mode, callable_tools)
            if call_fmt is not None:
                overrides["response_format"] = call_fmt
        defs = [t.definition for t in tools] or None
        truncate = wants_truncation(body)
        try:
            kept, cut = fit_messages(engine, messages, max_tokens, defs, truncate=truncate,
                                     model=loaded.ref, think=think)
        except ContextWindowError as exc:
            raise messages_too_long(exc, engine, truncate,
                                    has_older_turns(messages)) from None
        if max_tokens is not None:
            prompt_tokens = (cut.kept_tokens if cut is not None
                             else engine.count_tokens(kept, tools=defs, think=think))
            try:
                check_window(engine, prompt_tokens, max_tokens, max_param)
            except ContextWindowError as exc:
                if truncate or not has_older_turns(kept):
                    raise
                raise ContextWindowError(
                    f"{str(exc).rstrip('.')}, or send \"truncation\": \"auto\" to drop the "
                    f"oldest turns.", prompt_tokens=exc.prompt_tokens,
                    context_window=exc.context_window, param=exc.param) from None
        overflow = "truncate" if truncate else None
        try:
            streams = submit(n, body.seed, lambda extra: engine.chat(
                kept, tools=defs, overflow=overflow, think=think, **{**overrides, **extra}))
        except ContextWindowError as exc:
            raise messages_too_long(exc, engine, truncate,
                                    has_older_turns(messages)) from None
        tracker = Tracker(state.metrics, loaded.ref, started)
        events = merged(streams, tracker)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        tokenizer = engine.tokenizer
        if not body.stream:
            async with cancel_on_disconnect(request, streams):
                choices = await collect(events, n)
            answers = [chat_message(c.text, c.finish, plan, c.reasoning) for c in choices]
            result = p.ChatCompletion(
                id=cid, created=created, model=body.model, system_fingerprint=FINGERPRINT,
                choices=[p.ChatChoice(
                    index=c.index, message=message,
                    logprobs=p.ChoiceLogprobs(content=[chat_logprob(tokenizer, t)
                                                       for t in c.tokens])
                    if body.logprobs else None,
                    finish_reason=reason) for c, (message, reason) in zip(choices, answers,
                                                                           strict=True)],
                usage=usage_of(choices))
            data = result.model_dump()
            for choice in data["choices"]:
                for key in ("tool_calls", "reasoning_content"):
                    if choice["message"].get(key) is None:
                        choice["message"].pop(key, None)
            return JSONResponse(data, headers=truncation_headers(cut))
        async with cancel_on_disconnect(request, streams):
            first = await anext(events)  # an error before any token is still a status
        chunks = chat_chunks(prepend(first, events), n, cid, created, body.model, include_usage,
                             body.logprobs, tokenizer, plan)
        response = ReplyStreamingResponse(chunks, streams, on_close=lambda: state.pool.release(
            loaded), headers={**SSE_HEADERS, **truncation_headers(cut)})
        release = None
        return response
    finally:
        if release is not None:
            await state.pool.release(loaded)


async def chat_chunks(events: AsyncIterator[tuple[int, TokenEvent | FinishEvent]], n: int,
                      cid: str, created: int, model: str, include_usage: bool, logprobs: bool,
                      tokenizer: Any, calls: ToolPlan | None = None) -> AsyncIterator[str]:
    """The SSE chunks of a streamed chat completion. With tool calls possible, text that could
    open a call is held back; a call is sent whole as a `tool_calls` delta when the choice
    ends."""
    base: dict[str, Any] = {"id": cid, "created": created, "model": model,
                            "system_fingerprint": FINGERPRINT}

    def chunk(index: int, delta: p.Delta, reason: str | None = None,
              lps: list[p.TokenLogprob] | None = None) -> str:
        choice = p.ChunkChoice(index=index, delta=delta, finish_reason=reason,
                               logprobs=p.ChoiceLogprobs(content=lps) if lps is not None else None)
        return sse(p.ChatCompletionChunk(**base, choices=[choice]), drop_none=("usage",))

    # A plain text delta is most chunks: it is spliced into the chunk serialized once per
    # choice, the same bytes as `chunk` makes, at a fraction of the cost (on a small CPU each
    # token's serving work is taken from the decoding threads).
    templates: dict[int, tuple[str, str]] = {}

    def text_chunk(index: int, text: str) -> str:
        if index not in templates:
            head, mark, tail = chunk(index, p.Delta(content=_SPLICE)).partition(
                json.dumps(_SPLICE, ensure_ascii=False))
            assert mark, "the text's place in a serialized chunk"
            templates[index] = head, tail
        head, tail = templates[index]
        return head + json.dumps(text, ensure_ascii=False) + tail

    choices = [Choice(i) for i in range(n)]
    pending: list[list[p.TokenLogprob]] = [[] for _ in range(n)]
    sent = [0] * n  # characters of each choice's text sent as content (with tool calls)
    try:
        for i in range(n):
            yield chunk(i, p.Delta(role="assistant", content=""))
        async for i, event in events:
            if event.reasoning:  # thinking goes first: a token's answer text follows it
                yield chunk(i, p.Delta(reasoning_content=event.reasoning))
            if isinstance(event, TokenEvent):
                if logprobs:
                    pending[i].append(chat_logprob(tokenizer, event))
                if calls is not None:  # send what cannot be the start of a call
                    choices[i].pieces.append(event.text)
                    safe = streamable(choices[i].text, calls.style)
                    if safe > sent[i]:
                        yield chunk(i, p.Delta(content=choices[i].text[sent[i]:safe]),
                                    lps=pending[i] if logprobs else None)
                        sent[i] = safe
                        pending[i] = []
                    continue
                if event.text:
                    yield (chunk(i, p.Delta(content=event.text), lps=pending[i]) if logprobs
                           else text_chunk(i, event.text))
                    pending[i] = []
                continue
            choices[i].finish = event
            if calls is not None:
                text = choices[i].text + event.text
                message, reason = chat_message(text, event, calls)
                rest = text[sent[i]:streamable(text, calls.style) if message.tool_calls
                            else len(text)]
                if rest or pending[i]:
                    yield chunk(i, p.Delta(content=rest), lps=pending[i] if logprobs else None)
                    pending[i] = []
                if message.tool_calls:
                    yield chunk(i, p.Delta(tool_calls=[
                        {"index": k, **call} for k, call in enumerate(message.tool_calls)]))
                yield chunk(i, p.Delta(), reason)
                continue
            if event.text or pending[i]:
                yield chunk(i, p.Delta(content=event.text), lps=pending[i] if logprobs else None)
                pending[i] = []
            yield chunk(i, p.Delta(), finish_reason(event))
        if include_usage:
            usage = usage_of(choices)
            yield sse({**base, "object": "chat.completion.chunk", "choices": [],
                       "usage": usage.model_dump()})
        yield "data: [DONE]\n\n"
    except Exception as exc:  # noqa: BLE001 - the status is sent: report in the stream
        yield sse_error(exc)


# -- text completions ------------------------------------------------------------------------------
def completion_prompts(body: p.CompletionRequest, tokenizer: Any) -> list[str]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    if all(isinstance(x, str) for x in prompt):
        return list(prompt)  # type: ignore[arg-type]
    if all(isinstance(x, int) for x in prompt):
        return [tokenizer.decode(prompt)]
    return [tokenizer.decode(ids) for ids in prompt]  # type: ignore[arg-type]


def completion_logprobs(tokenizer: Any, tokens: Sequence[TokenEvent],
                        start: int = 0) -> p.CompletionLogprobs:
    strs, lps, tops, offsets = [], [], [], []
    offset = start
    for event in tokens:
        text = token_str(tokenizer, event.token_id)
        strs.append(text)
        lps.append(event.logprob)
        tops.append({token_str(tokenizer, tid): lp for tid, lp in (event.top_logprobs or ())})
        offsets.append(offset)
        offset += len(text)
    return p.CompletionLogprobs(tokens=strs, token_logprobs=lps, top_logprobs=tops,
                                text_offset=offsets)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = state_of(request)
    started = time.perf_counter()
    body = p.CompletionRequest.model_validate_json(await read_body(request))
    include_usage = check_stream_options(body)
    if body.suffix:
        raise InvalidRequestError("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequestError("best_of is not supported (leave it unset or equal to n)",
                                  "best_of")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(
            f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.logprobs}", "logprobs")
    overrides = {**sampling(body, body.max_tokens, "max_tokens"),
                 **response_format(body.response_format)}
    if body.logprobs is not None:
        overrides["logprobs"] = body.logprobs
    n = check_n(body, state)
    loaded = await state.pool.acquire(body.model)
    release: Any = loaded
    try:
        engine = loaded.engine
        prompts = completion_prompts(body, engine.tokenizer)
        if len(prompts) * n > state.config.max_n:
            raise InvalidRequestError(
                f"prompts × n must be at most {state.config.max_n}, got {len(prompts) * n}",
                "prompt")
        for text in prompts:
            if not text:
                raise InvalidRequestError("the prompt is empty", "prompt")
            if body.max_tokens is not None:
                count = len(engine.planner.encode(text, raw=True))
                try:
                    check_window(engine, count, body.max_tokens, "max_tokens", "prompt")
                except ContextWindowError as exc:
                    raise prompt_too_long(exc, wants_truncation(body)) from None
        streams: list[ReplyStream] = []
        try:
            for text in prompts:
                streams += submit(
                    n, body.seed,
                    lambda extra, t=text: engine.complete(t, **{**overrides, **extra}))
        except ContextWindowError as exc:
            for stream in streams:
                stream.cancel()
            raise prompt_too_long(exc, wants_truncation(body)) from None
        except BaseException:
            for stream in streams:
                stream.cancel()
            raise
        count = len(streams)
        echo = [prompts[i // n] if body.echo else "" for i in range(count)]
        tracker = Tracker(state.metrics, loaded.ref, started)
        events = merged(streams, tracker)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        tokenizer = engine.tokenizer
        if not body.stream:
            async with cancel_on_disconnect(request, streams):
                choices = await collect(events, count)
            result = p.Completion(
                id=cid, created=created, model=body.model, system_fingerprint=FINGERPRINT,
                choices=[p.CompletionChoice(
                    index=c.index, text=echo[c.index] + c.text,
                    logprobs=completion_logprobs(tokenizer, c.tokens, len(echo[c.index]))
                    if body.logprobs is not None else None,
                    finish_reason=finish_reason(c.finish)) for c in choices],
                usage=usage_of(choices, len(prompts)))
            return JSONResponse(result.model_dump())
        async with cancel_on_disconnect(request, streams):
            first = await anext(events)
        chunks = completion_chunks(prepend(first, events), echo, cid, created, body.model,
                                   include_usage, body.logprobs is not None, tokenizer,
                                   len(prompts))
        response = ReplyStreamingResponse(chunks, streams, on_close=lambda: state.pool.release(
            loaded), headers=SSE_HEADERS)
        release = None
        return response
    finally:
        if release is not None:
            await state.pool.release(loaded)


async def completion_chunks(events: AsyncIterator[tuple[int, TokenEvent | FinishEvent]],
                            echo: list[str], cid: str, created: int, model: str,
                            include_usage: bool, logprobs: bool, tokenizer: Any,
                            prompts: int) -> AsyncIterator[str]:
    base: dict[str, Any] = {"id": cid, "created": created, "model": model,
                            "system_fingerprint": FINGERPRINT}

    def chunk(index: int, text: str, reason: str | None = None,
              tokens: Sequence[TokenEvent] = ()) -> str:
        lps = completion_logprobs(tokenizer, tokens) if logprobs else None
        choice = p.CompletionChoice(index=index, text=text, logprobs=lps, finish_reason=reason)
        return sse(p.Completion(**base, choices=[choice]), drop_none=("usage",))

    choices = [Choice(i) for i in range(len(echo))]
    pending: list[list[TokenEvent]] = [[] for _ in echo]
    try:
        for i, text in enumerate(echo):
            if text:
                yield chunk(i, text)
        async for i, event in events:
            if isinstance(event, TokenEvent):
                pending[i].append(event)
                if event.text:
                    yield chunk(i, event.text, tokens=pending[i])
                    pending[i] = []
                continue
            choices[i].finish = event
            yield chunk(i, event.text, finish_reason(event), pending[i])
            pending[i] = []
        if include_usage:
            yield sse({**base, "object": "text_completion", "choices": [],
                       "usage": usage_of(choices, prompts).model_dump()})
        yield "data: [DONE]\n\n"
    except Exception as exc:  # noqa: BLE001 - the status is sent: report in the stream
        yield sse_error(exc)


# -- models and tokenizer ----------------------------------------------------------------------
def model_cards(state: ServerState) -> list[p.ModelCard]:
    """The stored models by the names users run them by, then command-line directories."""
    cards = {m.path: p.ModelCard(id=name, created=_mtime(m.path))
             for name, m in state.pool.listed()}
    for loaded in state.pool.loaded.values():
        if loaded.path not in cards:
            cards[loaded.path] = p.ModelCard(id=loaded.ref, created=int(loaded.loaded_at))
    return list(cards.values())


def _mtime(path: Any) -> int:
    try:
        return int(path.stat().st_mtime)
    except OSError:
        return 0


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse(p.ModelList(data=model_cards(state_of(request))).model_dump())


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> JSONResponse:
    state = state_of(request)
    _, path = state.pool.resolve(model_id)  # the id as asked: either spelling of a default
    return JSONResponse(p.ModelCard(id=model_id.strip(), created=_mtime(path)).model_dump())


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    state = state_of(request)
    body = p.TokenizeRequest.model_validate_json(await read_body(request))
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of 'prompt' and 'messages'", "prompt")
    loaded = await state.pool.acquire(body.model)
    try:
        engine = loaded.engine
        if body.messages is not None:
            text = engine.template.render(chat_messages(body.messages), add_generation_prompt=True)
            ids = engine.planner.encode(text)
        elif body.add_special_tokens:
            ids = engine.planner.encode(body.prompt, raw=True)
        else:
            ids = engine.tokenizer.encode(body.prompt)
        return JSONResponse({"tokens": ids, "count": len(ids),
                             "max_model_len": engine.context_window})
    finally:
        await state.pool.release(loaded)


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    state = state_of(request)
    body = p.DetokenizeRequest.model_validate_json(await read_body(request))
    loaded = await state.pool.acquire(body.model)
    try:
        engine = loaded.engine
        for i, t in enumerate(body.tokens):
            if not 0 <= t < engine.vocab_size:
                raise InvalidRequestError(
                    f"tokens[{i}] = {t} is outside the vocabulary (size {engine.vocab_size})",
                    f"tokens[{i}]")
        return JSONResponse({"prompt": engine.tokenizer.decode(body.tokens)})
    finally:
        await state.pool.release(loaded)
