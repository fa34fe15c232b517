"""What a reply prefills: rendering messages with the template, reusing what a sequence already
holds (the one implementation of prefix reuse between turns), and fitting the context window.

A sequence's state holds tokens whose text is known (the rendered prompt plus the reply as it
was fed). A new prompt reuses that state when the held text is a prefix of the new rendering
(then only the rest is tokenized and prefilled), or else when the held tokens are a prefix of
the new prompt's tokens; otherwise, when the state can roll back (a paged KV cache, with the prefix
cache on), it drops its tokens after the longest common token prefix (a template that rewrites
earlier turns, a regenerated reply), else it is reset and the whole prompt prefilled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from localchat.engine.templates import ConversationTemplate, Message
from localchat.errors import ContextWindowError, InvalidRequestError

OverflowPolicy = Literal["truncate", "error"]
OVERFLOW_POLICIES: tuple[str, ...] = ("truncate", "error")
# Room kept for a reply when deciding whether a conversation still fits its context window.
DEFAULT_REPLY_RESERVE = 256


@dataclass(frozen=True)
class RenderedDelta:
    """A prompt split into the part a sequence already holds and the new part.

    reuses_prefix False means the held text is not a prefix of the new prompt (the template
    rewrote earlier text, e.g. moved the system prompt): then `new_text == full`.
    """

    full: str
    new_text: str
    reuses_prefix: bool

    @property
    def reused_chars(self) -> int:
        """Length of the already-held prefix of `full`."""
        return len(self.full) - len(self.new_text)


def text_delta(held: str, full: str) -> RenderedDelta:
    """`full` minus an already-held `held` prefix, or all of `full` when it does not start so."""
    if full.startswith(held):
        return RenderedDelta(full, full[len(held) :], True)
    return RenderedDelta(full, full, False)


def render_delta(
    template: ConversationTemplate,
    previous: Sequence[Message],
    new: Sequence[Message],
    add_generation_prompt: bool = True,
) -> RenderedDelta:
    """The text that `new` messages add after `previous` ones (which end with a reply), as the
    template renders them, for a sequence that holds exactly `previous` rendered.

    The held text is `render(previous, add_generation_prompt=False)`; a trailing end-of-text
    token that some templates put after the last message only when no generation prompt
    follows (Phi-3) is not counted as held. The prefix is reused only if each earlier reply's
    prompt is a prefix too: templates that move text around as the conversation grows
    (Mistral-Nemo puts the system prompt into the last user turn) get the whole prompt.
    """
    full = template.render([*previous, *new], add_generation_prompt)
    held = template.render(previous, add_generation_prompt=False)
    eos = template.eos_token
    if not full.startswith(held) and eos and held.endswith(eos):
        held = held[: -len(eos)]
    for i, message in enumerate(previous):
        if message.get("role") == "assistant" and not held.startswith(
            template.render(previous[:i], add_generation_prompt=True)
        ):
            return RenderedDelta(full, full, False)
    return text_delta(held, full)


@dataclass(frozen=True)
class PromptPlan:
    """What a new reply feeds: the messages (after any truncation), their rendered text, the
    tokens to prefill, how many tokens of the sequence's state it reuses, whether that state
    must be reset first, how many earlier messages were dropped to fit the window, and how many
    tokens to drop from the end of the state first (rollback to a common prefix)."""

    messages: list[dict[str, Any]]
    text: str
    new_ids: list[int]
    reused: int
    reset: bool
    dropped: int = 0
    rollback: int = 0


class PromptPlanner:
    """Plans prompts for one model: its template, tokenizer, BOS rule and context window."""

    def __init__(
        self,
        template: ConversationTemplate,
        tokenizer: Any,
        *,
        context_window: int,
        reply_reserve: int,
        bos_token_id: int | None,
        rollback: bool = False,
    ) -> None:
        self.template = template
        self.rollback = rollback  # held states can drop their last tokens (paged KV cache)
        self.tokenizer = tokenizer
        self.context_window = context_window
        self.reply_reserve = reply_reserve
        self._bos = bos_token_id
        self._raw_template = template.name == "raw"  # plain text: BOS as for a completion

    def encode(self, text: str, raw: bool | None = None) -> list[int]:
        """Token ids of a whole prompt; a raw one starts with BOS when the model wants it."""
        ids = self.tokenizer.encode(text)
        if raw is None:
            raw = self._raw_template
        if raw and self._bos is not None:
            ids = [self._bos, *ids]
        return ids

    def count(
        self,
        messages: Sequence[Message],
        tools: Sequence[Message] | None = None,
        think: bool | None = None,
    ) -> int:
        """Tokens of the prompt for `messages` (with the generation prompt) from scratch."""
        return len(self.encode(self.render(messages, tools, think)))

    def render(
        self, messages: Sequence[Message], tools: Sequence[Message] | None, think: bool | None
    ) -> str:
        """The prompt text for `messages` with the generation prompt; `think` is passed as
        `enable_thinking` only when set (templates without thinking take no such argument)."""
        extra = {"enable_thinking": think} if think is not None else {}
        return self.template.render(messages, add_generation_prompt=True, tools=tools, **extra)

    def reserve(self, max_tokens: int | None) -> int:
        """Tokens kept free for the reply: the reserve, or max_tokens when smaller."""
        reserve = self.reply_reserve
        if max_tokens is not None:
            reserve = min(reserve, max_tokens)
        return min(reserve, self.context_window // 2)

    def check_fits(self, tokens: int, max_tokens: int | None, what: str) -> None:
        """ContextWindowError when `tokens` plus the reply's room exceed the window."""
        reserve = self.reserve(max_tokens)
        if tokens + reserve > self.context_window:
            raise ContextWindowError(
                f"{what} is {tokens} tokens; with {reserve} for the reply it exceeds the "
                f"context window of {self.context_window}",
                prompt_tokens=tokens,
                context_window=self.context_window,
                param="prompt",
            )

    def continuation(
        self, text: str, held_tokens: Sequence[int], held_text: str | None
    ) -> tuple[list[int], int, bool, int]:
        """(tokens to prefill, tokens reused, reset first, tokens to roll back first) for
        prompt `text` on a sequence that holds `held_tokens` whose text is `held_text` (None:
        unknown)."""
        if not held_tokens:
            return self.encode(text), 0, False, 0
        if held_text is not None and len(text) > len(held_text):
            delta = text_delta(held_text, text)
            if delta.reuses_prefix:
                return self.tokenizer.encode(delta.new_text), len(held_tokens), False, 0
        ids = self.encode(text)
        common = common_prefix(held_tokens, ids)
        if common == len(held_tokens) and common < len(ids):
            return ids[common:], common, False, 0
        keep = min(common, len(ids) - 1)  # at least one token is prefilled: its logits
        if self.rollback and keep > 0:
            return ids[keep:], keep, False, len(held_tokens) - keep
        return ids, 0, True, 0

    def plan(
        self,
        messages: Sequence[Message],
        max_tokens: int | None,
        *,
        overflow: OverflowPolicy,
        held_tokens: Sequence[int] = (),
        held_text: str | None = None,
        tools: Sequence[Message] | None = None,
        think: bool | None = None,
    ) -> PromptPlan:
        """Decide what to prefill for `messages` on a sequence holding `held_tokens` (whose text
        is `held_text`), and apply the overflow policy; `tools` and `think` (the template's
        `enable_thinking`) go to the template."""
        check_policy(overflow)
        messages = [dict(m) for m in messages]
        text = self.render(messages, tools, think)
        new_ids, reused, reset, rollback = self.continuation(text, held_tokens, held_text)
        reserve = self.reserve(max_tokens)
        window = self.context_window
        dropped = 0
        if overflow == "truncate":
            while reused + len(new_ids) + reserve > window:
                shorter = drop_oldest_turn(messages)
                if shorter is None:
                    break
                dropped += len(messages) - len(shorter)
                messages = shorter
                text = self.render(messages, tools, think)
                new_ids, reused, reset, rollback = self.continuation(text, held_tokens, None)
            need = reused + len(new_ids)
            if need >= window:
                raise ContextWindowError(
                    f"the message needs {need} tokens with the system prompt; the context "
                    f"window holds {window}",
                    prompt_tokens=need,
                    context_window=window,
                )
        else:
            need = reused + len(new_ids)
            if need + reserve > window:
                raise ContextWindowError(
                    f"the conversation needs {need} tokens plus {reserve} for the reply; the "
                    f"context window holds {window} (reset the conversation or start a new one)",
                    prompt_tokens=need + reserve,
                    context_window=window,
                )
        if not new_ids:
            raise InvalidRequestError("the prompt is empty", "messages")
        return PromptPlan(messages, text, new_ids, reused, reset, dropped, rollback)


