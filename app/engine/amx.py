"""Intel AMX's tile registers for this process. Linux (5.16+) gives the AMX tile data state
only to a process that asks for it (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA): a tile
instruction in one that did not dies with SIGILL. A library compiled with AMX
(`kernels.gemm_amx`) needs the request before its first call; the CPU target keeps AMX only
where the request succeeds (`device.cpu_target`)."""

from __future__ import annotations

import ctypes
import functools
import platform

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


@functools.cache
def request_amx() -> bool:
    """Ask Linux for the AMX tile state for this process (once); whether it was granted."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False
