"""Structured output: constrain a reply to JSON, a JSON Schema or a grammar, with xgrammar.

A `GenerationConfig.response_format` (OpenAI's shape, plus a grammar) is compiled once per
(tokenizer, format) by the engine's `GrammarCache` (an LRU of compiled grammars) and each reply
gets its own `TokenConstraint`: before every sampling step it fills the token bitmask of what the
grammar allows next and bans everything else; each accepted token advances its matcher.

    {"type": "text"}                                         no constraint
    {"type": "json_object"}                                  any JSON object
    {"type": "json_schema", "json_schema": {"schema": {...}, "name": ..., "strict": ...}}
    {"type": "grammar", "grammar": "root ::= ..."}           EBNF / GBNF text
    {"type": "structural_tag", "format": {...}}              xgrammar's structural tag (free
                                                             text and schema-bound tags; tool
                                                             calls use it, see server/tools.py)

xgrammar is imported only when a constrained reply is first asked for.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from localchat.errors import GenerationError, InvalidRequestError

FORMAT_TYPES = ("text", "json_object", "json_schema", "grammar", "structural_tag")
PARAM = "response_format"
CACHE_SIZE = 64  # compiled grammars kept per engine
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # JSON mode: any object, as OpenAI's json_object
# xgrammar's C++ errors start with "[12:00:00] /path/file.cc:123: "; keep what follows.
_NATIVE_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")


def normalize_response_format(value: Any) -> dict[str, Any] | None:
    """The canonical form of a response format (None for plain text), or InvalidRequestError.

    Accepts OpenAI's objects, a grammar object, and the shorthands "text" and "json".
    """
    if value is None:
        return None
    if isinstance(value, str):
        if value == "text":
            return None
        if value == "json":
            return {"type": "json_object"}
        raise InvalidRequestError(
            f"response_format must be an object like {{\"type\": \"json_object\"}} (or \"text\" "
            f"or \"json\"), got {value!r}", PARAM)
    if not isinstance(value, Mapping):
        raise InvalidRequestError(
            f"response_format must be an object, got {type(value).__name__}", PARAM)
    kind = value.get("type")
    if kind not in FORMAT_TYPES:
        raise InvalidRequestError(
            f"response_format.type must be one of {', '.join(FORMAT_TYPES)}, got {kind!r}", PARAM)
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "grammar":
        grammar = value.get("grammar")
        if not isinstance(grammar, str) or not grammar.strip():
            raise InvalidRequestError(
                "response_format.grammar must be non-empty EBNF/GBNF text", PARAM)
        return {"type": "grammar", "grammar": grammar}
    if kind == "structural_tag":
        tag = value.get("format")
        if not isinstance(tag, Mapping):
            raise InvalidRequestError(
                'response_format of type "structural_tag" needs a "format" object', PARAM)
        return {"type": "structural_tag", "format": dict(tag)}
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping):
        raise InvalidRequestError(
            'response_format of type "json_schema" needs a "json_schema" object holding '
            'the "schema"', PARAM)
    schema = spec.get("schema")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(
                f"response_format.json_schema.schema is not valid JSON: {exc}", PARAM) from None
    if not isinstance(schema, (Mapping, bool)):
        raise InvalidRequestError(
            "response_format.json_schema.schema must be a JSON Schema object", PARAM)
    return {"type": "json_schema", "json_schema": {"schema": schema}}


def format_key(fmt: Mapping[str, Any]) -> str:
    """A stable cache key for a normalized format."""
    return json.dumps(fmt, sort_keys=True, separators=(",", ":"), default=str)


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> Any:
    """xgrammar's view of a tokenizer: the HF vocabulary and its decoding for byte-level BPE
    (and other tokenizer.json kinds), the raw token bytes for the RWKV World tokenizer."""
    import xgrammar as xgr

    stops = sorted({int(t) for t in stop_token_ids if 0 <= int(t) < vocab_size})
    hf = getattr(tokenizer, "_tok", None)
    if hf is not None and hasattr(hf, "get_vocab") and hasattr(hf, "to_str"):
        encoded: list[Any] = [""] * vocab_size
        for token, idx in hf.get_vocab(with_added_tokens=True).items():
            if idx < vocab_size:
                encoded[idx] = token
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(hf.to_str())
        return xgr.TokenizerInfo(
            encoded, meta["vocab_type"], vocab_size=vocab_size,
            stop_token_ids=stops or None, add_prefix_space=meta["add_prefix_space"])
    token_bytes = getattr(tokenizer, "token_bytes", None)
    if token_bytes is not None:  # RWKV World: greedy longest match over raw bytes
        limit = int(tokenizer.vocab_size)
        encoded = [token_bytes(i) if i < limit else b"" for i in range(vocab_size)]
    else:  # any other tokenizer: each token's own text
        encoded = [tokenizer.decode([i]).encode("utf-8") for i in range(vocab_size)]
    return xgr.TokenizerInfo(
        encoded, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops or None)


def _native_message(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [_NATIVE_PREFIX.sub("", line).strip() for line in text.splitlines()]
    return next((line for line in lines if line), type(exc).__name__)


class GrammarCache:
    """Compiles response formats for one tokenizer, keeping the last CACHE_SIZE of them."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 size: int = CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.size = size
        self._compiler: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compilations = 0  # for tests: how many formats were actually compiled

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return self._compiler

    def compile(self, fmt: Mapping[str, Any]) -> Any:
        """The compiled grammar of a normalized format; InvalidRequestError when it does not
        compile."""
        key = format_key(fmt)
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
            compiler = self._get_compiler()
            try:
                if fmt["type"] == "json_object":  # an object (xgrammar's builtin: any value)
                    compiled = compiler.compile_json_schema(
                        JSON_OBJECT_SCHEMA, any_whitespace=False, strict_mode=False)
                elif fmt["type"] == "json_schema":
                    schema = fmt["json_schema"]["schema"]
                    compiled = compiler.compile_json_schema(
                        json.dumps(schema), any_whitespace=False, strict_mode=True)
                elif fmt["type"] == "structural_tag":
                    compiled = compiler.compile_structural_tag(json.dumps(
                        {"type": "structural_tag", "format": fmt["format"]}))
                else:
                    compiled = compiler.compile_grammar(fmt["grammar"])
            except (RuntimeError, ValueError, TypeError) as exc:
                what = {"json_schema": "JSON schema", "structural_tag": "structural tag"}.get(
                    fmt["type"], "grammar")
                raise InvalidRequestError(
                    f"response_format: the {what} does not compile: {_native_message(exc)}",
                    PARAM) from None
            self.compilations += 1
            self._compiled[key] = compiled
            while len(self._compiled) > self.size:
                self._compiled.popitem(last=False)
            return compiled


