"""The Ollama-compatible routes under /api: chat and generate (NDJSON streaming), tags, show,
ps, version, pull, copy and delete. Errors are `{"error": "message"}` (see errors.py).

Where we differ from Ollama on purpose: a prompt that does not fit the context window is
refused (400, with the token counts) unless the request says `"truncate": true` (top level or in
`options`): then the oldest turns are dropped, and the response says so in its
`X-Localchat-Truncated-Tokens` header. `options.num_ctx` over the model's window is clamped to it
(and logged), as Ollama does; the model is reloaded when a request asks for another window.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from localchat import FinishEvent, TokenEvent, __version__
from localchat.errors import (
    ContextWindowError,
    InvalidRequestError,
    LocalchatError,
    ModelNotFoundError,
    StoreError,
)
from localchat.server import protocol as p
from localchat.server.config import FOREVER_S, parse_duration
from localchat.server.openai_api import (
    ToolPlan,
    Truncation,
    fit_messages,
    truncation_headers,
    uses_tools,
)
from localchat.server.pool import LoadedModel
from localchat.server.state import ServerState, read_body, state_of
from localchat.server.streaming import (
    ReplyStreamingResponse,
    Tracker,
    cancel_on_disconnect,
    collect,
    merged,
    prepend,
)
from localchat.server.tools import call_format, check_tools, parse_calls, streamable

router = APIRouter(prefix="/api")
log = logging.getLogger("localchat.server")
NDJSON = "application/x-ndjson"
TENSOR_CACHE = "tensor-cache.json"  # the weights' index: each tensor's name, shape and type


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def keep_alive_seconds(value: float | str | None) -> float | None:
    """Ollama's keep_alive (seconds, or "5m", "1h30m", "-1") in seconds (-1.0: forever); None
    when unset."""
    if value is None:
        return None
    return parse_duration(value, "keep_alive")


def expiry_iso(expires_at: float | None) -> str:
    """/api/ps's `expires_at`: when the model will be unloaded; for a model kept forever, what
    Ollama says (its largest duration from now, some 292 years ahead; its CLI shows
    "Forever")."""
    return iso(time.time() + FOREVER_S if expires_at is None else expires_at)


def checked_name(ref: str | None, param: str = "model") -> str:
    """A model name from a management request (delete, copy): a 400 naming the problem when
    it is missing or could name a path (`..`, a leading `/`, `.` or `~`, a backslash) instead of
    a stored model."""
    if not isinstance(ref, str) or not ref.strip():
        raise InvalidRequestError(f"{param} is required", param)
    name = ref.strip()
    bare, _, quant = name.rpartition(":") if ":" in name else (name, "", "")
    segments = bare.split("/")
    problem = ""
    if name.startswith(("/", "~", ".")) or any(s in (".", "..") for s in segments):
        problem = "a model name is not a path"
    elif any(c in name for c in "\\\0") or any(ord(c) < 32 for c in name):
        problem = "it holds a backslash or a control character"
    else:
        try:
            from localchat.store import safe_name

            safe_name(bare)
            if ":" in name:
                safe_name(quant)
        except StoreError:
            problem = "use letters, digits, '-', '_' and '.' (`name` or `name:quant`)"
    if problem:
        raise InvalidRequestError(f"invalid model name {ref!r}: {problem}", param)
    return name


def options(opts: p.OllamaOptions | None) -> dict[str, Any]:
    """Ollama options as engine overrides (num_predict < 0: no limit)."""
    out: dict[str, Any] = {}
    if opts is None:
        return out
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "seed"):
        value = getattr(opts, name)
        if value is not None:
            out[name] = value
    if out.get("seed") is not None and out["seed"] < 0:
        out.pop("seed")  # Ollama: -1 is "random"
    if opts.repeat_penalty is not None:
        out["repetition_penalty"] = opts.repeat_penalty
    if opts.repeat_last_n is not None:  # Ollama: 0 turns the penalty off, -1 is the whole context
        if opts.repeat_last_n == 0:
            out["repetition_penalty"] = 1.0
        elif opts.repeat_last_n < -1:
            raise InvalidRequestError("repeat_last_n must be >= -1 (-1: the whole context)",
                                      "repeat_last_n")
        else:
            out["repetition_window"] = max(opts.repeat_last_n, 0)
    if opts.num_predict is not None and opts.num_predict >= 0:
        if opts.num_predict == 0:
            raise InvalidRequestError("num_predict must be positive (or -1: no limit)",
                                      "num_predict")
        out["max_tokens"] = opts.num_predict
    if opts.stop:
        out["stop"] = tuple(opts.stop)
    return out


def format_override(fmt: Any) -> dict[str, Any]:
    """Ollama's `format` as an engine override: "json" is any JSON object, an object is a JSON
    schema the reply must match; unset or "" is free text."""
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"schema": fmt}}}
    raise InvalidRequestError(f'format must be "json" or a JSON schema object, got {fmt!r}',
                              "format")


_PARAMETER_COUNTS: dict[tuple[Path, float], int] = {}


def parameter_count(path: Path) -> int:
    """The number of weights of a model directory, from its tensor index: 4-bit weights are
    packed eight to a uint32 word, group scales and mins are not weights (0 when unreadable)."""
    index = path / TENSOR_CACHE
    try:
        key = (path, index.stat().st_mtime)
    except OSError:
        return 0
    if key not in _PARAMETER_COUNTS:
        total = 0
        try:
            shards = json.loads(index.read_text(encoding="utf-8"))["records"]
            for record in (r for shard in shards for r in shard["records"]):
                if str(record["name"]).endswith((".scale", ".min", ".zero")):
                    continue
                count = 1
                for dim in record["shape"]:
                    count *= int(dim)
                total += count * (8 if record.get("dtype") == "uint32" else 1)
        except (OSError, ValueError, KeyError, TypeError):
            total = 0
        _PARAMETER_COUNTS[key] = total
    return _PARAMETER_COUNTS[key]


def parameter_size(count: int) -> str:
    """A parameter count as Ollama shows it: "135M", "1.2B", "8B" ("" when unknown)."""
    if count <= 0:
        return ""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            value = count / scale
            text = f"{value:.0f}" if value >= 100 else f"{value:.1f}".removesuffix(".0")
            return text + unit
    return str(count)


def details(config: dict[str, Any], quant: str, path: Path | None = None) -> dict[str, Any]:
    arch = str(config.get("architecture") or "unknown")
    size = str(config.get("parameter_size") or "") or (
        parameter_size(parameter_count(path)) if path is not None else "")
    return {"parent_model": "", "format": "tvm", "family": arch, "families": [arch],
            "parameter_size": size, "quantization_level": quant}


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def durations(tracker: Tracker, finish: FinishEvent | None, started: float,
              load_s: float) -> dict[str, Any]:
    stats = finish.reply.stats if finish is not None else None
    total = time.perf_counter() - started
    prompt_s = (stats.prompt_tokens / stats.prefill_tok_s
                if stats is not None and stats.prefill_tok_s else 0.0)
    eval_s = ((stats.completion_tokens - 1) / stats.decode_tok_s
              if stats is not None and stats.decode_tok_s else 0.0)
    return {
        "done_reason": (finish.finish_reason if finish is not None else "stop"),
        "total_duration": int(total * 1e9), "load_duration": int(load_s * 1e9),
        "prompt_eval_count": stats.prompt_tokens if stats else 0,
        "prompt_eval_duration": int(prompt_s * 1e9),
        "eval_count": stats.completion_tokens if stats else 0,
        "eval_duration": int(eval_s * 1e9),
    }


def _with_calls(chunk: dict[str, Any], calls: list[Any]) -> dict[str, Any]:
    """A chat body whose message carries Ollama's `tool_calls` (arguments as an object)."""
    message = {**chunk["message"], "tool_calls": [
        {"function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in calls]}
    return {**chunk, "message": message}


def wants_truncation(body: p.OllamaBase) -> bool:
    """Whether a request allows dropping its oldest turns to fit the window (`truncate`, at the
    top level or in `options`)."""
    return bool(body.truncate) or bool(body.options is not None and body.options.truncate)


def context_error(exc: ContextWindowError, loaded: LoadedModel, limit: int, truncate: bool,
                  turns: bool = True) -> ContextWindowError:
    """The 400 for a prompt the window cannot hold: the counts, and what could make it fit."""
    window = exc.context_window or loaded.context_window
    if truncate and turns:
        hint = "even with the oldest turns dropped; shorten the last message"
    elif truncate:
        hint = "and a single prompt has no earlier turns that truncate could drop; shorten it"
    elif turns:
        hint = 'shorten the messages, or send "truncate": true to drop the oldest turns'
    else:
        hint = "shorten the prompt"
    if window < limit:
        hint += f", or raise options.num_ctx (this model takes up to {limit})"
    room = "" if truncate and turns else " with room for the reply"
    return ContextWindowError(
        f"the prompt needs {exc.prompt_tokens} tokens{room} but the context window (num_ctx) "
        f"holds {window}: {hint}", prompt_tokens=exc.prompt_tokens,
        context_window=window, param="messages")


async def _generate(request: Request, state: ServerState, body: p.OllamaBase,
                    start: Any, shape: Any, plan: Any = None,
                    cuts: list[Truncation | None] | None = None, turns: bool = True
                    ) -> Response:
    """Run one reply for /api/chat or /api/generate; `shape(text)` builds a response body.
    `plan()` is the request's ToolPlan once `start` has run (None: no tools): then text that
    could open a call is held back, and calls come as the message's `tool_calls`. `cuts` gets
    what `start` truncated (said in the response's headers); `turns`: whether the prompt is a
    conversation (a raw one has no turns to drop)."""
    started = time.perf_counter()
    keep_alive = keep_alive_seconds(body.keep_alive)
    num_ctx = body.options.num_ctx if body.options is not None else None
    overrides = {**options(body.options), **format_override(body.format)}
    if start is None and keep_alive == 0:  # Ollama: nothing to say and keep_alive 0 unloads
        await state.pool.expire(body.model)
        return JSONResponse({**shape(""), "done": True, "done_reason": "unload"})
    t0 = time.perf_counter()
    loaded: LoadedModel = await state.pool.acquire(body.model, num_ctx=num_ctx,
                                                   keep_alive=keep_alive)
    load_s = time.perf_counter() - t0
    release: Any = loaded
    try:
        if start is None:  # no messages / no prompt: just load the model
            return JSONResponse({**shape(""), "done": True, "done_reason": "load"})
        try:
            streams = [start(loaded.engine, overrides)]
        except ContextWindowError as exc:
            raise context_error(exc, loaded, state.pool.model_window(loaded.path),
                                wants_truncation(body), turns) from None
        except InvalidRequestError as exc:
            if exc.param != "response_format":
                raise
            raise InvalidRequestError(str(exc).replace("response_format", "format", 1),
                                      "format") from None
        headers = truncation_headers(cuts[0] if cuts else None)
        tracker = Tracker(state.metrics, loaded.ref, started)
        events = merged(streams, tracker)
        calls = plan() if plan is not None else None
        if body.stream is False:
            async with cancel_on_disconnect(request, streams):
                (choice,) = await collect(events, 1)
            done = {"done": True, **durations(tracker, choice.finish, started, load_s)}
            if calls is not None:
                harmony = choice.finish.reply.tool_calls if choice.finish else ()
                content, found = parse_calls(choice.text, calls.style, calls.tools, harmony)
                if found:
                    return JSONResponse(
                        {**_with_calls(shape(content, choice.reasoning), found), **done},
                        headers=headers)
            return JSONResponse({**shape(choice.text, choice.reasoning), **done},
                                headers=headers)
        async with cancel_on_disconnect(request, streams):
            first = await anext(events)

        async def lines(events: AsyncIterator[tuple[int, TokenEvent | FinishEvent]]
                        ) -> AsyncIterator[str]:
            text, sent = "", 0  # with tools: the reply so far, and how much of it was sent
            try:
                async for _, event in events:
                    if event.reasoning:  # thinking streams as it comes, before the answer
                        yield json.dumps({**shape("", event.reasoning), "done": False}) + "\n"
                    if calls is not None:
                        text += event.text
                        found: list[Any] = []
                        if isinstance(event, FinishEvent):
                            _, found = parse_calls(text, calls.style, calls.tools,
                                                   event.reply.tool_calls)
                        safe = (len(text) if isinstance(event, FinishEvent) and not found
                                else streamable(text, calls.style))
                        if safe > sent:
                            yield json.dumps({**shape(text[sent:safe]), "done": False}) + "\n"
                            sent = safe
                        if found:
                            yield json.dumps({**_with_calls(shape(""), found),
                                              "done": False}) + "\n"
                        if isinstance(event, TokenEvent):
                            continue
                    elif isinstance(event, TokenEvent):
                        if event.text:
                            yield json.dumps({**shape(event.text), "done": False}) + "\n"
                        continue
                    elif event.text:
                        yield json.dumps({**shape(event.text), "done": False}) + "\n"
                    yield json.dumps({**shape(""), "done": True,
                                      **durations(tracker, event, started, load_s)}) + "\n"
            except Exception as exc:  # noqa: BLE001 - the status is sent: report in the stream
                log.error("a streamed reply failed: %s: %s", type(exc).__name__, exc)
                yield json.dumps({"error": str(exc)}) + "\n"

        response = ReplyStreamingResponse(
            lines(prepend(first, events)), streams, media_type=NDJSON,
            on_close=lambda: state.pool.release(loaded), headers=headers)
        release = None
        return response
    finally:
        if release is not None:
            await state.pool.release(loaded)


@router.post("/chat")
async def chat(request: Request) -> Response:
    state = state_of(request)
    body = p.OllamaChatRequest.model_validate_json(await read_body(request))
    tools = check_tools(body.tools)
    messages = [_chat_message(i, m) for i, m in enumerate(body.messages or [])]
    defs = [t.definition for t in tools] or None
    plans: list[ToolPlan] = []
    cuts: list[Truncation | None] = []
    truncate = wants_truncation(body)

    def start(engine: Any, o: dict[str, Any]) -> Any:
        template = engine.template
        if (tools or uses_tools(messages)) and not template.supports_tools:
            raise InvalidRequestError(
                f"{body.model} does not support tools: its chat template ({template.name}) "
                f"does not render them", "tools" if tools else "messages")
        if tools:  # Ollama has no tool_choice: the model may answer or call ("auto")
            if "response_format" in o:
                raise InvalidRequestError("format cannot be combined with tools", "format")
            plans.append(ToolPlan(template.tool_call_style, tools))
            call_fmt = call_format(template.tool_call_style, "auto", tools)
            if call_fmt is not None:
                o = {**o, "response_format": call_fmt}
        kept, cut = fit_messages(engine, messages, o.get("max_tokens"), defs,
                                 truncate=truncate, model=body.model, think=body.think)
        cuts.append(cut)
        return engine.chat(kept, tools=defs, overflow="truncate" if truncate else None,
                           think=body.think, **o)

    def shape(text: str, thinking: str = "") -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        return {"model": body.model, "created_at": now_iso(), "message": message}

    return await _generate(request, state, body, start if messages else None, shape,
                           lambda: plans[0] if plans else None, cuts)


def _chat_message(i: int, m: p.OllamaMessage) -> dict[str, Any]:
    """One /api/chat message for the template: an assistant's `tool_calls` in the OpenAI shape
    (arguments as an object), a tool result with its function's name."""
    if m.images:
        raise InvalidRequestError(f"messages[{i}]: images are not supported", "images")
    message: dict[str, Any] = {"role": m.role, "content": m.content or ""}
    if m.tool_calls:
        if m.role != "assistant":
            raise InvalidRequestError(f"messages[{i}]: only assistant messages have tool_calls",
                                      f"messages[{i}].tool_calls")
        calls = []
        for k, call in enumerate(m.tool_calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise InvalidRequestError(
                    f"messages[{i}].tool_calls[{k}] must be {{\"function\": {{\"name\": ..., "
                    f"\"arguments\": {{...}}}}}}", f"messages[{i}].tool_calls")
            args = fn.get("arguments") or {}
            calls.append({"type": "function",
                          "function": {"name": fn["name"], "arguments": args}})
        message["tool_calls"] = calls
    if m.role == "tool" and m.tool_name:
        message["name"] = m.tool_name
    if m.role == "assistant" and m.thinking:
        message["reasoning_content"] = m.thinking  # the key Qwen3's template reads
    return message


@router.post("/generate")
async def generate(request: Request) -> Response:
    state = state_of(request)
    body = p.OllamaGenerateRequest.model_validate_json(await read_body(request))
    if body.images:
        raise InvalidRequestError("images are not supported", "images")
    if body.suffix:
        raise InvalidRequestError("suffix is not supported", "suffix")
    prompt = body.prompt or ""
    start: Any = None
    if prompt:
        if body.raw:
            def start(engine: Any, o: dict[str, Any]) -> Any:
                return engine.complete(prompt, **o)
        else:
            messages = ([{"role": "system", "content": body.system}] if body.system else [])
            messages.append({"role": "user", "content": prompt})

            def start(engine: Any, o: dict[str, Any]) -> Any:
                # one turn: nothing truncate could drop, so the window decides alone
                return engine.chat(messages, think=body.think, **o)

    def shape(text: str, thinking: str = "") -> dict[str, Any]:
        out = {"model": body.model, "created_at": now_iso(), "response": text}
        if thinking:
            out["thinking"] = thinking
        return out

    return await _generate(request, state, body, start, shape, turns=False)


def _model_entry(name: str, path: Any, size: int, config: dict[str, Any],
                 quant: str) -> dict[str, Any]:
    """A model as /api/tags and /api/ps list it, by its listed name (the digest stays with the
    directory when what a bare name means changes)."""
    try:
        modified = iso(path.stat().st_mtime)
    except OSError:
        modified = now_iso()
    return {"name": name, "model": name, "modified_at": modified, "size": size,
            "digest": digest(str(path)), "details": details(config, quant, path)}


@router.api_route("/tags", methods=["GET", "HEAD"])
async def tags(request: Request) -> JSONResponse:
    state = state_of(request)
    models = [_model_entry(name, m.path, m.size_bytes, m.config, m.quantization)
              for name, m in state.pool.listed()]
    return JSONResponse({"models": models})


@router.post("/show")
async def show(request: Request) -> JSONResponse:
    state = state_of(request)
    body = p.OllamaModelRequest.model_validate_json(await read_body(request))
    if not body.ref:
        raise InvalidRequestError("model is required", "model")
    ref, path = state.pool.resolve(body.ref)
    loaded = state.pool.loaded.get(path)
    # the window a request without num_ctx runs with (the loaded one's, if it is loaded)
    num_ctx = (loaded.context_window if loaded is not None and not loaded.closing
               else state.pool.window_for(path, None, ref))
    from localchat import GenerationConfig
    from localchat import model_dir as md

    config = md.load_config(path)
    quant = str(config.get("quantization") or "")
    defaults = GenerationConfig.from_model_defaults(path)
    # Ollama's parameter names; the same defaults `run` and the UI use
    params = "\n".join(f"{name} {getattr(defaults, field)}" for name, field in (
        ("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"),
        ("min_p", "min_p"), ("repeat_penalty", "repetition_penalty"),
        ("repeat_last_n", "repetition_window")))
    params += f"\nnum_ctx {num_ctx}"
    template_file = path / "chat_template.jinja"
    template = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                else str(config.get("template") or ""))
    arch = str(config.get("architecture") or "unknown")
    info: dict[str, Any] = {"general.architecture": arch}
    for key, value in (config.get("model_config") or {}).items():
        if isinstance(value, (int, float, str, bool)):
            info[f"{arch}.{key}"] = value
    info[f"{arch}.context_length"] = config.get("context_window_size")  # the model's own
    info["general.parameter_count"] = parameter_count(path)
    entry = _model_entry(ref, path, 0, config, quant)
    return JSONResponse({"modelfile": f"# localchat model {ref}\nFROM {ref}\n",
                         "parameters": params, "template": template,
                         "details": entry["details"], "model_info": info,
                         "capabilities": capabilities(path, config, loaded),
                         "modified_at": entry["modified_at"]})


def capabilities(path: Path, config: dict[str, Any], loaded: LoadedModel | None) -> list[str]:
    """What Ollama's `/api/show` says a model can do: "embedding" for an embedding model;
    else "completion", "tools" when its chat template renders tools, "thinking" when it is a
    reasoning model (its template writes think blocks or its vocabulary has the tags)."""
    from localchat import model_dir as md

    if config.get(md.EMBEDDING_KEY) is not None:
        return ["embedding"]
    engine = loaded.engine if loaded is not None and not loaded.closing else None
    if engine is not None:
        template, thinks = engine.template, bool(engine.thinks)
    else:  # not loaded: the template and the tokenizer's files, no model load
        from localchat.engine import resolve_template

        template = resolve_template(path, None, config.get("template"))
        thinks = bool(template.thinks) or _think_tags_are_tokens(path)
    found = ["completion"]
    if template.supports_tools:
        found.append("tools")
    if thinks:
        found.append("thinking")
    return found


def _think_tags_are_tokens(path: Path) -> bool:
    """Whether the model's tokenizer.json has `<think>` and `</think>`, or harmony's channel
    markers (gpt-oss), as tokens of their own (as the engine's `ThinkTags` and
    `HarmonyTokens` find them once the tokenizer is loaded)."""
    try:
        data = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    added = {str(t.get("content")) for t in data.get("added_tokens") or []
             if isinstance(t, dict)}
    vocab = (data.get("model") or {}).get("vocab")
    vocab = vocab if isinstance(vocab, dict) else {}
    return any(all(tag in added or tag in vocab for tag in pair)
               for pair in (("<think>", "</think>"), ("<|channel|>", "<|message|>")))


@router.get("/ps")
async def ps(request: Request) -> JSONResponse:
    """The loaded models: when each will be unloaded (`expires_at`), the context window it runs
    with (`context_length`), and its memory (`size_vram`: 0 on the CPU)."""
    state = state_of(request)
    models = []
    names = state.pool.listed_names()
    for loaded in list(state.pool.loaded.values()):
        quant = str(loaded.config.get("quantization") or "")
        entry = _model_entry(names.get(loaded.path, loaded.ref), loaded.path, loaded.size_bytes,
                             loaded.config, quant)
        entry["expires_at"] = expiry_iso(loaded.expiry())
        entry["size_vram"] = 0 if _device_kind(loaded) == "cpu" else loaded.size_bytes
        entry["context_length"] = loaded.context_window
        entry.pop("modified_at")
        models.append(entry)
    return JSONResponse({"models": models})


def _device_kind(loaded: LoadedModel) -> str:
    """The kind of device a model runs on ("cpu", "cuda", ...)."""
    device = getattr(getattr(loaded.engine, "model", None), "device", None)
    return str(getattr(device, "kind", "cpu"))


@router.api_route("/version", methods=["GET", "HEAD"])
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


class _ClientGone(Exception):
    """The client of a pull went away: the download stops (the next pull resumes it)."""


class _QueueProgress:
    """A DownloadProgress that forwards pull progress to the event loop as status lines, and
    stops the download once `gone` is set."""

    def __init__(self, put: Any, gone: threading.Event) -> None:
        self.put = put
        self.gone = gone
        self.sizes: dict[str, int | None] = {}
        self.done: dict[str, int] = {}

    def _check(self) -> None:
        if self.gone.is_set():
            raise _ClientGone("the client went away")

    def begin(self, files: Any, done_bytes: int) -> None:
        self.sizes = dict(files)
        self._check()

    def file_begin(self, path: str, size: int | None, done: int) -> None:
        self.sizes[path] = size
        self.done[path] = done
        self._emit(path)
        self._check()

    def advance(self, path: str, nbytes: int) -> None:
        self.done[path] = self.done.get(path, 0) + nbytes
        self._emit(path)
        self._check()

    def file_end(self, path: str) -> None:
        size = self.sizes.get(path)
        if size is not None:
            self.done[path] = size
        self._emit(path)

    def end(self) -> None:
        self.put({"status": "verifying sha256 digest"})

    def _emit(self, path: str) -> None:
        line: dict[str, Any] = {"status": f"pulling {path}", "digest": path,
                                "completed": self.done.get(path, 0)}
        if self.sizes.get(path) is not None:
            line["total"] = self.sizes[path]
        self.put(line)


@router.post("/pull")
async def pull(request: Request) -> Response:
    state = state_of(request)
    body = p.OllamaPullRequest.model_validate_json(await read_body(request))
    if not body.ref:
        raise InvalidRequestError("model is required", "model")
    from localchat.downloader import engine_hooks, parse_source
    from localchat.downloader import pull as run_pull
    from localchat.recipes import QUANT_RE

    ref = body.ref
    if ref.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"the model {ref!r} cannot be pulled over the API: name a "
                                 f"model or a hub repo")
    name, _, quant = ref.rpartition(":")
    if not (name and QUANT_RE.match(quant)):  # `name:quant` picks (or compiles) that one
        name, quant = ref, ""
    parse_source(name)  # an unknown name is a 404 before anything streams
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    gone = threading.Event()

    def put(line: dict[str, Any] | None) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, line)

    def work() -> None:
        put({"status": "pulling manifest"})  # Ollama's first line, before anything is resolved
        try:
            store = state.pool.store
            hooks = engine_hooks(state.config.device, store, lambda m: put({"status": m}))
            result = run_pull(name, hooks=hooks, store=store, quantization=quant or None,
                              progress=_QueueProgress(put, gone),
                              log=lambda m: put({"status": m}))
            put({"status": "writing manifest"})
            put({"status": result.summary()})
            put({"status": "success"})
        except _ClientGone:
            log.info("pull of %s stopped: its client went away", ref)
        except LocalchatError as exc:
            put({"error": str(exc)})
        except Exception as exc:  # noqa: BLE001 - reported to the client, the server goes on
            put({"error": f"pull failed: {type(exc).__name__}: {exc}"})
        finally:
            put(None)

    task = loop.run_in_executor(None, work)

    async def lines() -> AsyncIterator[str]:
        try:
            while (line := await queue.get()) is not None:
                yield json.dumps(line) + "\n"
            await task
        finally:  # ended, or the client went away: a download still running stops
            gone.set()
            state.pool.forget()  # a pull may have changed what a bare name means

    if body.stream is False:
        last: dict[str, Any] = {}
        async for text in lines():
            last = json.loads(text)
            if "error" in last:
                raise LocalchatError(last["error"])
        return JSONResponse({"status": last.get("status", "success")})
    return StreamingResponse(lines(), media_type=NDJSON)


@router.post("/copy")
async def copy(request: Request) -> Response:
    """Store a model again under another name (`destination`, keeping the quantization): both
    are then listed and run (Ollama's `cp`)."""
    state = state_of(request)
    body = p.OllamaCopyRequest.model_validate_json(await read_body(request))
    source = checked_name(body.source, "source")
    destination = checked_name(body.destination, "destination")
    pool = state.pool
    try:
        copied = await asyncio.to_thread(pool.store.copy, source, destination)
    except StoreError as exc:
        raise InvalidRequestError(str(exc), "destination") from None
    except ModelNotFoundError:
        raise ModelNotFoundError(f"model {source!r} not found") from None
    pool.forget()  # the new name resolves from now on
    log.info("copied %s to %s", source, copied.ref)
    return Response(status_code=200)


@router.delete("/delete")
async def delete(request: Request) -> Response:
    """Delete a stored model (`name` its default quantization, as Ollama's `name` is
    `name:latest`; `name:quant` that one); a loaded copy is unloaded first, cancelling its
    running replies."""
    state = state_of(request)
    body = p.OllamaModelRequest.model_validate_json(await read_body(request))
    ref = checked_name(body.ref)
    pool = state.pool
    matches = pool.store.find(ref)
    if not matches:
        raise ModelNotFoundError(f"model {ref!r} not found")
    paths = {m.path for m in matches}
    for loaded in list(pool.loaded.values()):
        if loaded.path in paths:
            await pool.unload(loaded)
    pool.forget(paths)
    await asyncio.to_thread(pool.store.remove, ref)
    pool.forget()  # the name's default may have passed to another quantization
    log.info("deleted %s", ", ".join(m.ref for m in matches))
    return Response(status_code=200)
