"""The `localchat` command line: without a verb it opens the terminal UI (`cli/tui.py`); one
module per verb (convert, run, pull, list, rm, show, doctor, serve, debug), each registering its
subparser with `add_parser(sub)`; the interactive chat of `run`
is `localchat.cli.chat`, shared helpers are `localchat.cli.common`.

The CLI only parses arguments and prints; the work is done by the engine, the downloader and the
store. Nothing heavy is imported here or in the verb modules at import time, so `localchat
--help` stays fast: each handler imports what it needs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from localchat import __version__
from localchat.cli import bench, convert, debug, doctor, pull, rm, run, serve, show, tui
from localchat.cli import list as list_
from localchat.cli.common import Handler
from localchat.errors import LocalchatError

# in the order `--help` lists them
VERBS = (convert, run, pull, list_, rm, show, bench, doctor, serve, debug)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="localchat", description="Chat with LLMs compiled by Apache TVM for this machine."
    )
    parser.add_argument("--version", action="version", version=f"localchat {__version__}")
    tui.add_arguments(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for verb in VERBS:
        verb.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `localchat` console script."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse fills an optional positional before it sees the options after it:
        # `run MODEL --temperature 0.5 "Hello"` leaves "Hello" over; it is the message.
        if (len(extra) == 1 and not extra[0].startswith("-")
                and getattr(args, "message", "") is None):
            args.message = extra[0]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    handler: Handler | None = getattr(args, "handler", None)
    try:
        if handler is None:
            return tui.launch(args.tui_model, args.tui_server, args.tui_device, args.tui_api_key,
                              args.tui_threads)
        return handler(args)
    except LocalchatError as exc:
        print(f"localchat: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        os._exit(0)
    except Exception as exc:  # never a traceback; LOCALCHAT_DEBUG=1 shows it
        if os.environ.get("LOCALCHAT_DEBUG"):
            raise
        detail = str(exc).strip().splitlines()
        text = detail[-1] if detail else ""
        print(f"localchat: error: {type(exc).__name__}: {text} (an internal error; "
              f"LOCALCHAT_DEBUG=1 shows where)", file=sys.stderr)
        return 1


__all__ = ["build_parser", "main"]
