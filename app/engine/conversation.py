"""A conversation: its messages and the sequence whose KV/RNN state holds them, so a new turn
prefills only what it adds. It is the scheduler's `SequenceOwner` for that sequence."""

from __future__ import annotations

import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from localchat.engine.generation_config import GenerationConfig
from localchat.engine.prompt import OverflowPolicy, check_policy
from localchat.engine.reasoning import check_think
from localchat.engine.runtime import Sequence
from localchat.engine.scheduler import EndedReply
from localchat.engine.stream import Reply, ReplyStream
from localchat.errors import GenerationError, InvalidRequestError

if TYPE_CHECKING:
    from localchat.engine.engine import Engine


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
        think: bool | None = None,
    ) -> None:
        self.engine = engine
        # A reasoning model's thinking switch for every turn (None: the template's default).
        self.think = check_think(think)
        self.id = uuid.uuid4().hex[:12]
        self.config = (config or engine.config).validate(engine.vocab_size)
        self.overflow: OverflowPolicy = overflow or engine.overflow
        check_policy(self.overflow)
        self._messages: list[dict[str, Any]] = []
        if system is not None:
            self._messages.append({"role": "system", "content": system})
        self._seq: Sequence | None = None
        self._held_text: str | None = ""  # text of the tokens in _seq; None: unknown
        self._busy: ReplyStream | None = None
        self._reserved = False  # send() is preparing a request
        self._closed = False
        self.last_used = time.monotonic()
        self.last_reply: Reply | None = None
        self.replies: list[Reply] = []

    @property
    def _lock(self) -> threading.Condition:
        # The scheduler calls the owner methods below under its lock: share it.
        return self.engine.scheduler.lock

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
        self,
        content: str,
        config: GenerationConfig | None = None,
        *,
        think: bool | None = None,
        **overrides: Any,
    ) -> ReplyStream:
        """Add a user message and start the reply; parameters override the conversation's
        (`think`: this turn's thinking switch, else the conversation's)."""
        if not isinstance(content, str):
            raise InvalidRequestError("the message must be a string", "content")
        think = self.engine.thinking_switch(self.think if think is None else think)
        cfg = self.engine.resolve_config(config or self.config, overrides)
        with self._lock:
            self._check_idle()
            self._reserved = True
            seq = self._seq
            held_tokens = list(seq.tokens) if seq is not None else []
            held_text = self._held_text
            messages = [*self._messages, {"role": "user", "content": content}]
        try:
            plan = self.engine.planner.plan(
                messages,
                cfg.max_tokens,
                overflow=self.overflow,
                held_tokens=held_tokens,
                held_text=held_text,
                think=think,
            )
            request = self.engine.make_request(plan, cfg, seq=seq, owner=self)
            request.held_text_before = held_text
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
        self._held_text = ""
        if seq is not None:
            self.engine.scheduler.release(seq)

    # -- SequenceOwner: called by the scheduler under its lock --------------------------------
    def holds_idle_sequence(self) -> bool:
        """True when it holds a sequence and no reply of its is waiting or running."""
        return self._seq is not None and self._busy is None and not self._reserved

    def evict_sequence(self) -> Sequence | None:
        """Forget the sequence (the next turn re-prefills) and hand it back for removal."""
        seq, self._seq = self._seq, None
        self._held_text = ""
        return seq

    def reply_ended(self, ended: EndedReply) -> None:
        """Keep the sequence the reply left, and append the reply (or undo the turn)."""
        self._busy = None
        self.last_used = time.monotonic()
        reply = ended.reply
        self._seq = ended.seq if ended.seq is not None or reply is None else self._seq
        self._held_text = ended.held_text if self._seq is not None else ""
        if reply is None:  # failed: the scheduler dropped the sequence
            if self._messages and self._messages[-1]["role"] == "user":
                self._messages.pop()
            return
        if reply.finish_reason == "cancelled" and not reply.token_ids:
            self._messages.pop()  # a reply that never started leaves no turn behind
        else:
            # The answer is the content; the thinking goes in `reasoning_content`, the key
            # Qwen3's template reads (it renders it only for the turns after the last user
            # message, so earlier turns' thinking is not fed back); others ignore the key.
            message: dict[str, Any] = {"role": "assistant", "content": reply.text}
            if reply.reasoning:
                message["reasoning_content"] = reply.reasoning
            self._messages.append(message)
        self.last_reply = reply
        self.replies.append(reply)
        if self._closed:
            self._drop_state()
