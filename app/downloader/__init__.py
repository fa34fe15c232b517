"""Hub access, the local model store and `pull`: everything between a model name and a model
directory on disk (the engine does the converting and compiling)."""

from localchat.downloader.hub import HubClient, RepoFile, RepoSnapshot
from localchat.downloader.progress import DownloadProgress, NullProgress, RichProgress
from localchat.downloader.pull import EngineHooks, PullResult, engine_hooks, parse_source, pull
from localchat.downloader.store import MODEL_CONFIG, Store, StoredModel

__all__ = [
    "MODEL_CONFIG",
    "DownloadProgress",
    "EngineHooks",
    "HubClient",
    "NullProgress",
    "PullResult",
    "RepoFile",
    "RepoSnapshot",
    "RichProgress",
    "Store",
    "StoredModel",
    "engine_hooks",
    "parse_source",
    "pull",
]
