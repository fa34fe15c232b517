"""The CPU kernels of the Llama block's small operators: RMSNorm and the MLP's SiLU gate.

TVM's default CPU pipeline leaves legalized operators as serial scalar loops, and SiLU calls
libm's `expf` per element. At one token they cost about 8 % of a SmolLM2 decode step; at 16
sequences, or in a prefill, they grow with the rows while the other threads wait. Here rows run
in parallel beyond `SERIAL_ROWS` (a thread-pool launch costs more than a few rows), each row
is vectorized in `LANES`-wide steps, and SiLU's exponential is the polynomial `common.exp2`.
A row's result never depends on the other rows.
"""

from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

from localchat.engine.kernels.common import LANES, LOG2E, exp2, scheduled

SERIAL_ROWS = 2  # up to this many rows the kernels run on the calling thread
F32 = "float32"
OPAQUE = 8  # Relax's op pattern for a kernel that fusion leaves whole (it has no blocks)


@functools.cache
def silu_mul(n: int, dtype: str) -> tirx.PrimFunc:
    """y[b, s, :] = silu(x[b, s, :n]) * x[b, s, n:] (the gate and up halves of a fused
    projection), silu(g) = g / (1 + e^-g), computed in float32."""
    vecs, tail = divmod(n, LANES)

    def gated(x, i, j, c):
        g = T.Cast(F32, x[i, j, c])
        return T.Cast(
            dtype, g / (T.float32(1) + exp2(g * T.float32(-LOG2E))) * T.Cast(F32, x[i, j, n + c])
        )

    @T.macro
    def row(x, y, i, j):
        for c in range(vecs):
            for e in T.vectorized(LANES):
                y[i, j, c * LANES + e] = gated(x, i, j, c * LANES + e)
        for e in range(tail):
            y[i, j, vecs * LANES + e] = gated(x, i, j, vecs * LANES + e)

    @T.prim_func(private=True, s_tir=True)
    def func(var_x: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": OPAQUE})
        b, s = T.int64(), T.int64()
        x = T.match_buffer(var_x, (b, s, 2 * n), dtype)
        y = T.match_buffer(var_y, (b, s, n), dtype)
        # A root block: Relax's reshape detection (one-input calls) reads the body as blocks.
        with T.sblock("root"):
            if b * s <= SERIAL_ROWS:
                for i, j in T.grid(b, s):
                    row(x, y, i, j)
            else:
                for r in T.parallel(b * s):
                    row(x, y, r // s, r % s)

    return scheduled(func)


@functools.cache
def rms_norm(n: int, eps: float, dtype: str) -> tirx.PrimFunc:
    """y[b, s, :] = x[b, s, :] / sqrt(mean(x[b, s, :]^2) + eps) * w, in float32 (LANES
    partial sums per row, added in a fixed order)."""
    vecs, tail = divmod(n, LANES)

    def square(x, i, j, c):
        return T.Cast(F32, x[i, j, c]) * T.Cast(F32, x[i, j, c])

    def scaled(x, w, i, j, c, inv_rms):
        return T.Cast(dtype, T.Cast(F32, x[i, j, c]) * inv_rms * T.Cast(F32, w[c]))

    @T.macro
    def row(x, w, y, i, j):
        acc = T.alloc_buffer((LANES,), F32)
        total = T.alloc_buffer((1,), F32)
        for e in T.vectorized(LANES):
            acc[e] = T.float32(0)
        for c in range(vecs):
            for e in T.vectorized(LANES):
                acc[e] = acc[e] + square(x, i, j, c * LANES + e)
        total[0] = T.float32(0)
        for e in range(LANES):
            total[0] = total[0] + acc[e]
        for e in range(tail):
            total[0] = total[0] + square(x, i, j, vecs * LANES + e)
        total[0] = T.rsqrt(total[0] / T.float32(n) + T.float32(eps))
        for c in range(vecs):
            for e in T.vectorized(LANES):
                y[i, j, c * LANES + e] = scaled(x, w, i, j, c * LANES + e, total[0])
        for e in range(tail):
            y[i, j, vecs * LANES + e] = scaled(x, w, i, j, vecs * LANES + e, total[0])

    @T.prim_func(private=True)
    def func(var_x: T.handle, w: T.Buffer((n,), dtype), var_y: T.handle):
        T.func_attr({"op_pattern": OPAQUE})
        b, s = T.int64(), T.int64()
        x = T.match_buffer(var_x, (b, s, n), dtype)
        y = T.match_buffer(var_y, (b, s, n), dtype)
        if b * s <= SERIAL_ROWS:
            for i, j in T.grid(b, s):
                row(x, w, y, i, j)
        else:
            for r in T.parallel(b * s):
                row(x, w, y, r // s, r % s)

    return scheduled(func)
