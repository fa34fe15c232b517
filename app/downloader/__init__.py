"""Hub access and `pull`: everything between a model name and a model directory on disk (the
engine's build steps convert and compile; `localchat.store` keeps the result)."""

from localchat.downloader.hub import HubClient, RepoFile, RepoSnapshot
from localchat.downloader.progress import DownloadProgress, NullProgress, RichProgress
from localchat.downloader.pull import EngineHooks, PullResult, engine_hooks, parse_source, pull

__all__ = [
    "DownloadProgress",
    "EngineHooks",
    "HubClient",
    "NullProgress",
    "PullResult",
    "RepoFile",
    "RepoSnapshot",
    "RichProgress",
    "engine_hooks",
    "parse_source",
    "pull",
]
