"""localchat: chat with large language models compiled by Apache TVM for this machine."""

from localchat.errors import LocalchatError

__version__ = "0.1.0"

__all__ = ["LocalchatError", "__version__"]
