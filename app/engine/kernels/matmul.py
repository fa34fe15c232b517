"""Hand-scheduled TIR kernels for the CPU: linear layers with weights in float or 4-bit groups.

Legalization leaves matmuls as naive loop nests that are 10-50x slower than the memory or FMA
bound on a CPU, and dlight's CPU rules do not cover quantized GEMM. These kernels are written
already scheduled (parallel over output blocks, register tiles vectorized along K), so the
compile pipeline leaves them alone.

Weight layout is "NT": W[N, K] row-major, so both operands of every dot product are contiguous
along K. A 4-bit weight row is stored as uint32 words, 8 nibbles each, with one scale per group of
32 values; value = (nibble - 8) * scale, or in the asymmetric modes nibble * scale + min with a
float16 scale and min per group (side by side in one array). A thread dequantizes the block of
rows it owns into a small scratch buffer (NB rows) and reuses it for every row of X, so
dequantization is fused into the kernel and no full-precision copy of a weight exists at run time.
Decode runs the register-unpacking GEMV of `gemv` instead; which of the two runs is the caller's
choice, never the row count's, because the two sum in different orders and a sequence must get
the same bits whether it is alone in a call or batched with others.

Any reduction size K works: the register tiles cover K // 16 vectors and a K that is not a
multiple of 16 ends with a scalar tail (no tail code at all for the usual shapes). A 4-bit weight
whose K is not a multiple of 32 is stored padded to whole groups
(`quantization.padded_k`); the scratch rows are dequantized at the padded width and read only up
to K.
"""

from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

from localchat.engine.kernels import gemm
from localchat.engine.kernels.common import (
    GROUP_SIZE,
    LANES,
    NIBBLES_PER_WORD,
    padded_k,
    scheduled,
)

ROW_TILE = 4  # rows of X per register tile
COL_TILE = 4  # rows of W per register tile
COL_BLOCK = 16  # rows of W a thread owns at once (dequantized into scratch)


def linear_f(k: int, n: int, dtype: str, bias: bool) -> tirx.PrimFunc:
    """Y[m, n] = X[m, k] @ W[n, k]^T (+ b) with float weights of `dtype`, fp32 accumulation:
    the register-blocked outer-product GEMM of `gemm.gemm_f` (2-4x the dot-product kernel of
    `_linear` in bench/bench_gemm.py; each row's bits still do not depend on the other rows)."""
    return gemm.gemm_f(k, n, dtype, bias)


@functools.cache  # parsing the TVMScript is most of a model's export time
def linear_q4(
    k: int, n: int, dtype: str, bias: bool, asym: bool = False, scale_dtype: str | None = None
) -> tirx.PrimFunc:
    """Y[m, n] = X[m, k] @ dequant(Wq[n, kp/8], S[n, kp/32])^T (+ b), kp = `padded_k(k)`,
    dequantized in-kernel. `asym`: the asymmetric modes' weights, q * scale + min, S [n, 2 kp/32]
    holding each group's scale and min side by side; otherwise (q - 8) * S. S is of
    `scale_dtype` (default: float16 with `asym`, else `dtype`), read through a conversion."""
    return _linear(k, n, dtype, bias, quantized=True, asym=asym, scale_dtype=scale_dtype)