class TokenConstraint:
    """One reply's grammar state: the mask of allowed next tokens and a matcher to advance."""

    def __init__(self, compiled: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        import xgrammar as xgr

        stops = sorted({int(t) for t in stop_token_ids if 0 <= int(t) < vocab_size})
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        self.vocab_size = vocab_size
        self._bitmask = np.zeros(xgr.get_bitmask_shape(1, vocab_size), dtype=np.int32)
        self.mask_seconds = 0.0

    def allowed(self) -> np.ndarray:
        """A boolean vector: which tokens the grammar allows next."""
        self.matcher.fill_next_token_bitmask(self._bitmask)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        return bits[: self.vocab_size].view(np.bool_)

    def apply(self, logits: np.ndarray) -> None:
        """Set the logits of disallowed tokens to -inf, in place."""
        np.copyto(logits, np.float32(-np.inf), where=~self.allowed())

    def accept(self, token_id: int) -> None:
        """Advance the matcher by one sampled token (GenerationError if the grammar refuses)."""
        if self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(int(token_id)):
            raise GenerationError(f"token {token_id} does not fit the response format's grammar")

    @property
    def terminated(self) -> bool:
        """Whether the grammar is complete and accepted a stop token."""
        return bool(self.matcher.is_terminated())


__all__ = [
    "FORMAT_TYPES",
    "GrammarCache",
    "TokenConstraint",
    "format_key",
    "normalize_response_format",
    "tokenizer_info",
]
