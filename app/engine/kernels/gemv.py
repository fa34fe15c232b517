"""The decode GEMV on the CPU: y[m, n] = x[m, k] @ W[n, k]^T (+ b) for a few rows of x.

Decode reads every weight once per token, so it runs at the speed weights stream from memory only
if unpacking costs less than loading. `matmul` dequantizes a block of rows into a float scratch
buffer and then multiplies: right for prefill (the buffer serves many rows of x), but for one row
the unpacking dominates. Here the weights are consumed in registers, in the same storage formats
(`quantization`: 4-bit nibbles, 8 per uint32 word, value (q - 8) * scale, one scale per 32 values
along k; or float weights of the activation dtype):

* x is first transposed into xp[r, p, w] = x[r, 8 w + p] (`common.transpose_x`; once per call),
* a work item is a few rows of W; for each row, 16 consecutive words (128 weights, 4 groups) are
  one vector: for each nibble position p, t += float((words >> 4p) & 15) * xp[r, p, words] —
  contiguous loads, immediate shifts, no gathers; then t - 8 xs (xs: the per-word sums of x) is
  multiplied lane-wise by the scales of those 4 groups and accumulated. With AVX-512 the nibble
  is unpacked by a 16-entry table lookup of q - 8 instead (vpermps reads only the low 4 bits of
  each index): 3 instructions per 16 weights instead of 4,
* a reduction that is not a multiple of 128 ends with a narrower vector of the remaining words,
* a reduction that is not a multiple of 32 is stored padded to whole groups with zero weights
  (`quantization`); xp is zero past k, so the padding adds nothing and the loops are the same,
* parallel over work items; rows of x (the batch) loop inside, so a work item's weights are read
  from memory once per call.

This is the one decode GEMV: RWKV's decode calls `gemv_q4` / `gemv_f` directly, and the Llama
family's `matmul.linear_q4` runs `gemv_q4_macro` when a call has one row of x. Float weights: the
same shape without the unpacking (16-lane loads of W and x, fp32 accumulation).
"""

from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

from localchat.engine.kernels.common import (
    GROUP_SIZE,
    LANES,
    NIBBLES_PER_WORD,
    WORDS_PER_GROUP,
    divisor,
    padded_k,
    scheduled,
    transpose_x,
)

GROUPS_PER_VEC = LANES // WORDS_PER_GROUP  # 4 groups in one vector of 16 words
ROWS = 4  # rows of W per work item (generic kernel)
VEC_UNROLL = 4  # word vectors of one row in flight (independent FMA chains)
LONG_K = 4096  # beyond this reduction size the AVX-512 kernel shares x between rows
LONG_ROWS = 8  # rows sharing each load of x when k > LONG_K
LONG_VEC_UNROLL = 1  # word vectors in flight per row when k > LONG_K
F32 = "float32"


def _nibble_dot(w, xp, row, r, word, centered: bool = False):
    """sum over the 8 nibbles q_p of w[row, word] of q_p * x[r, 8 word + p] (or of (q_p - 8) * x
    when `centered`), as one expression so the products chain in registers."""
    total = None
    for p in range(NIBBLES_PER_WORD):
        q = T.Cast(F32, T.bitwise_and(T.shift_right(w[row, word], T.uint32(p * 4)), T.uint32(15)))
        if centered:
            q = q - T.float32(8)
        term = q * xp[r, p, word]
        total = term if total is None else total + term
    return total


def _lane_scale(s, row, group0, e, groups: int = GROUPS_PER_VEC):
    """The scale of lane e's group, s[row, group0 + e // 4], as a select over the `groups` groups
    of a vector, so the vectorizer emits broadcasts and blends instead of a gather."""
    value = T.Cast(F32, s[row, group0 + groups - 1])
    for g in range(groups - 2, -1, -1):
        value = T.Select(e < (g + 1) * WORDS_PER_GROUP, T.Cast(F32, s[row, group0 + g]), value)
    return value


def _sum_lanes(acc, vecs: int, first: int = 0):
    """The sum of `vecs` * 16 lanes of the flat accumulator `acc`, from vector `first`."""
    total = None
    for a in range(vecs):
        for e in range(LANES):
            value = acc[(first + a) * LANES + e]
            total = value if total is None else total + value
    return total