def drop_oldest_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """`messages` without its oldest turn (a user message and the replies up to the next user
    message); the system prompt and the last message stay. None when nothing can go."""
    start = 1 if messages and messages[0].get("role") == "system" else 0
    end = len(messages) - 1  # the new message stays
    if start >= end:
        return None
    stop = start + 1
    while stop < end and messages[stop].get("role") != "user":
        stop += 1
    return messages[:start] + messages[stop:]


def fed_reply_text(tokenizer: Any, context_ids: list[int], reply_ids: list[int]) -> str:
    """The text of `reply_ids` as it reads after `context_ids` (keeps a SentencePiece model's
    leading space, which decoding the reply alone would drop)."""
    decode = tokenizer.decode
    if not reply_ids:
        return ""
    if context_ids:
        anchor = context_ids[-1:]
        before = decode(anchor)
        after = decode(anchor + reply_ids)
        if after.startswith(before):
            return after[len(before) :]
    return decode(reply_ids)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def check_policy(policy: str) -> None:
    """InvalidRequestError unless `policy` is a known overflow policy."""
    if policy not in OVERFLOW_POLICIES:
        raise InvalidRequestError(
            f"unknown overflow policy {policy!r}; expected one of {', '.join(OVERFLOW_POLICIES)}",
            "overflow",
        )
