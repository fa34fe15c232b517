"""Embeddings: an encoder model (BERT family) turning texts into vectors on its compiled kernels.

    engine = Engine.open("all-minilm-l6-v2")              # an embedding model: an EmbeddingEngine
    result = engine.embed(["first text", "second"])       # Embeddings(vectors [2, 384], ...)

Texts are tokenized with the model's special tokens (BERT's [CLS] ... [SEP]), packed into
batches of at most `BATCH_TOKENS` tokens (several texts of different lengths in one call of the
library's `encode`, each attending only to itself), then pooled as the model's
sentence-transformers config says (recorded at convert time: `model_dir.EmbeddingSettings`),
normalized when it says so, and cut to `dimensions` (Matryoshka: the first values, then scaled
to unit length again) when asked.

A model whose sentence-transformers config names prompts (Qwen3-Embedding's "query"
instruction) gets them as `SentenceTransformer.encode` does: `prompt_name` picks one, else the
config's default prompt (if any) is used; the prompt's text goes before each text input (token-id
inputs are taken as they are). Decoder-based models (Qwen3-Embedding) pool the last token: the
end-of-text their tokenizer appends.

A text longer than the model's `max_tokens` (sentence-transformers' max_seq_length) is cut to
its first `max_tokens` tokens (the end token kept), and the result says which were
(`Embeddings.truncated`), or, with `truncate=False`, refused with a ContextWindowError.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from localchat import model_dir as md
from localchat.engine.engine import Engine
from localchat.engine.runtime import Model
from localchat.errors import ContextWindowError, InvalidRequestError, ModelConfigError

BATCH_TOKENS = 4096  # tokens of one call of `encode` (texts are never split between calls)
EmbedInput = str | Sequence[int]  # a text, or token ids taken as they are


@dataclass(frozen=True)
class Embeddings:
    """The vectors of a list of inputs, in their order, and what they cost."""

    vectors: np.ndarray  # float32 [inputs, dimensions]
    token_counts: list[int]  # tokens each input ran as (after truncation, special tokens in)
    truncated: list[bool]  # which inputs were cut to the model's max_tokens
    seconds: float  # wall time of tokenizing, encoding and pooling

    @property
    def prompt_tokens(self) -> int:
        """Tokens of every input together (OpenAI's usage.prompt_tokens)."""
        return sum(self.token_counts)

    def __len__(self) -> int:
        return len(self.token_counts)


def pool(hidden: np.ndarray, starts: np.ndarray, mode: str) -> np.ndarray:
    """One vector per text from the token states `hidden` [n, h] of texts packed at `starts`
    [texts + 1]: "mean" of its tokens, "cls" its first, "last" its last, "max" per dimension."""
    first, ends = starts[:-1], starts[1:]
    if mode == "cls":
        return hidden[first].copy()
    if mode == "last":
        return hidden[ends - 1].copy()
    if mode == "max":
        return np.maximum.reduceat(hidden, first, axis=0)
    if mode == "mean":
        sums = np.add.reduceat(hidden.astype(np.float64), first, axis=0)
        return (sums / (ends - first)[:, None]).astype(np.float32)
    raise ModelConfigError(f"unknown pooling {mode!r}")


def unit(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to length 1 (a zero row stays zero), as sentence-transformers' Normalize."""
    norms = np.linalg.norm(vectors.astype(np.float64), axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)


class EmbeddingTokenizer:
    """The model's tokenizer.json with its special tokens added and no padding; texts over
    `max_tokens` are cut by the tokenizer itself (keeping [CLS] and [SEP])."""

    def __init__(self, path: Path, max_tokens: int) -> None:
        from tokenizers import Tokenizer

        try:
            self._full = Tokenizer.from_file(str(path))
            self._cut = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library's own errors on a garbage file
            raise ModelConfigError(f"cannot load the tokenizer {path}: {exc}") from None
        self._full.no_padding()
        self._full.no_truncation()
        self._cut.no_padding()
        self._cut.enable_truncation(max_tokens)
        self.max_tokens = max_tokens
        self.vocab_size = self._full.get_vocab_size(with_added_tokens=True)

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, special tokens in, not truncated."""
        return [list(e.ids) for e in self._full.encode_batch(texts, add_special_tokens=True)]

    def truncate(self, text: str) -> list[int]:
        """Token ids of a text cut to `max_tokens` (special tokens in)."""
        return list(self._cut.encode(text, add_special_tokens=True).ids)


class EmbeddingEngine(Engine):
    """An embedding model ready to embed: `embed` runs; the chat entry points (`chat`,
    `complete`, `conversation`, and what they are made of) raise InvalidRequestError saying
    this is an embedding model. Open one with `Engine.open(ref)`."""

    def __init__(self, model: Model) -> None:
        if not model.is_encoder:
            raise InvalidRequestError(f"{model.model_dir} is not an embedding model", "model")
        settings = md.embedding_settings(model.meta)
        if settings is None:
            raise ModelConfigError(f"{model.model_dir}: {md.CONFIG_FILE} has no "
                                   f"{md.EMBEDDING_KEY!r} settings; convert it again")
        self.model = model
        self.settings = settings
        self.context_window = settings.max_tokens
        self.tokens = EmbeddingTokenizer(model.model_dir / "tokenizer.json", settings.max_tokens)
        self.tokenizer = model.tokenizer  # the engine's plain interface (/tokenize uses it)
        self.vocab_size = int(model.meta.get("vocab_size") or self.tokens.vocab_size)
        recorded = model.meta[md.EMBEDDING_KEY]  # the prompts `build.pooling.read_prompts` kept
        self.prompts: dict[str, str] = dict(recorded.get("prompts") or {})
        self.default_prompt: str | None = recorded.get("default_prompt")
        self._lock = threading.Lock()  # one call of the library at a time
        self._closed = False

    @classmethod
    def open_dir(cls, model_dir: Path, *, device: str = "auto",
                 log: Callable[[str], None] | None = None) -> EmbeddingEngine:
        """The embedding engine of a model directory (compiling its library if needed)."""
        return cls(Model(model_dir, device, max_batch_size=1, log=log))

    # -- embeddings ----------------------------------------------------------------------------
    def embed(self, inputs: EmbedInput | Sequence[EmbedInput], *, dimensions: int | None = None,
              truncate: bool = True, prompt_name: str | None = None) -> Embeddings:
        """The vectors of `inputs` (a text, or a list of texts or of token-id lists), in order.

        `dimensions`: keep the first values of each vector and scale it to unit length again
        (Matryoshka models); `truncate`: cut inputs over the model's max_tokens (else refuse
        them with ContextWindowError); `prompt_name`: one of the model's prompts (`prompts`)
        to put before each text (None: the model's default prompt, if it has one)."""
        start = time.perf_counter()
        items = self._check_inputs(inputs)
        dims = self._check_dimensions(dimensions)
        prefix = self._prompt(prompt_name)
        if prefix:
            items = [prefix + t if isinstance(t, str) else t for t in items]
        ids, truncated = self._tokenize(items, truncate)
        vectors = np.empty((len(ids), self.settings.dimensions), np.float32)
        for lo, hi in _batches([len(t) for t in ids], BATCH_TOKENS):
            vectors[lo:hi] = self._encode(ids[lo:hi])
        if self.settings.normalize:
            vectors = unit(vectors)
        if dims is not None:
            vectors = unit(vectors[:, :dims])
        return Embeddings(vectors, [len(t) for t in ids], truncated,
                          time.perf_counter() - start)

    def _check_inputs(self, inputs: Any) -> list[EmbedInput]:
        if isinstance(inputs, (list, tuple)) and not inputs:
            raise InvalidRequestError("input must not be empty", "input")
        if isinstance(inputs, str) or _is_ids(inputs):
            inputs = [inputs]
        if not isinstance(inputs, Sequence) or not inputs:
            raise InvalidRequestError("input must be a non-empty string or list", "input")
        items = list(inputs)
        for i, item in enumerate(items):
            if isinstance(item, str):
                if not item:
                    raise InvalidRequestError(f"input[{i}] is an empty string", "input")
            elif _is_ids(item):
                if not item:
                    raise InvalidRequestError(f"input[{i}] is an empty token list", "input")
                bad = [t for t in item if not 0 <= t < self.vocab_size]
                if bad:
                    raise InvalidRequestError(
                        f"input[{i}] has token id {bad[0]}, outside the vocabulary "
                        f"[0, {self.vocab_size})", "input")
            else:
                raise InvalidRequestError(
                    f"input[{i}] must be a string or a list of token ids", "input")
        return items

    def _prompt(self, name: Any) -> str:
        """The text of prompt `name` (None: the default prompt, or none)."""
        if name is None:
            name = self.default_prompt
            if name is None:
                return ""
        if not isinstance(name, str) or name not in self.prompts:
            known = ", ".join(repr(p) for p in self.prompts) or "none"
            raise InvalidRequestError(f"unknown prompt_name {name!r} (this model's prompts: "
                                      f"{known})", "prompt_name")
        return self.prompts[name]

    def _check_dimensions(self, dimensions: Any) -> int | None:
        if dimensions is None:
            return None
        full = self.settings.dimensions
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) \
                or not 1 <= dimensions <= full:
            raise InvalidRequestError(
                f"dimensions must be an integer in [1, {full}], got {dimensions!r}",
                "dimensions")
        return None if dimensions == full else dimensions

    def _tokenize(self, items: list[EmbedInput], truncate: bool
                  ) -> tuple[list[list[int]], list[bool]]:
        limit = self.settings.max_tokens
        texts = [(i, t) for i, t in enumerate(items) if isinstance(t, str)]
        ids: list[list[int]] = [list(t) if not isinstance(t, str) else [] for t in items]
        for (i, _), encoded in zip(texts, self.tokens.encode([t for _, t in texts])):
            ids[i] = encoded
        truncated = [len(t) > limit for t in ids]
        for i, cut in enumerate(truncated):
            if not cut:
                continue
            if not truncate:
                raise ContextWindowError(
                    f"input[{i}] has {len(ids[i])} tokens; this model embeds at most {limit} "
                    f"(ask for truncation to cut it)", prompt_tokens=len(ids[i]),
                    context_window=limit, param="input")
            item = items[i]
            ids[i] = self.tokens.truncate(item) if isinstance(item, str) else ids[i][:limit]
        return ids, truncated

    def _encode(self, token_lists: list[list[int]]) -> np.ndarray:
        """Pooled (not normalized) vectors of a batch of token lists, one call of `encode`."""
        import tvm

        lengths = np.array([len(t) for t in token_lists], np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        flat = np.fromiter((t for ts in token_lists for t in ts), np.int32, int(starts[-1]))
        positions = (np.arange(starts[-1]) - np.repeat(starts[:-1], lengths)).astype(np.int32)
        dev = self.model.dev
        with self._lock:
            if self._closed:
                raise InvalidRequestError(f"the model {self.name} was unloaded", "model")
            hidden = self.model.function("encode")(
                tvm.runtime.tensor(flat, dev), tvm.runtime.tensor(positions, dev),
                tvm.runtime.tensor(starts, dev), self.model.params).numpy()
        return pool(hidden, starts, self.settings.pooling)

    # -- what a chat engine has and this one does not --------------------------------------------
    def _not_chat(self, *_: Any, **__: Any) -> NoReturn:
        raise InvalidRequestError(
            f"{self.name} is an embedding model: it turns text into vectors (Engine.embed, "
            f"/v1/embeddings, /api/embed) and cannot chat or complete text", "model")

    chat = complete = conversation = count_tokens = _not_chat  # type: ignore[assignment]

    @property
    def template(self) -> Any:  # type: ignore[override]
        self._not_chat()

    @property
    def planner(self) -> Any:  # type: ignore[override]
        self._not_chat()

    @property
    def scheduler(self) -> Any:  # type: ignore[override]
        self._not_chat()

    @property
    def config(self) -> Any:  # type: ignore[override]
        self._not_chat()

    @property
    def is_embedding(self) -> bool:
        return True

    def close(self) -> None:
        """Refuse further calls (a running one finishes)."""
        with self._lock:
            self._closed = True


def _is_ids(value: Any) -> bool:
    """Whether `value` is a list of token ids (ints, not bools)."""
    return isinstance(value, (list, tuple)) and all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in value)


def _batches(lengths: list[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive [lo, hi) runs of texts holding at most `budget` tokens (at least one text)."""
    runs, lo, total = [], 0, 0
    for i, n in enumerate(lengths):
        if i > lo and total + n > budget:
            runs.append((lo, i))
            lo, total = i, 0
        total += n
    runs.append((lo, len(lengths)))
    return runs


__all__ = ["BATCH_TOKENS", "EmbeddingEngine", "Embeddings", "pool", "unit"]
