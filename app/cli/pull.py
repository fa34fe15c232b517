"""`localchat pull NAME | HF_REPO_ID | ./hf-folder | ./file.gguf`: fetch a model, convert and
compile it for the device, into the local store.

Progress and notes go to stderr (rich); the one summary line goes to stdout.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from localchat.cli.common import auto_device_reason, console, open_store, step


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pull",
        help="download a model and build it for this device",
        description="Fetch a model (a name from `localchat list --available`, a hub repo "
        "org/name[@revision], a local HF folder or a .gguf file), convert it to the chosen "
        "quantization and compile it for the device, into the local store.",
    )
    p.add_argument("model", metavar="NAME", help="model name, HF repo id, HF folder or .gguf file")
    p.add_argument("--quant", help="quantization (default: the recipe's for the device kind, "
                   "q4f16_1 on GPUs, q4f32_1 on CPUs; a .gguf file of Q4_1 weights on the CPU: "
                   "q4f32_asym, which holds them exactly)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, metal or vulkan")
    p.add_argument("--force", action="store_true", help="pull and build again even if stored")
    p.set_defaults(handler=cmd_pull)


def with_steps(hooks: Any, console: Any) -> Any:
    """The hooks, with conversion and compilation shown as steps with a spinner."""
    convert, compile_ = hooks.convert, hooks.compile

    def converting(source: Path, output_dir: Path, quantization: str, **kwargs: Any) -> Any:
        with step(console, f"convert to {quantization}"):
            return convert(source, output_dir, quantization, **kwargs)

    def compiling(model_dir: Path) -> Path:
        with step(console, f"compile for {hooks.target_key}"):
            return compile_(model_dir)

    return replace(hooks, convert=converting,
                   compile=compiling if compile_ is not None else None)


def cmd_pull(args: argparse.Namespace) -> int:
    """`localchat pull NAME | HF_REPO_ID | ./hf-folder | ./file.gguf`."""
    result = pull_with_progress(args.model, device=args.device, quantization=args.quant,
                                force=args.force)
    print(result.summary())
    if args.device == "auto":  # TVM is loaded: remember the status `list` shows, for free
        from localchat.cli.list import library_status

        store = open_store()
        library_status(store, store.models())
    return 0


def pull_with_progress(ref: str, *, device: str = "auto", quantization: str | None = None,
                       force: bool = False) -> Any:
    """Pull `ref` into the store with the usual progress on stderr (device, downloads with their
    bytes, convert and compile steps, notes); the PullResult."""
    from localchat.downloader import (
        RichProgress,
        engine_hooks,
        parse_source,
        pull,
        pull_with_token_prompt,
    )

    parse_source(ref)  # an unknown name fails before the engine (TVM) is loaded
    out = console()

    def log(message: str) -> None:
        out.print(message, style="dim", markup=False, highlight=False)

    if quantization:
        from localchat.engine import get_quant_mode

        get_quant_mode(quantization)  # an unknown mode fails before any download
    store = open_store()
    hooks = engine_hooks(device, store, log)
    picked = f"device: {hooks.device_name} ({hooks.target_key})"
    if device == "auto":
        reason = auto_device_reason()
        picked += " picked by --device auto" + (f" ({reason})" if reason else "")
    out.print(picked, markup=False, highlight=False)
    # a gated repo and no token: on a terminal, name the licence, ask a token, pull again
    result = pull_with_token_prompt(ref, lambda hub: pull(
        ref, hooks=with_steps(hooks, out), store=store, hub=hub, quantization=quantization,
        force=force, progress=RichProgress(out), log=log), say=log)
    for note in result.notes:
        log(note)
    return result


def ensure_local_model(ref: str, device: str = "auto") -> str:
    """`ref` when the store has it (or it is a model directory); else, when `pull` knows the
    name (a recipe or a hub repo id), pull it first with the usual progress and return the
    stored `name:quant`. Anything else raises the store's not-found error, with its hints."""
    from localchat import model_dir as md
    from localchat.downloader import parse_source
    from localchat.errors import LocalchatError, ModelNotFoundError

    if md.is_model_dir(Path(ref).expanduser()):
        return ref
    store = open_store()
    try:
        store.resolve(ref)
        return ref
    except ModelNotFoundError as missing:
        name, _, quant = ref.rpartition(":") if ":" in ref else (ref, "", "")
        try:
            source = parse_source(name)
        except LocalchatError:
            raise missing from None
        if source.kind not in ("recipe", "hub"):
            raise missing from None
    console().print(f"{ref} is not in the store; pulling it", markup=False, highlight=False)
    result = pull_with_progress(name, device=device, quantization=quant or None)
    print(result.summary(), file=sys.stderr)
    return f"{result.name}:{result.quantization}"
