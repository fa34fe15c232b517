"""Per-conversation settings: parsed from the settings form's text fields and validated by the
engine's own rules, so an invalid value is reported with its reason and never applied."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from localchat.engine.generation_config import GenerationConfig
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
}


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

    def overrides(self) -> dict[str, Any]:
        """The generation parameters that differ from the model's defaults."""
        return {k: getattr(self, k) for k in GENERATION_FIELDS if getattr(self, k) is not None}

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly fields (for the database)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ChatSettings:
        """Settings from `to_dict` output; unknown keys (a newer version's) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in names})

    def as_text(self) -> dict[str, str]:
        """Each field as the form shows it ("" for a default)."""
        return {k: "" if v is None else str(v) for k, v in self.to_dict().items()}


def parse_field(name: str, text: str, *, max_window: int | None = None) -> Any:
    """One form field's value (None for blank), or InvalidRequestError naming it and why."""
    text = text.strip()
    if name == "system":
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
    GenerationConfig().replace(**settings.overrides())  # the combination, too
    return settings
