"""Keeping gpt-oss's thinking apart from its answer: OpenAI's "harmony" channels.

gpt-oss writes OpenAI's "harmony" format: its prompt ends with `<|start|>assistant` and
the reply is a run of messages, each a header (`<|channel|>analysis`, `<|channel|>commentary
to=functions.f <|constrain|>json`, the role after an `<|start|>`) then `<|message|>` and a body
up to `<|end|>` (or the stop tokens `<|return|>` / `<|call|>`). The `HarmonySplitter` follows the
special tokens by id (`HarmonyTokens`): the `analysis` body is thinking, the `final` and
`commentary` bodies are answer, headers are never shown. A message with a recipient (`to=...`)
is a tool call, as Ollama and llama.cpp read it: neither thinking nor answer, its body is kept
in `calls` for the tool-calling code. Text before any header (a model that answers straight
away) is answer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
HARMONY_MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
THINKING_CHANNEL = "analysis"
MAX_HEADER_CHARS = 256  # a longer "header" (or one with a line break) is text the model wrote


@dataclass(frozen=True)
class HarmonyTokens:
    """The harmony special tokens of a vocabulary: (id, marker, text the detokenizer gives it)
    for each marker the vocabulary has; the text is "" where decoding skips the token."""

    markers: tuple[tuple[int, str, str], ...]

    @classmethod
    def of(cls, tokenizer: Any) -> HarmonyTokens | None:
        """The harmony tokens of `tokenizer`; None unless it has `<|channel|>` and `<|message|>`
        as single tokens."""
        lookup = getattr(tokenizer, "token_to_id", None)
        if lookup is None:
            return None
        found = []
        for marker in HARMONY_MARKERS:
            token_id = lookup(marker)
            if token_id is not None:
                found.append((int(token_id), marker, _decoded(tokenizer, int(token_id), marker)))
        names = {marker for _, marker, _ in found}
        if CHANNEL not in names or MESSAGE not in names:
            return None
        return cls(tuple(found))


def _decoded(tokenizer: Any, token_id: int, marker: str) -> str:
    """The text a token decodes to (the marker itself when the tokenizer cannot say)."""
    decode = getattr(tokenizer, "decode", None)
    if decode is None:
        return marker
    try:
        text = decode([token_id])
    except Exception:  # a tokenizer that cannot decode one id alone: assume it shows the marker
        return marker
    return text if isinstance(text, str) else marker


@dataclass
class HarmonyCall:
    """A message of the reply addressed to a tool (`to=functions.f`): kept out of the text."""

    recipient: str  # "functions.get_weather", "browser.search", "python"
    channel: str | None
    constrain: str | None  # the content type after `<|constrain|>` ("json"), if any
    arguments: str = ""  # the message body as written
    complete: bool = False  # the body ended (`<|call|>`, `<|end|>`), not cut short


@dataclass
class _Message:
    """The reply's current message: its header once parsed, and where its text goes."""

    channel: str | None = None
    recipient: str | None = None
    constrain: str | None = None
    side: str = "answer"  # thinking | answer | call
    started: bool = False  # some body text came (leading white space is dropped)
    first_token: int = 0  # tokens pushed before this message began


