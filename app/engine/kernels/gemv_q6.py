"""The GEMV for weights held in Q6_K (`build.q6_k`): y[m, n] = x[m, k] @ W[n, k]^T, for the
LM head and a Q4_K_M file's Q6_K attn_v / ffn_down (q4f32_k), decode and prefill.

The head is a few rows of x against the largest matrix of a small model (a 3B Llama's is 394M
weights), so it runs at the speed its bytes stream from memory: Q6_K's 6.56 bits a weight read
23% fewer bytes than the 8-bit head, and hold llama.cpp's Q6_K head exactly.

A super-block (256 weights) is three 64-byte loads (`build.q6_k`'s layout): two of low nibbles,
one of high bit pairs; masks and shifts make four vectors of 64 codes (0..63) as bytes, lane e
(4 bytes) of each belonging to sub-block e. x is quantized once per call to int8 per group of
32 (scale max |x| / 127, as the other int8 GEMVs), laid out to match: word v * 16 + e of a
super-block holds the 4 values of quad v of sub-block e. With VNNI, `vpdpbusd` multiplies the
unsigned codes by the signed x (AVX2: pmaddubsw + pmaddwd, the same integers), each lane
starting from -32 times its sub-block's x sum, so after four a lane holds sum (q - 32) x of its
16 weights exactly; it is converted once and multiplied by d * sc times x's group scale. Without
an int8 ISA the same loop runs in float: x permuted the same way (float), each code byte
converted and multiplied, the -32 applied through the sub-block's float x sum.

Rows of x run inside in blocks of 8 sharing the unpacked vectors and the scales; with many rows
(prefill) a block of x meets a tile of rows of W before the next block, and a reduction longer
than 2,048 is walked in chunks of 8 super-blocks (the block's int8 x for a chunk fits L1), each
row's accumulators carried between chunks. A row's operations, and their order, are the same
whatever the block, tile or chunk, so a sequence's results do not depend on the batch.
"""

from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

from localchat.engine.build.q6_k import CODE_BYTES, SUB, SUBS, SUPER, param_width
from localchat.engine.kernels.common import (
    INT8_ISAS,
    LANES,
    LONG_ROW_BYTES,
    add,
    divisor,
    f16_bytes,
    lane_tree,
    prefetch_ahead,
    row_prefetch,
)
from localchat.engine.kernels.gemv import (
    TILE_ROWS,
    _dpbusd,
    _madd_pairs,
    _maddubs,
    _many_rows,
    _store_macro,
    gemv_prim_func,
)

F32 = "float32"
I32 = "int32"
ROWS = 8  # rows of x sharing each unpacked super-block
GROUP = 32  # values of x sharing one int8 scale
QUADS = 4  # 4-code quads per sub-block: the four vectors of a super-block
CHUNK_SUPERS = 8  # super-blocks per chunk of a long reduction (2,048 values of x: 16 KB of int8
# x for a block of 8 rows, in L1)
U32 = f"uint32x{LANES}"
V32 = f"float32x{LANES}"


def _bcast_u32(value: int):
    return T.Broadcast(T.uint32(value), LANES)


