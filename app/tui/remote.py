"""The UI over a running `localchat serve` (or any OpenAI-compatible server): `localchat --server
URL`. `RemoteBackend` lists models with `GET /v1/models` and `RemoteChatModel` streams replies
from `POST /v1/chat/completions`, handing the screens the same `ReplyStream` of `TokenEvent`s and
one `FinishEvent` the in-process engine gives them. Timings are measured here, on the client;
token counts come from the server's `usage`. Pulling, deleting and compiling are not part of the
OpenAI API: they go through the Ollama API (`/api/pull` streaming its progress, `/api/delete`)
where the server has it, as `localchat serve` and Ollama do; elsewhere they raise
`NotAvailableRemotely` with a message saying where to do them.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx

from localchat import FinishEvent, Reply, ReplyStats, ReplyStream, TokenEvent
from localchat.errors import LocalchatError, ModelNotFoundError
from localchat.tui.backend import (
    RECOMMENDED,
    CatalogEntry,
    Log,
    ModelInfo,
    PullCancelled,
    Pulled,
    recipe_catalog,
)
from localchat.tui.settings import ChatSettings

if TYPE_CHECKING:
    from localchat.downloader import DownloadProgress

API_KEY_ENV = "LOCALCHAT_API_KEY"
CONNECT_TIMEOUT_S = 5.0
# a reply may wait on the server loading or compiling a model before its first token
READ_TIMEOUT_S = 600.0


class ServerError(LocalchatError):
    """The server answered with an error (its `{"error": ...}` message), or could not be
    reached; the message is one line meant for the user."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class NotAvailableRemotely(LocalchatError):
    """A store action (pull, delete, compile) that the server does not offer."""


def error_message(response: httpx.Response) -> str:
    """One line from an error response: the server's message (OpenAI's `{"error": {...}}` or
    Ollama's `{"error": "..."}`), else the status line."""
    try:
        body = response.json()
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        error = error.get("message")
    text = " ".join(str(error).split()) if error else (response.reason_phrase or "error")
    return f"{text} (HTTP {response.status_code})"


def _split_ref(ref: str) -> tuple[str, str]:
    name, sep, quant = ref.rpartition(":")
    return (name, quant) if sep and name else (ref, "")


class RemoteReplyStream(ReplyStream):
    """A `ReplyStream` fed by a reader thread from the server's SSE chunks. `cancel()` ends it
    at once with the text received so far (finish reason "cancelled") and the reader closes
    the HTTP stream, which the server takes as the client going away and stops generating."""

    def __init__(self, response: httpx.Response, started: float) -> None:
        super().__init__(0)
        self._response = response
        self._started = started
        self._end_lock = threading.Lock()
        self._ended = False
        self._received: list[str] = []
        self._thoughts: list[str] = []
        self._first: float | None = None
        self._last: float | None = None
        self._chunks = 0
        self._usage: dict[str, Any] = {}
        self._reason = "stop"
        self._reader = threading.Thread(target=self._read, name="localchat-remote-reply",
                                        daemon=True)
        self._reader.start()

    def cancel(self) -> None:
        """Stop the reply now, keeping the text received so far."""
        super().cancel()
        self._end("cancelled")

    def _stats(self, reason: str) -> ReplyStats:
        prompt = int(self._usage.get("prompt_tokens") or 0)
        completion = int(self._usage.get("completion_tokens") or self._chunks)
        ttft = (self._first - self._started) if self._first is not None else 0.0
        decode = 0.0
        if self._first is not None and self._last is not None and self._last > self._first:
            decode = max(0, completion - 1) / (self._last - self._first)
        return ReplyStats(
            prompt_tokens=prompt, completion_tokens=completion, ttft_s=ttft,
            prefill_tok_s=prompt / ttft if prompt and ttft > 0 else 0.0, decode_tok_s=decode,
            finish_reason=reason, context_tokens=prompt + completion)

    def _end(self, reason: str, error: BaseException | None = None) -> None:
        # the reader thread and cancel() race to end the stream: the first one wins
        with self._end_lock:
            if self._ended:
                return
            self._ended = True
            if error is not None:
                self.finish(None, error)
                self.put(error)
                return
            reply = Reply("".join(self._received), [], reason, self._stats(reason),
                          reasoning="".join(self._thoughts))
            self.finish(reply)
            self.put(FinishEvent(self.id, "", reply))

    def _token(self, text: str, reasoning: str = "") -> None:
        with self._end_lock:
            if self._ended:
                return
            now = time.monotonic()
            if self._first is None:
                self._first = now
            self._last = now
            self._chunks += 1
            self._received.append(text)
            self._thoughts.append(reasoning)
            self.put(TokenEvent(self.id, -1, text, reasoning=reasoning))

    def _read(self) -> None:
        try:
            for data in _sse_data(self._response.iter_lines()):
                if self.cancelled:
                    break
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    raise ServerError(f"the server failed: {message}")
                if chunk.get("usage"):
                    self._usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    content, thought = delta.get("content"), delta.get("reasoning_content")
                    if content or thought:  # thinking: vLLM's and DeepSeek's field
                        self._token(content or "", thought or "")
                    if choice.get("finish_reason"):
                        self._reason = "length" if choice["finish_reason"] == "length" else "stop"
        except LocalchatError as exc:
            self._end("error", exc)
        except httpx.HTTPError as exc:
            if not self.cancelled:  # closing a cancelled stream may break the read: expected
                self._end("error", ServerError(f"the reply stream broke: {exc}"))
        except Exception as exc:  # noqa: BLE001 - a malformed chunk ends the reply, shown
            self._end("error", ServerError(
                f"the server sent a malformed reply chunk ({type(exc).__name__}: {exc})"))
        finally:
            self._response.close()
        self._end("cancelled" if self.cancelled else self._reason)