def gemv_q4_macro(k: int, n: int, dtype: str, bias: bool, avx512: bool = False):
    """The 4-bit GEMV as a macro `(x, w, s, b, y, m)` over buffers x [m, k], w [n, kp/8] uint32,
    s [n, kp/32] (kp = `padded_k(k)`), b [n] (None without `bias`) and y [m, n], for use inside
    other kernels."""
    kw = padded_k(k) // NIBBLES_PER_WORD
    nv = kw // LANES  # full vectors of 16 words per row
    tw = kw % LANES  # words of the last, narrower vector (a multiple of 4)
    if avx512 and k > LONG_K:
        # One row at a time streams best while x (k floats) stays in L1; for long rows, blocks
        # of rows share each load of x (Zen 5, 2 threads, weights streamed from DRAM: k = 2560
        # single row ~42 GB/s = the copy bandwidth; k = 10240: 1 row 19, 2 rows 23, 4 rows 26,
        # 8 rows 30).
        rb, vu = divisor(n, (LONG_ROWS, 4, 2)), divisor(nv, (LONG_VEC_UNROLL, 2))
    elif avx512:
        rb, vu = 1, 1
    else:
        rb, vu = divisor(n, (ROWS, 2)), divisor(nv, (VEC_UNROLL, 2))
    prepare = transpose_x(k, with_sums=not avx512)
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

    def vec_scale(s, row, g0):
        """s[row, g0 + lane // 4] for the 16 lanes: 4 broadcasts and 3 blends."""
        lane = T.Ramp(T.int32(0), T.int32(1), LANES)
        value = T.Broadcast(T.Cast(F32, s[row, g0 + GROUPS_PER_VEC - 1]), LANES)
        for g in range(GROUPS_PER_VEC - 2, -1, -1):
            value = T.Select(
                lane < T.Broadcast(T.int32((g + 1) * WORDS_PER_GROUP), LANES),
                T.Broadcast(T.Cast(F32, s[row, g0 + g]), LANES),
                value,
            )
        return value

    def vec_dot(w, xp, row, r, wd0):
        """sum over nibbles p of (q_p - 8) * x for the 16 words from wd0, one vector."""
        words = w[row, T.Ramp(wd0, 1, LANES)]
        total = None
        for p in range(NIBBLES_PER_WORD):
            term = lookup(words, p) * xp[r, p, T.Ramp(wd0, 1, LANES)]
            total = term if total is None else total + term
        return total

    @T.macro
    def store(y, b, r, row, total):
        if bias:
            y[r, row] = T.Cast(dtype, total + T.Cast(F32, b[row]))
        else:
            y[r, row] = T.Cast(dtype, total)

    @T.macro
    def generic(x, w, s, b, y, m):
        xp = T.alloc_buffer((m, NIBBLES_PER_WORD, kw), F32)
        xs = T.alloc_buffer((m, kw), F32)
        prepare(x, xp, xs, m)
        for jo in T.parallel(n // rb):
            acc = T.alloc_buffer((vu * LANES,), F32)
            for r, jj in T.grid(m, rb):
                for u in T.unroll(vu):
                    for e in T.vectorized(LANES):
                        acc[u * LANES + e] = T.float32(0)
                for vo in range(nv // vu):
                    for u in T.unroll(vu):
                        for e in T.vectorized(LANES):
                            acc[u * LANES + e] = acc[u * LANES + e] + _lane_scale(
                                s, jo * rb + jj, (vo * vu + u) * GROUPS_PER_VEC, e
                            ) * (
                                _nibble_dot(w, xp, jo * rb + jj, r, (vo * vu + u) * LANES + e)
                                - T.float32(8) * xs[r, (vo * vu + u) * LANES + e]
                            )
                if tw > 0:
                    for e in T.vectorized(tw):
                        acc[e] = acc[e] + _lane_scale(
                            s, jo * rb + jj, nv * GROUPS_PER_VEC, e, tw // WORDS_PER_GROUP
                        ) * (
                            _nibble_dot(w, xp, jo * rb + jj, r, nv * LANES + e)
                            - T.float32(8) * xs[r, nv * LANES + e]
                        )
                store(y, b, r, jo * rb + jj, _sum_lanes(acc, vu))

    @T.macro
    def table(x, w, s, b, y, m):
        xp = T.alloc_buffer((m, NIBBLES_PER_WORD, kw), F32)
        prepare(x, xp, None, m)
        for jo in T.parallel(n // rb):
            acc = T.alloc_buffer((rb * vu * LANES,), F32)
            for r in range(m):
                for a in T.unroll(rb * vu):
                    acc[T.Ramp(a * LANES, 1, LANES)] = T.Broadcast(T.float32(0), LANES)
                for vo in range(nv // vu):
                    for u in T.unroll(vu):
                        for jj in T.unroll(rb):
                            acc[T.Ramp((jj * vu + u) * LANES, 1, LANES)] = acc[
                                T.Ramp((jj * vu + u) * LANES, 1, LANES)
                            ] + vec_scale(
                                s, jo * rb + jj, (vo * vu + u) * GROUPS_PER_VEC
                            ) * vec_dot(w, xp, jo * rb + jj, r, (vo * vu + u) * LANES)
                if tw > 0:
                    for jj in T.unroll(rb):
                        for e in T.vectorized(tw):
                            acc[jj * vu * LANES + e] = acc[jj * vu * LANES + e] + _lane_scale(
                                s, jo * rb + jj, nv * GROUPS_PER_VEC, e, tw // WORDS_PER_GROUP
                            ) * _nibble_dot(w, xp, jo * rb + jj, r, nv * LANES + e, centered=True)
                for jj in range(rb):
                    store(y, b, r, jo * rb + jj, _sum_lanes(acc, vu, jj * vu))

    return table if avx512 else generic


@functools.cache  # parsing the TVMScript is most of a model's export time
def gemv_q4(k: int, n: int, dtype: str, avx512: bool = False, bias: bool = False) -> tirx.PrimFunc:
    """y[m, n] = x[m, k] @ dequant(W[n, kp/8], S[n, kp/32])^T (+ b), m small (decode); kp =
    `padded_k(k)`, the stored width (columns past k are zero weights).

    `avx512`: unpack with a table lookup (the target must have AVX-512F; `common.has_avx512`).
    One row (single-sequence decode) has its own copy of the body with m = 1 known: with
    no-alias buffers LLVM schedules the short-k loops of the dynamic-m body ~1.4x slower
    (k = 512: 34 vs 24 us, Zen 4, 2 threads)."""
    body = gemv_q4_macro(k, n, dtype, bias, avx512)
    kw, kg = padded_k(k) // NIBBLES_PER_WORD, padded_k(k) // GROUP_SIZE

    if bias:

        @T.prim_func(private=True)
        def func(
            var_x: T.handle,
            w: T.Buffer((n, kw), "uint32"),
            s: T.Buffer((n, kg), dtype),
            b: T.Buffer((n,), dtype),
            var_y: T.handle,
        ):
            m = T.int64()
            x = T.match_buffer(var_x, (m, k), dtype)
            y = T.match_buffer(var_y, (m, n), dtype)
            if m == 1:
                body(x, w, s, b, y, 1)
            else:
                body(x, w, s, b, y, m)

    else:

        @T.prim_func(private=True)
        def func(
            var_x: T.handle,
            w: T.Buffer((n, kw), "uint32"),
            s: T.Buffer((n, kg), dtype),
            var_y: T.handle,
        ):
            m = T.int64()
            x = T.match_buffer(var_x, (m, k), dtype)
            y = T.match_buffer(var_y, (m, n), dtype)
            if m == 1:
                body(x, w, s, None, y, 1)
            else:
                body(x, w, s, None, y, m)

    return scheduled(func)


@functools.cache  # parsing the TVMScript is most of a model's export time
def gemv_f(k: int, n: int, dtype: str) -> tirx.PrimFunc:
    """y[m, n] = x[m, k] @ W[n, k]^T with float weights of `dtype`, m small (decode); a k that
    is not a multiple of 16 ends with a scalar tail."""
    kv = k // LANES
    kt = k % LANES  # the tail (0 for every common shape: no code for it then)
    vu = divisor(kv, (VEC_UNROLL, 2))
    rb = divisor(n, (ROWS, 2))

    @T.prim_func(private=True)
    def func(var_x: T.handle, w: T.Buffer((n, k), dtype), var_y: T.handle):
        m = T.int64()
        x = T.match_buffer(var_x, (m, k), dtype)
        y = T.match_buffer(var_y, (m, n), dtype)
        for jo in T.parallel(n // rb):
            acc = T.alloc_buffer((vu * LANES,), F32)
            for r, jj in T.grid(m, rb):
                for u in T.unroll(vu):
                    for e in T.vectorized(LANES):
                        acc[u * LANES + e] = T.float32(0)
                for vo in range(kv // vu):
                    for u in T.unroll(vu):
                        for e in T.vectorized(LANES):
                            acc[u * LANES + e] = acc[u * LANES + e] + T.Cast(
                                F32, w[jo * rb + jj, (vo * vu + u) * LANES + e]
                            ) * T.Cast(F32, x[r, (vo * vu + u) * LANES + e])
                if kt > 0:
                    for e in range(kt):
                        acc[e] = acc[e] + T.Cast(F32, w[jo * rb + jj, kv * LANES + e]) * T.Cast(
                            F32, x[r, kv * LANES + e]
                        )
                y[r, jo * rb + jj] = T.Cast(dtype, _sum_lanes(acc, vu))

    return scheduled(func)
