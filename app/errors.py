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
