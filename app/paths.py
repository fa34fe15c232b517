"""Where localchat keeps its files: the data dir (models) and the cache dir (downloads, compiled
libraries). `LOCALCHAT_HOME` puts both under one directory."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "LOCALCHAT_HOME"
APP_NAME = "localchat"


def home_override() -> Path | None:
    """The directory `LOCALCHAT_HOME` names, or None when it is unset."""
    home = os.environ.get(HOME_ENV)
    return Path(home).expanduser().resolve() if home else None


def data_dir(home: Path | str | None = None) -> Path:
    """Where models live: `home`, else `LOCALCHAT_HOME`, else the platform's user data dir."""
    root = Path(home).expanduser().resolve() if home is not None else home_override()
    if root is not None:
        return root
    import platformdirs

    return Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))


def cache_dir(home: Path | str | None = None) -> Path:
    """Where downloads and compiled libraries go: `<home>/cache`, else the user cache dir."""
    root = Path(home).expanduser().resolve() if home is not None else home_override()
    if root is not None:
        return root / "cache"
    import platformdirs

    return Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False))


def user_cache_dir() -> Path:
    """This user's own cache dir (the platform's), whatever `LOCALCHAT_HOME` says: where a
    library is compiled to when the store's cache belongs to someone else."""
    import platformdirs

    return Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False))
