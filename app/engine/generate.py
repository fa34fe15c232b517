"""The plain generation loop: prefill a prompt, then decode token by token, with timing stats.

This is the raw-completion path of `localchat run`; the chat engine builds conversations,
templates and richer sampling on the same `Model` calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import numpy as np

from localchat.engine.runtime import Model
from localchat.errors import GenerationError


@dataclass
class GenerationStats:
    """Timings of one completion."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = 0.0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


@dataclass
class Completion:
    """What a completion produced."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats = field(default_factory=GenerationStats)


def pick_token(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """Greedy at temperature 0, else a sample from softmax(logits / temperature)."""
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    return int(rng.choice(p.size, p=p))


def generate_tokens(
    model: Model,
    prompt_ids: list[int],
    max_tokens: int,
    choose: Callable[[np.ndarray], int],
    stats: GenerationStats,
    stop_ids: set[int] | None = None,
) -> Iterator[int]:
    """Yield generated token ids until a stop id (not yielded) or `max_tokens`."""
    if max_tokens < 1:
        raise GenerationError("max_tokens must be at least 1")
    if not prompt_ids:
        raise GenerationError("the prompt is empty")
    seq = model.new_sequence()
    try:
        start = time.perf_counter()
        logits = model.prefill(seq, prompt_ids)
        token = choose(logits)
        first = time.perf_counter()
        stats.prompt_tokens = len(prompt_ids)
        stats.ttft_s = first - start
        stats.prefill_tok_s = len(prompt_ids) / max(stats.ttft_s, 1e-9)
        produced = 0
        while True:
            if stop_ids and token in stop_ids:
                return
            produced += 1
            stats.completion_tokens = produced
            yield token
            if produced >= max_tokens or len(seq) + 1 > model.context_window_size:
                return
            logits = model.decode([seq], [token])[0]
            token = choose(logits)
            elapsed = time.perf_counter() - first
            stats.decode_tok_s = produced / max(elapsed, 1e-9)
    finally:
        model.remove(seq)


def complete(
    model: Model,
    prompt: str,
    *,
    max_tokens: int = 128,
    temperature: float = 0.0,
    seed: int | None = None,
    on_text: Callable[[str], None] | None = None,
) -> Completion:
    """Complete a raw prompt (no chat template); stream text pieces through `on_text`."""
    if temperature < 0:
        raise GenerationError("temperature must be >= 0")
    tok = model.tokenizer
    prompt_ids = tok.encode(prompt)
    bos = model.meta.get("bos_token_id")
    if model.meta.get("add_bos") and bos is not None:
        prompt_ids = [int(bos)] + prompt_ids
    rng = np.random.default_rng(seed)
    stats = GenerationStats()
    ids: list[int] = []
    emitted = ""
    stop = set(model.eos_token_ids)
    for token in generate_tokens(
        model, prompt_ids, max_tokens, lambda lg: pick_token(lg, temperature, rng), stats, stop
    ):
        ids.append(token)
        text = tok.decode(ids)
        if on_text and not text.endswith("\ufffd") and len(text) > len(emitted):
            on_text(text[len(emitted) :])
            emitted = text
    text = tok.decode(ids)
    if on_text and len(text) > len(emitted):
        on_text(text[len(emitted) :])
    finish = "length" if stats.completion_tokens >= max_tokens else "stop"
    return Completion(text, ids, finish, stats)