class HarmonySplitter:
    """Splits a harmony-format reply (gpt-oss) into thinking and answer, piece by piece.

    Driven by the special tokens' ids: a marker counts only when its token was pushed (a model
    that spells "<|channel|>" in plain tokens writes text); its text, which the detokenizer
    normally releases with the token, is cut out of the stream (a marker whose text lags is
    waited for, a partial one at the end of a piece held back). States: `start` (before any
    marker, or after a message ended: text that may still be a header such as ` to=functions.f`
    is held, anything else is answer), `header` (after `<|start|>`, `<|channel|>` or
    `<|constrain|>`, up to `<|message|>`: never shown) and `body`.

    The bodies of `analysis` messages are thinking; those of `final`, `commentary` and messages
    without a channel are answer; a message with a recipient is a tool call, recorded in
    `calls` (or answer with `calls_as_answer`). White space around a body is dropped, and two
    messages on one side are joined by a blank line. A reply cut off inside a message keeps what
    it has on that message's side; `thinking_tokens` counts the tokens of the analysis messages,
    their headers and `<|end|>` included.
    """

    def __init__(
        self, tokens: HarmonyTokens, *, prompt: str = "", calls_as_answer: bool = False
    ) -> None:
        self._kinds = {token_id: marker for token_id, marker, _ in tokens.markers}
        self._texts = {token_id: text for token_id, _, text in tokens.markers}
        self.calls_as_answer = calls_as_answer
        self.calls: list[HarmonyCall] = []
        self.state = "start"  # start | header | body
        self.thought = False  # some thinking came
        self.thinking_tokens = 0
        self._pending: deque[tuple[str, str]] = deque()  # markers pushed, text not yet seen
        self._held = ""  # text that may be the start of a pending marker's text
        self._header = ""  # the current message's header so far, markers written out
        self._segment = ""  # header text since the last marker
        self._segment_kind = "start"  # marker that began the segment ("start": none)
        self._message = _Message()
        self._space = ""  # trailing white space of the thinking, held back
        self._sides_used: set[str] = set()  # sides that got text (later messages: blank line)
        self._tokens = 0
        self._thought_tokens = 0  # tokens of finished analysis messages
        opened = _opened_message(prompt)
        if opened is not None:  # the prompt ends inside a message: the reply is its body
            self._begin_body(opened)

    # -- the interface ----------------------------------------------------------------------
    def push(self, text: str, token_id: int | None = None) -> tuple[str, str]:
        """Feed one piece of reply text (and the token that released it); (thinking, answer)."""
        if token_id is not None:
            self._tokens += 1
            marker = self._kinds.get(token_id)
            if marker is not None:
                self._pending.append((marker, self._texts[token_id]))
        out = self._run(self._held + text, final=False)
        self._count()
        return out

    def finish(self) -> tuple[str, str]:
        """What was held back, once the reply has ended."""
        out = self._run(self._held, final=True)
        parts = {"thinking": [out[0]], "answer": [out[1]]}
        if self.state == "start":
            self._emit_answer_text(self._segment, parts)  # cut before any header: answer
        self._end_message(complete=False)
        self._count()
        return "".join(parts["thinking"]), "".join(parts["answer"])

    # -- text and markers ---------------------------------------------------------------------
    def _run(self, buf: str, final: bool) -> tuple[str, str]:
        parts: dict[str, list[str]] = {"thinking": [], "answer": []}
        self._held = ""
        while self._pending:
            marker, mark = self._pending[0]
            at = buf.find(mark) if mark else len(buf)
            if at < 0 and not final:
                keep = _partial_suffix(buf, mark)
                self._text(buf[: len(buf) - keep], parts)
                self._held = buf[len(buf) - keep:]
                return "".join(parts["thinking"]), "".join(parts["answer"])
            if at < 0:  # the reply ended before the marker's text came: it ends the text
                at, mark = len(buf), ""
            self._text(buf[:at], parts)
            buf = buf[at + len(mark):]
            self._pending.popleft()
            self._marker(marker, parts)
        self._text(buf, parts)
        return "".join(parts["thinking"]), "".join(parts["answer"])

    def _text(self, text: str, parts: dict[str, list[str]]) -> None:
        if not text:
            return
        if self.state == "body":
            self._body(text, parts)
            return
        self._segment += text
        if _header_like(self._segment, implicit=self.state == "start"):
            return
        # Not a header after all: the message has none (or no `<|message|>`); what is left of
        # the segment is its body (after the role, channel or content type that began it).
        segment, self._segment = self._segment, ""
        if self.state == "start":
            self._begin_body(_Message())
            self._body(segment, parts)
            return
        stripped = segment.lstrip()
        word = stripped.split(None, 1)[0]
        self._header += word
        self._begin_body(_parse_header(self._header))
        self._body(stripped[len(word):], parts)

    def _marker(self, marker: str, parts: dict[str, list[str]]) -> None:
        if marker == MESSAGE:
            if self.state != "body":
                self._header += self._segment
                self._begin_body(_parse_header(self._header))
            return  # a second `<|message|>` in a body: dropped
        if marker in (END, RETURN, CALL):
            if self.state == "body":
                self._end_message(complete=True)
            self._enter("start", self._tokens)
            return
        if marker == START or (marker == CHANNEL and self.state == "body"):
            # a new message (the model may skip `<|end|><|start|>assistant` before a channel)
            if self.state == "body":
                self._end_message(complete=True, last=1)
            self._enter("header", self._tokens - 1)
            if marker == START:
                return
        if self.state == "body":  # `<|constrain|>` inside a body: dropped
            return
        self._header += self._segment + marker
        self._segment, self._segment_kind, self.state = "", marker, "header"

    def _enter(self, state: str, first_token: int) -> None:
        """Start a new message's header (its first token was the `first_token`-th + 1)."""
        self.state = state
        self._header = self._segment = ""
        self._segment_kind = START if state == "header" else "start"
        self._message = _Message(first_token=max(first_token, 0))

    def _begin_body(self, message: _Message) -> None:
        message.first_token = self._message.first_token
        if message.recipient is not None and not self.calls_as_answer:
            message.side = "call"
            self.calls.append(HarmonyCall(message.recipient, message.channel, message.constrain))
        elif message.channel == THINKING_CHANNEL and message.recipient is None:
            message.side = "thinking"
        else:
            message.side = "answer"
        self._message, self.state = message, "body"
        self._header = self._segment = ""

    def _body(self, text: str, parts: dict[str, list[str]]) -> None:
        message = self._message
        if message.side == "call":
            self.calls[-1].arguments += text
            return
        if not message.started:
            text = text.lstrip()
            if not text:
                return
            message.started = True
            if message.side in self._sides_used:
                text = "\n\n" + text
            self._sides_used.add(message.side)
        if message.side == "thinking":
            self.thought = True
            text = self._space + text
            body = text.rstrip()
            self._space = text[len(body):]
            parts["thinking"].append(body)
        else:
            parts["answer"].append(text)

    def _emit_answer_text(self, text: str, parts: dict[str, list[str]]) -> None:
        if text.strip():
            self._begin_body(_Message(first_token=self._message.first_token))
            self._body(text, parts)
        self._segment = ""

    def _end_message(self, complete: bool, last: int = 0) -> None:
        """End the current message; its last token is the one pushed `last` tokens ago."""
        message = self._message
        if self.state == "body" and message.side == "thinking":
            self._thought_tokens += max(self._tokens - last - message.first_token, 0)
        if self.state == "body" and message.side == "call":
            self.calls[-1].complete = complete
        self._space = ""
        self.state = "start"
        self._message = _Message(first_token=self._tokens)
        self._header = self._segment = ""

    def _count(self) -> None:
        message = self._message
        live = 0
        if self.state == "body" and message.side == "thinking":
            live = self._tokens - message.first_token
        self.thinking_tokens = self._thought_tokens + live


