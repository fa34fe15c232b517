"""The FastAPI application: routes, the guard (API key, body limit, request metrics), CORS,
/health and /metrics, and the lifespan that preloads models and unloads expired ones."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from localchat import __version__
from localchat.server import (
    embeddings_api,
    errors,
    messages_api,
    ollama_api,
    openai_api,
    responses_api,
)
from localchat.server.config import ServerConfig
from localchat.server.errors import APIError, error_body
from localchat.server.listen import ROOT_TEXT, display_address, listen
from localchat.server.metrics import Metrics
from localchat.server.pool import ModelPool
from localchat.server.state import ServerState, state_of

log = logging.getLogger("localchat.server")
access_log = logging.getLogger("localchat.server.access")
OPEN_PATHS = ("/", "/health")  # `/` is the heartbeat Ollama's clients send
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
          "/tokenize", "/detokenize", "/api/chat", "/api/generate", "/api/tags", "/api/show",
          "/api/ps", "/api/version", "/api/pull", "/v1/responses", "/v1/messages",
          "/v1/messages/count_tokens", "/api/copy", "/api/delete", "/v1/embeddings",
          "/api/embed", "/api/embeddings")
REAP_EVERY_S = 5.0
ACCESS_BODY_BYTES = 64 * 1024  # of a body read for the access log's model name
_MODEL_FIELD = re.compile(rb'"(?:model|name|source)"\s*:\s*"((?:[^"\\]|\\.){1,200})"')


def printable(text: str, limit: int = 200) -> str:
    """`text` for a log line: control characters escaped (no forged lines), at most `limit`."""
    text = text if len(text) <= limit else text[:limit] + "..."
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: f"\\x{ord(m.group()):02x}", text)


def model_of(path: str, body: bytes) -> str:
    """The model a request names, for the access log: its JSON body's `model` (`name`,
    `source`), or the id of `/v1/models/{id}`; "-" when none."""
    if path.startswith("/v1/models/"):
        return path[len("/v1/models/"):] or "-"
    if not body:
        return "-"
    try:
        data = json.loads(body)
    except ValueError:  # cut at ACCESS_BODY_BYTES, or not JSON: the first field that says
        match = _MODEL_FIELD.search(body)
        return match.group(1).decode("utf-8", "replace") if match else "-"
    if isinstance(data, dict):
        for key in ("model", "name", "source"):
            if isinstance(data.get(key), str) and data[key]:
                return data[key]
    return "-"


def route_label(path: str) -> str:
    """A bounded label for a path (unknown paths share one)."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}"
    return "other"


class Guard:
    """Pure ASGI middleware: the API key, the body limit, and requests-by-status metrics."""

    def __init__(self, app: ASGIApp, config: ServerConfig, metrics: Metrics) -> None:
        self.app = app
        self.config = config
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        status = [500]
        started = time.perf_counter()
        head = bytearray()  # the body's start, for the access log
        logging_requests = self.config.log_requests

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            error = self._check(scope)
            if error is not None:
                await _send_error(error, path, send_status)
                return
            limit, seen = self.config.max_body_bytes, [0]

            async def limited_receive() -> Message:
                message = await receive()
                if message["type"] == "http.request":
                    seen[0] += len(message.get("body", b""))
                    if logging_requests and len(head) < ACCESS_BODY_BYTES:
                        head.extend(message.get("body", b"")[:ACCESS_BODY_BYTES - len(head)])
                    if seen[0] > limit:
                        raise APIError(413, f"the request body exceeds {limit} bytes")
                return message

            await self.app(scope, limited_receive, send_status)
        finally:
            self.metrics.request_done(method, route_label(path), status[0])
            if logging_requests:  # once the response has ended (a stream's last byte too)
                client = scope.get("client")
                access_log.info("%s \"%s %s\" %d %.3fs model=%s",
                                f"{client[0]}:{client[1]}" if client else "-", method,
                                printable(path), status[0], time.perf_counter() - started,
                                printable(model_of(path, bytes(head))))

    def _check(self, scope: Scope) -> APIError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        key = self.config.api_key
        if key and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            x_key = headers.get("x-api-key")  # where Anthropic's clients send the key
            if not auth and x_key is None:
                return APIError(401, "missing API key: send 'Authorization: Bearer <key>'")
            bearer = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                        key.encode())
            if not bearer and not (x_key is not None and hmac.compare_digest(
                    x_key.strip().encode(), key.encode())):
                return APIError(401, "incorrect API key provided")
        length = headers.get("content-length")
        if length is not None:
            try:
                too_big = int(length) > self.config.max_body_bytes
            except ValueError:
                return APIError(400, "invalid Content-Length header")
            if too_big:
                return APIError(413, f"the request body exceeds {self.config.max_body_bytes} "
                                     f"bytes")
        return None


