"""`localchat rm NAME [--yes]`: remove models from the local store (asks first)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from localchat.cli.common import human_size, open_store
from localchat.errors import ModelNotFoundError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rm", help="remove a model from the local store")
    p.add_argument("model", metavar="NAME", help="name, or name:quantization")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    p.set_defaults(handler=cmd_rm)


def _not_found(store: Any, ref: str) -> ModelNotFoundError:
    """The store's error for an unknown reference (with close matches)."""
    try:
        store.resolve(ref)
    except ModelNotFoundError as exc:
        return exc
    return ModelNotFoundError(f"no model {ref!r} in the store ({store.models_dir})")


def cmd_rm(args: argparse.Namespace) -> int:
    """`localchat rm NAME [--yes]`: remove every quantization matching NAME (asks first)."""
    store = open_store()
    matches = store.find(args.model)
    if not matches:
        raise _not_found(store, args.model)
    if not args.yes:
        listing = ", ".join(f"{m.ref} ({human_size(m.size_bytes)})" for m in matches)
        print(f"remove {listing}? [y/N] ", end="", file=sys.stderr, flush=True)
        try:
            answer = sys.stdin.readline() if not sys.stdin.closed else ""
        except (OSError, ValueError):
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed", file=sys.stderr)
            return 1
    for m in store.remove(args.model):
        print(f"removed {m.ref} ({human_size(m.size_bytes)} freed)")
    return 0
