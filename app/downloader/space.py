"""Free disk space: checked before a pull starts, with a reserve left for the rest of the system."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from localchat.errors import DiskSpaceError
from localchat.units import human_size

RESERVE_ENV = "LOCALCHAT_DISK_RESERVE"
DEFAULT_RESERVE = 512 * 1024 * 1024


def _existing_ancestor(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds (or will hold) `path`."""
    return shutil.disk_usage(_existing_ancestor(path)).free


def default_reserve() -> int:
    """Bytes to leave free: LOCALCHAT_DISK_RESERVE (bytes) or 512 MiB."""
    value = os.environ.get(RESERVE_ENV, "").strip()
    try:
        return int(value) if value else DEFAULT_RESERVE
    except ValueError:
        return DEFAULT_RESERVE


def check_free_space(needs: Mapping[Path, int], reserve_bytes: int | None = None) -> None:
    """Raise DiskSpaceError unless each filesystem has room for what is written under it.

    `needs` maps a directory to the bytes about to be written there; directories on the same
    filesystem add up. `reserve_bytes` (default: `default_reserve()`) must stay free.
    """
    reserve = default_reserve() if reserve_bytes is None else reserve_bytes
    by_device: dict[int, tuple[Path, int]] = {}
    for directory, nbytes in needs.items():
        anchor = _existing_ancestor(directory)
        dev = os.stat(anchor).st_dev
        first, total = by_device.get(dev, (Path(directory), 0))
        by_device[dev] = (first, total + max(int(nbytes), 0))
    for directory, total in by_device.values():
        free = free_bytes(directory)
        if free - reserve < total:
            raise DiskSpaceError(
                f"not enough disk space in {directory}: the pull needs about {human_size(total)} "
                f"plus {human_size(reserve)} kept free, and only {human_size(free)} is free"
            )
