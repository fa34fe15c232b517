"""The continuous-batching loop: a scheduler thread that runs every active reply of one model.

Each loop turn admits waiting requests (a sequence slot for each, evicting the state of idle
sequence owners when slots run out), feeds one prefill chunk (several requests' chunks batched
in one call), then advances every decoding request by one token in one batched `Model.decode`
call. New requests join between steps. Cancellation is a flag the loop reads before every step,
so a reply stops within one decode step (or one prefill chunk).

Whoever keeps a sequence between replies (a `Conversation`) is a `SequenceOwner`: the
scheduler asks it three things (is your sequence idle, give it up, your reply ended) and
nothing else.

With the prefix cache on (prefix_cache.py), a sequence no one holds any more (a stateless
reply's, a closed conversation's) is kept rather than freed, and a request that starts without
a sequence forks the cached or idle sequence sharing the longest prefix with its prompt and
prefills only the rest. Cache entries are the first thing given up when a running request
needs a slot or room.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from localchat.engine.detokenizer import TextStream
from localchat.engine.generation_config import GenerationConfig
from localchat.engine.prefix_cache import MIN_MATCH_TOKENS, PrefixCache, enabled_from_env
from localchat.engine.prompt import fed_reply_text
from localchat.engine.reasoning import ReasoningSplitter
from localchat.engine.runtime import Model, Sequence
from localchat.engine.sampler import Sampler, sample_batch
from localchat.engine.stream import FinishEvent, Reply, ReplyStats, ReplyStream, TokenEvent
from localchat.errors import EngineBusyError, GenerationError, LocalchatError, ModelFailureError

_request_ids = itertools.count(1)


@dataclass(frozen=True)
class EndedReply:
    """What an owner learns when its reply ends.

    reply: the finished reply, or None when it failed (the sequence's state is then dropped).
    seq: the sequence the owner now holds (None: it holds none).
    held_text: the text of every token in `seq`'s state (None: unknown, e.g. cancelled during
        the prompt), so the owner's next prompt can reuse the state by text prefix.
    """

    reply: Reply | None
    seq: Sequence | None
    held_text: str | None


class SequenceOwner(Protocol):
    """Who keeps a sequence between replies (a conversation); the scheduler may evict it."""

    last_used: float

    def holds_idle_sequence(self) -> bool:
        """True when it holds a sequence and no reply of its is waiting or running."""
        ...

    def evict_sequence(self) -> Sequence | None:
        """Forget its sequence (its next reply re-prefills) and return it for removal."""
        ...

    def reply_ended(self, ended: EndedReply) -> None:
        """Called under the scheduler lock when its reply ends."""
        ...


@dataclass(eq=False)
class Request:
    """One reply to generate: the tokens to prefill, how to sample, where events go."""

    prompt_ids: list[int]
    config: GenerationConfig
    stop_token_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    window: int
    tokenizer: object
    vocab_size: int
    seq: Sequence | None = None
    reset: bool = False
    rollback: int = 0  # tokens to drop from the end of seq before prefilling
    snapshot_at: int = 0  # prompt tokens after which an RNN state is kept in the cache (0: no)
    owner: SequenceOwner | None = None
    prompt_text: str = ""  # the text of every token in seq once the prompt is in
    held_text_before: str | None = ""  # the text seq held when the request was made
    reused_tokens: int = 0
    dropped_messages: int = 0
    constraint: Any = None  # a grammar.TokenConstraint when the reply has a response format
    splitter: ReasoningSplitter | None = None  # keeps a reasoning model's thinking apart
    id: int = field(default_factory=lambda: next(_request_ids))
    stream: ReplyStream = field(init=False)
    # Filled in as it runs.
    admitted: bool = False  # got its sequence and started prefilling
    fed: int = 0
    prompt_end: int = 0  # len(seq) once the prompt is in
    sampler: Sampler | None = None
    text_stream: TextStream | None = None
    generated: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # text released so far
    thoughts: list[str] = field(default_factory=list)  # thinking text released so far
    next_token: int | None = None  # sampled, to be fed by the next decode step
    finish_reason: str | None = None
    message: str | None = None
    submitted_at: float = field(default_factory=time.perf_counter)
    prefill_started_at: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    sampling_s: float = 0.0

    def __post_init__(self) -> None:
        self.stream = ReplyStream(self.id)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt_ids)

    @property
    def cancelled(self) -> bool:
        return self.stream.cancelled


class Scheduler:
    """Runs the replies of one model in a background thread, batching their steps.

    max_queue: requests that may wait for a slot; one more raises EngineBusyError (None: no
    limit).
    prefix_cache: keep finished sequences for reuse by prompts that share a prefix (None:
        on unless the LOCALCHAT_PREFIX_CACHE environment variable is "0").
    prefix_cache_tokens: most tokens the kept sequences may hold (None: the KV cache's size;
        they yield to running requests in any case).
    """

    def __init__(
        self,
        model: Model,
        *,
        max_queue: int | None = None,
        prefix_cache: bool | None = None,
        prefix_cache_tokens: int | None = None,
    ) -> None:
        self.model = model
        self.max_queue = max_queue
        if prefix_cache is None:
            prefix_cache = enabled_from_env()
        # a fork that recomputes its prefix (windows on a GPU: runtime.forks_share_pages)
        # saves nothing: no cache to hold idle sequences for
        prefix_cache = prefix_cache and model.forks_share_pages
        budget = model.max_total_tokens if prefix_cache_tokens is None else prefix_cache_tokens
        self.cache: PrefixCache | None = (
            PrefixCache(budget, fork_anywhere=model.supports_rollback) if prefix_cache else None
        )
        self.cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._active: list[Request] = []
        self._owners: dict[int, SequenceOwner] = {}  # seq id -> idle-able owner
        self._seqs: dict[int, Sequence] = {}  # every sequence the scheduler allocated
        self._thread: threading.Thread | None = None
        self._closed = False
        self._reclaimer = self._reclaim_for_others  # (one bound method, to unregister it)
        if self.cache is not None:
            model.add_reclaimer(self._reclaimer)
        self._bounded = model.state_kind != "rnn"  # a KV cache has a token budget, RNN state not
        # Counters for benchmarks and tests.
        self.decode_steps = 0
        self.decode_seconds = 0.0
        self.sampling_seconds = 0.0
        self.max_decode_batch = 0

    # -- caller side -------------------------------------------------------------------------
    @property
    def lock(self) -> threading.Condition:
        """The lock owners hold while they change what the scheduler may ask them about."""
        return self.cond

    def submit(self, request: Request) -> ReplyStream:
        """Queue a request; its events arrive on `request.stream`."""
        with self.cond:
            if self._closed:
                raise GenerationError("the engine is closed")
            if self.max_queue is not None and len(self._waiting) >= self.max_queue:
                raise EngineBusyError(
                    f"the engine is busy: {len(self._waiting)} requests are already waiting; "
                    f"try again later"
                )
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="localchat-scheduler", daemon=True
                )
                self._thread.start()
            self._waiting.append(request)
            self.cond.notify_all()
        return request.stream

    def release(self, seq: Sequence) -> None:
        """Give up a sequence (an owner closing or resetting): kept in the prefix cache when it
        is on, else freed."""
        with self.cond:
            self._owners.pop(seq.seq_id, None)
            self._retire(seq)

    def close(self) -> None:
        """Cancel everything, stop the thread and free the sequences."""
        with self.cond:
            self._closed = True
            for request in [*self._waiting, *self._active]:
                request.stream.cancel()
            self.cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)
        self.model.remove_reclaimer(self._reclaimer)
        with self.cond:
            if self.cache is not None:
                self.cache.clear()
            for seq in list(self._seqs.values()):
                self.model.remove(seq)
            self._seqs.clear()
            self._owners.clear()

    def counts(self) -> tuple[int, int]:
        """(requests waiting for a slot, requests running) right now."""
        with self.cond:
            return len(self._waiting), len(self._active)

    def held_tokens(self) -> int:
        """Tokens held in the state by all sequences the scheduler knows."""
        with self.cond:
            return sum(len(s) for s in self._seqs.values())

    def cached_tokens(self) -> int:
        """Tokens held by the prefix cache's entries (0 when it is off)."""
        with self.cond:
            return self.cache.held_tokens if self.cache is not None else 0

    # -- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if not self._turn():
                    return
            except Exception as exc:  # noqa: BLE001 - a bug here must not hang the callers
                with self.cond:
                    for request in [*self._waiting, *self._active]:
                        if request.finish_reason is None:
                            self._fail(request, _as_generation_error(exc))
                    self._waiting.clear()
                    self._active.clear()

    def _turn(self) -> bool:
        """One loop turn: admit, one prefill chunk, one decode step. False when closed."""
        with self.cond:
            while not self._closed and not self._waiting and not self._active:
                self.cond.wait()
            if self._closed and not self._waiting and not self._active:
                return False
            self._finish_cancelled()
            self._admit()
            prefilling = [r for r in self._active if r.prefilling]
            decoding = [r for r in self._active if r.next_token is not None]
        if prefilling:
            self._guarded(self._prefill_step, prefilling)
        if decoding:
            self._guarded(self._decode_step, decoding)
        return True

    def _guarded(self, step: Callable[[list[Request]], None], requests: list[Request]) -> None:
        """Run a step; if the model fails, fail those requests and keep serving the others."""
        try:
            step(requests)
        except Exception as exc:  # noqa: BLE001 - reported to each caller, the loop goes on
            with self.cond:
                for request in requests:
                    if request.finish_reason is None:
                        self._fail(request, _as_generation_error(exc))

    def _finish_cancelled(self) -> None:
        for request in list(self._waiting):
            if request.cancelled or self._closed:
                self._waiting.remove(request)
                self._finish(request, "cancelled")
        for request in list(self._active):
            if request.cancelled or self._closed:
                self._finish(request, "cancelled")

    def _admit(self) -> None:
        """Give waiting requests a sequence and room in the KV cache, first come first served."""
        while self._waiting:
            request = self._waiting[0]
            if request.seq is None:
                seq = self._reuse_prefix(request) or self._new_sequence()
                if seq is None:
                    if not self._active:
                        self._waiting.popleft()
                        self._fail(request, GenerationError("no free sequence slot in the model"))
                        continue
                    return  # wait for a running reply to end
                request.seq = seq
                self._seqs[seq.seq_id] = seq
                if request.owner is not None:
                    self._owners[seq.seq_id] = request.owner
            if request.reset and len(request.seq):
                self.model.reset(request.seq)
            elif request.rollback:
                self.model.popn(request.seq, request.rollback)
                request.rollback = 0  # (admission may be retried: pop once)
            if self._bounded and not self._make_room(len(request.prompt_ids)):
                if not self._active:
                    self._waiting.popleft()
                    self._fail(
                        request,
                        GenerationError(
                            f"the prompt needs {len(request.prompt_ids)} tokens but the KV cache "
                            f"holds at most {self.model.max_total_tokens}"
                        ),
                    )
                    continue
                return
            self._waiting.popleft()
            self._start(request)

    def _new_sequence(self) -> Sequence | None:
        while True:
            try:
                return self.model.new_sequence()
            except GenerationError:
                if not self._evict_one() and not self.model.reclaim(self._reclaimer):
                    return None

    def _reclaim_for_others(self) -> bool:
        """Free one prefix-cache entry for another engine on the same model (never waits for
        this scheduler's lock: two engines reclaiming from each other must not deadlock)."""
        if self.cache is None or not self.cond.acquire(blocking=False):
            return False
        try:
            entry = self.cache.pop_lru()
            if entry is None:
                return False
            self._seqs.pop(entry.seq_id, None)
            self.model.remove(entry)
            return True
        finally:
            self.cond.release()

    def _reuse_prefix(self, request: Request) -> Sequence | None:
        """A fork of the cached (or idle) sequence sharing the longest prefix with the request's
        prompt, which then keeps only the tokens after it; None when nothing matches."""
        if self.cache is None:
            return None
        held = [
            self._seqs[seq_id]
            for seq_id, owner in self._owners.items()
            if seq_id in self._seqs and owner.holds_idle_sequence()
        ]
        match = self.cache.match(request.prompt_ids, held)
        if match is None:
            return None
        while True:
            try:
                child = self.model.fork(match.parent, match.tokens)
                break
            except GenerationError:  # no free slot: give up another entry or idle state
                if not self._evict_one(keep=match.parent) and not self.model.reclaim(
                    self._reclaimer
                ):
                    return None
        request.prompt_ids = request.prompt_ids[match.tokens :]
        request.reused_tokens += match.tokens
        return child

    def _retire(self, seq: Sequence) -> None:
        """A sequence no one holds any more: into the prefix cache, or freed."""
        drop = [seq] if self.cache is None or seq.seq_id not in self._seqs else self.cache.add(seq)
        for old in drop:
            self._seqs.pop(old.seq_id, None)
            self.model.remove(old)

    def _evict_one(self, keep: Sequence | None = None) -> bool:
        """Free a prefix-cache entry, else the state of the least recently used idle
        conversation (never `keep`); False if there is none."""
        if self.cache is not None:
            entry = self.cache.pop_lru(keep)
            if entry is not None:
                self._seqs.pop(entry.seq_id, None)
                self.model.remove(entry)
                return True
        idle = [
            h
            for seq_id, h in self._owners.items()
            if h.holds_idle_sequence() and (keep is None or seq_id != keep.seq_id)
        ]
        if not idle:
            return False
        victim = min(idle, key=lambda h: h.last_used)
        seq = victim.evict_sequence()
        if seq is not None:
            self._owners.pop(seq.seq_id, None)
            self._seqs.pop(seq.seq_id, None)
            self.model.remove(seq)
        return True

    def _make_room(self, tokens: int) -> bool:
        """Evict idle conversations until `tokens` more fit in the KV cache."""
        while sum(len(s) for s in self._seqs.values()) + tokens > self.model.max_total_tokens:
            if not self._evict_one():
                return False
        return True

    def _start(self, request: Request) -> None:
        assert request.seq is not None
        context = [*request.seq.tokens, *request.prompt_ids]
        request.sampler = Sampler(
            request.config, request.vocab_size, context, constraint=request.constraint
        )
        request.text_stream = TextStream(request.tokenizer, request.stop_strings)  # type: ignore[arg-type]
        request.prefill_started_at = time.perf_counter()
        request.admitted = True
        if (
            self.cache is not None
            and not self.model.supports_rollback
            and len(request.prompt_ids) >= 2
            and len(request.seq) + len(request.prompt_ids) > MIN_MATCH_TOKENS
        ):
            # An RNN state forks only at its end: keep one at the prompt's last token but one,
            # so a regenerated reply (same prompt) or a history resent with a reply worded
            # otherwise re-runs one token instead of the whole prompt.
            request.snapshot_at = len(request.prompt_ids) - 1
        self._active.append(request)

    # -- steps -------------------------------------------------------------------------------
    def _prefill_step(self, requests: list[Request]) -> None:
        """Feed one chunk: the next prompt tokens of as many requests as fit, in one call."""
        chunk = budget = self.model.prefill_chunk_size
        batch: list[tuple[Request, list[int]]] = []
        for request in requests:
            # A prompt is cut only at multiples of the chunk size (and at an RNN snapshot), never
            # where a shared budget happens to run out: where a prompt is cut changes the last
            # bits of its logits, and a request must get the same tokens alone or in a batch.
            end = (request.fed // chunk + 1) * chunk
            if request.fed < request.snapshot_at:
                end = min(end, request.snapshot_at)  # stop there to fork the snapshot
            part = request.prompt_ids[request.fed : end]
            if batch and len(part) > budget:
                break  # the next step takes it whole
            batch.append((request, part))
            budget -= len(part)
        seqs = [r.seq for r, _ in batch]
        parts = [p for _, p in batch]
        if len(batch) == 1:
            logits = self.model.prefill(seqs[0], parts[0])[None, :]  # type: ignore[arg-type]
        else:
            logits = self.model.batch_prefill(seqs, parts)  # type: ignore[arg-type]
        now = time.perf_counter()
        with self.cond:
            for (request, part), row in zip(batch, logits, strict=True):
                request.fed += len(part)
                if request.snapshot_at and request.fed == request.snapshot_at:
                    self._snapshot(request)
                if request.prefilling or request.finish_reason is not None:
                    continue
                assert request.seq is not None and request.sampler is not None
                request.prompt_end = len(request.seq)
                t0 = time.perf_counter()
                token = request.sampler.sample(row)
                request.sampling_s += time.perf_counter() - t0
                request.first_token_at = now
                self._accept(request, token, _logprobs(request, row, token))

    def _snapshot(self, request: Request) -> None:
        """Keep a copy of an RNN request's state in the prefix cache (if a slot is free: a
        snapshot never evicts anything)."""
        request.snapshot_at = 0
        if self.cache is None or request.seq is None or request.finish_reason is not None:
            return
        try:
            snap = self.model.fork(request.seq)
        except GenerationError:
            return
        self._seqs[snap.seq_id] = snap
        self._retire(snap)

    def _decode_step(self, requests: list[Request]) -> None:
        """Advance every decoding request by one token in one batched call."""
        with self.cond:
            requests = [r for r in requests if r.finish_reason is None]
            if self._bounded:
                requests = self._fit_decode_batch(requests)
        if not requests:
            return
        seqs = [r.seq for r in requests]
        tokens = [r.next_token for r in requests]
        t0 = time.perf_counter()
        logits = self.model.decode(seqs, tokens)  # type: ignore[arg-type]
        t1 = time.perf_counter()
        chosen = sample_batch([r.sampler for r in requests], logits)  # type: ignore[misc]
        t2 = time.perf_counter()
        self.decode_steps += 1
        self.decode_seconds += t1 - t0
        self.sampling_seconds += t2 - t1
        self.max_decode_batch = max(self.max_decode_batch, len(requests))
        share = (t2 - t1) / len(requests)
        with self.cond:
            for i, (request, token) in enumerate(zip(requests, chosen, strict=True)):
                request.next_token = None
                request.sampling_s += share
                request.last_token_at = t2
                self._accept(request, token, _logprobs(request, logits[i], token))

    def _fit_decode_batch(self, requests: list[Request]) -> list[Request]:
        """End the newest replies with "length" if one more token each overflows the KV cache."""
        while requests:
            held = sum(len(s) for s in self._seqs.values())
            if held + len(requests) <= self.model.max_total_tokens or not self._evict_one():
                break
        held = sum(len(s) for s in self._seqs.values())
        while requests and held + len(requests) > self.model.max_total_tokens:
            newest = max(requests, key=lambda r: r.submitted_at)
            requests.remove(newest)
            newest.message = "the KV cache is full (too many tokens across all sequences)"
            self._finish(newest, "length")
        return requests

    def _accept(
        self, request: Request, token: int, logprobs: tuple[float, Any] | None = None
    ) -> None:
        """Handle a sampled token: stop token, text and stop strings, limits; else decode it."""
        assert request.seq is not None and request.text_stream is not None
        if token in request.stop_token_ids:
            self._finish(request, "stop")
            return
        request.generated.append(token)
        request.last_token_at = time.perf_counter()
        piece = request.text_stream.add(token)
        thinking, answer = _split(request, piece.text, token)
        logprob, top = logprobs if logprobs is not None else (None, None)
        request.stream.put(TokenEvent(request.id, token, answer, logprob, top, thinking))
        limit = request.config.max_tokens
        if piece.stopped:
            self._finish(request, "stop")
        elif limit is not None and len(request.generated) >= limit:
            self._finish(request, "length")
        elif len(request.seq) + 1 > request.window:
            request.message = (
                f"the context window ({request.window} tokens) is full; the reply was cut short"
            )
            self._finish(request, "length")
        else:
            request.next_token = token

    # -- ending ------------------------------------------------------------------------------
    def _finish(self, request: Request, reason: str) -> None:
        """End a request (under the lock): flush its text, build the reply, notify its owner."""
        if request.finish_reason is not None:
            return
        request.finish_reason = reason
        request.next_token = None
        tail = request.text_stream.finish() if request.text_stream is not None else ""
        thinking, tail = _split(request, tail, None, final=True)
        calls = tuple(getattr(request.splitter, "calls", ()))
        if calls and reason == "stop" and not calls[-1].complete:
            # the stop token (harmony's <|call|>) ended the last call's body
            calls = (*calls[:-1], dataclasses.replace(calls[-1], complete=True))
        reply = Reply(
            text="".join(request.pieces),
            token_ids=list(request.generated),
            finish_reason=reason,
            stats=self._stats(request, reason),
            message=request.message,
            reasoning="".join(request.thoughts),
            tool_calls=calls,
        )
        self._detach(request)
        if request.owner is not None:
            request.owner.reply_ended(EndedReply(reply, request.seq, self._held_text(request)))
        request.stream.finish(reply)
        request.stream.put(FinishEvent(request.id, tail, reply, thinking))

    def _fail(self, request: Request, error: BaseException) -> None:
        """End a request with an error (under the lock); its sequence's state is dropped."""
        request.finish_reason = "error"
        self._detach(request)
        seq = request.seq
        if seq is not None:
            self._owners.pop(seq.seq_id, None)
            self._seqs.pop(seq.seq_id, None)
            try:
                self.model.remove(seq)
            except Exception:  # noqa: BLE001 - the state is already broken; nothing to keep
                pass
        if request.owner is not None:
            request.owner.reply_ended(EndedReply(None, None, ""))
        request.stream.finish(None, error)
        request.stream.put(error)

    def _detach(self, request: Request) -> None:
        if request in self._active:
            self._active.remove(request)
        if request.owner is None and request.seq is not None and request.finish_reason != "error":
            self._retire(request.seq)

    @staticmethod
    def _held_text(request: Request) -> str | None:
        """The text of the tokens in the request's sequence, when it is known."""
        if not request.admitted:  # never started: the sequence holds what it held before
            return request.held_text_before
        seq = request.seq
        if seq is None or not request.prompt_end:
            return None  # cancelled during prefill: part of a prompt is held
        context = seq.tokens[: request.prompt_end]
        fed = seq.tokens[request.prompt_end :]
        return request.prompt_text + fed_reply_text(request.tokenizer, context, fed)

    @staticmethod
    def _stats(request: Request, reason: str) -> ReplyStats:
        prefilled = request.fed
        first = request.first_token_at
        n = len(request.generated)
        ttft = first - request.submitted_at if first else 0.0
        prefill_s = first - request.prefill_started_at if first else 0.0
        decode_s = request.last_token_at - first if first and n > 1 else 0.0
        seq = request.seq
        return ReplyStats(
            prompt_tokens=prefilled,
            reused_tokens=request.reused_tokens,
            completion_tokens=n,
            ttft_s=ttft,
            prefill_tok_s=prefilled / prefill_s if prefill_s > 0 else 0.0,
            decode_tok_s=(n - 1) / decode_s if decode_s > 0 else 0.0,
            sampling_s=request.sampling_s,
            finish_reason=reason,
            context_tokens=len(seq) if seq is not None else 0,
            dropped_messages=request.dropped_messages,
            reasoning_tokens=request.splitter.thinking_tokens if request.splitter else 0,
        )


def _split(
    request: Request, text: str, token: int | None, final: bool = False
) -> tuple[str, str]:
    """(thinking, answer) of released text, recorded on the request; all answer for a model
    that does not think."""
    splitter = request.splitter
    if splitter is None:
        thinking, answer = "", text
    else:
        thinking, answer = splitter.push(text, token) if text or token is not None else ("", "")
        if final:
            more_thinking, more_answer = splitter.finish()
            thinking, answer = thinking + more_thinking, answer + more_answer
    if thinking:
        request.thoughts.append(thinking)
    if answer:
        request.pieces.append(answer)
    return thinking, answer


def _logprobs(
    request: Request, row: Any, token: int
) -> tuple[float, tuple[tuple[int, float], ...]] | None:
    """(log-probability of `token`, the k best (id, log-probability)) under the raw logits
    `row`, when the request asks for logprobs; else None."""
    k = request.config.logprobs
    if k is None:
        return None
    x = np.asarray(row, dtype=np.float64).reshape(-1)
    top = float(x.max())
    logz = top + math.log(float(np.exp(x - top).sum()))
    best: tuple[tuple[int, float], ...] = ()
    if k > 0:
        ids = np.argpartition(-x, k - 1)[:k] if k < x.shape[0] else np.arange(x.shape[0])
        ids = ids[np.argsort(-x[ids], kind="stable")]
        best = tuple((int(i), float(x[i]) - logz) for i in ids)
    return float(x[token]) - logz, best


def _as_generation_error(exc: Exception) -> LocalchatError:
    """A model failure as a one-line ModelFailureError (TVM errors carry long native traces)."""
    if isinstance(exc, LocalchatError):
        return exc
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    message = f"the model failed: {type(exc).__name__}" + (f": {first}" if first else "")
    error = ModelFailureError(message)
    error.__cause__ = exc
    return error


def sampling_share(scheduler: Scheduler) -> float:
    """Fraction of decode-step time spent sampling, over the scheduler's life so far."""
    total = scheduler.decode_seconds + scheduler.sampling_seconds
    return scheduler.sampling_seconds / total if total else 0.0


__all__ = ["EndedReply", "Request", "Scheduler", "SequenceOwner", "sampling_share"]
