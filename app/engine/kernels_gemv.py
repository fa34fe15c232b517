"""Matrix-vector kernels for decode on the CPU: y[m, n] = x[m, k] @ W[n, k]^T for a few rows of x.

Decode reads every weight once per token, so it runs at the speed weights stream from memory only
if unpacking costs less than loading. `kernels_cpu` dequantizes a block of rows into a float
scratch buffer and then multiplies: right for prefill (the buffer serves many rows of x), but for
one row the unpacking dominates. Here the weights are consumed in registers, in the same storage
formats (`quantization`: 4-bit nibbles, 8 per uint32 word, value (q - 8) * scale, one scale per
32 values along k; or float weights of the activation dtype):

* x is first transposed into xp[r, p, w] = x[r, 8 w + p] and its per-word sums
  xs[r, w] = sum_p x[r, 8 w + p] (k floats each; once per call),
* a work item is ROWS rows of W; for each row, 16 consecutive words (128 weights, 4 groups) are
  one vector: for each nibble position p, t += float((words >> 4p) & 15) * xp[r, p, words] —
  contiguous loads, immediate shifts, no gathers; then t - 8 xs is reduced to one value per group
  (4 lanes each), multiplied by the 4 scales of those groups and accumulated,
* parallel over work items; rows of x (the batch) loop inside, so a work item's weights are read
  from memory once per call.

Float weights: the same shape without the unpacking (16-lane loads of W and x, fp32 accumulation).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

GROUP_SIZE = 32
NIBBLES_PER_WORD = 8
WORDS_PER_GROUP = GROUP_SIZE // NIBBLES_PER_WORD  # 4
LANES = 16
GROUPS_PER_VEC = LANES // WORDS_PER_GROUP  # 4
ROWS = 4  # rows of W per work item
VEC_UNROLL = 4  # word vectors of one row in flight (independent FMA chains)
LONG_K = 4096  # beyond this reduction size the AVX-512 kernel shares x between rows
LONG_ROWS = 8  # rows sharing each load of x when k > LONG_K
LONG_VEC_UNROLL = 1  # word vectors in flight per row when k > LONG_K
Q4_K_MULTIPLE = LANES * NIBBLES_PER_WORD  # gemv_q4 needs k to be a multiple of this


def _rows(n: int) -> int:
    for r in (ROWS, 2, 1):
        if n % r == 0:
            return r
    return 1


def _nibble_dot(w, xp, row, r, word):
    """sum over the 8 nibbles q_p of w[row, word] of q_p * x[r, 8 word + p] (one expression, so
    the products chain in registers)."""
    total = None
    for p in range(NIBBLES_PER_WORD):
        q = T.bitwise_and(T.shift_right(w[row, word], T.uint32(p * 4)), T.uint32(15))
        term = T.Cast("float32", q) * xp[r, p, word]
        total = term if total is None else total + term
    return total


def _lane_scale(s, row, group0, e):
    """The scale of lane e's group, s[row, group0 + e // 4], as a select over the 4 groups of a
    vector, so the vectorizer emits 4 broadcasts and blends instead of a 16-lane gather."""
    value = T.Cast("float32", s[row, group0 + GROUPS_PER_VEC - 1])
    for g in range(GROUPS_PER_VEC - 2, -1, -1):
        value = T.Select(
            e < (g + 1) * WORDS_PER_GROUP, T.Cast("float32", s[row, group0 + g]), value
        )
    return value


def _sum_all(acc, rows: int, flat: bool = False):
    total = None
    for u in range(rows):
        for e in range(LANES):
            value = acc[u * LANES + e] if flat else acc[u, e]
            total = value if total is None else total + value
    return total


def _sum_row(acc, jj, vu: int):
    """Sum of the vu * 16 accumulator lanes of row jj (flat layout [(jj * vu + u) * 16 + e])."""
    total = None
    for u in range(vu):
        for e in range(LANES):
            value = acc[(jj * vu + u) * LANES + e]
            total = value if total is None else total + value
    return total


def _divisor(total: int, options: tuple[int, ...]) -> int:
    for d in options:
        if total % d == 0:
            return d
    return 1


def gemv_q4(k: int, n: int, dtype: str, avx512: bool = False) -> tirx.PrimFunc:
    """y[m, n] = x[m, k] @ dequant(W[n, k/8], S[n, k/32])^T, m small (decode).

    `avx512`: unpack with a 16-entry table lookup (vpermps reads only the low 4 bits of each
    index), 3 instructions per 16 weights instead of 4 (shift, and, convert, fma)."""
    if k % Q4_K_MULTIPLE != 0:
        raise ValueError(f"reduction size {k} is not a multiple of {Q4_K_MULTIPLE}")
    if avx512:
        return _gemv_q4_avx512(k, n, dtype)
    kw = k // NIBBLES_PER_WORD
    kg = k // GROUP_SIZE
    nv = kw // LANES  # vectors of words per row
    vu = _divisor(nv, (VEC_UNROLL, 2))  # vectors in flight (independent FMA chains)
    rb = _divisor(n, (ROWS, 2))
    f32 = "float32"

    @T.prim_func(private=True)
    def func(
        var_x: T.handle,
        w: T.Buffer((n, kw), "uint32"),
        s: T.Buffer((n, kg), dtype),
        var_y: T.handle,
    ):
        T.func_attr({"tir.noalias": True, "tir.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(var_x, (m, k), dtype)
        y = T.match_buffer(var_y, (m, n), dtype)
        xp = T.alloc_buffer((m, NIBBLES_PER_WORD, kw), f32)
        xs = T.alloc_buffer((m, kw), f32)
        for r, wd in T.grid(m, kw):
            xs[r, wd] = T.float32(0)
            for p in range(NIBBLES_PER_WORD):
                xp[r, p, wd] = T.Cast(f32, x[r, wd * NIBBLES_PER_WORD + p])
                xs[r, wd] = xs[r, wd] + T.Cast(f32, x[r, wd * NIBBLES_PER_WORD + p])
        for jo in T.parallel(n // rb):
            acc = T.alloc_buffer((vu, LANES), f32)
            for r, jj in T.grid(m, rb):
                for u in T.unroll(vu):
                    for e in T.vectorized(LANES):
                        acc[u, e] = T.float32(0)
                for vo in range(nv // vu):
                    for u in T.unroll(vu):
                        for e in T.vectorized(LANES):
                            acc[u, e] = acc[u, e] + _lane_scale(
                                s, jo * rb + jj, (vo * vu + u) * GROUPS_PER_VEC, e
                            ) * (
                                _nibble_dot(w, xp, jo * rb + jj, r, (vo * vu + u) * LANES + e)
                                - T.float32(8) * xs[r, (vo * vu + u) * LANES + e]
                            )
                y[r, jo * rb + jj] = T.Cast(dtype, _sum_all(acc, vu))

    return func


def _gemv_q4_avx512(k: int, n: int, dtype: str) -> tirx.PrimFunc:
    kw = k // NIBBLES_PER_WORD
    kg = k // GROUP_SIZE
    nv = kw // LANES
    # One row at a time streams best while x (k floats) stays in L1; for long rows, blocks of
    # rows share each load of x (Zen 5, 2 threads, weights streamed from DRAM: k = 2560 single
    # row ~42 GB/s = the copy bandwidth; k = 10240: 1 row 19, 2 rows 23, 4 rows 26, 8 rows 30).
    if k <= LONG_K:
        rb, vu = 1, 1
    else:
        rb, vu = _divisor(n, (LONG_ROWS, 4, 2)), _divisor(nv, (LONG_VEC_UNROLL, 2))
    f32 = "float32"
    v16 = f"float32x{LANES}"

    def lookup(words_u32, p: int):
        """float(q_p - 8) for nibble p of 16 words: vpermps over the table -8..7."""
        shifted = (
            words_u32 if p == 0 else T.shift_right(words_u32, T.Broadcast(T.uint32(4 * p), LANES))
        )
        table = T.Cast(v16, T.Ramp(T.int32(-8), T.int32(1), LANES))
        return T.call_llvm_pure_intrin(
            v16, "llvm.x86.avx512.permvar.sf.512", table, T.reinterpret(f"int32x{LANES}", shifted)
        )

    def lane_scale(sbuf, row, g0):
        """s[row, g0 + lane // 4] for the 16 lanes: 4 broadcasts and 3 blends."""
        lane = T.Ramp(T.int32(0), T.int32(1), LANES)
        value = T.Broadcast(T.Cast(f32, sbuf[row, g0 + GROUPS_PER_VEC - 1]), LANES)
        for g in range(GROUPS_PER_VEC - 2, -1, -1):
            value = T.Select(
                lane < T.Broadcast(T.int32((g + 1) * WORDS_PER_GROUP), LANES),
                T.Broadcast(T.Cast(f32, sbuf[row, g0 + g]), LANES),
                value,
            )
        return value

    def dot(wbuf, xpbuf, row, r, wd0):
        """sum over nibbles p of (q_p - 8) * x for the 16 words from wd0, one vector."""
        words = wbuf[row, T.Ramp(wd0, 1, LANES)]
        total = None
        for p in range(NIBBLES_PER_WORD):
            term = lookup(words, p) * xpbuf[r, p, T.Ramp(wd0, 1, LANES)]
            total = term if total is None else total + term
        return total

    @T.prim_func(private=True)
    def func(
        var_x: T.handle,
        w: T.Buffer((n, kw), "uint32"),
        s: T.Buffer((n, kg), dtype),
        var_y: T.handle,
    ):
        T.func_attr({"tir.noalias": True, "tir.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(var_x, (m, k), dtype)
        y = T.match_buffer(var_y, (m, n), dtype)
        xp = T.alloc_buffer((m, NIBBLES_PER_WORD, kw), f32)
        for r, wd in T.grid(m, kw):
            for p in range(NIBBLES_PER_WORD):
                xp[r, p, wd] = T.Cast(f32, x[r, wd * NIBBLES_PER_WORD + p])
        for jo in T.parallel(n // rb):
            acc = T.alloc_buffer((rb * vu * LANES,), f32)
            for r in range(m):
                for a in T.unroll(rb * vu):
                    acc[T.Ramp(a * LANES, 1, LANES)] = T.Broadcast(T.float32(0), LANES)
                for vo in range(nv // vu):
                    for u in T.unroll(vu):
                        for jj in T.unroll(rb):
                            acc[T.Ramp((jj * vu + u) * LANES, 1, LANES)] = acc[
                                T.Ramp((jj * vu + u) * LANES, 1, LANES)
                            ] + lane_scale(s, jo * rb + jj, (vo * vu + u) * GROUPS_PER_VEC) * dot(
                                w, xp, jo * rb + jj, r, (vo * vu + u) * LANES
                            )
                for jj in range(rb):
                    y[r, jo * rb + jj] = T.Cast(dtype, _sum_row(acc, jj, vu))

    return func


def gemv_f(k: int, n: int, dtype: str) -> tirx.PrimFunc:
    """y[m, n] = x[m, k] @ W[n, k]^T with float weights of `dtype`, m small (decode)."""
    if k % LANES != 0:
        raise ValueError(f"reduction size {k} is not a multiple of {LANES}")
    kv = k // LANES
    vu = _divisor(kv, (VEC_UNROLL, 2))
    rb = _divisor(n, (ROWS, 2))
    f32 = "float32"

    @T.prim_func(private=True)
    def func(var_x: T.handle, w: T.Buffer((n, k), dtype), var_y: T.handle):
        T.func_attr({"tir.noalias": True, "tir.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(var_x, (m, k), dtype)
        y = T.match_buffer(var_y, (m, n), dtype)
        for jo in T.parallel(n // rb):
            acc = T.alloc_buffer((vu, LANES), f32)
            for r, jj in T.grid(m, rb):
                for u in T.unroll(vu):
                    for e in T.vectorized(LANES):
                        acc[u, e] = T.float32(0)
                for vo in range(kv // vu):
                    for u in T.unroll(vu):
                        for e in T.vectorized(LANES):
                            acc[u, e] = acc[u, e] + T.Cast(
                                f32, w[jo * rb + jj, (vo * vu + u) * LANES + e]
                            ) * T.Cast(f32, x[r, (vo * vu + u) * LANES + e])
                y[r, jo * rb + jj] = T.Cast(dtype, _sum_all(acc, vu))

    return func
