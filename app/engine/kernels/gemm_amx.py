"""Prefill's 4-bit matmul on Intel AMX: y[m, n] = x[m, k] @ dequant(W[n, kp/8], S[n, kp/32])^T
(+ b) with int8 activations and the tile unit's int8 dot products (`tdpbssd`).

AMX multiplies a 16 x 64-byte tile of int8 by another into a 16 x 16 tile of int32 sums in a
few cycles: 16 x 16 x 32 products per 32-value group here, where AVX-512 VNNI's `vpdpbusd` does
64 per instruction. The layouts it needs are not the GEMV's, so this kernel is apart from
`gemv` and serves prefill only (decode stays in the VNNI GEMV, which streams one row of
weights at the memory's speed):

* x is quantized once per call, per row and group of 32, to int8 (scale max|x| / 127, rounded
  to nearest even, as the VNNI GEMV does), row-major: the A tile of a group is 16 rows of x's
  32 bytes of that group (stride kp), read in place;
* W is unpacked per tile of 16 output rows, once per call, into the B tiles' layout (per group,
  8 rows of 64 bytes: 4 consecutive weights of each of the 16 output rows, as signed bytes
  q - 8), with the rows' scales beside it as one float vector per group;
* per block of 16 rows of x and group: zero C, load A and B, `tdpbssd`, store C; then each row
  of C (16 output columns) adds float(C) * (w scales * its x scale) to a float accumulator held
  in registers across the groups (scales differ per group, so C cannot accumulate past one).
  Even and odd groups use two sets of tile registers, so that one group's tile product need
  not wait for the vector unit to read the one before (measured neutral against one set:
  0.93-1.11x at the 1B shapes; the float sums, ~4 vector instructions per row of C and group,
  are what bounds the kernel);
* the asymmetric modes (q * scale + min; q4f32_k's Q4_K too) keep the weight bytes q (0..15)
  and add min times the group's sum of the int8-rounded x, as the VNNI GEMV does;
* tiles of W run in parallel, each thread configuring the tile unit (`ldtilecfg`) at the start
  of its tile and releasing it at the end.

The integer sums are exact, so the result equals the dequantized weights times the int8-rounded
x up to float32 rounding; the float sums run in another order than the VNNI GEMV's, so a row's
bits differ from decode's (as on CPUs without int8 GEMVs, where prefill runs `gemm`), never
with the other rows of the call. The Linux kernel hands the tile registers only to a process
that asked (`amx.request_amx`), which `runtime.Model` does before running a library with AMX.
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
    add,
    asym_layout,
    asym_width,
    group_param,
    lane_tree,
    padded_k,
    x_group,
)

F32 = "float32"
TILE = 16  # rows of x and of W per tile (AMX's 16 tile rows; 16 int32 columns of C)
B_ROWS = GROUP_SIZE // 4  # a group's B tile: 8 rows of 4 bytes per output row
CFG_BYTES = 64  # the tile configuration ldtilecfg reads
# tile registers (C, A, B) of even and odd groups: two sets, so that a group's tdpbssd can run
# while the vector unit adds up the group before it
TILE_SETS = ((0, 1, 2), (3, 4, 5))


def _amx(name: str, *args):
    """A call of the AMX intrinsic llvm.x86.`name` (tile registers as immediates)."""
    return T.call_llvm_intrin("void", f"llvm.x86.{name}", *args)


def _spread(half, centered: bool):
    """4 nibbles (the low 16 bits of `half`) to 4 bytes: pdep puts nibble i in byte i; with
    `centered` each becomes the signed weight q - 8 (((b | 0x80) - 8) ^ 0x80 per byte subtracts
    8 with no borrow), else it stays q (0..15, as signed bytes too)."""
    b = T.call_llvm_pure_intrin("uint32", "llvm.x86.bmi.pdep.32", half,
                                T.uint32(0x0F0F0F0F))
    if not centered:
        return b
    return T.bitwise_xor(T.bitwise_or(b, T.uint32(0x80808080)) - T.uint32(0x08080808),
                         T.uint32(0x80808080))


def gemm_q4_amx_macro(k: int, n: int, dtype: str, bias: bool, asym=False):
    """The macro `(x, w, s, b, y, m)` of the AMX matmul over `gemv.gemv_prim_func`'s buffers
    (x [m, k], w [n, kp/8] uint32, s [n, kp/32] or the asymmetric parameters, b [n] or None,
    y [m, n]). `asym` (a `common.asym_layout`): weights q * scale + min, whose min meets each
    group's sum of the int8-rounded x (x scale * the int8 sum, as the VNNI GEMV's)."""
    kp = padded_k(k)
    kg = kp // GROUP_SIZE
    nt = -(-n // TILE)  # tiles of W (the last may be partial)
    has_min = bool(asym)  # `asym` may be the string Q4K: TVMScript's conditions want a bool
    v = f"{F32}x{LANES}"

    def xgroup(x, r, g, masked: bool):
        return x_group(x, r, g, k, masked)

    kfull = k // GROUP_SIZE  # groups wholly inside x

    @T.macro
    def quantize_group(x, xq, xs, xo, r, g, masked):
        sc = T.alloc_buffer((2,), F32)
        qv = T.alloc_buffer((GROUP_SIZE,), "int32")
        sc[0] = lane_tree(T.fabs(xgroup(x, r, g, masked)), GROUP_SIZE, T.max)
        sc[1] = T.Select(sc[0] > T.float32(0), T.float32(127) / sc[0], T.float32(0))
        xs[r, g] = sc[0] / T.float32(127)
        qv[T.Ramp(0, 1, GROUP_SIZE)] = T.Cast(
            f"int32x{GROUP_SIZE}",
            T.nearbyint(xgroup(x, r, g, masked) * T.Broadcast(sc[1], GROUP_SIZE)))
        xq[r, T.Ramp(g * GROUP_SIZE, 1, GROUP_SIZE)] = T.Cast(
            f"int8x{GROUP_SIZE}", qv[T.Ramp(0, 1, GROUP_SIZE)])
        if has_min:
            xo[r, g] = T.Cast(F32, lane_tree(qv[T.Ramp(0, 1, GROUP_SIZE)], GROUP_SIZE,
                                             add)) * xs[r, g]

    @T.macro
    def quantize(x, xq, xs, xo, m, mp):
        for r in T.parallel(mp):
            if r < m:
                for g in range(kfull):
                    quantize_group(x, xq, xs, xo, r, g, False)
                for g in range(kfull, kg):
                    quantize_group(x, xq, xs, xo, r, g, True)
            else:  # the last block's rows past m: zeros
                for g in range(kg):
                    xs[r, g] = T.float32(0)
                    if has_min:
                        xo[r, g] = T.float32(0)
                    xq[r, T.Ramp(g * GROUP_SIZE, 1, GROUP_SIZE)] = T.Broadcast(
                        T.int8(0), GROUP_SIZE)

    @T.macro
    def unpack(w, s, wb, ws, wm, tile):
        """Tile `tile` of W into B tiles wb [kg, 8, 16] (uint32: 4 signed bytes each) and its
        scales ws [kg, 16] (and mins wm); rows past n are zeros."""
        for i in range(TILE):
            row = tile * TILE + i
            if row < n:
                for g in range(kg):
                    if has_min:
                        ws[g, i] = group_param(s, row, g, 0, asym)
                        wm[g, i] = group_param(s, row, g, 1, asym)
                    else:
                        ws[g, i] = T.Cast(F32, s[row, g])
                    for j in T.unroll(WORDS_PER_GROUP):
                        word = w[row, g * WORDS_PER_GROUP + j]
                        wb[g, 2 * j, i] = _spread(T.bitwise_and(word, T.uint32(0xFFFF)),
                                                  not has_min)
                        wb[g, 2 * j + 1, i] = _spread(T.shift_right(word, T.uint32(16)),
                                                      not has_min)
            else:
                for g in range(kg):
                    ws[g, i] = T.float32(0)
                    if has_min:
                        wm[g, i] = T.float32(0)
                    for q in range(B_ROWS):
                        wb[g, q, i] = T.uint32(0)

    (c0, a0, b0), (c1, a1, b1) = TILE_SETS

    @T.macro
    def shape(cfg, tile, rows, width):
        """Tile register `tile`: `rows` rows of `width` bytes (the configuration's layout)."""
        cfg[16 + 2 * tile] = T.uint8(width)
        cfg[48 + tile] = T.uint8(rows)

    @T.macro
    def configure(cfg):
        """Palette 1; each set's C: 16 rows x 64 bytes, A: 16 x 32, B: 8 x 64."""
        for i in range(CFG_BYTES):
            cfg[i] = T.uint8(0)
        cfg[0] = T.uint8(1)
        shape(cfg, c0, TILE, 64)
        shape(cfg, a0, TILE, GROUP_SIZE)
        shape(cfg, b0, B_ROWS, 64)
        shape(cfg, c1, TILE, 64)
        shape(cfg, a1, TILE, GROUP_SIZE)
        shape(cfg, b1, B_ROWS, 64)
        T.evaluate(_amx("ldtilecfg", T.address_of(cfg[0])))

    @T.macro
    def group(xq, xs, xo, wb, ws, wm, cb, acc, r0, g, c, a, bt):
        T.evaluate(_amx("tilezero", T.int8(c)))
        T.evaluate(_amx("tileloadd64", T.int8(a),
                        T.address_of(xq[r0, g * GROUP_SIZE]), T.int64(kp)))
        T.evaluate(_amx("tileloadd64", T.int8(bt), T.address_of(wb[g, 0, 0]), T.int64(64)))
        T.evaluate(_amx("tdpbssd", T.int8(c), T.int8(a), T.int8(bt)))
        T.evaluate(_amx("tilestored64", T.int8(c), T.address_of(cb[0, 0]), T.int64(64)))
        for t in T.unroll(TILE):
            if has_min:
                acc[t, T.Ramp(0, 1, TILE)] = acc[t, T.Ramp(0, 1, TILE)] + T.Cast(
                    v, cb[t, T.Ramp(0, 1, TILE)]) * (
                    ws[g, T.Ramp(0, 1, TILE)] * T.Broadcast(xs[r0 + t, g], TILE)) + (
                    wm[g, T.Ramp(0, 1, TILE)] * T.Broadcast(xo[r0 + t, g], TILE))
            else:
                acc[t, T.Ramp(0, 1, TILE)] = acc[t, T.Ramp(0, 1, TILE)] + T.Cast(
                    v, cb[t, T.Ramp(0, 1, TILE)]) * (
                    ws[g, T.Ramp(0, 1, TILE)] * T.Broadcast(xs[r0 + t, g], TILE))

    @T.macro
    def store(b, y, acc, m, tile, r0):
        for t in range(TILE):
            if r0 + t < m:
                if (tile + 1) * TILE <= n:
                    if bias:
                        y[r0 + t, T.Ramp(tile * TILE, 1, TILE)] = T.Cast(
                            f"{dtype}x{TILE}",
                            acc[t, T.Ramp(0, 1, TILE)]
                            + T.Cast(v, b[T.Ramp(tile * TILE, 1, TILE)]))
                    else:
                        y[r0 + t, T.Ramp(tile * TILE, 1, TILE)] = T.Cast(
                            f"{dtype}x{TILE}", acc[t, T.Ramp(0, 1, TILE)])
                else:
                    for c in range(n - tile * TILE):
                        if bias:
                            y[r0 + t, tile * TILE + c] = T.Cast(
                                dtype, acc[t, c] + T.Cast(F32, b[tile * TILE + c]))
                        else:
                            y[r0 + t, tile * TILE + c] = T.Cast(dtype, acc[t, c])

    @T.macro
    def amx(x, w, s, b, y, m):
        mp = T.meta_var((m + TILE - 1) // TILE * TILE)
        xq = T.alloc_buffer((mp, kp), "int8")
        xs = T.alloc_buffer((mp, kg), F32)
        xo = T.alloc_buffer((mp, kg), F32) if has_min else T.meta_var(None)
        quantize(x, xq, xs, xo, m, mp)
        for tile in T.parallel(nt):
            cfg = T.alloc_buffer((CFG_BYTES,), "uint8")
            wb = T.alloc_buffer((kg, B_ROWS, TILE), "uint32")
            ws = T.alloc_buffer((kg, TILE), F32)
            wm = T.alloc_buffer((kg, TILE), F32) if has_min else T.meta_var(None)
            cb0 = T.alloc_buffer((TILE, TILE), "int32")
            cb1 = T.alloc_buffer((TILE, TILE), "int32")
            acc = T.alloc_buffer((TILE, TILE), F32)
            configure(cfg)
            unpack(w, s, wb, ws, wm, tile)
            for rb in range(mp // TILE):
                for t in T.unroll(TILE):
                    acc[t, T.Ramp(0, 1, TILE)] = T.Broadcast(T.float32(0), TILE)
                # groups in pairs on the two tile sets; the float sums stay in group order
                for g2 in range(kg // 2):
                    group(xq, xs, xo, wb, ws, wm, cb0, acc, rb * TILE, 2 * g2, c0, a0, b0)
                    group(xq, xs, xo, wb, ws, wm, cb1, acc, rb * TILE, 2 * g2 + 1, c1, a1, b1)
                if kg % 2 == 1:
                    group(xq, xs, xo, wb, ws, wm, cb0, acc, rb * TILE, kg - 1, c0, a0, b0)
                store(b, y, acc, m, tile, rb * TILE)
            T.evaluate(_amx("tilerelease"))

    return amx


@functools.cache  # parsing the TVMScript is most of a model's export time
def gemm_q4_amx(k: int, n: int, dtype: str, bias: bool = False, asym: bool = False,
                scale_dtype: str | None = None) -> tirx.PrimFunc:
    """y[m, n] = x[m, k] @ dequant(W, S)^T (+ b) on AMX for the 4-bit modes' weights (W [n,
    kp/8] nibbles): (q - 8) * S with S [n, kp/32] of `scale_dtype` (default `dtype`), or with
    `asym` q * scale + min, S as `gemv.gemv_q4` takes it (float16 pairs, or q4f32_k's Q4_K
    super-block bytes); the target must have AMX-INT8 (`common.has_amx`)."""
    from localchat.engine.kernels.gemv import gemv_prim_func

    kw, kg = padded_k(k) // NIBBLES_PER_WORD, padded_k(k) // GROUP_SIZE
    if asym:
        asym = asym_layout(scale_dtype)
        ks, sdt = asym_width(asym, kg), scale_dtype or "float16"
    else:
        ks, sdt = kg, scale_dtype or dtype
    body = gemm_q4_amx_macro(k, n, dtype, bias, asym)
    return gemv_prim_func(body, k, n, dtype, ((n, kw), "uint32"), ((n, ks), sdt), bias)
