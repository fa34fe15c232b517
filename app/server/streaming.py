"""Running replies for HTTP requests: merging the streams of `n` choices, timing tokens for the
metrics, cancelling replies when the client goes away, and a streaming response that always
cancels what it streams when it ends (finished, failed or disconnected)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from localchat import FinishEvent, ReplyStream, TokenEvent
from localchat.server.metrics import Metrics


@dataclass
class Choice:
    """What one reply produced, collected from its events."""

    index: int
    pieces: list[str] = field(default_factory=list)
    tokens: list[TokenEvent] = field(default_factory=list)
    finish: FinishEvent | None = None
    thoughts: list[str] = field(default_factory=list)  # a reasoning model's thinking

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def reasoning(self) -> str:
        return "".join(self.thoughts)


class Tracker:
    """Times a request's tokens (TTFT, inter-token latency) and counts them when replies end."""

    def __init__(self, metrics: Metrics, model: str, started: float) -> None:
        self.metrics = metrics
        self.model = model
        self.started = started
        self._last: dict[int, float] = {}
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def token(self, index: int) -> None:
        now = time.perf_counter()
        last = self._last.get(index)
        if last is None:
            self.metrics.observe_ttft(now - self.started)
        else:
            self.metrics.observe_itl(now - last)
        self._last[index] = now

    def finished(self, event: FinishEvent) -> None:
        stats = event.reply.stats
        self.prompt_tokens += stats.prompt_tokens
        self.completion_tokens += stats.completion_tokens
        self.metrics.reply_done(self.model, stats.prompt_tokens, stats.completion_tokens,
                                event.reply.finish_reason == "cancelled", stats=stats)


async def merged(streams: Sequence[ReplyStream],
                 tracker: Tracker) -> AsyncIterator[tuple[int, TokenEvent | FinishEvent]]:
    """(choice index, event) from several reply streams as they come; an engine error is
    raised; leaving early (or being cancelled) cancels every reply not yet finished."""
    ended: set[int] = set()  # choices whose FinishEvent was handed on
    if len(streams) == 1:
        try:
            async for event in streams[0]:
                _track(tracker, 0, event)
                if isinstance(event, FinishEvent):
                    ended.add(0)
                yield 0, event
        finally:
            _abandon(streams, ended, tracker)
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, stream: ReplyStream) -> None:
        try:
            async for event in stream:
                await queue.put((i, event))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, FinishEvent):
                left -= 1
                ended.add(i)
            _track(tracker, i, item)
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        _abandon(streams, ended, tracker)


def _abandon(streams: Sequence[ReplyStream], ended: set[int], tracker: Tracker) -> None:
    """Cancel the replies whose end was not handed on when their consumer left (a client
    went away), and count them as cancelled."""
    for i, stream in enumerate(streams):
        if i not in ended:
            stream.cancel()
            tracker.metrics.reply_done(tracker.model, 0, 0, cancelled=True)


def _track(tracker: Tracker, index: int, event: TokenEvent | FinishEvent) -> None:
    if isinstance(event, TokenEvent):
        tracker.token(index)
    else:
        tracker.finished(event)


async def collect(events: AsyncIterator[tuple[int, TokenEvent | FinishEvent]],
                  n: int) -> list[Choice]:
    """Every choice's text, tokens and finish."""
    choices = [Choice(i) for i in range(n)]
    async for i, event in events:
        if event.text:
            choices[i].pieces.append(event.text)
        if event.reasoning:
            choices[i].thoughts.append(event.reasoning)
        if isinstance(event, TokenEvent):
            choices[i].tokens.append(event)
        else:
            choices[i].finish = event
    return choices


@asynccontextmanager
async def cancel_on_disconnect(request: Request,
                               streams: Sequence[ReplyStream]) -> AsyncIterator[None]:
    """Cancel `streams` if the client disconnects while the block runs (the body must have
    been read already)."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                for stream in streams:
                    stream.cancel()
                return

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()


class ReplyStreamingResponse(StreamingResponse):
    """A StreamingResponse that cancels its replies and runs `on_close` however it ends."""

    def __init__(self, content: AsyncIterator[str], streams: Sequence[ReplyStream],
                 on_close: Callable[[], Awaitable[None]] | None = None,
                 media_type: str = "text/event-stream",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self._streams = list(streams)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._streams:
                if not stream.done:
                    stream.cancel()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            if self._on_close is not None:
                await self._on_close()


async def prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`first`, then the items of `rest`."""
    yield first
    async for item in rest:
        yield item
