"""The server's command-line options, shared by `localchat serve` and
`python -m localchat.server`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from localchat.engine import add_threads_argument, configure_threads
from localchat.errors import InvalidRequestError, LocalchatError
from localchat.server.config import (
    DEFAULT_HOST,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_PORT,
    ServerConfig,
    parse_duration,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the server's options to a parser."""
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port (default {DEFAULT_PORT}, Ollama's: its clients need no setting)")
    p.add_argument("--model", action="append", default=[], metavar="NAME",
                   help="a stored model (name or name:quant) to load at start; repeatable; "
                        "others load on first use")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (not on /health)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow this browser origin (repeatable; default: CORS off)")
    p.add_argument("--max-concurrency", type=int, default=8, metavar="N",
                   help="sequences decoded together per model (default 8)")
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests that may wait beyond --max-concurrency before 503 (default 64)")
    p.add_argument("--max-models", type=int, default=1, metavar="N",
                   help="models kept loaded at once (default 1)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help=f"largest request body (default {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, metal or vulkan")
    p.add_argument("--keep-alive", default="5m", metavar="DURATION",
                   help="how long a model loaded on first use stays loaded when idle, unless a "
                        "request's keep_alive says otherwise (default 5m; -1: forever)")
    p.add_argument("--context-length", type=int, default=None, metavar="N",
                   help="context window models run with unless a request's options.num_ctx "
                        "says otherwise (default: each model's own; clamped to it)")
    p.add_argument("--log-requests", action="store_true",
                   help="log one line per request: method, path, status, duration, model")
    add_threads_argument(p)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig for parsed options (invalid numbers are an InvalidRequestError)."""
    for name in ("port", "max_concurrency", "max_queue", "max_models", "max_body_bytes"):
        value = getattr(args, name)
        low = 0 if name in ("port", "max_queue") else 1
        if value < low:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be >= {low}", name)
    context_length = getattr(args, "context_length", None)
    if context_length is not None and context_length < 2:
        raise InvalidRequestError("--context-length must be >= 2", "context_length")
    keep_alive = parse_duration(getattr(args, "keep_alive", "5m"), "--keep-alive")
    configure_threads(getattr(args, "threads", None))  # before any model loads
    return ServerConfig(host=args.host, port=args.port, models=list(args.model),
                        api_key=args.api_key, cors_origins=list(args.cors_origin),
                        max_concurrency=args.max_concurrency, max_queue=args.max_queue,
                        max_loaded=args.max_models, max_body_bytes=args.max_body_bytes,
                        device=args.device, keep_alive=keep_alive,
                        context_length=context_length,
                        log_requests=bool(getattr(args, "log_requests", False)))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m localchat.server [options]`."""
    parser = argparse.ArgumentParser(prog="localchat serve",
                                     description="OpenAI- and Ollama-compatible local API")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    try:
        from localchat.server.app import run

        run(config_from_args(args))
    except LocalchatError as exc:
        print(f"localchat serve: error: {exc}", file=sys.stderr)
        return 1
    return 0
