"""The Ollama-compatible routes under /api: chat and generate (NDJSON streaming), tags, show,
ps, version and pull. Errors are `{"error": "message"}` (see errors.py)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from localchat import FinishEvent, TokenEvent, __version__
from localchat.errors import InvalidRequestError, LocalchatError, ModelNotFoundError
from localchat.server import protocol as p
from localchat.server.openai_api import ToolPlan, uses_tools
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
FAR_FUTURE = "2318-08-01T00:00:00Z"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def keep_alive_seconds(value: float | str | None) -> float | None:
    """Ollama's keep_alive (seconds, or "5m", "1h30m", "-1") in seconds; None when unset."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    parts = re.findall(r"(-?\d+(?:\.\d+)?)(ms|s|m|h)", text)
    if not parts or "".join(a + b for a, b in parts) != text:
        raise InvalidRequestError(f"keep_alive: cannot parse {value!r} as a duration",
                                  "keep_alive")
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(a) * scale[b] for a, b in parts)


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


def details(config: dict[str, Any], quant: str) -> dict[str, Any]:
    arch = str(config.get("architecture") or "unknown")
    return {"parent_model": "", "format": "tvm", "family": arch, "families": [arch],
            "parameter_size": str(config.get("parameter_size") or ""),
            "quantization_level": quant}


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


async def _generate(request: Request, state: ServerState, body: p.OllamaBase,
                    start: Any, shape: Any, plan: Any = None) -> Response:
    """Run one reply for /api/chat or /api/generate; `shape(text)` builds a response body.
    `plan()` is the request's ToolPlan once `start` has run (None: no tools): then text that
    could open a call is held back, and calls come as the message's `tool_calls`."""
    started = time.perf_counter()
    keep_alive = keep_alive_seconds(body.keep_alive)
    overrides = {**options(body.options), **format_override(body.format)}
    t0 = time.perf_counter()
    loaded: LoadedModel = await state.pool.acquire(body.model)
    load_s = time.perf_counter() - t0
    release: Any = loaded
    try:
        if start is None:  # no messages / no prompt: just load the model
            return JSONResponse({**shape(""), "done": True, "done_reason": "load"})
        try:
            streams = [start(loaded.engine, overrides)]
        except InvalidRequestError as exc:
            if exc.param != "response_format":
                raise
            raise InvalidRequestError(str(exc).replace("response_format", "format", 1),
                                      "format") from None
        tracker = Tracker(state.metrics, loaded.ref, started)
        events = merged(streams, tracker)
        calls = plan() if plan is not None else None
        if body.stream is False:
            async with cancel_on_disconnect(request, streams):
                (choice,) = await collect(events, 1)
            done = {"done": True, **durations(tracker, choice.finish, started, load_s)}
            if calls is not None:
                content, found = parse_calls(choice.text, calls.style, calls.tools)
                if found:
                    return JSONResponse({**_with_calls(shape(content), found), **done})
            return JSONResponse({**shape(choice.text), **done})
        async with cancel_on_disconnect(request, streams):
            first = await anext(events)

        async def lines(events: AsyncIterator[tuple[int, TokenEvent | FinishEvent]]
                        ) -> AsyncIterator[str]:
            text, sent = "", 0  # with tools: the reply so far, and how much of it was sent
            try:
                async for _, event in events:
                    if calls is not None:
                        text += event.text
                        found: list[Any] = []
                        if isinstance(event, FinishEvent):
                            _, found = parse_calls(text, calls.style, calls.tools)
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
            on_close=lambda: state.pool.release(loaded, keep_alive))
        release = None
        return response
    finally:
        if release is not None:
            await state.pool.release(loaded, keep_alive)


@router.post("/chat")
async def chat(request: Request) -> Response:
    state = state_of(request)
    body = p.OllamaChatRequest.model_validate_json(await read_body(request))
    tools = check_tools(body.tools)
    messages = [_chat_message(i, m) for i, m in enumerate(body.messages or [])]
    defs = [t.definition for t in tools] or None
    plans: list[ToolPlan] = []

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
            o = {**o, "response_format": call_format(template.tool_call_style, "auto", tools)}
        return engine.chat(messages, tools=defs, **o)

    def shape(text: str) -> dict[str, Any]:
        return {"model": body.model, "created_at": now_iso(),
                "message": {"role": "assistant", "content": text}}

    return await _generate(request, state, body, start if messages else None, shape,
                           lambda: plans[0] if plans else None)


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
                return engine.chat(messages, **o)

    def shape(text: str) -> dict[str, Any]:
        return {"model": body.model, "created_at": now_iso(), "response": text}

    return await _generate(request, state, body, start, shape)


def _model_entry(name: str, path: Any, size: int, config: dict[str, Any],
                 quant: str) -> dict[str, Any]:
    """A model as /api/tags and /api/ps list it, by its listed name (the digest stays with the
    directory when what a bare name means changes)."""
    try:
        modified = iso(path.stat().st_mtime)
    except OSError:
        modified = now_iso()
    return {"name": name, "model": name, "modified_at": modified, "size": size,
            "digest": digest(str(path)), "details": details(config, quant)}


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
    template_file = path / "chat_template.jinja"
    template = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                else str(config.get("template") or ""))
    arch = str(config.get("architecture") or "unknown")
    info: dict[str, Any] = {"general.architecture": arch}
    for key, value in (config.get("model_config") or {}).items():
        if isinstance(value, (int, float, str, bool)):
            info[f"{arch}.{key}"] = value
    info[f"{arch}.context_length"] = config.get("context_window_size")
    entry = _model_entry(ref, path, 0, config, quant)
    return JSONResponse({"modelfile": f"# localchat model {ref}\nFROM {ref}\n",
                         "parameters": params, "template": template,
                         "details": entry["details"], "model_info": info,
                         "capabilities": ["completion"], "modified_at": entry["modified_at"]})


@router.get("/ps")
async def ps(request: Request) -> JSONResponse:
    state = state_of(request)
    models = []
    names = state.pool.listed_names()
    for loaded in state.pool.loaded.values():
        quant = str(loaded.config.get("quantization") or "")
        entry = _model_entry(names.get(loaded.path, loaded.ref), loaded.path, loaded.size_bytes,
                             loaded.config, quant)
        entry["expires_at"] = iso(loaded.expires_at) if loaded.expires_at else FAR_FUTURE
        entry["size_vram"] = 0
        entry["context_length"] = loaded.engine.context_window
        entry.pop("modified_at")
        models.append(entry)
    return JSONResponse({"models": models})


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


@router.delete("/delete")
async def delete(request: Request) -> Response:
    """Delete a stored model (`name` its default quantization, as Ollama's `name` is
    `name:latest`; `name:quant` that one); a loaded copy is unloaded first, cancelling its
    running replies."""
    state = state_of(request)
    body = p.OllamaModelRequest.model_validate_json(await read_body(request))
    if not body.ref:
        raise InvalidRequestError("model is required", "model")
    pool = state.pool
    matches = pool.store.find(body.ref)
    if not matches:
        raise ModelNotFoundError(f"model {body.ref!r} not found")
    paths = {m.path for m in matches}
    for loaded in list(pool.loaded.values()):
        if loaded.path in paths:
            await pool.unload(loaded)
    pool.forget(paths)
    await asyncio.to_thread(pool.store.remove, body.ref)
    pool.forget()  # the name's default may have passed to another quantization
    log.info("deleted %s", ", ".join(m.ref for m in matches))
    return Response(status_code=200)
