"""The `localchat` command line: convert, run, and the other verbs as they land."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from localchat import __version__
from localchat.errors import LocalchatError, ModelNotFoundError

Handler = Callable[[argparse.Namespace], int]


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def resolve_model(name_or_path: str) -> Path:
    """A model directory given as a path, or a model name in the local store."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    try:
        from localchat.downloader.store import Store
    except ImportError:
        Store = None  # noqa: N806 - the store lands with the pull command
    if Store is not None:
        return Path(Store().resolve(name_or_path))
    raise ModelNotFoundError(f"no model directory {name_or_path!r}")


def cmd_convert(args: argparse.Namespace) -> int:
    from localchat.engine.convert import convert_model

    out = convert_model(
        Path(args.source),
        Path(args.output),
        args.quant,
        prefill_chunk_size=args.prefill_chunk_size,
        context_window_size=args.context_window,
        log=_log,
    )
    if not args.no_compile:
        from localchat.engine.runtime import Model

        model = Model(out, args.device)
        done = "compiled" if model.library.compiled else "found compiled"
        _log(f"{done} {model.library.path.name} ({model.compile_seconds:.1f} s)")
    print(out)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from localchat.engine.generate import complete
    from localchat.engine.runtime import Model

    model = Model(resolve_model(args.model), args.device)
    prompt = args.prompt
    if prompt is None:
        if sys.stdin.isatty():
            raise LocalchatError("give a prompt, or pipe one on stdin")
        prompt = sys.stdin.read()

    def stream(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = complete(
        model,
        prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        on_text=None if args.json else stream,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "text": result.text,
                    "token_ids": result.token_ids,
                    "prompt_tokens": result.stats.prompt_tokens,
                    "finish_reason": result.finish_reason,
                    "stats": {
                        "prefill_tok_s": result.stats.prefill_tok_s,
                        "decode_tok_s": result.stats.decode_tok_s,
                        "ttft_s": result.stats.ttft_s,
                    },
                },
                ensure_ascii=False,
            )
        )
    else:
        sys.stdout.write("\n")
    if args.stats:
        s = result.stats
        _log(
            f"prompt {s.prompt_tokens} tok, completion {s.completion_tokens} tok, "
            f"ttft {s.ttft_s:.3f} s, prefill {s.prefill_tok_s:.1f} tok/s, "
            f"decode {s.decode_tok_s:.1f} tok/s, finish {result.finish_reason}"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="localchat", description="Chat with LLMs compiled by Apache TVM for this machine."
    )
    parser.add_argument("--version", action="version", version=f"localchat {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("convert", help="build a model directory from an HF folder")
    p.add_argument("source", help="HF model folder (config.json + weights + tokenizer)")
    p.add_argument("--quant", default="q4f32_1", help="q0f32, q0f16, q4f32_1 or q4f16_1")
    p.add_argument("--output", "-o", required=True, help="model directory to create")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, metal or vulkan")
    p.add_argument("--context-window", type=int, default=None)
    p.add_argument("--prefill-chunk-size", type=int, default=None)
    p.add_argument("--no-compile", action="store_true", help="convert only; compile on first run")
    p.set_defaults(handler=cmd_convert)

    p = sub.add_parser("run", help="complete a prompt with a model")
    p.add_argument("model", help="model directory or name in the local store")
    p.add_argument("prompt", nargs="?", help="the prompt (default: read stdin)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--stats", action="store_true", help="print timing stats to stderr")
    p.set_defaults(handler=cmd_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `localchat` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    try:
        return handler(args)
    except LocalchatError as exc:
        print(f"localchat: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
