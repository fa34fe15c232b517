"""Streaming text out of token ids: incremental detokenization and stop-string matching.

`IncrementalDetokenizer` turns ids into text pieces one token at a time without ever emitting
half a UTF-8 character; the pieces add up to `tokenizer.decode(all ids)`.
`StopStringMatcher` holds back text that may be the start of a stop string and cuts the reply
before a stop string, which it never emits. `TextStream` chains the two for the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """The part of the tokenizer protocol (localchat.engine.tokenizer) used here."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; invalid UTF-8 at the edges becomes U+FFFD."""
        ...


class IncrementalDetokenizer:
    """Feeds token ids one by one and returns the new text each time.

    Each step decodes only a short window of recent ids: the ids of the last emitted piece
    (so that decoders which treat the first token specially, like SentencePiece's leading
    space, see the same context twice) plus the ids not yet emitted. The text that the window
    adds beyond the last emitted piece is the new piece. It is held back while it ends in
    U+FFFD, i.e. while the bytes so far stop inside a multi-byte character (byte-level BPE or
    byte-fallback tokens); a later token completes it, or `flush` gives it out at the end.

    The pieces plus `flush()` equal `decode(all ids)` whenever the output is valid UTF-8; a
    model that emits more than `max_pending` tokens in a row of broken bytes gets them shown
    as U+FFFD early, possibly split differently from a full decode, rather than nothing.
    """

    def __init__(self, tokenizer: Decoder, *, max_pending: int = 16) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the window: the previous piece's first id
        self._read_offset = 0  # ids before this are emitted
        self._max_pending = max_pending
        self._emitted: list[str] = []

    @property
    def ids(self) -> list[int]:
        """All ids fed so far."""
        return self._ids

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    def add(self, token_id: int) -> str:
        """Feed one id; return the text it completes ("" while a character is unfinished)."""
        self._ids.append(int(token_id))
        return self._step(final=False)

    def add_many(self, ids: Iterable[int]) -> str:
        """Feed several ids at once; return the text they complete."""
        self._ids.extend(int(i) for i in ids)
        return self._step(final=False)

    def flush(self) -> str:
        """The held-back text at the end of the stream (may contain U+FFFD); call once."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        window = self._ids[self._prefix_offset :]
        before = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        after = self._tok.decode(window)
        pending = len(self._ids) - self._read_offset
        if not after.startswith(before):
            if not final and after.endswith(REPLACEMENT_CHAR) and pending < self._max_pending:
                # Byte-fallback decoders turn a whole run of byte tokens into U+FFFDs while
                # its last character is unfinished, earlier complete ones included: wait.
                return ""
            # A decoder whose output for a window is not a prefix of the longer window's
            # (cleanup rules that look across tokens): compare full decodes instead. Rare.
            return self._resync(final)
        piece = after[len(before) :]
        # Wait while the bytes stop inside a character, and also while the new ids add no
        # text yet (a lone SentencePiece "▁" decodes to "" at a window's start but to " "
        # after other text, so it must stay out of the window's prefix). max_pending bounds
        # the window when a model really emits U+FFFD or invalid bytes.
        if not final and pending < self._max_pending:
            if not piece or piece.endswith(REPLACEMENT_CHAR):
                return ""
        return self._emit(piece)

    def _resync(self, final: bool) -> str:
        full = self._tok.decode(self._ids)
        emitted = self.text
        if not full.startswith(emitted):
            # The decoder rewrote text already emitted; it cannot be taken back. Emit nothing
            # more until the texts agree again, or at the end.
            return ""
        piece = full[len(emitted) :]
        if not final and (piece.endswith(REPLACEMENT_CHAR) or not piece):
            return ""
        return self._emit(piece)

    def _emit(self, piece: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if piece:
            self._emitted.append(piece)
        return piece


class StopStringMatcher:
    """Cuts streamed text at the first stop string, which is never emitted.

    Text that could still become a stop string (a suffix that is a proper prefix of one) is
    held back until the next piece decides; text before a stop string is always emitted.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(s for s in dict.fromkeys(stops) if s)
        self._prefixes = {s[:k] for s in self.stops for k in range(1, len(s))}
        self._longest_prefix = max((len(s) - 1 for s in self.stops), default=0)
        self._held = ""
        self.stopped: str | None = None  # the stop string that ended the text, once found

    def push(self, text: str) -> str:
        """Add text; return what can be emitted now (nothing more once a stop string is seen)."""
        if self.stopped is not None:
            return ""
        buf = self._held + text
        if not self.stops:
            self._held = ""
            return buf
        cut, found = -1, None
        for stop in self.stops:
            i = buf.find(stop)
            if i != -1 and (cut == -1 or i < cut):
                cut, found = i, stop
        if found is not None:
            self.stopped = found
            self._held = ""
            return buf[:cut]
        hold = 0
        for k in range(min(self._longest_prefix, len(buf)), 0, -1):
            if buf[-k:] in self._prefixes:
                hold = k
                break
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """Text held back when the stream ends without a stop string."""
        out, self._held = ("" if self.stopped is not None else self._held), ""
        return out


@dataclass
class StreamPiece:
    """What one token adds to the reply: text to show, and whether a stop string ended it."""

    text: str
    stopped: bool = False


class TextStream:
    """Token ids in, reply text out: incremental detokenization, then stop strings."""

    def __init__(self, tokenizer: Decoder, stop_strings: Iterable[str] = ()) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.matcher = StopStringMatcher(stop_strings)

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been seen (generation should end)."""
        return self.matcher.stopped is not None

    def add(self, token_id: int) -> StreamPiece:
        """Feed one generated id."""
        text = self.matcher.push(self.detokenizer.add(token_id))
        return StreamPiece(text, self.stopped)

    def finish(self) -> str:
        """The text still held back when generation ends (empty after a stop string)."""
        if self.stopped:
            return ""
        return self.matcher.push(self.detokenizer.flush()) + self.matcher.flush()
