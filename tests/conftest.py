"""Shared pytest setup: the tests folder on sys.path (for `fixtures`), and one compiled-library
cache for every store the tests make (LOCALCHAT_SHARED_LIBRARY_CACHE, unless already set: set it
empty to compile in each store), so a model shape is compiled once per run, not once per test."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fixtures import cache_dir  # noqa: E402

SHARED_LIBS_KEPT_DAYS = 14  # libraries of older sources are never matched again: pruned


def _shared_library_cache() -> Path:
    folder = cache_dir() / "libs-shared"
    folder.mkdir(exist_ok=True)
    old = time.time() - SHARED_LIBS_KEPT_DAYS * 86400
    for path in folder.iterdir():
        try:
            if path.stat().st_mtime < old:
                path.unlink()
        except OSError:
            pass
    return folder


os.environ.setdefault("LOCALCHAT_SHARED_LIBRARY_CACHE", str(_shared_library_cache()))
