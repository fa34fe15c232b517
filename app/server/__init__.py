"""`localchat serve`: an OpenAI- and Ollama-compatible HTTP API over the engine.

    from localchat.server import ServerConfig, create_app, run
    run(ServerConfig(models=["smollm2-135m-instruct"]))  # on 127.0.0.1:11434

The default address is 127.0.0.1:11434, Ollama's, so Ollama's clients find the server with no
setting; `run` binds it before anything loads, and a taken port is one error line saying who
holds it. `create_app` gives the FastAPI application (for uvicorn or tests); `add_arguments` and
`config_from_args` (localchat.server.cli) are the command line that both `localchat serve` and
`python -m localchat.server` use. FastAPI loads on first use of `create_app` or `run`, so the
command line stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ServerConfig": "localchat.server.config",
    "create_app": "localchat.server.app",
    "run": "localchat.server.app",
    "add_arguments": "localchat.server.cli",
    "config_from_args": "localchat.server.cli",
    "main": "localchat.server.cli",
}

__all__ = ["ServerConfig", "add_arguments", "config_from_args", "create_app", "main", "run"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'localchat.server' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
