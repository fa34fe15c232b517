"""`localchat rm NAME [--all] [--yes]`: remove models from the local store (asks first).

As in Ollama, a bare NAME is its default quantization; `NAME:QUANT` names one; `--all` takes
every quantization of NAME, and says which before it does.
"""

from __future__ import annotations

import argparse
import sys

from localchat.cli.common import human_size, open_store


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rm", help="remove a model from the local store")
    p.add_argument("model", metavar="NAME",
                   help="name (its default quantization), or name:quantization")
    p.add_argument("--all", action="store_true", dest="every",
                   help="remove every quantization of NAME")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    p.set_defaults(handler=cmd_rm)


def cmd_rm(args: argparse.Namespace) -> int:
    """`localchat rm NAME [--all] [--yes]`: remove what NAME means (asks first)."""
    store = open_store()
    if args.every and ":" in args.model:
        from localchat.errors import LocalchatError

        raise LocalchatError(f"--all takes a bare name (every quantization of it), "
                             f"got {args.model!r}")
    matches = store.find_all(args.model) if args.every else store.find(args.model)
    if not matches:
        raise store.not_found(args.model)
    listing = ", ".join(f"{m.ref} ({human_size(m.size_bytes)})" for m in matches)
    others = [] if args.every else [m.ref for m in store.find_all(args.model)
                                    if m.ref not in {x.ref for x in matches}]
    if others:
        print(f"(keeping {', '.join(others)}; `localchat rm {matches[0].name} --all` "
              f"removes every quantization)", file=sys.stderr)
    if args.yes:
        print(f"removing {listing}", file=sys.stderr)
    else:
        print(f"remove {listing}? [y/N] ", end="", file=sys.stderr, flush=True)
        try:
            answer = sys.stdin.readline() if not sys.stdin.closed else ""
        except (OSError, ValueError):
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed", file=sys.stderr)
            return 1
    for m in store.remove(args.model, every_quantization=args.every):
        print(f"removed {m.ref} ({human_size(m.size_bytes)} freed)")
    return 0