# `/api/show` parameter names (Ollama's where they differ) -> GenerationConfig's, and the type
OLLAMA_PARAMETERS: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float),
    "top_k": ("top_k", int),
    "top_p": ("top_p", float),
    "min_p": ("min_p", float),
    "repetition_penalty": ("repetition_penalty", float),
    "repeat_penalty": ("repetition_penalty", float),
    "repetition_window": ("repetition_window", int),
    "repeat_last_n": ("repetition_window", int),
}


def parse_parameters(text: object) -> dict[str, Any] | None:
    """The sampling defaults in an Ollama `/api/show` "parameters" text (a `name value` line
    each); None when it names none."""
    out: dict[str, Any] = {}
    for line in str(text or "").splitlines():
        name, _, value = line.strip().partition(" ")
        if name not in OLLAMA_PARAMETERS:
            continue
        field, kind = OLLAMA_PARAMETERS[name]
        try:
            out[field] = kind(float(value.strip()))
        except ValueError:
            continue
    return out or None


def pulled_ref(ref: str, summary: str, served: Sequence[str]) -> str:
    """Which served model a pull of `ref` installed: the one it names (a served name, or a
    bare name one quantization of it has), else the one its summary line names; "" if none."""
    named = [m for m in served if m == ref] or [m for m in served if _split_ref(m)[0] == ref]
    if len(named) == 1:
        return named[0]
    said = [m for m in served if re.search(rf"(?<!\S){re.escape(m)}(?=[:\s]|$)", summary)]
    return said[0] if len(said) == 1 else ""


