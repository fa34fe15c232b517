"""Showing a reasoning model's reply in a terminal: its thinking (the `<think>` block) dimmed
before the answer, or on stderr when stdout is not a terminal, so that a pipe gets the answer
alone."""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

from localchat.cli.common import ctrl_c_cancels

DIM, RESET = "\x1b[2m", "\x1b[0m"


def _styled(out: TextIO) -> bool:
    """Whether `out` is a terminal that takes ANSI styles."""
    term = os.environ.get("TERM", "dumb")
    return out.isatty() and term != "dumb" and "NO_COLOR" not in os.environ


class ReplyPrinter:
    """Prints a reply's pieces as they stream: thinking first (dimmed on a terminal, else on
    stderr), then the answer on stdout, a blank line between them."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        tty = self.out.isatty()
        self.thinking_out = self.out if tty else (err or sys.stderr)
        self.dim = _styled(self.thinking_out)
        self.thinking = False  # inside the thinking now
        self.thought = False  # some thinking was printed

    def piece(self, reasoning: str, text: str) -> None:
        """Print what one event released."""
        if reasoning:
            if not self.thinking:
                self.thinking = True
                if self.dim:
                    self.thinking_out.write(DIM)
            self.thinking_out.write(reasoning)
            self.thinking_out.flush()
            self.thought = True
        if text:
            self.end_thinking()
            self.out.write(text)
            self.out.flush()

    def end_thinking(self) -> None:
        """Close the thinking (style off, a blank line) before the answer or at the end."""
        if self.thinking:
            self.thinking = False
            self.thinking_out.write((RESET if self.dim else "") + "\n\n")
            self.thinking_out.flush()


def write_reply(stream: Any, echo: bool, out: TextIO | None = None) -> Any:
    """Consume a reply stream, printing its thinking and answer when `echo`; the Reply."""
    printer = ReplyPrinter(out)
    with ctrl_c_cancels(stream):
        try:
            for event in stream:
                if echo:
                    printer.piece(event.reasoning, event.text)
        finally:
            if echo:
                printer.end_thinking()
    return stream.reply
