"""Structured output on real models: JSON mode, JSON Schema and grammars constrain every token
(llguidance's mask before sampling), in batches beside free replies, on both tokenizer kinds."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from localchat import Engine, GenerationConfig
from localchat.engine.runtime import Model
from localchat.errors import InvalidRequestError

from fixtures import converted, smollm2_hf_dir

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
     "required": ["colour"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                               "items": {"type": "string", "maxLength": 10}}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["score"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "string",
                                                                          "maxLength": 15}},
     "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                         "email": {"type": "string", "format": "email"}},
        "required": ["id", "email"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"day": {"type": "string", "format": "date"}},
     "required": ["day"], "additionalProperties": False},
    {"type": "object", "properties": {"points": {"type": "array", "minItems": 2, "maxItems": 2,
                                                 "items": {"type": "integer", "minimum": -5,
                                                           "maximum": 5}}},
     "required": ["points"], "additionalProperties": False},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]},
                                      "mode": {"const": "fast"}},
     "required": ["level", "mode"], "additionalProperties": False},
    {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "integer", "minimum": 0,
                                                              "maximum": 99}},
    {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"}},
     "required": ["ip"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}},
     "required": ["id"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "minLength": 2,
                                                "maxLength": 12},
                                      "year": {"type": "integer", "minimum": 1900,
                                               "maximum": 2030},
                                      "rating": {"type": "number", "minimum": 0,
                                                 "maximum": 10}},
     "required": ["title", "year"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["c"], "additionalProperties": False}},
        "required": ["b"], "additionalProperties": False}},
     "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2,
                                                "items": {"type": "object", "properties": {
                                                    "sku": {"type": "string",
                                                            "pattern": "^[a-z]{2}[0-9]$"},
                                                    "qty": {"type": "integer", "minimum": 1,
                                                            "maximum": 5}},
                                                    "required": ["sku", "qty"],
                                                    "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"enum": ["open", "closed"]},
                                      "count": {"type": ["integer", "null"]}},
     "required": ["status", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"temp": {"type": "number", "exclusiveMinimum": -50,
                                               "exclusiveMaximum": 60}},
     "required": ["temp"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer", "minimum": 0,
                                                            "maximum": 9},
                                                           {"enum": ["none"]}]}},
     "required": ["answer"], "additionalProperties": False},
    {"type": "object", "properties": {"letters": {"type": "array", "minItems": 2,
                                                  "maxItems": 3, "uniqueItems": False,
                                                  "items": {"enum": ["a", "b", "c"]}},
                                      "word": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
     "required": ["letters"], "additionalProperties": False},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
]

ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num ::= [1-9] [0-9]?
"""
ARITHMETIC_RE = re.compile(r"[0-9+\-*/()]+")
# The same language in Lark (llguidance's dialect), which a grammar may also be written in.
ARITHMETIC_LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUM | "(" expr ")"
NUM: /[1-9][0-9]?/
"""

SAMPLED = {"temperature": 0.8, "top_p": 0.95}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def ask(schema: dict) -> list[dict]:
    return [{"role": "user", "content":
             "Reply with JSON only, matching this JSON schema, and keep it short: "
             + json.dumps(schema)}]


def is_sentence(text: str) -> bool:
    """Whether `text` is a sentence of ARITHMETIC (a tiny recursive-descent parser)."""
    pos = 0

    def num() -> bool:
        nonlocal pos
        m = re.match(r"[1-9][0-9]?", text[pos:])
        if not m:
            return False
        pos += m.end()
        return True

    def factor() -> bool:
        nonlocal pos
        if text.startswith("(", pos):
            pos += 1
            if not expr() or not text.startswith(")", pos):
                return False
            pos += 1
            return True
        return num()

    def chain(item, ops: str) -> bool:  # noqa: ANN001
        nonlocal pos
        if not item():
            return False
        while pos < len(text) and text[pos] in ops:
            pos += 1
            if not item():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/")

    def expr() -> bool:
        return chain(term, "+-")

    return expr() and pos == len(text)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine.open(converted(smollm2_hf_dir(), "q4f32_1"), device="cpu",
                     options={"temperature": 0.0}) as eng:
        yield eng


def test_twenty_schemas_sampled_replies_validate(engine: Engine) -> None:
    assert len(SCHEMAS) >= 20
    for schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)
    streams = [
        engine.chat(ask(schema), response_format=schema_format(schema), max_tokens=64, seed=i,
                    **SAMPLED)
        for i, schema in enumerate(SCHEMAS)
    ]
    stopped = 0
    for schema, stream in zip(SCHEMAS, streams, strict=True):
        reply = stream.result()
        assert reply.finish_reason in ("stop", "length")
        if reply.finish_reason == "stop":
            stopped += 1
            value = json.loads(reply.text)
            jsonschema.Draft202012Validator(
                schema, format_checker=jsonschema.FormatChecker()).validate(value)
        else:
            assert len(reply.token_ids) == 64
    assert stopped >= len(SCHEMAS) * 3 // 4, f"only {stopped} replies finished"


def test_json_mode_replies_are_json_objects(engine: Engine) -> None:
    prompts = ["Describe a cat as JSON.", "Give me a JSON object with two numbers.",
               "A book as JSON with a title.", "Return {} or any small JSON object."]
    streams = [engine.chat([{"role": "user", "content": p}], response_format={"type":
               "json_object"}, max_tokens=64, seed=i, **SAMPLED) for i, p in enumerate(prompts)]
    for stream in streams:
        reply = stream.result()
        if reply.finish_reason == "stop":
            assert isinstance(json.loads(reply.text), dict)
        else:
            assert reply.finish_reason == "length"
            assert reply.text.lstrip().startswith("{")


def test_json_mode_allows_only_an_object(engine: Engine) -> None:
    from localchat.engine.grammar import TokenConstraint

    compiled = engine.grammars.compile({"type": "json_object"})
    allowed = TokenConstraint(compiled, engine.vocab_size, engine.stop_token_ids).allowed()
    tok = engine.tokenizer
    assert allowed[tok.encode("{")[0]]
    for text in ("[", "1", '"', "null"):
        assert not allowed[tok.encode(text)[0]], text
    assert not any(allowed[t] for t in engine.stop_token_ids)


def test_max_tokens_cuts_a_prefix_with_length(engine: Engine) -> None:
    schema = SCHEMAS[0]
    full = engine.chat(ask(schema), response_format=schema_format(schema), max_tokens=64,
                       temperature=0).result()
    cut = engine.chat(ask(schema), response_format=schema_format(schema), max_tokens=4,
                      temperature=0).result()
    assert full.finish_reason == "stop"
    jsonschema.validate(json.loads(full.text), schema)
    assert cut.finish_reason == "length" and full.text.startswith(cut.text)


def test_arithmetic_grammar_outputs_are_sentences(engine: Engine) -> None:
    fmt = {"type": "grammar", "grammar": ARITHMETIC}
    streams = [engine.complete(f"Arithmetic exercise {i}: ", response_format=fmt, max_tokens=24,
                               seed=i, **SAMPLED) for i in range(6)]
    streams.append(engine.chat([{"role": "user", "content": "Write a sum."}], response_format=fmt,
                               max_tokens=24, temperature=0))
    for stream in streams:
        reply = stream.result()
        assert ARITHMETIC_RE.fullmatch(reply.text), reply.text
        if reply.finish_reason == "stop":
            assert is_sentence(reply.text), reply.text


def test_lark_grammar_outputs_are_sentences(engine: Engine) -> None:
    fmt = {"type": "grammar", "grammar": ARITHMETIC_LARK}
    streams = [engine.complete(f"Arithmetic exercise {i}: ", response_format=fmt, max_tokens=24,
                               seed=i, **SAMPLED) for i in range(3)]
    for stream in streams:
        reply = stream.result()
        assert ARITHMETIC_RE.fullmatch(reply.text), reply.text
        if reply.finish_reason == "stop":
            assert is_sentence(reply.text), reply.text
    with pytest.raises(InvalidRequestError, match="grammar does not compile.*nope"):
        engine.chat(ask({}), response_format={"type": "grammar", "grammar": "start: nope"})


def test_schema_properties_are_closed_unless_it_says_otherwise(engine: Engine) -> None:
    from localchat.engine.grammar import TokenConstraint

    tok = engine.tokenizer

    def allowed_after(schema: dict, text: str) -> np.ndarray:
        c = TokenConstraint(engine.grammars.compile(schema_format(schema)), engine.vocab_size,
                            engine.stop_token_ids)
        for token in tok.encode(text):
            c.accept(token)
        return c.allowed()

    closed = {"type": "object", "properties": {"a": {"type": "integer"}}}
    after_a = allowed_after(closed, '{"a": 1')
    assert not after_a[tok.encode(",")[0]] and after_a[tok.encode("}")[0]]
    assert allowed_after({**closed, "additionalProperties": True}, '{"a": 1')[tok.encode(",")[0]]


def test_tool_call_tags_free_text_then_one_call_or_exactly_one_call(engine: Engine) -> None:
    from localchat.engine.grammar import TokenConstraint
    from localchat.server.tools import Tool, call_format

    weather = Tool("get_weather", {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}, {})
    tok = engine.tokenizer
    call = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"unit": "celsius"}}\n</tool_call>')

    def fits(mode: str, text: str) -> bool:
        """Whether the grammar takes `text` whole and then lets the reply stop."""
        c = TokenConstraint(engine.grammars.compile(call_format("tag", mode, [weather])),
                            engine.vocab_size, engine.stop_token_ids)
        for token in tok.encode(text):
            if not c.allowed()[token]:
                return False
            c.accept(token)
        return bool(c.allowed()[min(engine.stop_token_ids)])

    assert fits("auto", "No call needed.") and fits("auto", call)
    assert fits("auto", "Let me look. " + call)
    assert not fits("auto", "Let me look. <tool_call> oops")  # the opening commits to a call
    assert not fits("auto", call + " and more")  # one call, then the reply ends
    assert fits("required", call)
    assert not fits("required", "Let me look. " + call) and not fits("required", "No call.")
    assert not fits("required", call.replace("celsius", "kelvin"))


def test_a_batch_half_constrained_equals_solo_runs(engine: Engine) -> None:
    schema = SCHEMAS[13]
    prompts = ["Name a film.", "Count to five.", "A film as JSON.", "Say hello.",
               "Name a colour.", "Give a year.", "A film title?", "What is 2+2?"]

    def start(i: int, prompt: str):  # noqa: ANN202
        fmt = schema_format(schema) if i % 2 == 0 else None
        return engine.chat([{"role": "user", "content": prompt}], response_format=fmt,
                           max_tokens=20, temperature=0)

    solo = [start(i, p).result() for i, p in enumerate(prompts)]
    streams = [start(i, p) for i, p in enumerate(prompts)]
    batch = [s.result() for s in streams]
    assert engine.scheduler.max_decode_batch == 8
    for a, b in zip(solo, batch, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    for i in range(0, 8, 2):
        assert batch[i].text.startswith("{")


def test_stop_strings_and_cancel_work_under_a_format(engine: Engine) -> None:
    schema = SCHEMAS[0]
    reply = engine.chat(ask(schema), response_format=schema_format(schema), max_tokens=64,
                        temperature=0, stop=['"age"']).result()
    assert reply.finish_reason == "stop" and '"age"' not in reply.text
    assert reply.text.startswith("{")
    stream = engine.chat(ask(schema), response_format=schema_format(schema), max_tokens=64,
                         temperature=0)
    for _event in stream:
        stream.cancel()
    assert stream.result().finish_reason == "cancelled"


def test_formats_compile_once_and_bad_ones_are_invalid_requests(engine: Engine) -> None:
    fmt = schema_format({"type": "object", "properties": {"z": {"type": "integer"}}})
    engine.chat(ask({}), response_format=fmt, max_tokens=1).result()
    before = engine.grammars.compilations
    engine.chat(ask({}), response_format=json.loads(json.dumps(fmt)), max_tokens=1).result()
    assert engine.grammars.compilations == before
    with pytest.raises(InvalidRequestError, match="grammar does not compile.*undefined_rule") as e:
        engine.chat(ask({}), response_format={"type": "grammar",
                                              "grammar": "root ::= undefined_rule"})
    assert e.value.param == "response_format"
    with pytest.raises(InvalidRequestError, match="JSON schema does not compile"):
        engine.chat(ask({}), response_format=schema_format({"type": "no-such-type"}))
    with pytest.raises(InvalidRequestError, match="response_format.type"):
        engine.chat(ask({}), response_format={"type": "xml"})
    with pytest.raises(InvalidRequestError, match="json_schema"):
        GenerationConfig(response_format={"type": "json_schema"}).validate()
    text = engine.chat(ask({}), response_format={"type": "text"}, max_tokens=3).result()
    assert text.finish_reason in ("stop", "length")


def test_world_tokenizer_json_schema_reply_validates() -> None:
    from rwkv_variants import build_variant

    schema = {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "colour": {"enum": ["red", "green"]}, "word": {"type": "string", "maxLength": 4}},
        "required": ["ok", "n", "colour", "word"], "additionalProperties": False}
    model = Model(converted(build_variant("rwkv4-world"), "q0f32"), "cpu")
    with Engine(model, config=GenerationConfig(temperature=0.0)) as world:
        assert type(world.tokenizer).__name__ == "WorldTokenizer"
        replies = [world.chat([{"role": "user", "content": "JSON please"}],
                              response_format=schema_format(schema), max_tokens=240, seed=i,
                              temperature=0.8 if i else 0.0).result() for i in range(3)]
    for reply in replies:
        assert reply.finish_reason == "stop", reply.text
        jsonschema.validate(json.loads(reply.text), schema)


def test_formats_round_trip_through_the_config(tmp_path: Path) -> None:
    cfg = GenerationConfig(response_format={"type": "json_object"})
    assert cfg.to_dict()["response_format"] == {"type": "json_object"}
    assert GenerationConfig(response_format="json").structured_format() == {"type":
                                                                             "json_object"}
    assert GenerationConfig(response_format={"type": "text"}).structured_format() is None
