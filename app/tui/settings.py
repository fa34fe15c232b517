"""Per-conversation settings: parsed from the settings form's text fields and validated by the
engine's own rules, so an invalid value is reported with its reason and never applied. The
output format (text, any JSON object, or JSON valid under a schema) becomes the reply's
`GenerationConfig.response_format`."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from localchat import GenerationConfig
from localchat.errors import InvalidRequestError

# generation parameters the form offers, with the type each parses to
GENERATION_FIELDS: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
    "max_tokens": int,
    "seed": int,
}
FIELD_LABELS = {
    "system": "System prompt",
    "temperature": "Temperature",
    "top_p": "Top-p",
    "top_k": "Top-k",
    "min_p": "Min-p",
    "repetition_penalty": "Repeat penalty",
    "max_tokens": "Max tokens",
    "seed": "Seed",
    "context_window": "Context window",
    "output_format": "Output format",
    "json_schema": "JSON Schema",
}
# output format -> what the form calls it
OUTPUT_FORMATS = {"text": "Text", "json": "JSON object", "json_schema": "JSON Schema"}


@dataclass(frozen=True)
class ChatSettings:
    """A conversation's system prompt and parameters; None means the model's default."""

    system: str = ""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    context_window: int | None = None
    output_format: str = "text"  # a key of OUTPUT_FORMATS
    json_schema: str = ""  # the schema as typed (kept as text so the form shows it again)
    think: bool | None = None  # a reasoning model's thinking: on, off, None = its default

    def response_format(self) -> dict[str, Any] | None:
        """The `GenerationConfig.response_format` of the output format (None: free text)."""
        if self.output_format == "json":
            return {"type": "json_object"}
        if self.output_format == "json_schema":
            return {"type": "json_schema", "json_schema": {"schema": json.loads(self.json_schema)}}
        return None

    def overrides(self) -> dict[str, Any]:
        """The generation parameters that differ from the model's defaults (the output format
        included)."""
        out = {k: getattr(self, k) for k in GENERATION_FIELDS if getattr(self, k) is not None}
        fmt = self.response_format()
        if fmt is not None:
            out["response_format"] = fmt
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly fields (for the database)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ChatSettings:
        """Settings from `to_dict` output; unknown keys (a newer version's) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in names})

    def as_text(self) -> dict[str, str]:
        """Each field as the form shows it ("" for a default); the thinking switch is a key of
        the chat screen, not a form field."""
        return {k: "" if v is None else str(v) for k, v in self.to_dict().items()
                if k != "think"}


def parse_schema(text: str, *, compile_check: bool = False) -> dict[str, Any]:
    """The response format of a JSON Schema typed in the form, or InvalidRequestError (param
    "json_schema") saying why not. `compile_check` also compiles it as the engine will
    (llguidance, no tokenizer needed), catching what is valid JSON but no usable schema."""
    from localchat.engine import json_schema_problem, normalize_response_format

    if not text.strip():
        raise InvalidRequestError("the JSON Schema is empty: type one, or pick another output "
                                  "format", "json_schema")
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"the JSON Schema is not valid JSON: {exc}",
                                  "json_schema") from None
    try:
        fmt = normalize_response_format({"type": "json_schema", "json_schema": {"schema": schema}})
    except InvalidRequestError as exc:
        raise InvalidRequestError(str(exc), "json_schema") from None
    assert fmt is not None
    if compile_check:
        try:
            problem = json_schema_problem(schema)
        except ImportError:  # no structured output here: the reply itself will say so
            return fmt
        if problem:
            raise InvalidRequestError(f"the JSON Schema does not compile: {problem}",
                                      "json_schema")
    return fmt


def parse_field(name: str, text: str, *, max_window: int | None = None) -> Any:
    """One form field's value (None for blank), or InvalidRequestError naming it and why."""
    if name == "json_schema":
        return text  # checked with its output format, by parse_settings
    text = text.strip()
    if name == "system":
        return text
    if name == "output_format":
        if text not in OUTPUT_FORMATS:
            raise InvalidRequestError(f"output_format must be one of {', '.join(OUTPUT_FORMATS)}"
                                      f", got {text!r}", name)
        return text
    if not text:
        return None
    kind = int if name == "context_window" else GENERATION_FIELDS[name]
    try:
        value = kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise InvalidRequestError(f"{name} must be {what}, got {text!r}", name) from None
    if name == "context_window":
        top = max_window if max_window is not None else value
        if not 2 <= value <= top:
            raise InvalidRequestError(f"context_window must be in [2, {top}], got {value}", name)
        return value
    GenerationConfig().replace(**{name: value})  # the engine's own range checks
    return value


def parse_settings(fields: dict[str, str], *, max_window: int | None = None) -> ChatSettings:
    """Settings from the form's text fields; raises InvalidRequestError for the first bad one."""
    values = {name: parse_field(name, text, max_window=max_window)
              for name, text in fields.items()}
    settings = ChatSettings(**values)
    if settings.output_format == "json_schema":
        parse_schema(settings.json_schema, compile_check=True)
    GenerationConfig().replace(**settings.overrides())  # the combination, too
    return settings
