"""The settings of one `localchat serve` process."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from localchat.errors import InvalidRequestError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 11434  # Ollama's: its clients (ollama.Client(), oterm) find us unset
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's default: an idle model stays loaded 5 minutes
# Ollama's "forever": a negative keep_alive becomes Go's largest duration (2**63 - 1 ns, about
# 292 years), so /api/ps shows an expiry some 292 years away; anything longer counts as that.
FOREVER_S = (2**63 - 1) / 1e9
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
                   "h": 3600.0}
_DURATION_PART = re.compile(r"([-+]?\d+(?:\.\d*)?|[-+]?\.\d+)(ns|us|µs|ms|s|m|h)")


def parse_duration(value: float | int | str, param: str = "keep_alive") -> float:
    """Seconds of an Ollama duration: a number of seconds, or a Go duration string ("5m",
    "1h30m", "300ms", "-1"); a negative one means forever (returned as -1.0). A bad value is an
    InvalidRequestError naming `param`."""
    if isinstance(value, bool):
        raise InvalidRequestError(f"{param}: expected a duration, got {value!r}", param)
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            parts = _DURATION_PART.findall(text)
            if not parts or "".join(a + b for a, b in parts) != text:
                raise InvalidRequestError(
                    f"{param}: cannot parse {value!r} as a duration (say 300, \"5m\", \"1h\" or "
                    f"-1 for forever)", param) from None
            seconds = sum(float(a) * _DURATION_UNITS[b] for a, b in parts)
    if math.isnan(seconds):
        raise InvalidRequestError(f"{param}: {value!r} is not a duration", param)
    if seconds < 0 or seconds >= FOREVER_S:
        return -1.0
    return seconds


@dataclass
class ServerConfig:
    """How the server runs.

    models: store references (or model directories, from the command line only) loaded at start.
    api_key: when set, every endpoint but /health needs `Authorization: Bearer <key>`.
    cors_origins: origins allowed by CORS (none: CORS off).
    max_concurrency: sequences decoded together per model (the engine's batch size).
    max_queue: requests that may wait for a sequence per model; one more gets 503.
    max_loaded: models kept loaded at once (the least recently used idle one is unloaded).
    max_body_bytes: largest request body accepted (413 beyond it).
    device: the device models are opened on ("auto", "cpu", "cuda", ...).
    keep_alive: seconds an idle model loaded on first use stays loaded when a request does not
        say (Ollama's `keep_alive`; < 0: forever); command-line models stay until told otherwise.
    context_length: the context window models run with when a request does not say (Ollama's
        `options.num_ctx`); None: each model's own window. Clamped to the model's window.
    log_requests: log one line per request (method, path, status, duration, model).
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    models: list[str] = field(default_factory=list)
    api_key: str | None = None
    cors_origins: list[str] = field(default_factory=list)
    max_concurrency: int = 8
    max_queue: int | None = 64
    max_loaded: int = 1
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    device: str = "auto"
    max_n: int = 16
    keep_alive: float = DEFAULT_KEEP_ALIVE_S
    context_length: int | None = None
    log_requests: bool = False
