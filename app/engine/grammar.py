"""Structured output: constrain a reply to JSON, a JSON Schema or a grammar, with llguidance.

A `GenerationConfig.response_format` (OpenAI's shape, plus a grammar) is compiled once per
(tokenizer, format) by the engine's `GrammarCache` (an LRU of compiled grammars) and each reply
gets its own `TokenConstraint`: before every sampling step it fills the token bitmask of what the
grammar allows next and bans everything else; each accepted token advances its matcher.

    {"type": "text"}                                         no constraint
    {"type": "json_object"}                                  any JSON object
    {"type": "json_schema", "json_schema": {"schema": {...}, "name": ..., "strict": ...}}
    {"type": "grammar", "grammar": "root ::= ..."}           GBNF or Lark text (below)
    {"type": "structural_tag", "format": {...}}              free text and schema-bound tags
                                                             (tool calls, see server/tools.py)

A grammar is GBNF, llama.cpp's EBNF (`name ::= ...` rules, the reply is a sentence of `root`),
which llguidance's converter turns into Lark; or Lark in llguidance's dialect, recognised by a
`start:` rule or a `%llguidance` line (the reply is a sentence of `start`).

JSON is written compactly with ", " and ": " between items; a schema object that lists
`properties` and says nothing of `additionalProperties` admits only those (OpenAI's strict mode);
keywords llguidance does not implement (`uniqueItems`, unknown `format`s) are not enforced.

A structural tag is `{"type": "triggered_tags", "triggers": [...], "tags": [{"begin": ...,
"content": {"type": "json_schema", "json_schema": {...}}, "end": ...}], "at_least_one": bool,
"stop_after_first": bool}`: free text in which a trigger opens one of the tags (whose `begin`
starts with it) and its content follows the schema; with `at_least_one` the reply opens with a tag
straight away, with `stop_after_first` it ends after one.

llguidance is imported only when a constrained reply is first asked for.
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
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}  # JSON mode: any object, as OpenAI's
# Whitespace between JSON tokens as llama.cpp's grammars allow it: none, a space, or a line break
# or two and an indent of up to 20. Models write JSON pretty-printed; forbidding the line break
# they want after "{" pushes a small model off its course (keys of escape characters, numbers
# whose digits never end), and unbounded whitespace could run on by itself. Keywords llguidance
# does not implement are ignored rather than refused.
JSON_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})?"
JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE,
                "lenient": True}
_LARK_START = re.compile(r"(?m)^\s*(%llguidance\b|start\s*:(?!:))")  # GBNF's is "::="
# Lines of llguidance's error messages that only point into the grammar text.
_POINTER_LINE = re.compile(r"^(\^+|\d+\s*\|.*|\|.*)$")


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
                "response_format.grammar must be non-empty GBNF or Lark text", PARAM)
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


# -- formats as llguidance grammars ---------------------------------------------------------------
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "contains", "not",
               "propertyNames", "if", "then", "else")
_COMBINERS = ("$ref", "allOf", "anyOf", "oneOf")


def strict_schema(schema: Any) -> Any:
    """`schema` where every object schema that lists `properties` (and says nothing of extra
    ones, nor combines with other schemas) admits no other properties."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {k: strict_schema(v) for k, v in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            # Branches combined with sibling properties are intersected with them: leave them.
            keep = "properties" in out
            out[key] = [v if keep else strict_schema(v) for v in out[key]]
    for key in _SCHEMA_ONE:
        if key in out:
            out[key] = strict_schema(out[key])
    if (isinstance(out.get("properties"), Mapping)
            and not any(k in out for k in ("additionalProperties", "patternProperties",
                                           "unevaluatedProperties", *_COMBINERS))):
        out["additionalProperties"] = False
    return out


def _json_schema_grammar(schema: Any, *, strict: bool) -> str:
    import llguidance as llg

    if schema is True:
        schema = {}
    if schema is False:
        raise InvalidRequestError(
            "response_format: the JSON schema does not compile: the schema false matches "
            "nothing", PARAM)
    if strict:
        schema = strict_schema(schema)
    try:
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise _compile_error("JSON schema", exc) from None


def is_lark(text: str) -> bool:
    """Whether grammar text is Lark (a `start:` rule or a `%llguidance` line) rather than GBNF."""
    return _LARK_START.search(text) is not None


def _text_grammar(text: str) -> str:
    import llguidance as llg

    if not is_lark(text):
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as exc:  # the converter raises plain Exception for unknown rules
            raise InvalidRequestError(
                f"response_format: the grammar does not compile: {_error_message(str(exc))} "
                f"(a GBNF grammar; Lark grammars have a start: rule)", PARAM) from None
    return llg.LLMatcher.grammar_from_lark(text)


