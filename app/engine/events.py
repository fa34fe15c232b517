"""What generation reports: per-token events, the finish event, a reply's stats, and the error
raised when a conversation no longer fits the context window.

A reply streams as `TokenEvent`s (one per generated token, with the text it releases) and ends
with exactly one `FinishEvent` (the held-back tail text, the finish reason and the whole `Reply`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from localchat.errors import ContextWindowError  # noqa: F401 - re-exported for callers

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
    early when the finish reason alone does not (e.g. the context window is full).
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: ReplyStats = field(default_factory=ReplyStats)
    message: str | None = None


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it releases ("" while text is held back)."""

    request_id: int
    token_id: int
    text: str


@dataclass(frozen=True)
class FinishEvent:
    """The end of a reply: the last held-back text (usually "") and the whole reply."""

    request_id: int
    text: str
    reply: Reply

    @property
    def finish_reason(self) -> str:
        return self.reply.finish_reason

    @property
    def stats(self) -> ReplyStats:
        return self.reply.stats


Event = TokenEvent | FinishEvent
