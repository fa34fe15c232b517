"""Choosing the next token from a logits vector: penalties, temperature, top-k/top-p/min-p, seed.

Everything is numpy on the host. The steps over the whole vocabulary are a handful of O(V)
vector operations (copy, max, exp, one partition); only small candidate sets are ever sorted,
so a step stays well under a millisecond on 50-65k vocabularies (see bench/bench_sampler.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from localchat.engine.generation_config import GenerationConfig
from localchat.errors import GenerationError

__all__ = ["GenerationConfig", "Sampler", "sample_batch"]

# Nucleus search: look at the best FIRST_NUCLEUS tokens, then NUCLEUS_GROWTH times more each
# round; only a nearly flat distribution needs a sort of (almost) the whole vocabulary.
FIRST_NUCLEUS = 64
NUCLEUS_GROWTH = 8
# Inverse-CDF draws over more weights than this go through block sums instead of one cumsum.
DRAW_BLOCK = 1024


class _IdSet:
    """A set of token ids that is also a growing numpy array, for fancy indexing."""

    def __init__(self, vocab_size: int) -> None:
        self.member = np.zeros(vocab_size, dtype=bool)
        self._ids = np.empty(64, dtype=np.int64)
        self._n = 0

    @property
    def array(self) -> np.ndarray:
        return self._ids[: self._n]

    def __len__(self) -> int:
        return self._n

    def add_many(self, ids: np.ndarray) -> None:
        new = np.unique(ids[~self.member[ids]])
        if new.size == 0:
            return
        self.member[new] = True
        need = self._n + new.size
        if need > self._ids.size:
            grown = np.empty(max(need, 2 * self._ids.size), dtype=np.int64)
            grown[: self._n] = self._ids[: self._n]
            self._ids = grown
        self._ids[self._n : need] = new
        self._n = need

    def add(self, token_id: int) -> None:
        if not self.member[token_id]:
            self.add_many(np.array([token_id], dtype=np.int64))


class _RecentIds:
    """The last `size` token ids seen (a ring), as the set the repetition penalty acts on."""

    def __init__(self, size: int) -> None:
        self._ring = np.empty(size, dtype=np.int64)
        self._n = 0  # tokens ever added

    def __len__(self) -> int:
        return min(self._n, self._ring.size)

    @property
    def array(self) -> np.ndarray:
        return np.unique(self._ring[: len(self)])

    def add_many(self, ids: np.ndarray) -> None:
        size = self._ring.size
        ids = ids[-size:]
        for token_id in ids.tolist():
            self._ring[self._n % size] = token_id
            self._n += 1

    def add(self, token_id: int) -> None:
        self._ring[self._n % self._ring.size] = token_id
        self._n += 1


class Sampler:
    """Picks the tokens of one sequence's reply; owns its random generator and token history.

    Create one per reply with the tokens already in the context (`prompt_ids`, which the
    repetition penalty counts as seen); `sample` picks a token and records it. With a
    `constraint` (a grammar.TokenConstraint, for a response format) tokens it does not allow
    are banned before every pick, and every recorded token advances it.
    """

    def __init__(
        self,
        config: GenerationConfig,
        vocab_size: int,
        prompt_ids: Iterable[int] = (),
        constraint: Any = None,
    ) -> None:
        config.validate(vocab_size)
        self.config = config
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(config.seed)
        self.num_generated = 0
        self.constraint = constraint
        self.mask_seconds = 0.0  # time spent filling and applying the grammar's token mask
        self._inv_temperature = 0.0 if config.greedy else 1.0 / config.temperature
        self._bias_ids = np.fromiter(config.logit_bias.keys(), dtype=np.int64)
        self._bias_values = np.fromiter(config.logit_bias.values(), dtype=np.float32)
        self._seen: _IdSet | _RecentIds | None = None
        if config.repetition_penalty != 1.0:
            window = config.repetition_window
            self._seen = _RecentIds(window) if window else _IdSet(vocab_size)
        self._use_counts = config.presence_penalty != 0.0 or config.frequency_penalty != 0.0
        self._generated = _IdSet(vocab_size) if self._use_counts else None
        self._counts = np.zeros(vocab_size, dtype=np.float32) if self._use_counts else None
        self.observe_prompt(prompt_ids)

    @property
    def adjusts_logits(self) -> bool:
        """Whether bias or penalties can change the logits (False: greedy is a bare argmax)."""
        return (
            bool(self._bias_ids.size)
            or self._seen is not None
            or self._use_counts
            or self.constraint is not None
        )

    def observe_prompt(self, ids: Iterable[int]) -> None:
        """Mark context tokens as seen (repetition penalty only; they are not reply tokens)."""
        if self._seen is None:
            return
        arr = np.fromiter(ids, dtype=np.int64)
        if arr.size:
            if arr.min() < 0 or arr.max() >= self.vocab_size:
                raise GenerationError(f"prompt token ids must be in [0, {self.vocab_size})")
            self._seen.add_many(arr)

    def accept(self, token_id: int) -> None:
        """Record a token of the reply (done by `sample`; call it for tokens chosen elsewhere)."""
        self.num_generated += 1
        if self.constraint is not None:
            self.constraint.accept(token_id)
        if self._seen is not None:
            self._seen.add(token_id)
        if self._generated is not None and self._counts is not None:
            self._generated.add(token_id)
            self._counts[token_id] += 1.0

    def sample(self, logits: np.ndarray) -> int:
        """Pick the next token from one logits vector and record it."""
        x = self.adjust_logits(logits)
        if self.config.greedy:
            token = int(np.argmax(x))
            if not np.isfinite(x[token]):
                raise GenerationError(_bad_logits_message(x))
        else:
            ids, weights = self._candidates(x)
            index = _draw(weights, self.rng.random())
            token = int(index if ids is None else ids[index])
        self.accept(token)
        return token

    def adjust_logits(self, logits: np.ndarray) -> np.ndarray:
        """A float32 copy of `logits` with logit_bias and the three penalties applied."""
        x = np.array(logits, dtype=np.float32, copy=True).reshape(-1)
        if x.shape[0] != self.vocab_size:
            raise GenerationError(
                f"logits have {x.shape[0]} entries but the vocabulary has {self.vocab_size}"
            )
        cfg = self.config
        if self._bias_ids.size:
            x[self._bias_ids] += self._bias_values
        if self._seen is not None and len(self._seen):
            ids = self._seen.array
            v = x[ids]
            x[ids] = np.where(v > 0, v / cfg.repetition_penalty, v * cfg.repetition_penalty)
        if self._generated is not None and self._counts is not None and len(self._generated):
            ids = self._generated.array
            x[ids] -= cfg.presence_penalty + cfg.frequency_penalty * self._counts[ids]
        if self.constraint is not None:
            t0 = time.perf_counter()
            self.constraint.apply(x)
            self.mask_seconds += time.perf_counter() - t0
        return x

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution `sample` would draw from (float64, sums to 1); records nothing."""
        x = self.adjust_logits(logits)
        probs = np.zeros(self.vocab_size, dtype=np.float64)
        if self.config.greedy:
            probs[int(np.argmax(x))] = 1.0
            return probs
        ids, weights = self._candidates(x)
        w = weights.astype(np.float64)
        if ids is None:
            probs[:] = w
        else:
            probs[ids] = w
        return probs / probs.sum()

    def _candidates(self, x: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """Token ids (None = all) and unnormalized weights left after temperature and filters.

        Works in place on `x`. The weights are exp(logit/T - max), i.e. each token's probability
        relative to the top one, so min_p is a plain threshold on them; top-k and top-p become
        thresholds too, which keeps tokens tied at the boundary (as HF's top-k does).
        """
        cfg = self.config
        x *= self._inv_temperature
        top = x.max()
        if not np.isfinite(top):
            raise GenerationError(_bad_logits_message(x))
        x -= top
        e = np.exp(x, out=x)
        size = e.shape[0]
        threshold = 0.0
        if 0 < cfg.top_k < size:
            threshold = float(np.partition(e, size - cfg.top_k)[size - cfg.top_k])
        if cfg.top_p < 1.0:
            pool = e if threshold == 0.0 else e[e >= threshold]
            target = cfg.top_p * float(pool.sum(dtype=np.float64))
            threshold = max(threshold, _nucleus_threshold(pool, target))
        if cfg.min_p > 0.0:
            threshold = max(threshold, cfg.min_p)
        if threshold == 0.0:
            return None, e
        ids = np.flatnonzero(e >= threshold)
        return ids, e[ids]


def _nucleus_threshold(weights: np.ndarray, target: float) -> float:
    """The smallest weight of the shortest best-first prefix of `weights` whose sum >= target."""
    size = weights.shape[0]
    k = FIRST_NUCLEUS
    while True:
        if k * 2 >= size:
            best = np.sort(weights)[::-1]
        else:
            best = np.sort(np.partition(weights, size - k)[size - k :])[::-1]
        cum = np.cumsum(best, dtype=np.float64)
        i = int(np.searchsorted(cum, target))
        if i < best.shape[0]:
            return float(best[i])
        if best.shape[0] == size:
            return float(best[-1])  # rounding kept the sum below target: keep everything
        k *= NUCLEUS_GROWTH


def _draw(weights: np.ndarray, u: float) -> int:
    """Index i drawn with probability weights[i] / sum(weights), given u uniform in [0, 1)."""
    n = weights.shape[0]
    if n <= 4 * DRAW_BLOCK:
        cum = np.cumsum(weights, dtype=np.float64)
        i = int(np.searchsorted(cum, u * cum[-1], side="right"))
        return _positive_at_or_before(weights, min(i, n - 1))
    # Sum blocks first, then walk one block: avoids a cumsum over the whole vocabulary.
    nb = n // DRAW_BLOCK
    blocks = np.empty(nb + 1, dtype=np.float64)
    blocks[:nb] = weights[: nb * DRAW_BLOCK].reshape(nb, DRAW_BLOCK).sum(axis=1, dtype=np.float64)
    blocks[nb] = weights[nb * DRAW_BLOCK :].sum(dtype=np.float64)
    cum = np.cumsum(blocks)
    target = u * cum[-1]
    b = min(int(np.searchsorted(cum, target, side="right")), nb if blocks[nb] > 0 else nb - 1)
    start = b * DRAW_BLOCK
    inner = np.cumsum(weights[start : start + DRAW_BLOCK], dtype=np.float64)
    inner += cum[b - 1] if b > 0 else 0.0
    j = int(np.searchsorted(inner, target, side="right"))
    return _positive_at_or_before(weights, start + min(j, inner.shape[0] - 1))


def _positive_at_or_before(weights: np.ndarray, i: int) -> int:
    # Float rounding at the very top of the CDF can land on a zero-weight tail entry.
    if weights[i] > 0:
        return i
    nonzero = np.flatnonzero(weights[: i + 1])
    return int(nonzero[-1]) if nonzero.size else int(np.argmax(weights))


def _bad_logits_message(x: np.ndarray) -> str:
    if np.isnan(x).any():
        return "the model produced NaN logits"
    if np.isneginf(x).all():
        return (
            "every token is excluded (all logits are -inf after logit_bias, penalties and the "
            "response format's grammar)"
        )
    return "every token is excluded (all logits are -inf after logit_bias and penalties)"


def sample_batch(samplers: Sequence[Sampler], logits: np.ndarray) -> list[int]:
    """One token per sequence from a (batch, vocab) logits array, row i by samplers[i]."""
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[0] != len(samplers):
        raise GenerationError(
            f"expected logits of shape ({len(samplers)}, vocab), got {tuple(logits.shape)}"
        )
    if all(s.config.greedy and not s.adjusts_logits for s in samplers):
        tokens = np.argmax(logits, axis=1)
        out = []
        for sampler, row, token in zip(samplers, logits, tokens, strict=True):
            if not np.isfinite(row[token]):
                raise GenerationError(_bad_logits_message(row))
            sampler.accept(int(token))
            out.append(int(token))
        return out
    return [sampler.sample(row) for sampler, row in zip(samplers, logits, strict=True)]