def _lark_literal(text: str) -> str:
    """A Lark string literal matching exactly `text`."""
    return json.dumps(text, ensure_ascii=False)


def _regex_literal(text: str) -> str:
    """A regex (inside /.../) matching exactly `text`."""
    return "".join(c if c.isalnum() or ord(c) > 127 else f"\\x{ord(c):02X}" for c in text)


def _tag_lark(spec: Mapping[str, Any]) -> str:
    """The Lark grammar of a structural tag (see the module docstring)."""
    def bad(why: str) -> InvalidRequestError:
        return InvalidRequestError(f"response_format: the structural tag {why}", PARAM)

    if spec.get("type") != "triggered_tags":
        raise bad('must be of type "triggered_tags"')
    triggers = spec.get("triggers")
    tags = spec.get("tags")
    if (not isinstance(triggers, list) or not triggers
            or not all(isinstance(t, str) and t for t in triggers)):
        raise bad("needs a list of non-empty trigger strings")
    if not isinstance(tags, list) or not tags:
        raise bad("needs a list of tags")
    lines = ["%llguidance {}"]
    heads: dict[str, str] = {}
    bare, headed = [], []
    for i, tag in enumerate(tags):
        if not isinstance(tag, Mapping):
            raise bad(f"tags[{i}] must be an object")
        begin, end, content = tag.get("begin"), tag.get("end", ""), tag.get("content")
        if not isinstance(begin, str) or not isinstance(end, str):
            raise bad(f"tags[{i}] needs begin and end strings")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise bad(f"tags[{i}]: begin {begin!r} starts with none of the triggers")
        if (not isinstance(content, Mapping) or content.get("type") != "json_schema"
                or not isinstance(content.get("json_schema"), Mapping)):
            raise bad(f'tags[{i}].content must be {{"type": "json_schema", "json_schema": ...}}')
        schema = {"x-guidance": JSON_OPTIONS, **strict_schema(content["json_schema"])}
        body = f"%json {json.dumps(schema)}" + (f" {_lark_literal(end)}" if end else "")
        if trigger not in heads:  # text up to and including the trigger's first occurrence
            heads[trigger] = f"head_{len(heads)}"
            lines.append(f"{heads[trigger]}[lazy]: ANY {_lark_literal(trigger)}")
        rest = begin[len(trigger):]
        lines.append(f"tag_{i}: {_lark_literal(begin)} {body}")
        lines.append(f"tag_{i}_after_text: {heads[trigger]} "
                     + (f"{_lark_literal(rest)} " if rest else "") + body)
        bare.append(f"tag_{i}")
        headed.append(f"tag_{i}_after_text")
    one_first = " | ".join(bare)
    one_after_text = " | ".join(headed)
    if spec.get("at_least_one") and spec.get("stop_after_first", False):
        start = f"start: {one_first}"
    elif spec.get("at_least_one"):
        start = f"start: ({one_first}) ({one_after_text})* TEXT"
    elif spec.get("stop_after_first", False):
        start = f"start: TEXT | {one_after_text}"
    else:
        start = f"start: ({one_after_text})* TEXT"
    banned = "|".join(_regex_literal(t) for t in triggers)
    lines += [start, "ANY: /(?s:.*)/",
              f"TEXT: /(?s:.*)/ & ~/(?s:.*)({banned})(?s:.*)/"]  # text without a trigger
    return "\n".join(lines) + "\n"


def harmony_call_grammar(functions: Iterable[tuple[str, Mapping[str, Any]]]) -> str:
    """A Lark grammar (llguidance's dialect, in which `<|...|>` is a special token) for a
    harmony reply (gpt-oss) that is one call to one of `functions` (name, JSON Schema of its
    arguments): the prompt ends with `<|start|>assistant`; the reply is `<|channel|>commentary
    to=functions.NAME <|constrain|>json<|message|>{...}`, the arguments under the schema, and
    the stop token `<|call|>` ends it. For a response format {"type": "grammar", ...}."""
    rules = []
    for i, (name, schema) in enumerate(functions):
        strict = {"x-guidance": JSON_OPTIONS, **strict_schema(dict(schema))}
        rules.append(f'call_{i}: {_lark_literal(name)} " " <|constrain|> "json" <|message|> '
                     f"%json {json.dumps(strict)}")
    if not rules:
        raise InvalidRequestError("a harmony call needs at least one function", "tools")
    alternatives = " | ".join(f"call_{i}" for i in range(len(rules)))
    start = f'start: <|channel|> "commentary to=functions." ({alternatives})'
    return "\n".join(["%llguidance {}", start, *rules]) + "\n"


