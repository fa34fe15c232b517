"""`localchat run MODEL [MESSAGE]`: one message (an argument or piped on stdin) through the chat
template, or the raw text with --raw, streamed to stdout (or one JSON object with --json);
without a message on a terminal, the interactive chat (`localchat.cli.chat`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from localchat.cli.common import report_end
from localchat.cli.thinking import write_reply
from localchat.engine import add_threads_argument
from localchat.errors import InvalidRequestError, LocalchatError

CHAT_DEFAULT_MAX_TOKENS = 1024  # a turn of the interactive chat; one message: up to the window


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="chat with a model: one message, or an interactive chat",
        description="Send MESSAGE (or text piped on stdin) through the chat template and stream "
        "the reply; without a message, chat interactively.",
    )
    p.add_argument("model", help="model name (pulled first when missing), name:quant, or "
                   "model directory")
    p.add_argument("message", nargs="?", help="the message (default: stdin, or a chat)")
    p.add_argument("--raw", action="store_true", help="complete the text as is, no template")
    p.add_argument("--system", help="system prompt")
    think = p.add_mutually_exclusive_group()
    think.add_argument("--think", dest="think", action="store_const", const=True, default=None,
                       help="a reasoning model (Qwen3, DeepSeek-R1) thinks before answering; "
                       "its thinking is shown dimmed (default: the model's template decides)")
    think.add_argument("--no-think", dest="think", action="store_const", const=False,
                       help="ask a reasoning model not to think (its template's "
                       "enable_thinking=false)")
    p.add_argument("--template", help="built-in template name or .jinja file")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy; the defaults of every option: the model's "
                   "generation_config.json, else temperature 0.8, top-k 40, top-p 0.9, "
                   "repeat-penalty 1.1 over the last 64 tokens")
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
        help=f"default: until the reply ends or fills the context window "
        f"({CHAT_DEFAULT_MAX_TOKENS} a turn in a chat)",
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
    add_threads_argument(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (the reply, its tokens, stats)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--format", choices=["text", "json"], default=None,
                     help="json: the reply is a JSON object (constrained token by token)")
    fmt.add_argument("--json-schema", metavar="FILE",
                     help="the reply is JSON valid under the JSON Schema in FILE")
    fmt.add_argument("--grammar", metavar="FILE",
                     help="the reply is a sentence of the grammar in FILE: GBNF (rule root) "
                     "or Lark (rule start)")
    p.add_argument("--stats", action="store_true", help="print timing stats to stderr")
    p.set_defaults(handler=cmd_run)


def sampling_overrides(args: argparse.Namespace) -> dict[str, Any]:
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
    response_format = format_option(args)
    if response_format is not None:
        out["response_format"] = response_format
    return out


def _read_text_file(path: str, flag: str) -> str:
    """The UTF-8 text of the file a flag names, or a LocalchatError saying what is wrong."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LocalchatError(f"{flag}: no such file: {path}") from None
    except IsADirectoryError:
        raise LocalchatError(f"{flag}: {path} is a directory, not a file") from None
    except UnicodeDecodeError as exc:
        raise LocalchatError(f"{flag}: {path} is not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise LocalchatError(f"{flag}: cannot read {path}: {exc.strerror}") from None


def format_option(args: argparse.Namespace) -> dict[str, Any] | None:
    """The response format of --format, --json-schema or --grammar (None: free text)."""
    if getattr(args, "json_schema", None):
        text = _read_text_file(args.json_schema, "--json-schema")
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise LocalchatError(f"--json-schema: {args.json_schema} is not valid JSON: "
                                 f"{exc.msg} (line {exc.lineno}, column {exc.colno})") from None
        if not isinstance(schema, (dict, bool)):
            raise LocalchatError(f"--json-schema: {args.json_schema} must hold a JSON Schema "
                                 f"object, got {type(schema).__name__}")
        return {"type": "json_schema", "json_schema": {"schema": schema}}
    if getattr(args, "grammar", None):
        text = _read_text_file(args.grammar, "--grammar")
        if not text.strip():
            raise LocalchatError(f"--grammar: {args.grammar} is empty")
        return {"type": "grammar", "grammar": text}
    if getattr(args, "format", None) == "json":
        return {"type": "json_object"}
    return None


def _format_flag(args: argparse.Namespace) -> str:
    if getattr(args, "json_schema", None):
        return f"--json-schema {args.json_schema}"
    if getattr(args, "grammar", None):
        return f"--grammar {args.grammar}"
    return "--format json"


def _valid_utf8(text: str, where: str) -> str:
    """`text` (an argument: undecodable bytes are kept as surrogates) when it is valid UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start].encode("utf-8", "surrogateescape")
        raise LocalchatError(
            f"{where} is not valid UTF-8 (byte 0x{bad.hex()} at character {exc.start})"
        ) from None
    return text


def read_stdin() -> str:
    """All of stdin as UTF-8 text, or a clear error naming the first invalid byte."""
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LocalchatError(
            f"the text on stdin is not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start})"
        ) from None


def cmd_run(args: argparse.Namespace) -> int:
    message = args.message
    if message is not None:
        _valid_utf8(message, "the message")
    for name in ("system", "stop"):
        for value in (v for v in ([getattr(args, name)] if name == "system"
                                  else getattr(args, name) or []) if v):
            _valid_utf8(value, f"--{name}")
    interactive = message is None and sys.stdin.isatty()
    if message is None and not interactive:
        message = read_stdin()
    if interactive and (args.json or args.raw):
        raise LocalchatError(
            f"{'--json' if args.json else '--raw'} needs a message (an argument or piped on stdin)"
        )
    if args.raw and (args.system is not None or args.template is not None):
        raise LocalchatError("--raw sends the text as it is; it takes no --system or --template")
    think = getattr(args, "think", None)
    if args.raw and think is not None:
        raise LocalchatError("--raw sends the text as it is; --think and --no-think need the "
                             "chat template")
    if message is not None and not args.raw:
        message = message.strip()
        if not message:
            raise LocalchatError("the message is empty")

    options = sampling_overrides(args)
    if interactive:
        options.setdefault("max_tokens", CHAT_DEFAULT_MAX_TOKENS)
    engine = _open_engine(args, options)
    try:
        if interactive:
            from localchat.cli.chat import chat_loop

            return chat_loop(engine, engine.conversation(system=args.system, think=think),
                             stats=args.stats)
        try:
            if args.raw:
                stream = engine.complete(message)
            else:
                stream = engine.conversation(system=args.system, think=think).send(message)
        except InvalidRequestError as exc:
            if exc.param == "think":
                raise LocalchatError(f"--think: {exc}") from None
            if exc.param != "response_format":
                raise
            detail = str(exc).split(": ", 1)[-1]
            raise LocalchatError(f"{_format_flag(args)}: {detail}") from None
        reply = write_reply(stream, echo=not args.json)
        if args.json:
            out = {
                "text": reply.text,
                "reasoning": reply.reasoning,
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
        report_end(reply, args.stats, max_tokens=options.get("max_tokens"))
        return 130 if reply.finish_reason == "cancelled" else 0
    finally:
        engine.close()


def _refuse_embedding_model(ref: str) -> None:
    """`run` chats: an embedding model is refused before its library is compiled or loaded."""
    from localchat import model_dir as md
    from localchat.cli.common import open_store

    path = Path(ref).expanduser()
    try:
        meta = md.read_config(path if md.is_model_dir(path) else open_store().resolve(ref))
    except LocalchatError:
        return  # Engine.open reports what is wrong with it
    if md.EMBEDDING_KEY in meta:
        raise InvalidRequestError(
            f"{ref} is an embedding model: it turns text into vectors (serve it and call "
            f"/v1/embeddings or /api/embed, or use Engine.embed) and cannot chat", "model")


def _open_engine(args: argparse.Namespace, options: dict[str, Any]) -> Any:
    """The engine for `args.model`; Engine.open raises user errors before the model loads."""
    from localchat import Engine  # imports TVM: only once a message is there
    from localchat.cli.common import log
    from localchat.cli.pull import ensure_local_model
    from localchat.engine import configure_threads

    configure_threads(args.threads)
    model = ensure_local_model(args.model, args.device)  # `run` pulls a missing model first
    _refuse_embedding_model(model)

    try:
        return Engine.open(
            model,
            device=args.device,
            template="raw" if args.raw else args.template,
            context_window=args.context_window,
            overflow=args.overflow,
            options=options,
            log=log,
        )
    except InvalidRequestError as exc:
        window = args.context_window
        if exc.param == "context_window" and window is not None and window < 2:
            raise LocalchatError(
                f"--context-window must be at least 2, got {window}"
            ) from None
        raise
