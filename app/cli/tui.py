"""`localchat` with no verb: open the terminal UI (`localchat.tui`), optionally straight into a
chat with `--model NAME`. Textual and the UI are imported only when it opens."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The top-level options of the UI (`localchat --model NAME`)."""
    parser.add_argument("--model", metavar="NAME", dest="tui_model",
                        help="open the terminal UI in a new chat with NAME")
    parser.add_argument("--device", default="auto", dest="tui_device", metavar="DEVICE",
                        help="device for the terminal UI's models: auto, cpu, cuda, metal, "
                        "vulkan (default: auto)")


def launch(model: str | None, server: str | None, device: str = "auto") -> int:
    """Run the terminal UI until it quits; its exit status."""
    if server is not None:
        print("localchat: error: --server (the UI over an OpenAI API server) is not available "
              "yet", file=sys.stderr)
        return 2
    if not sys.stdin.isatty() or not sys.stdout.isatty():
        print("localchat: error: the terminal UI needs a terminal; see `localchat --help` for "
              "the commands", file=sys.stderr)
        return 2
    from localchat.tui.app import LocalchatApp

    app = LocalchatApp(model=model, device=device)
    app.run()
    return int(app.return_code or 0)