def _codes(w, row, sb, v: int):
    """Vector v (0..3) of super-block sb of row `row`: 64 codes as bytes in 16 uint32 lanes."""
    base = sb * CODE_BYTES

    def load(offset: int):
        return T.reinterpret(U32, w[row, T.Ramp(base + offset, 1, 4 * LANES)])

    nibbles = load(64 * (v // 2))
    if v % 2 == 1:
        nibbles = T.shift_right(nibbles, _bcast_u32(4))
    low = T.bitwise_and(nibbles, _bcast_u32(0x0F0F0F0F))
    high = T.bitwise_and(T.shift_right(load(128), _bcast_u32(2 * v)), _bcast_u32(0x03030303))
    return T.bitwise_or(low, T.shift_left(high, _bcast_u32(4)))


def _step(s, row, k: int, sb):
    """d * sc of super-block sb's 16 sub-blocks, one per lane (exact in float32); d is the
    float16 after the row's sc bytes."""
    sc = T.Cast(V32, T.reinterpret(f"int8x{LANES}", s[row, T.Ramp(sb * SUBS, 1, SUBS)]))
    return sc * T.Broadcast(f16_bytes(s, row, k // SUB + 2 * sb), LANES)


def q6_gemv_macro(k: int, n: int, dtype: str, bias: bool, isa: bool | str):
    """The macro `(x, w, s, b, y, m)` over x [m, k], codes w [n, 3k/4] uint8, parameters
    s [n, k/16 + k/128] uint8, b [n] (None without `bias`) and y [m, n]; `isa` "vnni" or "avx2"
    for the int8 forms, anything else for float arithmetic."""
    nsb = k // SUPER
    int8 = isa in INT8_ISAS
    nr = divisor(n, (TILE_ROWS, 32, 16, 8, 4, 2))  # rows of W per tile when x has many rows
    store = _store_macro(dtype, bias)
    cw = nsb * CODE_BYTES  # code bytes of a row
    spread = cw > LONG_ROW_BYTES  # decode: prefetches spread over a long row (as the 4-bit GEMV)

    @T.macro
    def prep_int8(x, xq, xe, xo, r):
        sc = T.alloc_buffer((2,), F32)
        qv = T.alloc_buffer((GROUP,), I32)
        for g in range(k // GROUP):
            xv = T.Cast(f"float32x{GROUP}", x[r, T.Ramp(g * GROUP, 1, GROUP)])
            sc[0] = lane_tree(T.fabs(xv), GROUP, T.max)
            sc[1] = T.Select(sc[0] > T.float32(0), T.float32(127) / sc[0], T.float32(0))
            qv[T.Ramp(0, 1, GROUP)] = T.Cast(
                f"int32x{GROUP}", T.nearbyint(xv * T.Broadcast(sc[1], GROUP)))
            for h in range(GROUP // SUB):
                sub = g * (GROUP // SUB) + h  # sub-block index along the row
                at = (sub // SUBS) * SUBS * QUADS + sub % SUBS
                xe[r, sub] = sc[0] / T.float32(127)
                xo[r, sub] = T.int32(-32) * lane_tree(qv[T.Ramp(h * SUB, 1, SUB)], SUB, add)
                xq[r, T.Ramp(at, SUBS, QUADS)] = T.reinterpret(
                    f"int32x{QUADS}", T.Cast(f"int8x{SUB}", qv[T.Ramp(h * SUB, 1, SUB)]))

    @T.macro
    def prep_float(x, xp, xs, r):
        for sub in range(k // SUB):
            base = (sub // SUBS) * SUPER + sub % SUBS
            xs[r, sub] = lane_tree(T.Cast(V32, x[r, T.Ramp(sub * SUB, 1, SUB)]), SUB, add)
            for t in range(SUB):  # code t = 4 v + b of the sub-block: at v * 64 + b * 16 + e
                xp[r, base + (t // QUADS) * QUADS * SUBS + (t % QUADS) * SUBS] = T.Cast(
                    F32, x[r, sub * SUB + t])

    def int8_dot(acc, codes, xq, r, sb, v: int):
        xw = xq[r, T.Ramp(sb * SUBS * QUADS + v * SUBS, 1, SUBS)]
        if isa == "avx2":
            return acc + _madd_pairs(_maddubs(codes, xw, LANES), LANES)
        return _dpbusd(acc, codes, xw, LANES)

    def float_dot(wv, xp, r, sb):
        """sum over a sub-block's 16 codes of q * x, one sub-block per lane (float)."""
        total = None
        for v in range(QUADS):
            for byte in range(4):
                q = T.Cast(V32, T.bitwise_and(
                    T.shift_right(wv[T.Ramp(v * LANES, 1, LANES)], _bcast_u32(8 * byte)),
                    _bcast_u32(0xFF)))
                term = q * xp[r, T.Ramp(sb * SUPER + v * QUADS * SUBS + byte * SUBS, 1, SUBS)]
                total = term if total is None else total + term
        return total

    @T.macro
    def accumulate(w, s, xq, xe, xo, f, base, row, r0, nrows, sb0, sb1, pf):
        """Super-blocks sb0 .. sb1 - 1 of W's row `row` times x's rows r0 .. r0 + nrows - 1,
        added to their 16-lane accumulators f[base + rr * 16 ...] in super-block order; `pf`
        (decode, long rows): each super-block prefetches the lines `PREFETCH_AHEAD` bytes past
        its codes."""
        wv = T.alloc_buffer((QUADS * LANES,), "uint32")
        ws = T.alloc_buffer((LANES,), F32)
        if pf:
            wf = T.decl_buffer((n * cw,), "uint8", data=w.data, elem_offset=w.elem_offset)
        for sb in range(sb0, sb1):
            if pf:
                for line in T.unroll(CODE_BYTES // 64):
                    prefetch_ahead(wf, row * cw + sb * CODE_BYTES + line * 64, n * cw, 1)
            # (the vector index picks masks and shifts: Python constants, so four stores)
            wv[T.Ramp(0, 1, LANES)] = _codes(w, row, sb, 0)
            wv[T.Ramp(LANES, 1, LANES)] = _codes(w, row, sb, 1)
            wv[T.Ramp(2 * LANES, 1, LANES)] = _codes(w, row, sb, 2)
            wv[T.Ramp(3 * LANES, 1, LANES)] = _codes(w, row, sb, 3)
            ws[T.Ramp(0, 1, LANES)] = _step(s, row, k, sb)
            for rr in T.unroll(nrows):
                if int8:
                    f[T.Ramp(base + rr * LANES, 1, LANES)] = f[
                        T.Ramp(base + rr * LANES, 1, LANES)] + T.Cast(
                        V32,
                        int8_dot(int8_dot(int8_dot(int8_dot(
                            xo[r0 + rr, T.Ramp(sb * SUBS, 1, SUBS)],
                            wv[T.Ramp(0, 1, LANES)], xq, r0 + rr, sb, 0),
                            wv[T.Ramp(LANES, 1, LANES)], xq, r0 + rr, sb, 1),
                            wv[T.Ramp(2 * LANES, 1, LANES)], xq, r0 + rr, sb, 2),
                            wv[T.Ramp(3 * LANES, 1, LANES)], xq, r0 + rr, sb, 3),
                    ) * (ws[T.Ramp(0, 1, LANES)] * xe[r0 + rr, T.Ramp(sb * SUBS, 1, SUBS)])
                else:
                    f[T.Ramp(base + rr * LANES, 1, LANES)] = f[
                        T.Ramp(base + rr * LANES, 1, LANES)] + (
                        float_dot(wv, xq, r0 + rr, sb)
                        - T.Broadcast(T.float32(32), LANES)
                        * xe[r0 + rr, T.Ramp(sb * SUBS, 1, SUBS)]
                    ) * ws[T.Ramp(0, 1, LANES)]

    @T.macro
    def block(w, s, b, y, xq, xe, xo, row, r0, nrows, pf):
        f = T.alloc_buffer((nrows * LANES,), F32)
        for a in T.unroll(nrows):
            f[T.Ramp(a * LANES, 1, LANES)] = T.Broadcast(T.float32(0), LANES)
        accumulate(w, s, xq, xe, xo, f, 0, row, r0, nrows, 0, nsb, pf)
        for rr in range(nrows):
            store(y, b, r0 + rr, row, lane_tree(f[T.Ramp(rr * LANES, 1, LANES)], LANES, add))

    @T.macro
    def chunked_block(w, s, b, y, xq, xe, xo, tile, r0):
        """A block of `ROWS` rows of x against a tile of `nr` rows of W when the reduction is
        long: walked in chunks of `CHUNK_SUPERS` super-blocks (the block's x for one chunk
        fits L1), each row of W's accumulators carried between chunks; the same operations,
        in the same order, as `block`'s."""
        acc = T.alloc_buffer((nr * ROWS * LANES,), F32)
        for a in range(nr * ROWS):
            acc[T.Ramp(a * LANES, 1, LANES)] = T.Broadcast(T.float32(0), LANES)
        for c in range(nsb // CHUNK_SUPERS):
            for rr in range(nr):
                accumulate(w, s, xq, xe, xo, acc, rr * ROWS * LANES, tile * nr + rr, r0, ROWS,
                           c * CHUNK_SUPERS, c * CHUNK_SUPERS + CHUNK_SUPERS, False)
        if nsb % CHUNK_SUPERS != 0:
            for rr in range(nr):
                accumulate(w, s, xq, xe, xo, acc, rr * ROWS * LANES, tile * nr + rr, r0, ROWS,
                           nsb - nsb % CHUNK_SUPERS, nsb, False)
        for rr in range(nr):
            for a in range(ROWS):
                store(y, b, r0 + a, tile * nr + rr,
                      lane_tree(acc[T.Ramp((rr * ROWS + a) * LANES, 1, LANES)], LANES, add))

    @T.macro
    def tail_rows(w, s, b, y, xq, xe, xo, row, m, pf):
        """The rows of x after the whole blocks of `ROWS`, in blocks of 4, 2 and 1."""
        if m % ROWS >= 4:
            block(w, s, b, y, xq, xe, xo, row, m - m % ROWS, 4, pf)
        if m % 4 >= 2:
            block(w, s, b, y, xq, xe, xo, row, m - m % 4, 2, pf)
        if m % 2 == 1:
            block(w, s, b, y, xq, xe, xo, row, m - 1, 1, pf)

    ahead = row_prefetch(n, cw, 1)  # decode: W's rows ahead (rows up to LONG_ROW_BYTES)

    @T.macro
    def body(x, w, s, b, y, m):
        # int8: xq holds x's int8 words, xe its scales and xo -32 times its sums per
        # sub-block; float: xq holds x permuted, xe its sums (xo unused)
        xq = T.alloc_buffer((m, k // 4 if int8 else k), I32 if int8 else F32)
        xe = T.alloc_buffer((m, k // SUB), F32)
        xo = T.alloc_buffer((m, k // SUB), I32)
        if _many_rows(m):
            for r in T.parallel(m):
                if int8:
                    prep_int8(x, xq, xe, xo, r)
                else:
                    prep_float(x, xq, xe, r)
        else:
            for r in range(m):
                if int8:
                    prep_int8(x, xq, xe, xo, r)
                else:
                    prep_float(x, xq, xe, r)
        if m > ROWS:
            # many rows (prefill through a Q6_K matrix): a block of x meets a tile of rows of W
            # before the next block, so it is read from L1; a row's operations are unchanged
            for tile in T.parallel(n // nr):
                for rb in range(m // ROWS):
                    if nsb > CHUNK_SUPERS:
                        chunked_block(w, s, b, y, xq, xe, xo, tile, rb * ROWS)
                    else:
                        for rr in range(nr):
                            block(w, s, b, y, xq, xe, xo, tile * nr + rr, rb * ROWS, ROWS,
                                  False)
                for rr in range(nr):
                    tail_rows(w, s, b, y, xq, xe, xo, tile * nr + rr, m, False)
        else:
            for row in T.parallel(n):
                if not spread:
                    ahead(w, row)
                for rb in range(m // ROWS):
                    block(w, s, b, y, xq, xe, xo, row, rb * ROWS, ROWS, spread)
                tail_rows(w, s, b, y, xq, xe, xo, row, m, spread)

    return body


@functools.cache
def gemv_q6_k(k: int, n: int, dtype: str, isa: bool | str = False,
              bias: bool = False) -> tirx.PrimFunc:
    """y[m, n] = x[m, k] @ W^T (+ b) for W [n, k] in Q6_K (`build.q6_k`: codes [n, 3k/4],
    parameters [n, k/16 + k/128], both uint8; k a multiple of 256); `isa`: `common.gemv_isa`'s
    value ("vnni" / "avx2": int8 activations)."""
    body = q6_gemv_macro(k, n, dtype, bias, isa)
    return gemv_prim_func(body, k, n, dtype, ((n, k // SUPER * CODE_BYTES), "uint8"),
                          ((n, param_width(k)), "uint8"), bias)
