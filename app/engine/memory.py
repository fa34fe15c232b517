"""Will a model fit? Its weights and KV cache (or recurrent state) against the memory this
machine has free, checked before anything is loaded so that a model too large is refused with
both sizes instead of swapping the machine to a halt or being killed part-way.

Free memory is the kernel's `MemAvailable` (what can be allocated without swapping), capped by
`LOCALCHAT_MAX_MEMORY` ("12GB", "8GiB", bytes) for a user who wants localchat to stay within a
budget. Where neither is known (no /proc/meminfo and no cap), nothing is refused. The check
covers CPU memory; a GPU's own memory is left to its driver's error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from localchat.errors import InsufficientMemoryError, ModelConfigError
from localchat.units import human_size, parse_size

MAX_MEMORY_ENV = "LOCALCHAT_MAX_MEMORY"
# The runtime's own needs beside weights and cache: the compiled library, scratch buffers,
# Python; refusing only past this margin keeps a model that barely fits loadable.
OVERHEAD_BYTES = 256 * 1000**2


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_cap() -> int | None:
    """The LOCALCHAT_MAX_MEMORY cap in bytes, None when unset; a malformed value is an error."""
    value = os.environ.get(MAX_MEMORY_ENV, "").strip()
    if not value:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ModelConfigError(f"{MAX_MEMORY_ENV}: {exc}") from None


def available_memory() -> int | None:
    """Bytes a model may use now: free memory, capped by LOCALCHAT_MAX_MEMORY; None: unknown."""
    return _capped(_meminfo("MemAvailable"))


def total_memory() -> int | None:
    """Bytes of memory this machine has in all, capped by LOCALCHAT_MAX_MEMORY; None: unknown."""
    return _capped(_meminfo("MemTotal"))


def _capped(size: int | None) -> int | None:
    cap = memory_cap()
    if size is None:
        return cap
    return size if cap is None else min(size, cap)


def weight_bytes_on_disk(model_dir: Path) -> int:
    """Bytes of a model directory's weights as its tensor cache records them (what loading
    allocates), 0 when the record is missing (the load reports that itself)."""
    try:
        cache = json.loads((Path(model_dir) / "tensor-cache.json").read_text(encoding="utf-8"))
        return sum(int(r.get("nbytes", 0)) for r in cache.get("records", []))
    except (OSError, ValueError, AttributeError, TypeError):
        return 0


def check_fits(name: str, weights: int, cache: int, available: int | None = None) -> None:
    """Raise InsufficientMemoryError if `weights` + `cache` bytes (plus the runtime's overhead)
    exceed `available` (default: `available_memory()`), naming every size and what to try."""
    if available is None:
        available = available_memory()
    needed = weights + cache + OVERHEAD_BYTES
    if available is None or needed <= available:
        return
    capped = memory_cap()
    limit = (f"{human_size(available)} available (capped by {MAX_MEMORY_ENV})"
             if capped is not None and capped <= available else
             f"{human_size(available)} of memory available")
    raise InsufficientMemoryError(
        f"{name} needs about {human_size(needed)} (weights {human_size(weights)}, cache "
        f"{human_size(cache)}) but this machine has {limit}: close other programs, pick a "
        f"smaller quantization or model, or lower the context (--context-length)",
        needed_bytes=needed, available_bytes=available)


def check_machine_holds(name: str, weights: int) -> None:
    """Raise InsufficientMemoryError if a model's `weights` bytes (plus the runtime's overhead)
    exceed all the memory this machine has: such a model is refused before a pull downloads
    it, where one that fits in all but not in what is free now is left to the load-time check."""
    total = total_memory()
    needed = weights + OVERHEAD_BYTES
    if total is None or needed <= total:
        return
    raise InsufficientMemoryError(
        f"{name} needs about {human_size(needed)} of memory to run (its weights "
        f"{human_size(weights)}) but this machine has {human_size(total)} in all"
        f"{' (capped by ' + MAX_MEMORY_ENV + ')' if memory_cap() == total else ''}: pick a "
        f"smaller model or quantization", needed_bytes=needed, available_bytes=total)
