"""Refuse, before writing, a benchmark model the disk has no room for.

The benchmarks build multi-GB models into the test cache once and keep them; several shapes at
full depth fill a small disk (60 GB of them did once, mid-run). Each builder asks first.
"""

from __future__ import annotations

import shutil
from pathlib import Path

MARGIN = 2 * 1024**3  # left free for the OS, the test suite and llama.cpp's own temp files


def require_free(where: Path, need: int, what: str) -> None:
    """SystemExit naming the sizes when `where`'s disk has less than `need` bytes (+ margin)."""
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free
    if free < need + MARGIN:
        raise SystemExit(
            f"{what} needs about {need / 1e9:.1f} GB under {where}, and {free / 1e9:.1f} GB are "
            f"free (keeping {MARGIN / 1e9:.1f} GB spare): remove old benchmark models there "
            f"(bench-*) or pass --layers with fewer layers")
