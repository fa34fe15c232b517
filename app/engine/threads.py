"""How many CPU threads the compiled kernels use: `--threads N`, else `LOCALCHAT_NUM_THREADS`,
else one per physical core this process may run on.

TVM's CPU thread pool is per calling thread and reads `TVM_NUM_THREADS` when it is created: the
engine's scheduler thread creates its pool at the first kernel launch, so the count set here
before an engine starts is the count that engine uses. Without the variable, TVM would use half
the logical CPUs on x86 (one thread on a 2-vCPU machine) and ask the OS on every launch.

Why physical cores: decode streams weights from memory and prefill keeps the vector units busy;
a second hyperthread on a core adds no bandwidth and no FMA units, only a straggler that the
pool's barrier waits for. On a 2-core machine without SMT that is 2 threads, which measures
faster than 1 for both prefill and decode (see bench/bench_engine.py).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from localchat.errors import LocalchatError

THREADS_ENV = "LOCALCHAT_NUM_THREADS"
TVM_THREADS_ENV = "TVM_NUM_THREADS"
THREADS_HELP = (f"CPU threads for the model (default: ${THREADS_ENV}, else one per physical "
                "core)")


class ThreadCountError(LocalchatError):
    """A thread count that is not a positive whole number."""

    http_status = 400
    error_type = "invalid_request_error"
    code = "invalid_value"
    param = "threads"


def parse_threads(text: str, source: str = "--threads") -> int:
    """`text` as a thread count (a whole number ≥ 1), or a ThreadCountError naming `source`."""
    try:
        value = int(text.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise ThreadCountError(f"{source} must be a whole number of threads, 1 or more, "
                               f"not {text.strip()!r}")
    return value


def thread_count_argument(text: str) -> int:
    """`parse_threads` as an argparse type (--threads N): a bad value is a usage error."""
    try:
        return parse_threads(text)
    except ThreadCountError:
        raise argparse.ArgumentTypeError(
            f"a whole number of threads, 1 or more, is needed, not {text.strip()!r}"
        ) from None


def add_threads_argument(parser: argparse.ArgumentParser, dest: str = "threads") -> None:
    """The --threads N option of a command that runs a model."""
    parser.add_argument("--threads", type=thread_count_argument, default=None, metavar="N",
                        dest=dest, help=THREADS_HELP)


def _allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS has no affinity API
        return list(range(os.cpu_count() or 1))


def physical_cores() -> int:
    """The physical cores among the CPUs this process may run on (hyperthread siblings counted
    once); the logical count where the topology is not readable."""
    cpus = _allowed_cpus()
    cores: set[str] = set()
    for cpu in cpus:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            cores.add(siblings.read_text().strip())
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def configure_threads(count: int | None = None) -> int:
    """Make engines started from now on use `count` threads and return the count. Without
    `count`: `LOCALCHAT_NUM_THREADS` (an invalid value raises ThreadCountError), else a
    `TVM_NUM_THREADS` already set, else `physical_cores()`. Process-wide: it sets
    `TVM_NUM_THREADS`."""
    if count is not None:
        if count < 1:
            raise ThreadCountError(f"threads must be 1 or more, not {count}")
        value = count
    elif os.environ.get(THREADS_ENV, "").strip():
        value = parse_threads(os.environ[THREADS_ENV], THREADS_ENV)
    else:
        current = os.environ.get(TVM_THREADS_ENV, "").strip()
        value = int(current) if current.isdigit() and int(current) > 0 else physical_cores()
    os.environ[TVM_THREADS_ENV] = str(value)
    return value


def ensure_threads() -> int:
    """`configure_threads()` that never raises: a bad `LOCALCHAT_NUM_THREADS` falls back to
    `physical_cores()` here and is reported where a front end calls `configure_threads`."""
    try:
        return configure_threads()
    except ThreadCountError:
        os.environ[TVM_THREADS_ENV] = str(physical_cores())
        return physical_cores()