def format_grammar(fmt: Mapping[str, Any]) -> str:
    """llguidance's grammar for a normalized format (not yet checked against a tokenizer);
    InvalidRequestError for what cannot be expressed."""
    import llguidance as llg

    kind = fmt["type"]
    if kind == "json_object":
        return _json_schema_grammar(JSON_OBJECT_SCHEMA, strict=False)
    if kind == "json_schema":
        return _json_schema_grammar(fmt["json_schema"]["schema"], strict=True)
    if kind == "structural_tag":
        return llg.LLMatcher.grammar_from_lark(_tag_lark(fmt["format"]))
    return _text_grammar(fmt["grammar"])


def _error_message(text: str) -> str:
    """llguidance's error as one line: without the lines that draw a caret under the grammar
    text, repeated lines, and runs of spaces."""
    seen: list[str] = []
    for line in text.strip().splitlines():
        line = " ".join(line.split())
        if line and not _POINTER_LINE.match(line) and line not in seen:
            seen.append(line)
    return " ".join(seen) or "unknown error"


def _compile_error(what: str, exc: BaseException | str) -> InvalidRequestError:
    return InvalidRequestError(
        f"response_format: the {what} does not compile: {_error_message(str(exc))}", PARAM)


_WHAT = {"json_object": "JSON schema", "json_schema": "JSON schema",
         "structural_tag": "structural tag", "grammar": "grammar"}


def json_schema_problem(schema: Any) -> str | None:
    """Why a JSON Schema does not compile as the engine compiles it (no tokenizer needed), or
    None when it does."""
    import llguidance as llg

    try:
        grammar = _json_schema_grammar(schema, strict=True)
    except InvalidRequestError as exc:
        return str(exc).split("does not compile: ", 1)[-1]
    problem = llg.LLMatcher.validate_grammar(grammar)
    return _error_message(problem) if problem else None


# -- tokenizers -----------------------------------------------------------------------------------
class _TokenBytes:
    """A tokenizer as llguidance's TokenizerWrapper reads it: every token's bytes and an
    encoder (used for the World tokenizer and any tokenizer without a tokenizer.json)."""

    def __init__(self, tokens: list[bytes], encode: Any, eos: int, special: list[int]) -> None:
        self.tokens = tokens
        self.eos_token_id = eos
        self.bos_token_id = None
        self.special_token_ids = special
        self._encode = encode

    def __call__(self, text: str | bytes) -> list[int]:
        return list(self._encode(text))


def ll_tokenizer(tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> Any:
    """llguidance's view of a tokenizer: the HF tokenizer.json for `tokenizers` tokenizers, the
    raw token bytes for the RWKV World tokenizer (and, for any other, each token's text). Its
    end-of-sequence token stands for all stop tokens (TokenConstraint maps them)."""
    import llguidance as llg

    stops = sorted({int(t) for t in stop_token_ids if 0 <= int(t) < vocab_size})
    hf = getattr(tokenizer, "_tok", None)
    if hf is not None and hasattr(hf, "to_str") and hasattr(hf, "get_vocab_size"):
        if hf.padding or hf.truncation:  # a copy without them, as llguidance wants
            hf = type(hf).from_str(hf.to_str())
            hf.no_padding()
            hf.no_truncation()
        n_vocab = max(vocab_size, hf.get_vocab_size(with_added_tokens=True))
        return llg.LLTokenizer(hf.to_str(), n_vocab=n_vocab, eos_token=stops or None)
    token_bytes = getattr(tokenizer, "token_bytes", None)
    if token_bytes is not None:  # RWKV World: greedy longest match over raw bytes
        limit = int(tokenizer.vocab_size)
        tokens = [token_bytes(i) if i < limit else b"" for i in range(vocab_size)]

        def encode(text: str | bytes) -> list[int]:
            data = text if isinstance(text, bytes) else text.encode("utf-8")
            return tokenizer.encode_bytes(data)
    else:  # any other tokenizer: each token's own text
        tokens = [tokenizer.decode([i]).encode("utf-8") for i in range(vocab_size)]

        def encode(text: str | bytes) -> list[int]:
            return tokenizer.encode(text if isinstance(text, str) else text.decode("utf-8"))
    eos = stops[0] if stops else next((i for i, t in enumerate(tokens) if not t), 0)
    wrapper = llg.TokenizerWrapper(_TokenBytes(tokens, encode, eos, [eos]))
    return llg.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)


