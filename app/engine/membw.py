"""This machine's memory read bandwidth, measured by a compiled streaming sum: the ceiling a
decode step's weight reads run against, so the roofline that `localchat bench` and the scripts
under bench/ divide by.

Why a compiled kernel: numpy's `sum` under-reads the memory (one thread, and a reduction that
does not keep enough loads in flight); this one sums on every thread of TVM's pool, four
interleaved streams per thread (one stream per core leaves the hardware prefetchers short of
work), 16-lane vectors. The buffer is filled by a kernel too, so its pages are really backed
(pages never written would all map the one zero page, which sits in the cache).

The bandwidth of a shared machine follows its neighbours' load and moves by tens of percent
within minutes: sample it before and after what it is compared with.
"""

from __future__ import annotations

import os
import time
from typing import Any

DEFAULT_BYTES = 512 << 20  # far above any L3 (32 MB on the machines seen), and the design's size
STREAMS = 4  # interleaved streams per thread
LANES = 16  # float32 lanes per vector load


class ReadBandwidth:
    """A buffer of about `nbytes` on the CPU and the compiled kernel that reads it.

    `sample()` it as often as needed (each sample reads the whole buffer `repeats` times and
    keeps the fastest); `release()` gives the buffer's memory back between samples (the next
    sample fills a new one), so what it holds need not count in a measured peak. Compiling the
    kernel takes a second or two, filling the buffer a fraction of one.
    """

    def __init__(self, nbytes: int = DEFAULT_BYTES, threads: int | None = None) -> None:
        import tvm

        from localchat.engine.device import cpu_target

        # Chunks of the parallel loop: one per CPU (the pool's workers share them out).
        self.threads = threads or os.cpu_count() or 1
        step = self.threads * STREAMS * LANES
        self.elements = max(step, (nbytes // 4) // step * step)
        self.nbytes = self.elements * 4
        lib = tvm.compile(_kernels(self.elements, self.threads), target=cpu_target())
        self._sum, self._fill = lib["main"], lib["fill"]
        self._buffer: Any = None
        self._out: Any = None

    def sample(self, repeats: int = 3) -> float:
        """Bytes read per second, in GB/s (1e9), the fastest of `repeats` full reads."""
        if self._buffer is None:
            self._allocate()
        best = float("inf")
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            self._sum(self._buffer, self._out)
            best = min(best, time.perf_counter() - t0)
        return self.nbytes / best / 1e9

    def release(self) -> None:
        """Free the buffer (the process's resident memory drops by its size)."""
        self._buffer = None
        self._out = None

    def _allocate(self) -> None:
        import numpy as np
        import tvm

        dev = tvm.cpu()
        self._buffer = tvm.runtime.empty((self.elements,), "float32", dev)
        self._out = tvm.runtime.tensor(np.zeros((self.threads, LANES), np.float32), dev)
        self._fill(self._buffer)
        self._sum(self._buffer, self._out)  # warm: the pool's threads, the first page walks

    def __enter__(self) -> ReadBandwidth:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def measure_read_bandwidth(nbytes: int = DEFAULT_BYTES, repeats: int = 3) -> float:
    """One sample of the read bandwidth in GB/s, the buffer freed afterwards."""
    with ReadBandwidth(nbytes) as probe:
        return probe.sample(repeats)


def _kernels(n: int, threads: int) -> Any:
    """The module of `fill` (every element 1.0) and `main` (the streaming sum) over `n`
    float32 elements, `n` a multiple of threads x STREAMS x LANES."""
    import tvm
    from tvm.script import tirx as T

    chunk = n // threads
    per = chunk // STREAMS

    @T.prim_func
    def fill(a: T.Buffer((n,), "float32")):
        T.func_attr({"tir.noalias": True, "global_symbol": "fill"})
        for t in T.parallel(threads):
            for i in range(chunk // LANES):
                for e in T.vectorized(LANES):
                    a[t * chunk + i * LANES + e] = T.float32(1)

    @T.prim_func
    def total(a: T.Buffer((n,), "float32"), out: T.Buffer((threads, LANES), "float32")):
        T.func_attr({"tir.noalias": True, "global_symbol": "main"})
        for t in T.parallel(threads):
            acc = T.alloc_buffer((STREAMS, LANES), "float32")
            for u in T.unroll(STREAMS):
                for e in T.vectorized(LANES):
                    acc[u, e] = T.float32(0)
            for i in range(per // LANES):
                for u in T.unroll(STREAMS):
                    for e in T.vectorized(LANES):
                        acc[u, e] = acc[u, e] + a[(t * STREAMS + u) * per + i * LANES + e]
            for e in T.vectorized(LANES):
                out[t, e] = acc[0, e] + acc[1, e] + acc[2, e] + acc[3, e]

    return tvm.IRModule({"main": total, "fill": fill})


__all__ = ["DEFAULT_BYTES", "ReadBandwidth", "measure_read_bandwidth"]
