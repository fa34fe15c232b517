"""The sampling and stopping parameters of one reply, validated up front with clear errors."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localchat.errors import InvalidRequestError, ModelConfigError

# OpenAI's documented ranges for the additive penalties and the logit bias.
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# What a reply gets when neither its caller nor the model's generation_config.json says
# otherwise: Ollama's defaults, so that small models' replies end instead of looping.
MODEL_DEFAULTS: dict[str, Any] = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.9,
    "repetition_penalty": 1.1,
    "repetition_window": 64,
}
# Most alternatives a token's logprobs may list (OpenAI's top_logprobs limit).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class GenerationConfig:
    """How to pick tokens and when to stop.

    The fields' own defaults change nothing but the temperature; what a reply gets when its
    caller sets nothing is `from_model_defaults`: the model's generation_config.json over
    MODEL_DEFAULTS (Ollama's), the same for the CLI, the terminal UI and the server.

    temperature: 0 is greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens (0 = off).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1 = off).
    min_p: keep tokens whose probability is at least min_p times the top one's (0 = off).
    repetition_penalty: for every token among the last `repetition_window` of the context
        (prompt and reply), a positive logit is divided by it and a negative one multiplied by
        it (1 = off), as in HF and llama.cpp.
    repetition_window: how many of the latest tokens the repetition penalty looks at (0 = the
        whole context; Ollama's repeat_last_n).
    presence_penalty / frequency_penalty: OpenAI semantics over the reply's tokens:
        logit -= presence * (count > 0) + frequency * count.
    logit_bias: token id -> value added to its logit (-100..100, or -inf to ban a token).
    seed: seeds this reply's own random generator; None draws fresh entropy.
    max_tokens: most tokens in the reply; None = until a stop or the context window ends.
    stop: strings that end the reply; they are never emitted, the text before them is kept.
    stop_token_ids: extra token ids that end the reply (on top of the model's own).
    logprobs: None = off; k >= 0 = report each token's log-probability and the k most likely
        alternatives (0..MAX_TOP_LOGPROBS) on its TokenEvent.
    response_format: None or {"type": "text"} = free text; {"type": "json_object"} = any JSON
        object; {"type": "json_schema", "json_schema": {"schema": {...}}} = JSON valid under
        the schema (OpenAI's shape); {"type": "grammar", "grammar": "<GBNF or Lark>"}. The reply
        is constrained token by token (engine/grammar.py).
    """

    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_window: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    response_format: Mapping[str, Any] | str | None = None

    def __post_init__(self) -> None:
        # Accept lists for the tuple fields and any mapping for logit_bias, store plain types.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(
            self, "stop_token_ids", tuple(_as_token_key(t) for t in self.stop_token_ids)
        )
        object.__setattr__(
            self, "logit_bias", {_as_token_key(k): v for k, v in dict(self.logit_bias).items()}
        )

    @property
    def greedy(self) -> bool:
        """True when the next token is always the argmax (temperature 0)."""
        return self.temperature == 0

    def validate(self, vocab_size: int | None = None) -> GenerationConfig:
        """Raise InvalidRequestError naming the first out-of-range value; return self when valid.

        With `vocab_size`, token ids in logit_bias and stop_token_ids are checked against it.
        """
        _check_number("temperature", self.temperature, lo=0.0)
        _check_int("top_k", self.top_k, lo=0)
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0.0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}",
                "repetition_penalty",
            )
        _check_int("repetition_window", self.repetition_window, lo=0)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                raise InvalidRequestError(
                    f"{name} must be in [{PENALTY_RANGE[0]}, {PENALTY_RANGE[1]}], got {value}", name
                )
        for token_id, bias in self.logit_bias.items():
            _check_token_id("logit_bias", token_id, vocab_size)
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias):
                raise InvalidRequestError(
                    f"logit_bias[{token_id}] must be a number, got {bias!r}", "logit_bias"
                )
            if bias != -math.inf and not LOGIT_BIAS_RANGE[0] <= bias <= LOGIT_BIAS_RANGE[1]:
                raise InvalidRequestError(
                    f"logit_bias[{token_id}] must be in [{LOGIT_BIAS_RANGE[0]}, "
                    f"{LOGIT_BIAS_RANGE[1]}] (or -inf to ban the token), got {bias}",
                    "logit_bias",
                )
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(
                    f"stop strings must be non-empty strings, got {s!r}", "stop"
                )
        for token_id in self.stop_token_ids:
            _check_token_id("stop_token_ids", token_id, vocab_size)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0)
            if self.logprobs > MAX_TOP_LOGPROBS:
                raise InvalidRequestError(
                    f"logprobs must be at most {MAX_TOP_LOGPROBS}, got {self.logprobs}",
                    "logprobs",
                )
        self.structured_format()
        return self

    def structured_format(self) -> dict[str, Any] | None:
        """The normalized response format (None for free text); InvalidRequestError if
        malformed."""
        from localchat.engine.grammar import normalize_response_format

        return normalize_response_format(self.response_format)

    def replace(self, **changes: Any) -> GenerationConfig:
        """A copy with some fields changed (unknown names are an error), validated."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise InvalidRequestError(
                f"unknown generation parameter(s) {', '.join(unknown)}; known: "
                f"{', '.join(sorted(names))}",
                unknown[0],
            )
        return dataclasses.replace(self, **changes).validate()

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly fields."""
        out = dataclasses.asdict(self)
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        out["response_format"] = (
            dict(self.response_format) if isinstance(self.response_format, Mapping)
            else self.response_format
        )
        return out

    @classmethod
    def from_model_defaults(cls, path: Path, **overrides: Any) -> GenerationConfig:
        """The defaults of a model's replies: MODEL_DEFAULTS, then what its HF
        `generation_config.json` sets (when it exists), then `overrides`.

        Reads temperature, top_k, top_p, min_p, repetition_penalty and `do_sample: false`
        (greedy); other keys there (lengths, beams) are not sampling parameters and are ignored.
        """
        values: dict[str, Any] = dict(MODEL_DEFAULTS)
        path = Path(path)
        if path.is_dir():
            path = path / "generation_config.json"
        if path.exists():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ModelConfigError(f"{path}: not valid JSON ({exc})") from None
            for key in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
                if data.get(key) is not None:
                    values[key] = data[key]
            if data.get("do_sample") is False:
                values["temperature"] = 0.0
        values.update(overrides)
        return cls().replace(**values)


def _as_token_key(key: Any) -> Any:
    """JSON gives logit_bias keys as strings and numpy as numpy integers; make them ints."""
    if isinstance(key, str) and key.strip().isdigit():
        return int(key)
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):
        return int(key)
    return key


def _check_number(name: str, value: Any, lo: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", name)
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be finite, got {value}", name)
    if lo is not None and value < lo:
        raise InvalidRequestError(f"{name} must be >= {lo:g}, got {value}", name)


def _check_int(name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", name)
    if value < lo:
        raise InvalidRequestError(f"{name} must be >= {lo}, got {value}", name)


def _check_token_id(name: str, token_id: Any, vocab_size: int | None) -> None:
    if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
        raise InvalidRequestError(
            f"{name}: token ids must be non-negative integers, got {token_id!r}", name
        )
    if vocab_size is not None and token_id >= vocab_size:
        raise InvalidRequestError(
            f"{name}: token id {token_id} is outside the vocabulary (size {vocab_size})", name
        )
