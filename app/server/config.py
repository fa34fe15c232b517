"""The settings of one `localchat serve` process."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 11434  # Ollama's: its clients (ollama.Client(), oterm) find us unset
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


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
