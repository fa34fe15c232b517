"""`localchat serve`: an OpenAI- and Ollama-compatible local API (see localchat.server)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from localchat.server.cli import add_arguments

    p = sub.add_parser(
        "serve",
        help="serve models over an OpenAI- and Ollama-compatible HTTP API",
        description="Serve stored models over HTTP: the OpenAI API under /v1 and Ollama's "
        "under /api, with continuous batching across concurrent requests. Binds 127.0.0.1 "
        "unless --host says otherwise.",
    )
    add_arguments(p)
    p.set_defaults(handler=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """`localchat serve [options]`."""
    import logging

    from localchat.cli.pull import ensure_local_model
    from localchat.server import config_from_args, run

    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    config = config_from_args(args)
    # a missing known model is pulled once the port is ours (a taken port fails before)
    run(config, prepare=lambda: [ensure_local_model(m, config.device) for m in config.models])
    return 0
