"""Hub access and `pull`: everything between a model name and a model directory on disk (the
engine's build steps convert and compile; `localchat.store` keeps the result).

This package is the facade the front ends (CLI, TUI, API server) use; they import these names
from `localchat.downloader`, never from a module under it:

- pulling (`downloader/pull.py`): `pull` (a name, hub repo or local source -> a model in the
  store, with its `PullResult`), `parse_source` (what a name refers to; an unknown one fails
  here, before any engine work), `engine_hooks` (the engine's build steps for a device, as
  `pull` calls them: an `EngineHooks`), `source_on_disk` (a model's source while the download
  cache still has it);
- progress (`downloader/progress.py`): `DownloadProgress` (the protocol `pull` reports to),
  `NullProgress` (reports nothing), `RichProgress` (progress bars on a terminal);
- gated repos (`downloader/gated.py`): `pull_with_token_prompt` (a pull that, refused by a
  gated repo for want of a token, names the licence and its page and asks a person at the
  terminal for a token; elsewhere one line saying to set HF_TOKEN);
- the hub (`downloader/hub.py`): `HubClient` (listings and verified, resumable downloads),
  `RepoSnapshot` and `RepoFile` (a repo's listing), `hub_offline` (whether HF_HUB_OFFLINE is
  on, read now);
- disk space (`downloader/space.py`): `free_bytes` (free space where a path is or would be),
  `human_size` (a byte count as "1.2 GB").

Each name loads its module on first use (huggingface_hub and rich are not loaded by importing
this package), and is looked up in its module on every access, so patching the defining module
(in tests) reaches the front ends.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from localchat._lazy import lazy_getattr

if TYPE_CHECKING:
    from localchat.downloader.gated import pull_with_token_prompt
    from localchat.downloader.hub import HubClient, RepoFile, RepoSnapshot, hub_offline
    from localchat.downloader.progress import DownloadProgress, NullProgress, RichProgress
    from localchat.downloader.pull import (
        EngineHooks,
        PullResult,
        engine_hooks,
        parse_source,
        pull,
        source_on_disk,
    )
    from localchat.downloader.space import free_bytes, human_size

# name -> module that defines it, imported on first access
_LAZY = {
    "EngineHooks": "localchat.downloader.pull",
    "PullResult": "localchat.downloader.pull",
    "engine_hooks": "localchat.downloader.pull",
    "parse_source": "localchat.downloader.pull",
    "pull": "localchat.downloader.pull",
    "source_on_disk": "localchat.downloader.pull",
    "pull_with_token_prompt": "localchat.downloader.gated",
    "DownloadProgress": "localchat.downloader.progress",
    "NullProgress": "localchat.downloader.progress",
    "RichProgress": "localchat.downloader.progress",
    "HubClient": "localchat.downloader.hub",
    "RepoFile": "localchat.downloader.hub",
    "RepoSnapshot": "localchat.downloader.hub",
    "hub_offline": "localchat.downloader.hub",
    "free_bytes": "localchat.downloader.space",
    "human_size": "localchat.downloader.space",
}

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
    "free_bytes",
    "hub_offline",
    "human_size",
    "parse_source",
    "source_on_disk",
    "pull",
    "pull_with_token_prompt",
]


__getattr__ = lazy_getattr(__name__, _LAZY)


class _Facade(types.ModuleType):
    """This package, keeping `pull` the function: importing the submodule
    `localchat.downloader.pull` binds the module as the package's attribute `pull`, which would
    hide the function from `from localchat.downloader import pull`."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return  # the import system binding a submodule over a facade name
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Facade
