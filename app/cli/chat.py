"""The interactive chat of `localchat run` (no message, a terminal on stdin): read a line,
stream the reply; /commands; Ctrl-C stops a reply, Ctrl-D or /exit leaves."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

from localchat.cli.common import log, report_end
from localchat.cli.thinking import write_reply
from localchat.errors import LocalchatError

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


def chat_loop(engine: Any, chat: Any, *, stats: bool = False) -> int:
    """The interactive chat: read a line, stream the reply; /commands; Ctrl-C stops a reply."""
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass
    # Ctrl-C must reach us even when we were started with SIGINT ignored (a background job of a
    # non-interactive shell): at the prompt it only prints a hint, during a reply it stops it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    log(
        f"chatting with {engine.name} ({engine.template.name} template, "
        f"{engine.context_window}-token window); /help for commands, /exit or Ctrl-D to leave; "
        f'a paste is one message, and so is a block between """ lines'
    )
    with bracketed_paste():
        return _converse(engine, chat, stats)


@contextlib.contextmanager
def bracketed_paste() -> Iterator[None]:
    """Ask the terminal to mark pastes (ESC [200~ ... ESC [201~) while the chat runs, so a
    multi-line paste arrives as one message; a dumb terminal is left alone."""
    on = sys.stdout.isatty() and os.environ.get("TERM", "dumb") != "dumb"
    if on:
        sys.stdout.write("\x1b[?2004h")
        sys.stdout.flush()
    try:
        yield
    finally:
        if on:
            sys.stdout.write("\x1b[?2004l")
            sys.stdout.flush()


def _converse(engine: Any, chat: Any, stats: bool) -> int:
    """Read messages and answer them until the user leaves."""
    while True:
        try:
            line = read_message()
        except EOFError:
            sys.stdout.write("\n")
            return 0
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            log("(use /exit or Ctrl-D to leave)")
            continue
        except UnicodeDecodeError as exc:
            log(f"localchat: error: the input is not valid UTF-8 ({exc.reason}); "
                f"nothing was sent")
            continue
        text = line.strip()
        if not text:
            continue
        try:
            if text.startswith("/"):
                if chat_command(text, engine, chat) == "exit":
                    return 0
                continue
            reply = write_reply(chat.send(text), echo=True)
        except LocalchatError as exc:
            log(f"localchat: error: {exc}")
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        report_end(reply, stats, max_tokens=chat.config.max_tokens)


PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"  # a terminal's bracketed paste markers
BLOCK = '"""'


def read_message(prompt: str = ">>> ") -> str:
    """One message: a line; a block between \"\"\" lines; or a multi-line paste (bracketed by
    the terminal, or lines that arrive together faster than anyone types)."""
    line = input(prompt)
    if PASTE_START in line:
        text = line
        while PASTE_END not in text:
            text += "\n" + input("")
        return text.replace(PASTE_START, "").replace(PASTE_END, "")
    stripped = line.strip()
    if stripped.startswith(BLOCK):
        rest = stripped[len(BLOCK):]
        if rest.endswith(BLOCK):
            return rest[: -len(BLOCK)]
        lines = [rest] if rest else []
        while True:
            more = input("... ")
            if more.rstrip().endswith(BLOCK):
                lines.append(more.rstrip()[: -len(BLOCK)])
                return "\n".join(lines)
            lines.append(more)
    lines = [line]
    while _input_pending():
        lines.append(input(""))
    return "\n".join(lines)


def _input_pending(wait_s: float = 0.05) -> bool:
    """Whether more input arrives within `wait_s` (the rest of a paste)."""
    import select

    try:
        return bool(select.select([sys.stdin], [], [], wait_s)[0])
    except (OSError, ValueError):
        return False


def chat_command(text: str, engine: Any, chat: Any) -> str | None:
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
        chat_set(rest, chat)
    elif name == "system":
        if rest:
            chat.set_system(rest)
            print("(system prompt set)")
        else:
            print(chat.system if chat.system is not None else "(no system prompt)")
    else:
        raise LocalchatError(f"unknown command /{name}; /help lists the commands")
    return None


def chat_set(rest: str, chat: Any) -> None:
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