async def _send_error(error: APIError, path: str, send: Send) -> None:
    body = json.dumps(error_body(error, path)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.http_status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.http_status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def create_app(config: ServerConfig | None = None, pool: ModelPool | None = None) -> FastAPI:
    """The API server application for `config`."""
    config = config or ServerConfig()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = ServerState(config, pool or ModelPool(config), metrics)
        app.state.localchat = state
        state.pool.starting = bool(config.models)
        preloading = asyncio.create_task(_preload(state.pool, config.models))
        reaper = asyncio.create_task(_reap(state.pool))
        try:
            yield
        finally:
            preloading.cancel()
            reaper.cancel()
            await state.pool.close()

    app = FastAPI(title="localchat", version=__version__, lifespan=lifespan)
    errors.install(app)
    app.include_router(openai_api.router)
    app.include_router(ollama_api.router)
    app.include_router(embeddings_api.router)
    app.include_router(responses_api.router)
    app.include_router(messages_api.router)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        pool = state_of(request).pool
        if pool.loading or pool.starting:
            loading = sorted(pool.loading) or list(state_of(request).config.models)
            return JSONResponse({"status": "loading", "loading": loading},
                                status_code=503)
        return JSONResponse({"status": "ok",
                             "models": sorted(m.ref for m in pool.loaded.values())})

    @app.get("/metrics")
    async def metrics_route(request: Request) -> PlainTextResponse:
        state = state_of(request)
        return PlainTextResponse(state.metrics.render(list(state.pool.loaded.values())),
                                 media_type="text/plain; version=0.0.4")

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root() -> PlainTextResponse:
        return PlainTextResponse(ROOT_TEXT)

    app.add_middleware(Guard, config=config, metrics=metrics)
    if config.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins),
                           allow_methods=["*"], allow_headers=["*"])
    return app


async def _preload(pool: ModelPool, refs: list[str]) -> None:
    """Load the command-line models in the background (/health says 503 meanwhile)."""
    try:
        for ref in refs:
            try:
                await pool.preload(ref)
            except Exception as exc:  # noqa: BLE001 - the server still serves the others
                log.error("could not load %s: %s", ref, exc)
    finally:
        pool.starting = False


async def _reap(pool: ModelPool) -> None:
    while True:
        await asyncio.sleep(REAP_EVERY_S)
        try:
            await pool.reap()
        except Exception:  # noqa: BLE001 - keep reaping
            log.exception("unloading expired models failed")


def run(config: ServerConfig, *, announce: Any = print,
        prepare: Callable[[], object] | None = None) -> None:
    """Serve until interrupted (uvicorn).

    The port is bound first: a taken one is an AddressError (one line) before `prepare` (work
    such as pulling a missing --model), the banner, or any model load; uvicorn then serves on
    that very socket. `announce` gets the URL and model lines.
    """
    sock = listen(config.host, config.port)
    try:
        if prepare is not None:
            prepare()
        import uvicorn

        app = create_app(config)
        address = display_address(config.host, sock.getsockname()[1])
        announce(f"localchat serve: http://{address} (OpenAI API at /v1, Ollama API at /api)")
        announce(f"models: {', '.join(config.models) if config.models else 'loaded on first use'}"
                 + ("; API key required" if config.api_key else ""))
        server = uvicorn.Server(uvicorn.Config(app, log_level="info", access_log=False,
                                               timeout_graceful_shutdown=5))
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:
            pass
    finally:
        sock.close()
