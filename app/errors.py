"""The one exception hierarchy of localchat; the CLI prints any of these as one line."""


class LocalchatError(Exception):
    """Base class of every error a user can cause or fix; its message is meant to be shown."""


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


class GenerationError(LocalchatError):
    """Bad generation parameters or a request the engine cannot serve."""


class RecipeError(LocalchatError):
    """A recipe or prebuilt-index file is malformed or fails its schema."""


class UnknownRecipeError(ModelNotFoundError):
    """A model name that no recipe defines; `suggestions` holds close matches."""

    def __init__(self, message: str, suggestions: list[str] | None = None) -> None:
        super().__init__(message)
        self.suggestions: list[str] = list(suggestions or [])


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


class ContextWindowError(GenerationError):
    """A prompt that does not fit the context window (with room for a reply)."""
