"""Byte sizes as people write them: `human_size` for messages, `parse_size` for settings."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2,
          "gib": 1024**3, "tib": 1024**4}


def human_size(nbytes: float) -> str:
    """1.2 GB, 340.0 MB, 512 B."""
    size = float(nbytes)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(size) < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{nbytes} B"


def parse_size(text: str) -> int:
    """Bytes of "8GB", "512 MiB", "1.5g" or "1048576"; ValueError for anything else."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 8GB, 512MiB, 1048576)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