def _linear(
    k: int, n: int, dtype: str, bias: bool, quantized: bool, asym: bool = False,
    scale_dtype: str | None = None,
) -> tirx.PrimFunc:
    kp = padded_k(k) if quantized else k  # the stored width of a weight row
    kw = kp // NIBBLES_PER_WORD
    kg = kp // GROUP_SIZE
    nb = COL_BLOCK if n % COL_BLOCK == 0 else (COL_TILE if n % COL_TILE == 0 else 1)
    ct = COL_TILE if nb % COL_TILE == 0 else 1
    kl = k // LANES
    kt = k % LANES  # the scalar tail; 0 for every common shape, and then no code for it
    acc_t = "float32"

    # The weight arguments differ by mode; the body reads them only through `fill`.
    if asym:

        @T.macro
        def fill(wbuf, w, s, j0):
            for jj, wd in T.grid(nb, kw):
                for e in T.vectorized(NIBBLES_PER_WORD):
                    wbuf[jj, wd * NIBBLES_PER_WORD + e] = T.Cast(
                        acc_t,
                        T.bitwise_and(
                            T.shift_right(w[j0 + jj, wd], T.Cast("uint32", e * 4)), T.uint32(15)
                        ),
                    ) * T.Cast(acc_t, s[j0 + jj, wd // 4 * 2]) + T.Cast(
                        acc_t, s[j0 + jj, wd // 4 * 2 + 1]
                    )

    elif quantized:

        @T.macro
        def fill(wbuf, w, s, j0):
            for jj, wd in T.grid(nb, kw):
                for e in T.vectorized(NIBBLES_PER_WORD):
                    wbuf[jj, wd * NIBBLES_PER_WORD + e] = T.Cast(
                        acc_t,
                        T.Cast(
                            "int32",
                            T.bitwise_and(
                                T.shift_right(w[j0 + jj, wd], T.Cast("uint32", e * 4)),
                                T.uint32(15),
                            ),
                        )
                        - 8,
                    ) * T.Cast(acc_t, s[j0 + jj, wd // 4])

    else:

        @T.macro
        def fill(wbuf, w, s, j0):
            for jj, kk in T.grid(nb, kl):
                for e in T.vectorized(LANES):
                    wbuf[jj, kk * LANES + e] = T.Cast(acc_t, w[j0 + jj, kk * LANES + e])
            if kt > 0:
                for jj, e in T.grid(nb, kt):
                    wbuf[jj, kl * LANES + e] = T.Cast(acc_t, w[j0 + jj, kl * LANES + e])

    @T.macro
    def tile(x, wbuf, y, b, i0, rows, j0, jt):
        acc = T.alloc_buffer((ROW_TILE, ct, LANES), acc_t)
        for ii, jj in T.grid(rows, ct):
            for e in T.vectorized(LANES):
                acc[ii, jj, e] = T.float32(0)
        for kk in range(kl):
            for ii in T.unroll(rows):
                for jj in T.unroll(ct):
                    for e in T.vectorized(LANES):
                        acc[ii, jj, e] = (
                            acc[ii, jj, e]
                            + T.Cast(acc_t, x[i0 + ii, kk * LANES + e])
                            * wbuf[jt + jj, kk * LANES + e]
                        )
        if kt > 0:
            for ii, jj, e in T.grid(rows, ct, kt):
                acc[ii, jj, e] = (
                    acc[ii, jj, e]
                    + T.Cast(acc_t, x[i0 + ii, kl * LANES + e]) * wbuf[jt + jj, kl * LANES + e]
                )
        for ii, jj in T.grid(rows, ct):
            red = T.alloc_buffer((1,), acc_t)
            red[0] = T.float32(0)
            for e in range(LANES):
                red[0] = red[0] + acc[ii, jj, e]
            if bias:
                y[i0 + ii, j0 + jt + jj] = T.Cast(dtype, red[0] + T.Cast(acc_t, b[j0 + jt + jj]))
            else:
                y[i0 + ii, j0 + jt + jj] = T.Cast(dtype, red[0])

    @T.macro
    def body(var_x, w, s, b, var_y):
        m = T.int64()
        x = T.match_buffer(var_x, (m, k), dtype)
        y = T.match_buffer(var_y, (m, n), dtype)
        for jo in T.parallel(n // nb):
            wbuf = T.alloc_buffer((nb, kp), acc_t)
            fill(wbuf, w, s, jo * nb)
            for io in range(m // ROW_TILE):
                for jt in range(nb // ct):
                    tile(x, wbuf, y, b, io * ROW_TILE, ROW_TILE, jo * nb, jt * ct)
            for it in range(m % ROW_TILE):
                for jt in range(nb // ct):
                    tile(x, wbuf, y, b, m - m % ROW_TILE + it, 1, jo * nb, jt * ct)

    # the group parameters
    ks, sdt = (2 * kg, scale_dtype or "float16") if asym else (kg, scale_dtype or dtype)
    if quantized and bias:

        @T.prim_func(private=True)
        def func(
            var_x: T.handle,
            w: T.Buffer((n, kw), "uint32"),
            s: T.Buffer((n, ks), sdt),
            b: T.Buffer((n,), dtype),
            var_y: T.handle,
        ):
            body(var_x, w, s, b, var_y)

    elif quantized:

        @T.prim_func(private=True)
        def func(
            var_x: T.handle,
            w: T.Buffer((n, kw), "uint32"),
            s: T.Buffer((n, ks), sdt),
            var_y: T.handle,
        ):
            body(var_x, w, s, None, var_y)

    elif bias:

        @T.prim_func(private=True)
        def func(
            var_x: T.handle, w: T.Buffer((n, k), dtype), b: T.Buffer((n,), dtype), var_y: T.handle
        ):
            body(var_x, w, None, b, var_y)

    else:

        @T.prim_func(private=True)
        def func(var_x: T.handle, w: T.Buffer((n, k), dtype), var_y: T.handle):
            body(var_x, w, None, None, var_y)

    return scheduled(func)