def _sse_data(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith("data:"):
            yield line[5:].strip()


def request_body(model: str, messages: Sequence[dict[str, str]],
                 settings: ChatSettings) -> dict[str, Any]:
    """The `/v1/chat/completions` request for a conversation: the system prompt first, the
    conversation's sampling settings as the request's fields (top_k, min_p and
    repetition_penalty are localchat's extensions), streamed with usage."""
    system = [{"role": "system", "content": settings.system}] if settings.system else []
    body: dict[str, Any] = {
        "model": model,
        "messages": system + [{"role": m["role"], "content": m["content"]} for m in messages],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(settings.overrides())
    if settings.think is not None:  # vLLM's (and llama.cpp's) way to switch thinking
        body["chat_template_kwargs"] = {"enable_thinking": settings.think}
    return body


class RemoteChatModel:
    """A model served by the server; every reply is a stateless request with the whole
    conversation (the server keeps no conversation state)."""

    def __init__(self, backend: RemoteBackend, ref: str, context_window: int,
                 defaults: dict[str, Any] | None = None) -> None:
        self.backend = backend
        self.name = ref
        self.context_window = context_window
        self.device = backend.where
        self.defaults = defaults
        self.thinks = True  # not known here: a server refuses thinking for a model without it

    def reply(self, key: str, messages: Sequence[dict[str, str]],
              settings: ChatSettings) -> RemoteReplyStream:
        if not messages or messages[-1]["role"] != "user":
            raise ValueError("the last message must be the user's")
        started = time.monotonic()
        response = self.backend.stream("POST", "/v1/chat/completions",
                                       json=request_body(self.name, messages, settings))
        return RemoteReplyStream(response, started)

    def forget(self, key: str) -> None:
        pass  # nothing is held per conversation

    def close(self) -> None:
        pass  # the server owns the model


class RemoteBackend:
    """The models of the server at `url`, with `api_key` sent as a Bearer token."""

    def __init__(self, url: str, api_key: str | None = None, *,
                 transport: httpx.BaseTransport | None = None) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ServerError(f"--server must be an http(s) URL like http://127.0.0.1:11434, "
                              f"got {url!r}")
        self.url = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
        # whether pull and delete work here: learnt off the UI thread by `check`
        self.manages_store = False
        self.where = parts.netloc
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            base_url=self.url, headers=headers, transport=transport,
            timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))

    # HTTP ------------------------------------------------------------------------------------
    def _unreachable(self, exc: httpx.HTTPError) -> ServerError:
        return ServerError(f"cannot reach the server at {self.url}: {exc or type(exc).__name__}")

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """A JSON request; its decoded body (None when empty), or ServerError with the server's
        message."""
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
        if response.status_code >= 400:
            raise ServerError(error_message(response), response.status_code)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            raise ServerError(f"{self.url}{path} did not answer JSON: is this a localchat or "
                              f"OpenAI-compatible server?") from None

    def stream(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """A streamed response whose status is 200 (the caller closes it), or ServerError."""
        request = self._client.build_request(method, path, **kwargs)
        try:
            response = self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
        if response.status_code >= 400:
            try:
                response.read()
            finally:
                response.close()
            raise ServerError(error_message(response), response.status_code)
        return response

    def check(self) -> list[str]:
        """The served model ids; ServerError when the server is unreachable or refuses us."""
        body = self.request("GET", "/v1/models")
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            raise ServerError(f"{self.url}/v1/models is not an OpenAI model list")
        self._probe_store()
        return [str(m.get("id")) for m in data if isinstance(m, dict) and m.get("id")]

    # Backend ---------------------------------------------------------------------------------
    def _probe_store(self) -> None:
        """Learn whether the server pulls and deletes models: it has the Ollama API."""
        try:
            body = self.request("GET", "/api/version")
        except ServerError:
            body = None
        self.manages_store = isinstance(body, dict) and isinstance(body.get("version"), str)

    def _tags(self) -> dict[str, dict[str, Any]]:
        # localchat's Ollama API adds sizes and architectures; another server may lack it
        try:
            body = self.request("GET", "/api/tags")
        except ServerError:
            return {}
        models = body.get("models") if isinstance(body, dict) else None
        return {str(m.get("name")): m for m in models or [] if isinstance(m, dict)}

    def models(self) -> list[ModelInfo]:
        out = []
        tags = self._tags()
        for ref in self.check():
            name, quant = _split_ref(ref)
            tag = tags.get(ref, {})
            details = tag.get("details") if isinstance(tag.get("details"), dict) else {}
            size = tag.get("size")
            # a bare name (a default quantization) says its quantization in /api/tags only
            quant = quant or str(details.get("quantization_level") or "")
            out.append(ModelInfo(
                ref=ref, name=name, quantization=quant,
                architecture=str(details.get("family") or ""),
                targets=(f"server {self.where}",),
                size_bytes=size if isinstance(size, int) else 0,
                path=f"{self.url}/v1/models/{ref}"))
        return out

    def catalog(self) -> list[CatalogEntry]:
        # the recipe names a localchat server pulls by; nothing where it cannot pull
        return recipe_catalog() if self.manages_store else []

    def recommended(self) -> str:
        return RECOMMENDED

    def _show(self, ref: str) -> tuple[int, dict[str, Any] | None]:
        """The model's context window (0: unknown) and sampling defaults (None: unknown), from
        the Ollama API's `/api/show`, which localchat's server has and another may not."""
        try:
            body = self.request("POST", "/api/show", json={"model": ref})
        except ServerError:
            return 0, None
        if not isinstance(body, dict):
            return 0, None
        info = body.get("model_info") if isinstance(body.get("model_info"), dict) else {}
        value = next((v for k, v in info.items() if k.endswith(".context_length")), None)
        window = int(value) if isinstance(value, int) else 0
        return window, parse_parameters(body.get("parameters"))

    def load(self, ref: str, *, context_window: int | None = None,
             log: Log | None = None) -> RemoteChatModel:
        served = self.check()
        if ref not in served:
            matches = [m for m in served if _split_ref(m)[0] == ref]
            if len(matches) != 1:
                raise ModelNotFoundError(
                    f"the server at {self.url} does not serve {ref!r}; it serves: "
                    f"{', '.join(served) or 'no models'}", served)
            ref = matches[0]
        window, defaults = self._show(ref)
        return RemoteChatModel(self, ref, window, defaults)

    def _unavailable(self, what: str) -> NotAvailableRemotely:
        return NotAvailableRemotely(
            f"{what} is not available over --server (the OpenAI API has no such action): run "
            f"it on the server's machine, e.g. `localchat {what.split()[0]} NAME`")

    def remove(self, ref: str) -> None:
        if not self.manages_store:
            raise self._unavailable("rm (deleting a model)")
        self.request("DELETE", "/api/delete", json={"model": ref})

    def pull(self, ref: str, *, progress: DownloadProgress, stage: Callable[[str], None],
             log: Log, cancelled: Callable[[], bool]) -> Pulled:
        """Pull on the server (`/api/pull`), its progress lines reported as ours. Cancelling
        closes the stream: the server stops the download, and the next pull resumes it."""
        if not self.manages_store:
            raise self._unavailable("pull (downloading or compiling a model)")
        stage("prepare")
        tracker = _PullLines(progress, stage, log)
        response = self.stream("POST", "/api/pull", json={"model": ref, "stream": True})
        try:
            for line in response.iter_lines():
                if cancelled():
                    raise PullCancelled(f"pull of {ref} cancelled")
                if line.strip():
                    tracker.take(json.loads(line))
        except httpx.HTTPError as exc:
            raise ServerError(f"the server's pull of {ref} broke off: {exc}") from None
        except ValueError:
            raise ServerError(f"{self.url}/api/pull did not answer NDJSON") from None
        finally:
            response.close()
            tracker.end()
        if not tracker.succeeded:
            raise ServerError(f"the server's pull of {ref} ended without success")
        summary = tracker.summary or f"pulled {ref} on the server"
        return Pulled(pulled_ref(ref, summary, self.check()), summary)

    def close(self) -> None:
        self._client.close()


class _PullLines:
    """Ollama pull progress lines (`{"status", "digest", "total", "completed"}`) turned into
    the stages and per-file progress a local pull reports."""

    def __init__(self, progress: DownloadProgress, stage: Callable[[str], None],
                 log: Log) -> None:
        self.progress, self.stage, self.log = progress, stage, log
        self.files: dict[str, int] = {}  # bytes reported so far per file
        self.ended: set[str] = set()
        self.stages: list[str] = []
        self.summary = ""
        self.succeeded = False
        self.downloading = False

    def _enter(self, stage: str) -> None:
        if not self.stages or self.stages[-1] != stage:
            self.stages.append(stage)
            self.stage(stage)

    def take(self, line: dict[str, Any]) -> None:
        """Report one progress line; a line with an error raises it."""
        if line.get("error"):
            raise ServerError(f"the server's pull failed: {line['error']}")
        status = str(line.get("status") or "")
        path, done = line.get("digest"), line.get("completed")
        if isinstance(path, str) and isinstance(done, int):
            self._file(path, line.get("total"), done)
        elif status == "success":
            self.succeeded = True
        elif status.startswith("converting to "):
            self._enter(f"convert to {status.removeprefix('converting to ')}")
        elif status.startswith("compiling for "):
            self._enter(f"compile for {status.removeprefix('compiling for ')}")
        elif status and status not in ("pulling manifest", "verifying sha256 digest",
                                       "writing manifest"):
            self.summary = status  # the last free-form line is the pull's summary
            self.log(status)

    def _file(self, path: str, total: Any, done: int) -> None:
        size = total if isinstance(total, int) else None
        if not self.downloading:
            self.downloading = True
            self._enter("download")
        if path not in self.files:
            self.files[path] = done
            self.progress.begin([(path, size)], done)
            self.progress.file_begin(path, size, done)
        if done != self.files[path]:
            self.progress.advance(path, done - self.files[path])
            self.files[path] = done
        if size is not None and done >= size and path not in self.ended:
            self.ended.add(path)
            self.progress.file_end(path)

    def end(self) -> None:
        if self.downloading:
            self.progress.end()
