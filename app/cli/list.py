"""`localchat list`: the models in the local store (or, with --available, the known names in
the catalogue's order)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from localchat.cli.common import human_size, open_store


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="list the models in the local store")
    p.add_argument("--available", action="store_true", help="list the known model names instead")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(handler=cmd_list)


def library_status(store: Any, models: list[Any]) -> dict[Path, str]:
    """For each model: "yes" (this device's library is there), "stale" (an older build for this
    target), "no"; "?" where the engine cannot tell ("damaged" ones are left to the caller)."""
    from localchat.engine import library_status as status

    healthy = [m.path for m in models if not m.damaged]
    out: dict[Path, str] = {m.path: "yes" if m.compiled else "no" for m in models}
    if healthy:
        out.update(status(healthy, store.cache_dir))
    return out


def cmd_list(args: argparse.Namespace) -> int:
    """`localchat list`: the stored models (or, with --available, the known names)."""
    if args.available:
        return _list_available(args)
    store = open_store()
    models = store.models()
    status = library_status(store, models)
    rows = [{
        "name": m.name,
        "quantization": m.quantization,
        "architecture": m.config.get("architecture"),
        "targets": list(m.targets),
        "compiled": "damaged" if m.damaged else status[m.path],
        "damaged": m.damaged,
        "problem": m.damage_message() if m.damaged else None,
        "size_bytes": m.size_bytes,
        "origin": m.config.get("origin"),
        "path": str(m.path),
    } for m in models]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no models in {store.models_dir}; get one with "
              f"`localchat pull smollm2-135m-instruct`")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("NAME", "QUANT", "ARCH", "DEVICE", "SIZE", "COMPILED"):
        table.add_column(col, justify="right" if col == "SIZE" else "left")
    for r in rows:
        table.add_row(r["name"], r["quantization"], str(r["architecture"] or "?"),
                      ", ".join(r["targets"]) or "-", human_size(r["size_bytes"]), r["compiled"])
    Console(highlight=False, width=max(100, Console().width)).print(table)
    for r in rows:
        if r["damaged"]:
            print(f"localchat: {r['problem']}", file=sys.stderr)
    return 0


def _list_available(args: argparse.Namespace) -> int:
    from localchat.recipes import catalogue

    recipes = catalogue()  # by line, newer releases first (RWKV-7 before RWKV-4)
    if args.json:
        print(json.dumps([{"name": r.name, "repo": r.repo, "file": r.file or None,
                           "released": r.released.isoformat() if r.released else None,
                           "architecture": r.architecture, "download_mb": r.download_mb,
                           "quantization": dict(r.quantization)}
                          for r in recipes], indent=2))
        return 0
    width = max(len(r.name) for r in recipes)
    for r in recipes:
        print(f"{r.name:<{width}}  {r.display_name} ({r.repo}, ~{r.download_mb} MB)")
    return 0
