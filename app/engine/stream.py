"""One reply as its caller sees it: the `ReplyStream` of events (iterable with `for` in a thread
and with `async for` in an event loop), the events, the finished `Reply` and its `ReplyStats`.

A reply streams as `TokenEvent`s (one per generated token, with the text it releases) and ends
with exactly one `FinishEvent` (the held-back tail text, the finish reason and the whole
`Reply`); an engine failure is raised from the iteration instead. The scheduler thread feeds the
stream; an asyncio consumer is woken with `call_soon_threadsafe`, so no thread is spent per
stream.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from localchat.engine.harmony import HarmonyCall

FinishReason = Literal["stop", "length", "cancelled"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "cancelled")


@dataclass(frozen=True)
class ReplyStats:
    """Counts and timings of one reply.

    prompt_tokens: tokens prefilled for this reply (a later turn of a conversation prefills only
        what it adds); reused_tokens: tokens of the prompt already in the sequence's state.
    ttft_s: from the request to its first token; prefill_tok_s: prompt_tokens over the prefill
        time; decode_tok_s: tokens after the first over the time after the first.
    sampling_s: time spent choosing tokens (penalties, filters, the draw).
    context_tokens: tokens held in the sequence's state after the reply.
    dropped_messages: earlier messages dropped to fit the context window ("truncate" policy).
    reasoning_tokens: of completion_tokens, those of a reasoning model's think block (tags
        included).
    """

    prompt_tokens: int = 0
    reused_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = 0.0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    sampling_s: float = 0.0
    finish_reason: str = "stop"
    context_tokens: int = 0
    dropped_messages: int = 0
    reasoning_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly fields."""
        return asdict(self)

    def summary(self) -> str:
        """One line for a terminal."""
        reused = f" (+{self.reused_tokens} reused)" if self.reused_tokens else ""
        return (
            f"prompt {self.prompt_tokens} tok{reused}, completion {self.completion_tokens} tok, "
            f"ttft {self.ttft_s:.3f} s, prefill {self.prefill_tok_s:.1f} tok/s, "
            f"decode {self.decode_tok_s:.1f} tok/s, finish {self.finish_reason}"
        )


@dataclass(frozen=True)
class Reply:
    """A finished reply: its text (stop strings cut), generated ids, why it ended, and stats.

    `token_ids` excludes a stop token that ended the reply; `message` says why a reply ended
    early when the finish reason alone does not (e.g. the context window is full). A reasoning
    model's thinking (its `<think>` block) is in `reasoning`, apart from `text`, the answer.
    A harmony model's (gpt-oss) messages to a tool (`to=functions.f`) are in `tool_calls`, in
    the order written, apart from both.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: ReplyStats = field(default_factory=ReplyStats)
    message: str | None = None
    reasoning: str = ""
    tool_calls: tuple[HarmonyCall, ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it releases ("" while text is held back).

    `text` is answer; `reasoning` is the thinking text the token releases (a reasoning model's
    `<think>` block, tags left out). One token may release some of each.

    With `GenerationConfig.logprobs` set, `logprob` is the token's log-probability under the
    model (the raw logits' log-softmax) and `top_logprobs` the most likely (token id,
    log-probability) pairs, best first.
    """

    request_id: int
    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    reasoning: str = ""


@dataclass(frozen=True)
class FinishEvent:
    """The end of a reply: the last held-back text (usually "") and the whole reply."""

    request_id: int
    text: str
    reply: Reply
    reasoning: str = ""  # the last held-back thinking text

    @property
    def finish_reason(self) -> str:
        """Why the reply ended: "stop", "length" or "cancelled"."""
        return self.reply.finish_reason

    @property
    def stats(self) -> ReplyStats:
        """The reply's counts and timings."""
        return self.reply.stats


Event = TokenEvent | FinishEvent