def _opened_message(prompt: str) -> _Message | None:
    """The message a prompt leaves open (it ends with a header's `<|message|>`), else None."""
    if not prompt.endswith(MESSAGE):
        return None
    header = prompt[: -len(MESSAGE)]
    return _parse_header(header[header.rfind(START) + len(START):] if START in header else "")


def _parse_header(header: str) -> _Message:
    """Channel, recipient and content type of a header (`assistant to=functions.f<|channel|>
    commentary <|constrain|>json`: markers written out)."""
    words = header.replace(CHANNEL, f" {CHANNEL} ").replace(CONSTRAIN, f" {CONSTRAIN} ").split()
    message = _Message()
    for before, word in zip([""] + words, words):
        if word in (CHANNEL, CONSTRAIN):
            continue
        if before == CHANNEL:
            message.channel = word
        elif before == CONSTRAIN:
            message.constrain = word
        elif word.startswith("to="):
            message.recipient = word[3:]
    return message


def _header_like(segment: str, implicit: bool) -> bool:
    """Whether header text since the last marker may still be one. Implicit (no marker yet,
    the role came with the prompt): only a recipient (`to=...`) may come."""
    text = segment.strip()
    if not text:
        return True
    if "\n" in text or len(text) > MAX_HEADER_CHARS:
        return False
    words = text.split()
    if implicit:
        return all(w.startswith("to=") or "to=".startswith(w) for w in words)
    return len(words) <= 3


def _partial_suffix(text: str, mark: str) -> int:
    """Length of the longest end of `text` that is a proper start of `mark`."""
    for k in range(min(len(mark) - 1, len(text)), 0, -1):
        if mark.startswith(text[-k:]):
            return k
    return 0


__all__ = ["HARMONY_MARKERS", "HarmonyCall", "HarmonySplitter", "HarmonyTokens"]
