"""Hand-scheduled TIR kernels for the CPU: linear layers with weights in float or 4-bit groups.

Legalization leaves matmuls as naive loop nests that are 10-50x slower than the memory or FMA
bound on a CPU, and dlight's CPU rules do not cover quantized GEMM. These kernels are written
already scheduled (parallel over output blocks, register tiles vectorized along K), so the
compile pipeline leaves them alone.

Weight layout is "NT": W[N, K] row-major, so both operands of every dot product are contiguous
along K. A 4-bit weight row is stored as uint32 words, 8 nibbles each, with one scale per group of
32 values; value = (nibble - 8) * scale. A thread dequantizes the block of rows it owns into a
small scratch buffer (NB rows) and reuses it for every row of X, so dequantization is fused into
the kernel and no full-precision copy of a weight exists at run time.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

GROUP_SIZE = 32
NIBBLES_PER_WORD = 8
LANES = 16  # one AVX-512 register of float32
ROW_TILE = 4  # rows of X per register tile
COL_TILE = 4  # rows of W per register tile
COL_BLOCK = 16  # rows of W a thread owns at once (dequantized into scratch)


def _check_k(k: int) -> None:
    if k % GROUP_SIZE != 0:
        raise ValueError(f"reduction size {k} is not a multiple of {GROUP_SIZE}")


def linear_f(k: int, n: int, dtype: str, bias: bool) -> tirx.PrimFunc:
    """Y[m, n] = X[m, k] @ W[n, k]^T (+ b) with float weights of `dtype`, fp32 accumulation."""
    _check_k(k)
    return _linear(k, n, dtype, bias, quantized=False)


def linear_q4(k: int, n: int, dtype: str, bias: bool) -> tirx.PrimFunc:
    """Y[m, n] = X[m, k] @ dequant(Wq[n, k/8], S[n, k/32])^T (+ b), dequantized in-kernel."""
    _check_k(k)
    return _linear(k, n, dtype, bias, quantized=True)


def _linear(k: int, n: int, dtype: str, bias: bool, quantized: bool) -> tirx.PrimFunc:
    kw = k // NIBBLES_PER_WORD
    kg = k // GROUP_SIZE
    nb = COL_BLOCK if n % COL_BLOCK == 0 else (COL_TILE if n % COL_TILE == 0 else 1)
    ct = COL_TILE if nb % COL_TILE == 0 else 1
    kl = k // LANES
    acc_t = "float32"

    # The weight arguments differ by mode; the body reads them only through `fill`.
    if quantized:

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
        for ii, jj in T.grid(rows, ct):
            red = T.alloc_buffer((1,), acc_t)
            red[0] = T.float32(0)
            for e in range(LANES):
                red[0] = red[0] + acc[ii, jj, e]
            if bias:
                y[i0 + ii, j0 + jt + jj] = T.Cast(dtype, red[0] + T.Cast(acc_t, b[j0 + jt + jj]))
            else:
                y[i0 + ii, j0 + jt + jj] = T.Cast(dtype, red[0])

    rq = 4 if nb % 4 == 0 else 1  # rows of W per GEMV register tile
    wpg = GROUP_SIZE // NIBBLES_PER_WORD

    @T.macro
    def gemv_q4(x, xs, w, s, b, y, j0):
        # One row of X. Nibbles are used unshifted (q, not q - 8): the -8 is applied once per
        # group through xs, the lane-wise group sums of x, which all rows share. Each of the
        # rq rows keeps its own accumulators, so the FMA chains are independent.
        for jq in range(nb // rq):
            acc = T.alloc_buffer((rq, NIBBLES_PER_WORD), acc_t)
            gacc = T.alloc_buffer((rq, NIBBLES_PER_WORD), acc_t)
            for r in T.unroll(rq):
                for e in T.vectorized(NIBBLES_PER_WORD):
                    acc[r, e] = T.float32(0)
            for g in range(kg):
                for r in T.unroll(rq):
                    for e in T.vectorized(NIBBLES_PER_WORD):
                        gacc[r, e] = T.float32(0)
                for wd in T.unroll(wpg):
                    for r in T.unroll(rq):
                        for e in T.vectorized(NIBBLES_PER_WORD):
                            gacc[r, e] = gacc[r, e] + T.Cast(
                                acc_t, x[0, g * GROUP_SIZE + wd * NIBBLES_PER_WORD + e]
                            ) * T.Cast(
                                acc_t,
                                T.bitwise_and(
                                    T.shift_right(
                                        w[j0 + jq * rq + r, g * wpg + wd],
                                        T.Cast("uint32", e * 4),
                                    ),
                                    T.uint32(15),
                                ),
                            )
                for r in T.unroll(rq):
                    for e in T.vectorized(NIBBLES_PER_WORD):
                        acc[r, e] = acc[r, e] + (gacc[r, e] - xs[g, e]) * T.Cast(
                            acc_t, s[j0 + jq * rq + r, g]
                        )
            for r in range(rq):
                red = T.alloc_buffer((1,), acc_t)
                red[0] = T.float32(0)
                for e in range(NIBBLES_PER_WORD):
                    red[0] = red[0] + acc[r, e]
                if bias:
                    y[0, j0 + jq * rq + r] = T.Cast(
                        dtype, red[0] + T.Cast(acc_t, b[j0 + jq * rq + r])
                    )
                else:
                    y[0, j0 + jq * rq + r] = T.Cast(dtype, red[0])

    w_shape = (n, kw) if quantized else (n, k)
    w_dtype = "uint32" if quantized else dtype

    @T.macro
    def body(var_x, w, s, b, var_y):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(var_x, (m, k), dtype)
        y = T.match_buffer(var_y, (m, n), dtype)
        if quantized and m == 1:
            xs = T.alloc_buffer((kg, NIBBLES_PER_WORD), acc_t)
            for g in range(kg):
                for e in T.vectorized(NIBBLES_PER_WORD):
                    xs[g, e] = T.float32(0)
                for wd in range(wpg):
                    for e in T.vectorized(NIBBLES_PER_WORD):
                        xs[g, e] = xs[g, e] + T.float32(8) * T.Cast(
                            acc_t, x[0, g * GROUP_SIZE + wd * NIBBLES_PER_WORD + e]
                        )
            for jo in T.parallel(n // nb):
                gemv_q4(x, xs, w, s, b, y, jo * nb)
        else:
            for jo in T.parallel(n // nb):
                wbuf = T.alloc_buffer((nb, k), acc_t)
                fill(wbuf, w, s, jo * nb)
                for io in range(m // ROW_TILE):
                    for jt in range(nb // ct):
                        tile(x, wbuf, y, b, io * ROW_TILE, ROW_TILE, jo * nb, jt * ct)
                for it in range(m % ROW_TILE):
                    for jt in range(nb // ct):
                        tile(x, wbuf, y, b, m - m % ROW_TILE + it, 1, jo * nb, jt * ct)

    if quantized and bias:

        @T.prim_func(private=True)
        def func(
            var_x: T.handle,
            w: T.Buffer((n, kw), "uint32"),
            s: T.Buffer((n, kg), dtype),
            b: T.Buffer((n,), dtype),
            var_y: T.handle,
        ):
            body(var_x, w, s, b, var_y)

    elif quantized:

        @T.prim_func(private=True)
        def func(
            var_x: T.handle,
            w: T.Buffer((n, kw), "uint32"),
            s: T.Buffer((n, kg), dtype),
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

    del w_shape, w_dtype
    return func