class ReplyStream:
    """The caller's end of one reply: iterate it (`for` or `async for`) for events, and
    `cancel()` it from any thread or from the event loop.

    Iteration yields `TokenEvent`s then one `FinishEvent`; an engine failure is raised from
    the iteration. One consumer at a time; `wait()` can be used from other threads. When the
    asyncio task iterating it is cancelled (a client went away), the reply is cancelled too.
    """

    def __init__(self, request_id: int) -> None:
        self.id = request_id
        self._items: deque[Event | BaseException] = deque()
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._finished = threading.Event()
        self._exhausted = False
        self._cancelled = False
        self._pieces: list[str] = []
        self._thoughts: list[str] = []
        self.reply: Reply | None = None  # set when the reply is finished
        self.error: BaseException | None = None

    # -- consuming ---------------------------------------------------------------------------
    def __iter__(self) -> ReplyStream:
        return self

    def __next__(self) -> Event:
        with self._cond:
            if self._exhausted:
                raise StopIteration
            while not self._items:
                self._cond.wait()
            item = self._items.popleft()
        return self._deliver(item)

    def __aiter__(self) -> ReplyStream:
        return self

    async def __anext__(self) -> Event:
        while True:
            with self._cond:
                if self._exhausted:
                    raise StopAsyncIteration
                if self._items:
                    item = self._items.popleft()
                    break
                loop = asyncio.get_running_loop()
                waiter: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, waiter))
            try:
                await waiter
            except asyncio.CancelledError:
                self.cancel()
                raise
        return self._deliver(item)

    def _deliver(self, item: Event | BaseException) -> Event:
        if isinstance(item, BaseException):
            self._exhausted = True
            raise item
        if item.text:
            self._pieces.append(item.text)
        if item.reasoning:
            self._thoughts.append(item.reasoning)
        if isinstance(item, FinishEvent):
            self._exhausted = True
        return item

    def __enter__(self) -> ReplyStream:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._finished.is_set():
            self.cancel()

    async def __aenter__(self) -> ReplyStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._finished.is_set():
            self.cancel()

    def cancel(self) -> None:
        """Stop the reply; it ends with finish reason "cancelled" within one step.

        Only sets a flag, so it is safe from any thread, the event loop and a signal handler.
        """
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        """Whether cancel() was called."""
        return self._cancelled

    @property
    def done(self) -> bool:
        """Whether the reply has finished (or failed)."""
        return self._finished.is_set()

    @property
    def text(self) -> str:
        """The answer text consumed from the stream so far."""
        return "".join(self._pieces)

    @property
    def reasoning(self) -> str:
        """The thinking text consumed from the stream so far."""
        return "".join(self._thoughts)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the reply has finished, without consuming events; False on timeout."""
        return self._finished.wait(timeout)

    def texts(self) -> Iterator[str]:
        """The non-empty text pieces of the reply, in order."""
        for event in self:
            if event.text:
                yield event.text

    async def atexts(self) -> AsyncIterator[str]:
        """The non-empty text pieces of the reply, in order, from an event loop."""
        async for event in self:
            if event.text:
                yield event.text

    def result(self) -> Reply:
        """Consume the rest of the stream and return the finished reply."""
        for _ in self:
            pass
        return self._final()

    async def aresult(self) -> Reply:
        """Consume the rest of the stream from an event loop and return the finished reply."""
        async for _ in self:
            pass
        return self._final()

    def _final(self) -> Reply:
        if self.error is not None and self.reply is None:
            raise self.error
        assert self.reply is not None
        return self.reply

    # -- producing (the scheduler thread) ----------------------------------------------------
    def put(self, item: Event | BaseException) -> None:
        """Deliver an event (or the error that ends the reply) to the consumer."""
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, waiter in waiters:
            try:
                loop.call_soon_threadsafe(_wake, waiter)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening
                pass

    def finish(self, reply: Reply | None, error: BaseException | None = None) -> None:
        """Record how the reply ended (before its last event is put)."""
        self.reply = reply
        self.error = error
        self._finished.set()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


__all__ = [
    "FINISH_REASONS",
    "Event",
    "FinishEvent",
    "FinishReason",
    "Reply",
    "ReplyStats",
    "ReplyStream",
    "TokenEvent",
]
