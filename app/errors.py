"""The one exception hierarchy of localchat; the CLI prints any of these as one line.

Each class says how an API server reports it: `http_status`, an OpenAI-style `error_type`, and
a `code`; instances carry the offending `param` where there is one. The server maps errors with
these attributes alone, so a new error class only needs its own three values.
"""

from __future__ import annotations


class LocalchatError(Exception):
    """Base class of every error a user can cause or fix; its message is meant to be shown."""

    http_status: int = 500
    error_type: str = "server_error"
    code: str | None = None
    param: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        """The error as the body of an OpenAI-style error response (`{"error": ...}`'s value)."""
        return {"message": str(self), "type": self.error_type, "param": self.param,
                "code": self.code}


class ModelConfigError(LocalchatError):
    """A model folder or its config.json is missing, malformed or inconsistent."""


class UnsupportedModelError(LocalchatError):
    """An architecture or an option of one that localchat does not implement."""


class WeightsError(LocalchatError):
    """Weight files are missing, truncated, corrupt or do not match the config."""


class QuantizationError(LocalchatError):
    """An unknown quantization mode or one that cannot apply to this model."""


class CompileError(LocalchatError):
    """The model could not be compiled for the requested target."""


class DeviceError(LocalchatError):
    """The requested device does not exist or the installed TVM cannot drive it."""


class ModelNotFoundError(LocalchatError):
    """A model name or path that is neither a model directory nor in the local store."""

    http_status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"
    param = "model"

    def __init__(self, message: str, suggestions: list[str] | None = None) -> None:
        super().__init__(message)
        self.suggestions: list[str] = list(suggestions or [])


class GenerationError(LocalchatError):
    """A request the engine cannot serve (the subclasses say why)."""


class InvalidRequestError(GenerationError):
    """A malformed request or an invalid parameter; `param` names it when there is one."""

    http_status = 400
    error_type = "invalid_request_error"
    code = "invalid_parameter"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineBusyError(GenerationError):
    """The engine cannot take the request now (its queue is full); retry later."""

    http_status = 503
    error_type = "server_error"
    code = "engine_busy"


class ModelFailureError(GenerationError):
    """The model failed while generating (a runtime error in compiled code, say)."""

    http_status = 500
    error_type = "server_error"
    code = "model_failure"


class InsufficientMemoryError(LocalchatError):
    """A model whose weights and cache need more memory than this machine has free: refused
    before loading, with both sizes in the message (`needed_bytes`, `available_bytes`)."""

    http_status = 507
    error_type = "server_error"
    code = "insufficient_memory"

    def __init__(self, message: str, *, needed_bytes: int = 0, available_bytes: int = 0) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes


class RecipeError(LocalchatError):
    """A recipe or prebuilt-index file is malformed or fails its schema."""


class UnknownRecipeError(ModelNotFoundError):
    """A model name that no recipe defines; `suggestions` holds close matches."""


class DownloadError(LocalchatError):
    """Fetching files from the hub (or an offline source) failed."""


class NetworkError(DownloadError):
    """The hub cannot be reached: no network, server down, timeout or offline mode."""


class AccessDeniedError(DownloadError):
    """The hub refused access (HTTP 401/403): a gated or private repo, or a rejected token."""


class RemoteNotFoundError(DownloadError):
    """The repo, revision or file does not exist on the hub (HTTP 404)."""


class IntegrityError(DownloadError):
    """A downloaded file does not match the size or hash the hub published for it."""


class StoreError(LocalchatError):
    """The local model store is inconsistent, locked or cannot be written."""


class DiskSpaceError(StoreError):
    """Not enough free disk space to start, or the disk filled up part-way."""


class ContextWindowError(InvalidRequestError):
    """A prompt that does not fit the context window (with room for a reply).

    `prompt_tokens` is what the request needs (prompt, plus the room kept for the reply when
    the message says so) and `context_window` what the window holds.
    """

    code = "context_length_exceeded"

    def __init__(self, message: str, *, prompt_tokens: int | None = None,
                 context_window: int | None = None, param: str | None = "messages") -> None:
        super().__init__(message, param)
        self.prompt_tokens = prompt_tokens
        self.context_window = context_window
