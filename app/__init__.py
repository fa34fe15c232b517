"""localchat: chat with large language models compiled by Apache TVM for this machine.

The public surface, the names every front end (CLI, TUI, API server) uses:

- `Engine` (open a model by name or folder: `Engine.open(ref)`), `Conversation`,
  `GenerationConfig`;
- a reply: `ReplyStream` (iterate with `for` or `async for`), its events `TokenEvent` and
  `FinishEvent` (`Event` is either), the finished `Reply` and its `ReplyStats`;
- the errors, rooted at `LocalchatError`; each knows the HTTP status a server answers with.

Heavy modules (TVM, numpy) load on first use of an engine name, so `import localchat` and
`localchat --help` stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from localchat._lazy import lazy_getattr
from localchat.errors import (
    CompileError,
    ContextWindowError,
    DeviceError,
    DownloadError,
    EngineBusyError,
    GenerationError,
    InvalidRequestError,
    LocalchatError,
    ModelConfigError,
    ModelFailureError,
    ModelNotFoundError,
    StoreError,
    UnsupportedModelError,
)

if TYPE_CHECKING:
    from localchat.engine.conversation import Conversation
    from localchat.engine.engine import Engine
    from localchat.engine.generation_config import GenerationConfig
    from localchat.engine.stream import (
        Event,
        FinishEvent,
        Reply,
        ReplyStats,
        ReplyStream,
        TokenEvent,
    )

__version__ = "0.1.0"

# name -> module that defines it, imported on first access
_LAZY = {
    "Engine": "localchat.engine.engine",
    "Conversation": "localchat.engine.conversation",
    "GenerationConfig": "localchat.engine.generation_config",
    "ReplyStream": "localchat.engine.stream",
    "Reply": "localchat.engine.stream",
    "ReplyStats": "localchat.engine.stream",
    "TokenEvent": "localchat.engine.stream",
    "FinishEvent": "localchat.engine.stream",
    "Event": "localchat.engine.stream",
}

__all__ = [
    "CompileError",
    "ContextWindowError",
    "Conversation",
    "DeviceError",
    "DownloadError",
    "Engine",
    "EngineBusyError",
    "Event",
    "FinishEvent",
    "GenerationConfig",
    "GenerationError",
    "InvalidRequestError",
    "LocalchatError",
    "ModelConfigError",
    "ModelFailureError",
    "ModelNotFoundError",
    "Reply",
    "ReplyStats",
    "ReplyStream",
    "StoreError",
    "TokenEvent",
    "UnsupportedModelError",
    "__version__",
]


__getattr__ = lazy_getattr(__name__, _LAZY)
