"""localchat: chat with large language models compiled by Apache TVM for this machine.

The public surface is small: `Engine` (a loaded model serving conversations), `Conversation`,
`GenerationConfig`, and the error hierarchy rooted at `LocalchatError`. Heavy modules (TVM)
load on first use of `Engine`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from localchat.errors import LocalchatError

if TYPE_CHECKING:
    from localchat.engine.chat import Conversation, Engine
    from localchat.engine.generation_config import GenerationConfig

__version__ = "0.1.0"

__all__ = ["Conversation", "Engine", "GenerationConfig", "LocalchatError", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "Conversation"):
        from localchat.engine import chat

        return getattr(chat, name)
    if name == "GenerationConfig":
        from localchat.engine.generation_config import GenerationConfig

        return GenerationConfig
    raise AttributeError(name)
