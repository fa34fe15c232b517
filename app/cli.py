"""The `localchat` command line: convert, run, and the other verbs as they land."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

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


RUN_DEFAULT_MAX_TOKENS = 256  # one message; an interactive chat allows longer replies
CHAT_DEFAULT_MAX_TOKENS = 1024
CHAT_HELP = """commands:
  /reset              forget the conversation (keeps the system prompt)
  /stats              stats of the last reply and the context used
  /set                show the sampling parameters
  /set NAME VALUE     change one (temperature, top_p, top_k, min_p, repeat_penalty,
                      presence_penalty, frequency_penalty, seed, max_tokens, stop)
  /system [TEXT]      show or replace the system prompt
  /exit               leave (also /quit, /bye, Ctrl-D)
Ctrl-C stops the reply being written."""
SET_ALIASES = {"repeat_penalty": "repetition_penalty", "penalty": "repetition_penalty"}
SET_TYPES: dict[str, Callable[[str], Any]] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "seed": int,
    "max_tokens": int,
}


def _sampling_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The generation parameters given on the command line."""
    values = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repeat_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "seed": args.seed,
        "max_tokens": args.max_tokens,
    }
    out = {k: v for k, v in values.items() if v is not None}
    if args.stop:
        out["stop"] = tuple(args.stop)
    return out


