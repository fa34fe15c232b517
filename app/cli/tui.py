"""`localchat` with no verb: open the terminal UI (`localchat.tui`), optionally straight into a
chat with `--model NAME`, and over a running server with `--server URL` (its OpenAI API).
Textual and the UI are imported only when it opens."""

from __future__ import annotations

import argparse
import os
import sys

from localchat.engine import add_threads_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The top-level options of the UI (`localchat --model NAME --server URL`)."""
    parser.add_argument("--model", metavar="NAME", dest="tui_model",
                        help="open the terminal UI in a new chat with NAME")
    parser.add_argument("--device", default="auto", dest="tui_device", metavar="DEVICE",
                        help="device for the terminal UI's models: auto, cpu, cuda, metal, "
                        "vulkan (default: auto)")
    add_threads_argument(parser, dest="tui_threads")
    parser.add_argument("--server", metavar="URL", dest="tui_server",
                        help="chat with the models of a running `localchat serve` (or another "
                        "OpenAI-compatible server) at URL instead of loading them here")
    parser.add_argument("--api-key", metavar="KEY", dest="tui_api_key",
                        help="the --server's API key (default: $LOCALCHAT_API_KEY)")


def launch(model: str | None, server: str | None, device: str = "auto",
           api_key: str | None = None, threads: int | None = None) -> int:
    """Run the terminal UI until it quits; its exit status."""
    from localchat.engine import configure_threads

    configure_threads(threads)  # before a model loads; a bad $LOCALCHAT_NUM_THREADS said now
    backend = None
    if server is not None:
        from localchat.tui.remote import API_KEY_ENV, RemoteBackend, ServerError

        try:
            backend = RemoteBackend(server, api_key or os.environ.get(API_KEY_ENV) or None)
            backend.check()  # an unreachable server or a refused key: said before anything
        except ServerError as exc:
            if backend is not None:
                backend.close()
            print(f"localchat: error: {exc}", file=sys.stderr)
            return 1
    try:
        if not sys.stdin.isatty() or not sys.stdout.isatty():
            print("localchat: error: the terminal UI needs a terminal; see `localchat --help` "
                  "for the commands", file=sys.stderr)
            return 2
        if model is not None and backend is None:  # a missing known model is pulled first
            from localchat.cli.pull import ensure_local_model

            model = ensure_local_model(model, device)
        from localchat.tui.app import LocalchatApp

        app = LocalchatApp(model=model, device=device, backend=backend)
        app.run()
        return int(app.return_code or 0)
    finally:
        if backend is not None:
            backend.close()
