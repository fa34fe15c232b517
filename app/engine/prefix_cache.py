"""The prefix cache: sequences of finished replies kept in the model's state, so a new prompt that
starts with the same tokens (a repeated system prompt, a resent chat history, an edited message)
forks one of them and prefills only the rest.

The scheduler owns the cache and calls it under its lock. An entry is a `Sequence` no one holds
any more; matching is by the longest common token prefix. A paged KV cache forks a sequence at
any position (whole pages are shared, so removing the parent later leaves the child intact); an
RNN state only forks at a sequence's end, so there an entry matches only when all its tokens
start the prompt: the state each reply leaves, and one the scheduler forks at its prompt's last
token but one, are snapshots at turn boundaries. Entries leave by least recent use, when their
tokens exceed the budget or when the scheduler needs room.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from localchat.engine.prompt import common_prefix
from localchat.engine.runtime import Sequence

ENV_SWITCH = "LOCALCHAT_PREFIX_CACHE"  # "0" (or "off", "false", "no") turns the cache off
# Shorter matches are not reused: they save a few milliseconds of prefill, and a model's default
# system prompt (SmolLM2's is ~25 tokens) would otherwise make every prompt a "hit" whose split
# prefill differs from a whole one in the last bits. (A KV page is 16 tokens.)
MIN_MATCH_TOKENS = 64


def enabled_from_env(default: bool = True) -> bool:
    """Whether LOCALCHAT_PREFIX_CACHE leaves the prefix cache on (unset: `default`)."""
    value = os.environ.get(ENV_SWITCH, "").strip().lower()
    if not value:
        return default
    return value not in {"0", "off", "false", "no"}


@dataclass(frozen=True)
class PrefixMatch:
    """A sequence to fork and how many of its first tokens the new prompt reuses."""

    parent: Sequence
    tokens: int
    cached: bool  # the parent is a cache entry (else a sequence some owner holds)


@dataclass
class PrefixCacheStats:
    """Counters since the cache was made."""

    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    evictions: int = 0


class PrefixCache:
    """Finished sequences kept for reuse, least recently used first out.

    budget_tokens: most tokens the entries may hold together.
    fork_anywhere: the state forks at any position (paged KV) rather than only at the end (RNN).
    """

    def __init__(self, budget_tokens: int, *, fork_anywhere: bool) -> None:
        self.budget_tokens = max(0, int(budget_tokens))
        self.fork_anywhere = fork_anywhere
        self._entries: OrderedDict[int, Sequence] = OrderedDict()  # seq id -> seq, LRU first
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, seq: Sequence) -> bool:
        return seq.seq_id in self._entries

    @property
    def held_tokens(self) -> int:
        """Tokens the entries hold together."""
        return sum(len(s) for s in self._entries.values())

    def sequences(self) -> list[Sequence]:
        """The entries, least recently used first."""
        return list(self._entries.values())

    def usable(self, parent: Sequence, prompt: list[int]) -> int:
        """Tokens of `prompt` a fork of `parent` would hold; at least one prompt token is left
        to prefill (its logits start the reply). 0 when the match is too short to bother."""
        common = common_prefix(parent.tokens, prompt)
        if self.fork_anywhere:
            n = min(common, len(prompt) - 1)
        else:  # an RNN state is the state after all its tokens: all or nothing
            n = len(parent) if common == len(parent) < len(prompt) else 0
        return n if n >= MIN_MATCH_TOKENS else 0

    def match(self, prompt: list[int], held: Iterable[Sequence] = ()) -> PrefixMatch | None:
        """The entry (or `held` sequence of an idle owner) sharing the longest usable prefix
        with `prompt`, counted as a lookup; None when nothing is worth forking."""
        self.stats.lookups += 1
        best: PrefixMatch | None = None
        for seq, cached in [
            *((s, True) for s in self._entries.values()),
            *((s, False) for s in held),
        ]:
            n = self.usable(seq, prompt)
            if n and (best is None or n > best.tokens):
                best = PrefixMatch(seq, n, cached)
        if best is not None:
            self.stats.hits += 1
            self.stats.reused_tokens += best.tokens
            if best.cached:
                self._entries.move_to_end(best.parent.seq_id)
        return best

    def add(self, seq: Sequence) -> list[Sequence]:
        """Keep a finished sequence; returns the sequences to free (entries it makes redundant,
        entries over the budget, or `seq` itself when it is not worth keeping)."""
        if len(seq) < MIN_MATCH_TOKENS or len(seq) > self.budget_tokens:
            return [seq]
        drop: list[Sequence] = []
        for other in list(self._entries.values()):
            common = common_prefix(other.tokens, seq.tokens)
            # A paged KV entry serves every prefix of itself, so of two entries where one's
            # tokens start the other's only the longer is kept; an RNN entry serves only its
            # whole self, so there only an identical one is redundant.
            if common == len(seq) and (self.fork_anywhere or len(other) == len(seq)):
                self._entries.move_to_end(other.seq_id)
                return [seq]
            if common == len(other) and self.fork_anywhere:
                drop.append(self._entries.pop(other.seq_id))
        self._entries[seq.seq_id] = seq
        while self.held_tokens > self.budget_tokens:
            drop.append(self._entries.popitem(last=False)[1])
            self.stats.evictions += 1
        return drop

    def pop_lru(self, keep: Sequence | None = None) -> Sequence | None:
        """Take the least recently used entry out (never `keep`); None when there is none."""
        for seq_id, seq in self._entries.items():
            if keep is None or seq_id != keep.seq_id:
                del self._entries[seq_id]
                self.stats.evictions += 1
                return seq
        return None

    def discard(self, seq: Sequence) -> bool:
        """Forget an entry (the caller frees it); False when it was not one."""
        return self._entries.pop(seq.seq_id, None) is not None

    def clear(self) -> list[Sequence]:
        """Forget every entry; returns them for the caller to free."""
        seqs = list(self._entries.values())
        self._entries.clear()
        return seqs


__all__ = [
    "ENV_SWITCH",
    "MIN_MATCH_TOKENS",
    "PrefixCache",
    "PrefixCacheStats",
    "PrefixMatch",
    "enabled_from_env",
]
