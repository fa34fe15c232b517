"""Helpers shared by the CLI verbs: stderr logging, the rich console, sizes, the store, the
step spinner, and streaming a reply to the terminal.

Nothing heavy (TVM, huggingface_hub, rich, numpy) is imported at module level: `localchat
--help` must stay fast, so each helper imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

Handler = Callable[[argparse.Namespace], int]


def log(message: str) -> None:
    """A progress line or note, on stderr."""
    print(message, file=sys.stderr, flush=True)


def console() -> Any:
    """A rich console on stderr, for progress and notes."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def human_size(nbytes: int) -> str:
    """`nbytes` as a human-readable size, e.g. "5.0 KB"."""
    from localchat.downloader import human_size as size

    return size(nbytes)


def open_store() -> Any:
    """The local model store (LOCALCHAT_HOME or the platform directories)."""
    from localchat.store import Store

    return Store()


def auto_device_reason() -> str:
    """Why `--device auto` skipped each GPU kind, e.g. "cuda: not built in this TVM"."""
    from localchat.engine import DEVICE_KINDS, backend_supported, device_present

    notes = []
    for kind in DEVICE_KINDS:
        if kind == "cpu":
            continue
        if not backend_supported(kind):
            notes.append(f"{kind}: not in this TVM build")
        elif not device_present(kind):
            notes.append(f"{kind}: no device")
        else:
            break
    return "; ".join(notes)


@contextlib.contextmanager
def step(console: Any, label: str) -> Iterator[None]:
    """A spinner with elapsed time while a long step runs, then one line saying it is done."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    start = time.perf_counter()
    if console.is_terminal:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            progress.add_task(label, total=None)
            yield
    else:
        yield
    console.print(f"[green]✓[/] {label} ({time.perf_counter() - start:.1f} s)")


# -- streaming a reply -----------------------------------------------------------------------
@contextlib.contextmanager
def ctrl_c_cancels(stream: Any) -> Iterator[None]:
    """While a reply streams, Ctrl-C cancels it (the reply ends "cancelled") instead of raising."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: stream.cancel())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def write_reply(stream: Any, echo: bool) -> Any:
    """Consume a reply stream (printing its text when `echo`) and return the Reply."""
    with ctrl_c_cancels(stream):
        for event in stream:
            if echo and event.text:
                sys.stdout.write(event.text)
                sys.stdout.flush()
    return stream.reply


def report_end(reply: Any, stats: bool, max_tokens: int | None = None) -> None:
    """The notes after a reply, on stderr: stopped, cut, dropped messages, a message, stats."""
    if reply.finish_reason == "cancelled":
        log("[stopped]")
    elif reply.finish_reason == "length":
        completion = reply.stats.completion_tokens
        if max_tokens is not None and completion >= max_tokens:
            log(f"[cut at {max_tokens} tokens by --max-tokens; give a larger --max-tokens "
                f"for a longer reply]")
        else:
            log(f"[cut after {completion} tokens: the context window is full]")
    if reply.stats.dropped_messages:
        log(f"(dropped the {reply.stats.dropped_messages} oldest messages to fit the context)")
    if reply.message:
        log(f"localchat: {reply.message}")
    if stats:
        log(reply.stats.summary())
