"""The chat engine: conversations over one loaded model, streamed replies, batched generation.

    engine = Engine(Model(model_dir, "cpu"))
    chat = engine.conversation(system="Be brief.")
    for event in chat.send("Hello!", temperature=0):
        print(event.text, end="")

`Engine` owns the model, its conversation template and stops, and a scheduler thread that
generates every active reply together (see generate.py). A `Conversation` keeps its messages
and its sequence's KV/RNN state, so a new turn prefills only the tokens it adds. `send`,
`Engine.chat` (stateless, for a server) and `Engine.complete` (raw text) all return a
`ReplyStream`: an iterator of `TokenEvent`s and one `FinishEvent`, cancellable from any thread.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from localchat.engine.events import ContextWindowError, Reply
from localchat.engine.generate import ReplyStream, Request, Scheduler, fed_reply_text
from localchat.engine.generation_config import GenerationConfig
from localchat.engine.runtime import Model
from localchat.engine.runtime import Sequence as ModelSequence
from localchat.engine.templates import ConversationTemplate, Message, resolve_template
from localchat.errors import GenerationError

OverflowPolicy = Literal["truncate", "error"]
OVERFLOW_POLICIES: tuple[str, ...] = ("truncate", "error")
# Room kept for a reply when deciding whether a conversation still fits its context window.
DEFAULT_REPLY_RESERVE = 256


@dataclass(frozen=True)
class PromptPlan:
    """What a new reply feeds: the messages (after any truncation), their rendered text, the
    tokens to prefill, how many tokens of the sequence's state it reuses, whether that state
    must be reset first, and how many earlier messages were dropped to fit the window."""

    messages: list[dict[str, Any]]
    text: str
    new_ids: list[int]
    reused: int
    reset: bool
    dropped: int = 0


class Engine:
    """One model ready to chat: template, stops, defaults, and the scheduler that runs replies.

    model: a loaded `Model`, or a model directory to load on `device`.
    template: a built-in template name or a .jinja file; default: the model's own Jinja
        template, else the template its localchat config names.
    context_window: tokens a sequence may hold (default and maximum: the model's window and
        the KV cache's size).
    overflow: what a conversation does when it outgrows the window: "truncate" drops the
        oldest turns (never the system prompt) and re-prefills, "error" raises
        ContextWindowError.
    reply_reserve: tokens kept free for a reply when checking the window (max_tokens when
        smaller).
    config: default generation parameters (default: the model's generation_config.json).
    """

    def __init__(
        self,
        model: Model | str | Path,
        *,
        device: str = "auto",
        template: str | ConversationTemplate | None = None,
        context_window: int | None = None,
        overflow: OverflowPolicy = "truncate",
        reply_reserve: int = DEFAULT_REPLY_RESERVE,
        config: GenerationConfig | None = None,
    ) -> None:
        self.model = model if isinstance(model, Model) else Model(Path(model), device)
        self.tokenizer = self.model.tokenizer
        warm_up = getattr(self.tokenizer, "warm_up", None)
        if warm_up is not None:  # a lazily built tokenizer: pay at load, not at the first reply
            warm_up()
        self.vocab_size = int(self.model.meta.get("vocab_size") or self.tokenizer.vocab_size)
        model_dir = self.model.model_dir
        if isinstance(template, ConversationTemplate):
            self.template = template
        else:
            self.template = resolve_template(model_dir, template, self.model.meta.get("template"))
        stops = self.template.stops(self.tokenizer, model_dir)
        self.stop_token_ids = frozenset([*stops.token_ids, *self.model.eos_token_ids])
        self.stop_strings = stops.strings
        limit = min(self.model.context_window_size, self.model.max_total_tokens)
        if context_window is not None:
            if isinstance(context_window, bool) or not isinstance(context_window, int):
                raise GenerationError(f"context_window must be an integer, got {context_window!r}")
            if not 2 <= context_window <= limit:
                raise GenerationError(
                    f"context_window must be in [2, {limit}], got {context_window}"
                )
        self.context_window = context_window or limit
        _check_policy(overflow)
        self.overflow: OverflowPolicy = overflow
        if (
            isinstance(reply_reserve, bool)
            or not isinstance(reply_reserve, int)
            or reply_reserve < 0
        ):
            raise GenerationError(f"reply_reserve must be an integer >= 0, got {reply_reserve!r}")
        self.reply_reserve = reply_reserve
        self.config = (config or GenerationConfig.from_model_defaults(model_dir)).validate(
            self.vocab_size
        )
        self.scheduler = Scheduler(self.model)
        self._add_bos = bool(self.model.meta.get("add_bos")) and (
            self.model.meta.get("bos_token_id") is not None
        )
        self._raw_template = self.template.name == "raw"  # plain text: BOS as for complete()

    # -- public API --------------------------------------------------------------------------
    def conversation(
        self,
        system: str | None = None,
        *,
        config: GenerationConfig | None = None,
        overflow: OverflowPolicy | None = None,
    ) -> Conversation:
        """A new conversation (optionally with a system prompt) that keeps its state."""
        return Conversation(self, system=system, config=config, overflow=overflow)

    def chat(
        self,
        messages: Sequence[Message],
        config: GenerationConfig | None = None,
        *,
        overflow: OverflowPolicy | None = None,
        **overrides: Any,
    ) -> ReplyStream:
        """A reply to `messages` on a fresh sequence, freed when it ends (e.g. for a server)."""
        cfg = self._config(config, overrides)
        if not messages:
            raise GenerationError("messages must not be empty")
        plan = self.plan_prompt(messages, cfg, overflow=overflow or self.overflow)
        return self.scheduler.submit(self._request(plan, cfg))

    def complete(
        self, prompt: str, config: GenerationConfig | None = None, **overrides: Any
    ) -> ReplyStream:
        """A continuation of raw text (no template); only the model's EOS tokens stop it."""
        cfg = self._config(config, overrides)
        if not isinstance(prompt, str):
            raise GenerationError("the prompt must be a string")
        ids = self._encode(prompt, raw=True)
        if not ids:
            raise GenerationError("the prompt is empty")
        self._check_fits(len(ids), cfg, "the prompt")
        plan = PromptPlan([], prompt, ids, 0, False)
        request = self._request(plan, cfg, stop_token_ids=frozenset(self.model.eos_token_ids))
        request.stop_strings = cfg.stop
        return self.scheduler.submit(request)

    def count_tokens(self, messages: Sequence[Message]) -> int:
        """Tokens of the prompt for `messages` (with the generation prompt) from scratch."""
        return len(self._encode(self.template.render(messages, add_generation_prompt=True)))

    def close(self) -> None:
        """Cancel running replies, stop the scheduler thread and free all sequences."""
        self.scheduler.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- prompts -----------------------------------------------------------------------------
    def plan_prompt(
        self,
        messages: Sequence[Message],
        config: GenerationConfig,
        *,
        overflow: OverflowPolicy,
        seq_tokens: Sequence[int] = (),
        fed_text: str | None = None,
    ) -> PromptPlan:
        """Decide what to prefill for `messages`, given a sequence that holds `seq_tokens`
        (whose text is `fed_text`), and apply the overflow policy.

        The new prompt reuses the state when the text fed so far is a prefix of the new
        rendering (then only the rest is tokenized and prefilled), or else when the tokens held
        are a prefix of the new prompt's tokens; otherwise the state is reset and the whole
        prompt prefilled.
        """
        _check_policy(overflow)
        messages = [dict(m) for m in messages]
        text = self.template.render(messages, add_generation_prompt=True)
        new_ids, reused, reset = self._continuation(text, list(seq_tokens), fed_text)
        reserve = self._reserve(config)
        window = self.context_window
        dropped = 0
        if overflow == "truncate":
            while reused + len(new_ids) + reserve > window:
                shorter = drop_oldest_turn(messages)
                if shorter is None:
                    break
                dropped += len(messages) - len(shorter)
                messages = shorter
                text = self.template.render(messages, add_generation_prompt=True)
                new_ids, reused, reset = self._encode(text), 0, bool(seq_tokens)
            need = reused + len(new_ids)
            if need >= window:
                raise ContextWindowError(
                    f"the message needs {need} tokens with the system prompt; the context "
                    f"window holds {window}"
                )
        else:
            need = reused + len(new_ids)
            if need + reserve > window:
                raise ContextWindowError(
                    f"the conversation needs {need} tokens plus {reserve} for the reply; the "
                    f"context window holds {window} (reset the conversation or start a new one)"
                )
        if not new_ids:
            raise GenerationError("the prompt is empty")
        return PromptPlan(messages, text, new_ids, reused, reset, dropped)

    def _continuation(
        self, text: str, seq_tokens: list[int], fed_text: str | None
    ) -> tuple[list[int], int, bool]:
        """(tokens to prefill, tokens reused, reset first) for prompt `text` on a sequence."""
        if not seq_tokens:
            return self._encode(text), 0, False
        if fed_text is not None and len(text) > len(fed_text) and text.startswith(fed_text):
            return self.tokenizer.encode(text[len(fed_text) :]), len(seq_tokens), False
        ids = self._encode(text)
        common = _common_prefix(seq_tokens, ids)
        if common == len(seq_tokens) and common < len(ids):
            return ids[common:], common, False
        return ids, 0, True

    def _encode(self, text: str, raw: bool | None = None) -> list[int]:
        """Token ids of a whole prompt; a raw one starts with BOS when the model wants it."""
        ids = self.tokenizer.encode(text)
        if raw is None:
            raw = self._raw_template
        if raw and self._add_bos:
            ids = [int(self.model.meta["bos_token_id"]), *ids]
        return ids

    def _reserve(self, config: GenerationConfig) -> int:
        reserve = self.reply_reserve
        if config.max_tokens is not None:
            reserve = min(reserve, config.max_tokens)
        return min(reserve, self.context_window // 2)

    def _check_fits(self, tokens: int, config: GenerationConfig, what: str) -> None:
        reserve = self._reserve(config)
        if tokens + reserve > self.context_window:
            raise ContextWindowError(
                f"{what} is {tokens} tokens; with {reserve} for the reply it exceeds the "
                f"context window of {self.context_window}"
            )

    def _config(
        self, config: GenerationConfig | None, overrides: Mapping[str, Any]
    ) -> GenerationConfig:
        cfg = config or self.config
        if overrides:
            cfg = cfg.replace(**overrides)
        return cfg.validate(self.vocab_size)

    def _request(
        self,
        plan: PromptPlan,
        config: GenerationConfig,
        *,
        seq: ModelSequence | None = None,
        holder: Conversation | None = None,
        stop_token_ids: frozenset[int] | None = None,
    ) -> Request:
        stops = self.stop_token_ids if stop_token_ids is None else stop_token_ids
        return Request(
            prompt_ids=plan.new_ids,
            config=config,
            stop_token_ids=stops | frozenset(config.stop_token_ids),
            stop_strings=tuple(dict.fromkeys([*self.stop_strings, *config.stop])),
            window=self.context_window,
            tokenizer=self.tokenizer,
            vocab_size=self.vocab_size,
            seq=seq,
            reset=plan.reset,
            holder=holder,
            prompt_text=plan.text,
            reused_tokens=plan.reused,
            dropped_messages=plan.dropped,
        )


class Conversation:
    """A chat that keeps its messages and its sequence's state between turns.

    `send` appends a user message and returns the reply's stream; when the reply ends, the
    assistant message is appended. One reply at a time. The engine may evict the state of an
    idle conversation when it needs the slot; its next turn then re-prefills its history.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        system: str | None = None,
        config: GenerationConfig | None = None,
        overflow: OverflowPolicy | None = None,
    ) -> None:
        self.engine = engine
        self.id = uuid.uuid4().hex[:12]
        self.config = (config or engine.config).validate(engine.vocab_size)
        self.overflow: OverflowPolicy = overflow or engine.overflow
        _check_policy(self.overflow)
        self._messages: list[dict[str, Any]] = []
        if system is not None:
            self._messages.append({"role": "system", "content": system})
        self._seq: ModelSequence | None = None
        self._fed_text: str | None = ""  # text of the tokens in _seq; None: unknown
        self._busy: ReplyStream | None = None
        self._reserved = False  # send() is preparing a request
        self._closed = False
        self.last_used = time.monotonic()
        self.last_reply: Reply | None = None
        self.replies: list[Reply] = []

    @property
    def _lock(self) -> threading.Condition:
        return self.engine.scheduler.cond

    # -- public API --------------------------------------------------------------------------
    @property
    def messages(self) -> list[dict[str, Any]]:
        """A copy of the messages so far (system prompt first when there is one)."""
        with self._lock:
            return [dict(m) for m in self._messages]

    @property
    def system(self) -> str | None:
        """The system prompt, or None."""
        with self._lock:
            first = self._messages[0] if self._messages else None
            return first["content"] if first and first["role"] == "system" else None

    def set_system(self, system: str | None) -> None:
        """Replace (or with None remove) the system prompt, keeping the other messages."""
        with self._lock:
            self._check_idle()
            if self._messages and self._messages[0]["role"] == "system":
                self._messages.pop(0)
            if system is not None:
                self._messages.insert(0, {"role": "system", "content": system})

    @property
    def busy(self) -> bool:
        """Whether a reply is being generated."""
        with self._lock:
            return self._busy is not None or self._reserved

    @property
    def context_tokens(self) -> int:
        """Tokens held in this conversation's state now."""
        with self._lock:
            return len(self._seq) if self._seq is not None else 0

    def send(
        self, content: str, config: GenerationConfig | None = None, **overrides: Any
    ) -> ReplyStream:
        """Add a user message and start the reply; parameters override the conversation's."""
        if not isinstance(content, str):
            raise GenerationError("the message must be a string")
        cfg = self.engine._config(config or self.config, overrides)
        with self._lock:
            self._check_idle()
            self._reserved = True
            seq = self._seq
            seq_tokens = list(seq.tokens) if seq is not None else []
            fed_text = self._fed_text
            messages = [*self._messages, {"role": "user", "content": content}]
        try:
            plan = self.engine.plan_prompt(
                messages, cfg, overflow=self.overflow, seq_tokens=seq_tokens, fed_text=fed_text
            )
            request = self.engine._request(plan, cfg, seq=seq, holder=self)
        except BaseException:
            with self._lock:
                self._reserved = False
            raise
        with self._lock:
            self._messages = plan.messages
            self._busy = request.stream
            self._reserved = False
            self.last_used = time.monotonic()
        try:
            return self.engine.scheduler.submit(request)
        except BaseException:
            with self._lock:
                self._busy = None
                self._messages.pop()
            raise

    def cancel(self) -> None:
        """Stop the reply being generated, if any (from any thread)."""
        stream = self._busy
        if stream is not None:
            stream.cancel()

    def reset(self) -> None:
        """Forget the turns (keeping the system prompt) and the state; cancels a running reply."""
        self._stop_reply()
        with self._lock:
            self._messages = [m for m in self._messages[:1] if m["role"] == "system"]
            self._drop_state()

    def close(self) -> None:
        """Cancel a running reply and free the sequence; the conversation cannot send again."""
        self._stop_reply()
        with self._lock:
            self._closed = True
            self._drop_state()

    def __enter__(self) -> Conversation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------
    def _check_idle(self) -> None:
        if self._closed:
            raise GenerationError("the conversation is closed")
        if self._busy is not None or self._reserved:
            raise GenerationError("a reply is already being generated in this conversation")

    def _stop_reply(self) -> None:
        stream = self._busy
        if stream is not None:
            stream.cancel()
            stream.wait()

    def _drop_state(self) -> None:
        seq, self._seq = self._seq, None
        self._fed_text = ""
        if seq is not None:
            self.engine.scheduler.release(seq)

    # SequenceHolder: called by the scheduler under its lock.
    def holds_idle_sequence(self) -> bool:
        return self._seq is not None and self._busy is None and not self._reserved

    def evict_sequence(self) -> ModelSequence | None:
        seq, self._seq = self._seq, None
        self._fed_text = ""
        return seq

    def reply_finished(self, request: Request, reply: Reply | None) -> None:
        self._busy = None
        self.last_used = time.monotonic()
        if reply is None:  # failed: the scheduler dropped the sequence
            self._seq = None
            self._fed_text = ""
            if self._messages and self._messages[-1]["role"] == "user":
                self._messages.pop()
            return
        if request.seq is not None:
            self._seq = request.seq
        if request.admitted:
            seq = request.seq
            assert seq is not None
            if request.prompt_end:
                context = seq.tokens[: request.prompt_end]
                fed = seq.tokens[request.prompt_end :]
                self._fed_text = request.prompt_text + fed_reply_text(
                    self.engine.tokenizer, context, fed
                )
            else:
                self._fed_text = None  # cancelled during prefill: part of a prompt is held
        if reply.finish_reason == "cancelled" and not reply.token_ids:
            self._messages.pop()  # a reply that never started leaves no turn behind
        else:
            self._messages.append({"role": "assistant", "content": reply.text})
        self.last_reply = reply
        self.replies.append(reply)
        if self._closed:
            self._drop_state()


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


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _check_policy(policy: str) -> None:
    if policy not in OVERFLOW_POLICIES:
        raise GenerationError(
            f"unknown overflow policy {policy!r}; expected one of {', '.join(OVERFLOW_POLICIES)}"
        )


__all__ = [
    "ContextWindowError",
    "Conversation",
    "DEFAULT_REPLY_RESERVE",
    "Engine",
    "OverflowPolicy",
    "PromptPlan",
    "ReplyStream",
    "drop_oldest_turn",
]