# -- compiling and matching -----------------------------------------------------------------------
class CompiledGrammar:
    """A format compiled for one tokenizer: a matcher in its start state that every reply's
    TokenConstraint copies."""

    def __init__(self, matcher: Any, eos_token_ids: Iterable[int], mask_vocab: int) -> None:
        self._matcher = matcher
        self._lock = threading.Lock()
        self.eos_token_ids = tuple(eos_token_ids)
        self.mask_vocab = mask_vocab  # the vocabulary size llguidance's masks cover

    def new_matcher(self) -> Any:
        """A fresh matcher at the start of the grammar."""
        with self._lock:
            return self._matcher.deep_copy()


class GrammarCache:
    """Compiles response formats for one tokenizer, keeping the last CACHE_SIZE of them."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 size: int = CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.size = size
        self._ll_tokenizer: Any = None
        self._compiled: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.compilations = 0  # for tests: how many formats were actually compiled

    def _get_tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = ll_tokenizer(self.tokenizer, self.vocab_size,
                                              self.stop_token_ids)
        return self._ll_tokenizer

    def compile(self, fmt: Mapping[str, Any]) -> CompiledGrammar:
        """The compiled grammar of a normalized format; InvalidRequestError when it does not
        compile."""
        key = format_key(fmt)
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
            import llguidance as llg

            tok = self._get_tokenizer()
            grammar = format_grammar(fmt)
            matcher = llg.LLMatcher(tok, grammar, log_level=0)
            if matcher.is_error():
                raise _compile_error(_WHAT[fmt["type"]], matcher.get_error())
            compiled = CompiledGrammar(matcher, tok.eos_tokens, tok.vocab_size)
            self.compilations += 1
            self._compiled[key] = compiled
            while len(self._compiled) > self.size:
                self._compiled.popitem(last=False)
            return compiled


class TokenConstraint:
    """One reply's grammar state: the mask of allowed next tokens and a matcher to advance.

    The reply's stop tokens are allowed exactly where the grammar may end, and only as stops.
    """

    def __init__(self, compiled: CompiledGrammar, vocab_size: int,
                 stop_token_ids: Iterable[int]) -> None:
        from llguidance.numpy import allocate_token_bitmask

        self.matcher = compiled.new_matcher()
        self.vocab_size = vocab_size
        self._eos = compiled.eos_token_ids[0]
        self._eos_ids = np.array([t for t in compiled.eos_token_ids if t < vocab_size],
                                 dtype=np.int64)
        self._stop_set = frozenset(int(t) for t in stop_token_ids if 0 <= int(t) < vocab_size)
        self._stops = np.array(sorted(self._stop_set), dtype=np.int64)
        self._bitmask = allocate_token_bitmask(1, compiled.mask_vocab)
        self._ended = False
        self.mask_seconds = 0.0

    def allowed(self) -> np.ndarray:
        """A boolean vector: which tokens the grammar allows next."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self._bitmask)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        allowed = bits[: self.vocab_size].view(np.bool_)
        may_end = bool(bits[self._eos])
        allowed[self._eos_ids] = False
        allowed[self._stops] = may_end
        return allowed

    def apply(self, logits: np.ndarray) -> None:
        """Set the logits of disallowed tokens to -inf, in place."""
        np.copyto(logits, np.float32(-np.inf), where=~self.allowed())

    def accept(self, token_id: int) -> None:
        """Advance the matcher by one sampled token (GenerationError if the grammar refuses)."""
        if self._ended:
            return
        token_id = int(token_id)
        if token_id in self._stop_set:
            if not self.matcher.is_accepting() or not self.matcher.consume_token(self._eos):
                raise GenerationError(
                    f"stop token {token_id} came before the response format's grammar was "
                    "complete")
            self._ended = True
            return
        if not self.matcher.consume_token(token_id):
            why = _error_message(self.matcher.get_error())
            raise GenerationError(
                f"token {token_id} does not fit the response format's grammar ({why})")

    @property
    def terminated(self) -> bool:
        """Whether the grammar is complete and accepted a stop token."""
        return self._ended


__all__ = [
    "FORMAT_TYPES",
    "CompiledGrammar",
    "GrammarCache",
    "TokenConstraint",
    "format_grammar",
    "format_key",
    "is_lark",
    "json_schema_problem",
    "ll_tokenizer",
    "normalize_response_format",
    "strict_schema",
]
