"""`localchat run` with structured output: --format json, --json-schema FILE, --grammar FILE
(the reply constrained token by token), --json still the machine-readable result, and clear
one-line errors for bad files and schemas."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from fixtures import converted, smollm2_hf_dir

LOCALCHAT = str(Path(sys.executable).with_name("localchat"))
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 1, "maximum": 99}},
    "required": ["name", "age"], "additionalProperties": False}
SUMS = 'root ::= num " + " num " = " num\nnum ::= [1-9] [0-9]?\n'
SUMS_RE = re.compile(r"[1-9][0-9]? \+ [1-9][0-9]? = [1-9][0-9]?")


@pytest.fixture(scope="module")
def model_dir() -> str:
    path = converted(smollm2_hf_dir(), "q0f32")
    from localchat.engine.runtime import Model

    Model(path, "cpu")  # compile once here, so the CLI runs below only load it
    return str(path)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LOCALCHAT, "run", *args], input="", capture_output=True, text=True,
                          timeout=300)


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line and "Warning:" not in line]


def test_json_schema_file_constrains_the_reply(model_dir: str, tmp_path: Path) -> None:
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON), encoding="utf-8")
    done = run(model_dir, "Invent a person.", "--json-schema", str(schema), "--json",
               "--max-tokens", "40")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)  # --json is still the result object
    assert out["finish_reason"] == "stop" and len(out["token_ids"]) <= 40
    jsonschema.validate(json.loads(out["text"]), PERSON)
    plain = run(model_dir, "Invent a person.", "--json-schema", str(schema), "--max-tokens",
                "40", "--temperature", "0.9", "--seed", "7")
    assert plain.returncode == 0, plain.stderr
    jsonschema.validate(json.loads(plain.stdout), PERSON)


def test_format_json_and_grammar(model_dir: str, tmp_path: Path) -> None:
    done = run(model_dir, "Describe a cat.", "--format", "json", "--json", "--max-tokens", "48")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    if out["finish_reason"] == "stop":
        assert isinstance(json.loads(out["text"]), dict)
    else:
        assert out["finish_reason"] == "length" and out["text"].startswith("{")
    grammar = tmp_path / "sums.gbnf"
    grammar.write_text(SUMS, encoding="utf-8")
    done = run(model_dir, "A sum: ", "--raw", "--grammar", str(grammar), "--max-tokens", "16",
               "--temperature", "0.8", "--seed", "3")
    assert done.returncode == 0, done.stderr
    text = done.stdout.rstrip("\n")
    assert SUMS_RE.fullmatch(text) and "[cut at" not in done.stderr, (text, done.stderr)


def test_bad_format_files_are_one_line_errors(model_dir: str, tmp_path: Path) -> None:
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json", encoding="utf-8")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"type": "no-such-type"}), encoding="utf-8")
    bad_grammar = tmp_path / "bad.gbnf"
    bad_grammar.write_text("root ::= missing_rule\n", encoding="utf-8")
    cases = [
        (("--json-schema", str(tmp_path / "absent.json")), "--json-schema: no such file"),
        (("--json-schema", str(bad_json)), "is not valid JSON"),
        (("--json-schema", str(wrong)), "the JSON schema does not compile"),
        (("--grammar", str(bad_grammar)), "the grammar does not compile"),
    ]
    for flags, words in cases:
        done = run(model_dir, "Hi.", *flags, "--max-tokens", "4")
        lines = errors(done.stderr)
        assert done.returncode == 1 and done.stdout == "", done
        assert len(lines) == 1 and lines[0].startswith("localchat: error: ") and words in lines[0]
        assert flags[0] in lines[0] and "Traceback" not in done.stderr
    both = run(model_dir, "Hi.", "--format", "json", "--grammar", str(bad_grammar))
    assert both.returncode == 2 and "not allowed with" in both.stderr
