"""Keeping a reasoning model's thinking apart from its answer as the reply streams.

Qwen3 and the DeepSeek-R1 distills think in `<think>…</think>` before they answer. The
`ReasoningSplitter` takes the reply's text pieces as the engine releases them and hands back,
for each, the part that is thinking and the part that is answer. It handles the variants:

- the model writes `<think>` itself at the start of its reply;
- the prompt already opened the block (R1 distills end the prompt with `<think>\\n`), so the
  reply starts inside the thinking and only `</think>` appears;
- thinking switched off (Qwen3 with `enable_thinking=False` renders an empty block in the
  prompt): the reply has no tags and is all answer.

Where the tags are single tokens of the vocabulary, only those tokens count as tags (a model
that spells "</think>" in plain tokens while thinking about tags does not end its thinking);
otherwise the tags are found in the text, and a partial tag split across tokens is held back
until the next piece decides. White space between the tags and the text is dropped.

gpt-oss writes OpenAI's "harmony" channels instead: `harmony.HarmonySplitter`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from localchat.engine.harmony import HarmonyTokens
from localchat.errors import InvalidRequestError

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"


@dataclass(frozen=True)
class ThinkTags:
    """The token ids of `<think>` and `</think>` when each is one token (else None: text)."""

    open_id: int | None = None
    close_id: int | None = None

    @classmethod
    def of(cls, tokenizer: Any) -> ThinkTags:
        """The tags as the tokenizer knows them."""
        lookup = getattr(tokenizer, "token_to_id", None)
        if lookup is None:
            return cls()
        open_id, close_id = lookup(OPEN_TAG), lookup(CLOSE_TAG)
        if open_id is None or close_id is None:  # both or neither: a half-known pair is text
            return cls()
        return cls(int(open_id), int(close_id))

    @property
    def by_id(self) -> bool:
        """Whether the tags are single tokens."""
        return self.close_id is not None


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a prompt ends inside an opened think block (the reply starts thinking)."""
    return prompt.rstrip().endswith(OPEN_TAG)


def check_think(think: Any) -> bool | None:
    """A thinking switch as given when it is None or a bool; else InvalidRequestError."""
    if think is not None and not isinstance(think, bool):
        raise InvalidRequestError(f"think must be true, false or null, got {think!r}", "think")
    return think


def model_thinks(template: Any, tokenizer: Any) -> bool:
    """Whether replies may carry thinking: the template writes a think block, or the
    vocabulary has the think tags or the harmony channel tokens (gpt-oss) as tokens."""
    return (
        bool(getattr(template, "thinks", False))
        or ThinkTags.of(tokenizer).by_id
        or HarmonyTokens.of(tokenizer) is not None
    )


class ReasoningSplitter:
    """Splits one reply's text into thinking and answer, piece by piece (stream-safe).

    `push(text, token_id)` returns (thinking, answer) text that is decided now; `finish()`
    returns what was held back. The pieces of each side add up to the whole thinking and the
    whole answer. A reply that ends while thinking keeps it all as thinking.
    """

    def __init__(self, tags: ThinkTags = ThinkTags(), *, opened: bool = False) -> None:
        self.tags = tags
        self.state = "thinking" if opened else "start"  # start | thinking | answer
        self._held = ""
        self._close_seen = False  # (by id) the `</think>` token came; its text may lag
        self._open_seen = False
        self._thinking_started = False  # leading white space of the thinking is dropped
        self._answer_started = False  # leading white space after `</think>` is dropped
        self.thought = opened  # whether the reply had a think block
        self._tokens = 0  # tokens pushed so far
        # tokens of the think block: those up to the one that closed it, the tags included
        # (all of them while it is open); what OpenAI's usage calls reasoning tokens
        self.thinking_tokens = 0

    def push(self, text: str, token_id: int | None = None) -> tuple[str, str]:
        """Feed one piece of reply text (and the token that released it); (thinking, answer)."""
        if token_id is not None:
            self._tokens += 1
            if self.tags.by_id and token_id == self.tags.open_id:
                self._open_seen = True
            elif self.tags.by_id and token_id == self.tags.close_id:
                self._close_seen = True
        before = self.state
        split = self._split(self._held + text, final=False)
        if self.state == "thinking" or (before != "answer" and self.thought):
            self.thinking_tokens = self._tokens
        return split

    def finish(self) -> tuple[str, str]:
        """The held-back text once the reply has ended."""
        held, self._held = self._held, ""
        return self._split(held, final=True)

    # -- the states ---------------------------------------------------------------------------
    def _split(self, buf: str, final: bool) -> tuple[str, str]:
        thinking, answer = "", ""
        self._held = ""
        if self.state == "start":
            buf = self._start(buf, final)
            if self.state == "start":
                return "", buf if final else ""
        if self.state == "thinking":
            at = self._close_at(buf)
            if at < 0:
                thinking = self._thinking(buf, final)
                return thinking, ""
            thinking = self._thinking(buf[:at], final=True)
            buf = buf[at + len(CLOSE_TAG):]
            self.state = "answer"
        if self.state == "answer":
            answer = self._answer(buf)
        return thinking, answer

    def _start(self, buf: str, final: bool) -> str:
        """Before any text: an opening tag starts the thinking, anything else is answer."""
        lead = buf.lstrip()
        if not lead and not final:
            self._held = buf  # only white space so far: the tag may still come
            return ""
        if lead.startswith(OPEN_TAG) and (not self.tags.by_id or self._open_seen):
            self.state, self.thought = "thinking", True
            return lead[len(OPEN_TAG):]
        if not final and not self.tags.by_id and OPEN_TAG.startswith(lead):
            self._held = buf  # "<thi" may become the tag
            return ""
        if not final:
            self.state = "answer"
            self._answer_started = True  # no think block: the answer is as written
        return buf

    def _close_at(self, buf: str) -> int:
        """Where `</think>` starts in `buf` (-1: not there, or not the tag token)."""
        if self.tags.by_id and not self._close_seen:
            return -1
        return buf.find(CLOSE_TAG)

    def _thinking(self, text: str, final: bool) -> str:
        """Thinking text to release; a possible partial `</think>` and trailing white space
        are held back (dropped when the tag follows)."""
        if not self._thinking_started:
            text = text.lstrip()
            if not text:
                return ""
            self._thinking_started = True
        if final:
            return text.rstrip()
        keep = 0
        if not self.tags.by_id:
            for k in range(min(len(CLOSE_TAG) - 1, len(text)), 0, -1):
                if CLOSE_TAG.startswith(text[-k:]):
                    keep = k
                    break
        body = text[: len(text) - keep]
        stripped = body.rstrip()
        self._held = body[len(stripped):] + text[len(text) - keep:]
        return stripped

    def _answer(self, text: str) -> str:
        if not self._answer_started:
            text = text.lstrip()
            if not text:
                return ""
            self._answer_started = True
        return text


class Splitter(Protocol):
    """What the engine asks of a reply's thinking/answer splitter."""

    thinking_tokens: int

    def push(self, text: str, token_id: int | None = None) -> tuple[str, str]:
        """(thinking, answer) decided by one more piece of text and its token."""
        ...

    def finish(self) -> tuple[str, str]:
        """(thinking, answer) held back until the reply ended."""
        ...


__all__ = [
    "CLOSE_TAG",
    "OPEN_TAG",
    "ReasoningSplitter",
    "Splitter",
    "ThinkTags",
    "check_think",
    "model_thinks",
    "prompt_opens_thinking",
]