@contextlib.contextmanager
def _ctrl_c_cancels(stream: Any) -> Iterator[None]:
    """While a reply streams, Ctrl-C cancels it (the reply ends "cancelled") instead of raising."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: stream.cancel())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _write_reply(stream: Any, echo: bool) -> Any:
    """Consume a reply stream (printing its text when `echo`) and return the Reply."""
    with _ctrl_c_cancels(stream):
        for event in stream:
            if echo and event.text:
                sys.stdout.write(event.text)
                sys.stdout.flush()
    return stream.reply


def _report_end(reply: Any, args: argparse.Namespace) -> None:
    if reply.finish_reason == "cancelled":
        _log("[stopped]")
    if reply.stats.dropped_messages:
        _log(f"(dropped the {reply.stats.dropped_messages} oldest messages to fit the context)")
    if reply.message:
        _log(f"localchat: {reply.message}")
    if args.stats:
        _log(reply.stats.summary())


def cmd_run(args: argparse.Namespace) -> int:
    from localchat.engine.generation_config import GenerationConfig

    message = args.message
    interactive = message is None and sys.stdin.isatty()
    if message is None and not interactive:
        message = sys.stdin.read()
    if interactive and (args.json or args.raw):
        raise LocalchatError(
            f"{'--json' if args.json else '--raw'} needs a message (an argument or piped on stdin)"
        )
    if args.raw and (args.system is not None or args.template is not None):
        raise LocalchatError("--raw sends the text as it is; it takes no --system or --template")
    if message is not None and not args.raw:
        message = message.strip()
        if not message:
            raise LocalchatError("the message is empty")

    model_dir = resolve_model(args.model)
    overrides = _sampling_overrides(args)
    overrides.setdefault("temperature", 0.0)
    overrides.setdefault(
        "max_tokens", CHAT_DEFAULT_MAX_TOKENS if interactive else RUN_DEFAULT_MAX_TOKENS
    )
    config = GenerationConfig.from_model_defaults(model_dir, **overrides)  # user errors first
    if args.template is not None:
        from localchat.engine.templates import resolve_template

        resolve_template(model_dir, args.template)
    if args.context_window is not None and args.context_window < 2:
        raise LocalchatError(f"--context-window must be at least 2, got {args.context_window}")
    from localchat.engine.chat import Engine  # imports TVM: after the cheap checks
    from localchat.engine.runtime import Model

    model = Model(model_dir, args.device, max_total_tokens=args.context_window)
    engine = Engine(
        model,
        template="raw" if args.raw else args.template,
        context_window=args.context_window,
        overflow=args.overflow,
        config=config,
    )
    try:
        if interactive:
            return _chat_loop(engine, engine.conversation(system=args.system), args)
        if args.raw:
            stream = engine.complete(message)
        else:
            stream = engine.conversation(system=args.system).send(message)
        reply = _write_reply(stream, echo=not args.json)
        if args.json:
            out = {
                "text": reply.text,
                "token_ids": reply.token_ids,
                "prompt_tokens": reply.stats.prompt_tokens,
                "finish_reason": reply.finish_reason,
                "stats": reply.stats.to_dict(),
            }
            if reply.message:
                out["message"] = reply.message
            print(json.dumps(out, ensure_ascii=False))
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()
        _report_end(reply, args)
        return 130 if reply.finish_reason == "cancelled" else 0
    finally:
        engine.close()


def _chat_loop(engine: Any, chat: Any, args: argparse.Namespace) -> int:
    """The interactive chat: read a line, stream the reply; /commands; Ctrl-C stops a reply."""
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass
    # Ctrl-C must reach us even when we were started with SIGINT ignored (a background job of a
    # non-interactive shell): at the prompt it only prints a hint, during a reply it stops it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _log(
        f"chatting with {engine.model.model_dir.name} ({engine.template.name} template, "
        f"{engine.context_window}-token window); /help for commands, /exit or Ctrl-D to leave"
    )
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            sys.stdout.write("\n")
            return 0
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            _log("(use /exit or Ctrl-D to leave)")
            continue
        text = line.strip()
        if not text:
            continue
        try:
            if text.startswith("/"):
                if _chat_command(text, engine, chat) == "exit":
                    return 0
                continue
            reply = _write_reply(chat.send(text), echo=True)
        except LocalchatError as exc:
            _log(f"localchat: error: {exc}")
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        _report_end(reply, args)


def _chat_command(text: str, engine: Any, chat: Any) -> str | None:
    """Run one /command of the interactive chat; "exit" to leave."""
    name, _, rest = text[1:].partition(" ")
    rest = rest.strip()
    if name in ("exit", "quit", "bye"):
        return "exit"
    if name == "help":
        print(CHAT_HELP)
    elif name == "reset":
        chat.reset()
        print("(conversation cleared)")
    elif name == "stats":
        reply = chat.last_reply
        if reply is None:
            print("no reply yet")
        else:
            print(reply.stats.summary())
        print(
            f"context: {chat.context_tokens} of {engine.context_window} tokens, "
            f"{len(chat.messages)} messages"
        )
    elif name == "set":
        _chat_set(rest, chat)
    elif name == "system":
        if rest:
            chat.set_system(rest)
            print("(system prompt set)")
        else:
            print(chat.system if chat.system is not None else "(no system prompt)")
    else:
        raise LocalchatError(f"unknown command /{name}; /help lists the commands")
    return None


def _chat_set(rest: str, chat: Any) -> None:
    """/set (show) or /set NAME VALUE (change one generation parameter)."""
    if not rest:
        config = chat.config.to_dict()
        print(", ".join(f"{k} = {config[k]}" for k in [*SET_TYPES, "stop"]))
        return
    key, _, value = rest.partition(" ")
    key = key.replace("-", "_")
    key = SET_ALIASES.get(key, key)
    value = value.strip()
    if key == "stop":
        parsed: Any = () if value in ("", "none") else (value,)
    elif key in SET_TYPES:
        if not value:
            raise LocalchatError(f"/set {key} needs a value")
        if value == "none" and key in ("seed", "max_tokens"):
            parsed = None
        else:
            try:
                parsed = SET_TYPES[key](value)
            except ValueError:
                kind = "an integer" if SET_TYPES[key] is int else "a number"
                raise LocalchatError(f"{key} must be {kind}, got {value!r}") from None
    else:
        raise LocalchatError(
            f"/set: unknown parameter {key!r}; known: {', '.join(SET_TYPES)}, stop"
        )
    chat.config = chat.config.replace(**{key: parsed})
    print(f"{key} = {getattr(chat.config, key)}")


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

    p = sub.add_parser(
        "run",
        help="chat with a model: one message, or an interactive chat",
        description="Send MESSAGE (or text piped on stdin) through the chat template and stream "
        "the reply; without a message, chat interactively.",
    )
    p.add_argument("model", help="model directory or name in the local store")
    p.add_argument("message", nargs="?", help="the message (default: stdin, or a chat)")
    p.add_argument("--raw", action="store_true", help="complete the text as is, no template")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--template", help="built-in template name or .jinja file")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repeat-penalty", type=float, default=None, help="1 = off")
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"default {RUN_DEFAULT_MAX_TOKENS} ({CHAT_DEFAULT_MAX_TOKENS} in a chat)",
    )
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--context-window", type=int, default=None, help="tokens (default: model's)")
    p.add_argument(
        "--overflow",
        choices=["truncate", "error"],
        default="truncate",
        help="when a chat outgrows the window: drop the oldest turns, or stop with an error",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--stats", action="store_true", help="print timing stats to stderr")
    p.set_defaults(handler=cmd_run)

    from localchat.cli_store import add_store_commands

    add_store_commands(sub)
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
