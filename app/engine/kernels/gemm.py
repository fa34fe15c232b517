"""A register-blocked outer-product GEMM for the CPU: prefill and encoder linear layers.

Y[m, n] = X[m, k] @ W[n, k]^T (+ b), W "NT" (row-major [n, k]) in float32/float16 or in the 4-bit
group layouts of `build.quantization`. The scheme is BLIS's: the work is split into tasks of
(a chunk of X's rows, at most MC; the chunks about equal) x (NB rows of W), run in parallel; a
task walks K in blocks of KC and, per block,

* packs its W block K-major, [NB / NR, KC, NR] float32 (dequantizing 4-bit weights on the way),
  so the NR outputs of a micro-panel are one contiguous vector per k;
* reads its X rows in place when they are float32 (the MR rows a micro-kernel walks, MR x KC
  floats, stay in L1), or converts them once per block into a float32 scratch [MC, KC];
* runs the micro-kernel: MR rows x NR columns of accumulators (6 x 16 floats: 12 ymm registers
  with AVX2, 6 zmm with AVX-512; `wide`, for AVX-512, two micro-panels at once: 12 zmm) held in
  registers across the block, each k one broadcast of x[i, k] per row and one FMA per
  accumulator vector. The accumulators live in a float32 scratch
  C [MC, NB] between K blocks (a store and a reload are exact).

Bit-identical rows whatever m is: every output y[i, j] is one float32 accumulator that starts at
0 and takes x[i, k] * w[j, k] for k = 0, 1, ..., K-1 in that order (the K blocks split the same
chain; nothing is ever summed across lanes), then adds the bias. Rows that do not fill a tile of
MR run together in a smaller tile, each the same chain, so where a row lands (which task, which
tile, a tail or not) changes nothing in its bits. Columns past n in the last W block are packed
as zeros and never written back.

All tile sizes are compile-time constants, independent of m and, but for `wide`, of the target:
on AVX-512 the 16-float vector is one zmm, on AVX2 two ymm (the LLVM output is checked for
vfmadd on ymm/zmm and for no gathers in tests/test_gemm_cpu.py).
"""

from __future__ import annotations

import functools

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from localchat.engine.kernels.common import (
    GROUP_SIZE,
    NIBBLES_PER_WORD,
    asym_layout,
    asym_width,
    group_param,
    padded_k,
    scheduled,
)

F32 = "float32"
MR = 6  # rows of X per micro-kernel
NR = 16  # columns (rows of W) per micro-kernel: one float32 vector of 16 lanes
NB = 64  # columns per task: NB / NR micro-panels, packed together per K block
MC = 80 * MR  # most rows of X per task (a multiple of MR): one packed W block serves them all
assert MR == 6, "gemm's tail macro has one branch per tail size 1..MR-1"
# With AVX-512's 32 registers a micro-kernel spans two micro-panels: 12 accumulators, enough
# independent FMA chains to cover the FMA latency (6 leave a quarter of the issue slots idle);
# AVX2's 6 x 16 tile is already 12 ymm of its 16 registers. Each output is the same chain.
WIDE_SPAN = 2
KC = 256  # reduction block: a packed micro-panel (KC x NR) stays in L1 across the row tiles


@functools.cache  # parsing the TVMScript is most of a model's export time
def gemm_f(k: int, n: int, dtype: str, bias: bool, wide: bool = False) -> tirx.PrimFunc:
    """Y[m, n] = X[m, k] @ W[n, k]^T (+ b), float weights of `dtype`, fp32 accumulation.
    Arguments (x [m, k], w [n, k], [b [n]], y [m, n]), all of `dtype`. `wide`: the micro-kernel
    spans two micro-panels (`WIDE_SPAN`), for targets with 32 vector registers (AVX-512)."""
    return _gemm(k, n, dtype, bias, "float", wide=wide)


@functools.cache
def gemm_f_panels(k: int, n: int, dtype: str, bias: bool, wide: bool = False) -> tirx.PrimFunc:
    """`gemm_f` on weights laid out at convert time as the micro-kernel reads them
    (`weight_panels`): W [ceil(n / NR), k, NR], so no call packs them. The same chains, so
    the same bits as `gemm_f`; what it saves is the packing, as costly as the FMAs at 16 rows.
    Arguments (x [m, k], w, [b [n]], y [m, n]), all of `dtype`; `wide` as `gemm_f`'s."""
    return _gemm(k, n, dtype, bias, "panels", wide=wide)


def weight_panels(weight: np.ndarray) -> np.ndarray:
    """W [n, k] as `gemm_f_panels` takes it: [ceil(n / NR), k, NR], rows past n zero."""
    n, k = weight.shape
    padded = np.zeros((-(-n // NR) * NR, k), weight.dtype)
    padded[:n] = weight
    return np.ascontiguousarray(padded.reshape(-1, NR, k).transpose(0, 2, 1))


@functools.cache
def gemm_q4(
    k: int, n: int, dtype: str, bias: bool, asym: bool = False, scale_dtype: str | None = None,
    wide: bool = False,
) -> tirx.PrimFunc:
    """Y[m, n] = X[m, k] @ dequant(Wq[n, kp/8], S)^T (+ b), kp = `padded_k(k)`: symmetric
    (q - 8) * scale with S [n, kp/32] of `scale_dtype` (default `dtype`), or with `asym`
    q * scale + min with S [n, 2 kp/32] of `scale_dtype` (default float16; scale and min side by
    side), or uint8 [n, `q4_k_width`(kp/32)] (q4f32_k's Q4_K super-blocks). The arguments of
    `matmul.linear_q4`; `wide` as `gemm_f`'s."""
    return _gemm(k, n, dtype, bias, "q4_asym" if asym else "q4", scale_dtype, wide)


def _nibble(w, j, kk):
    """Nibble kk of row j of the packed words w, as int32."""
    return T.Cast(
        "int32",
        T.bitwise_and(
            T.shift_right(
                w[j, kk // NIBBLES_PER_WORD], T.Cast("uint32", kk % NIBBLES_PER_WORD * 4)
            ),
            T.uint32(15),
        ),
    )


def _gemm(
    k: int, n: int, dtype: str, bias: bool, kind: str, scale_dtype: str | None = None,
    wide: bool = False,
) -> tirx.PrimFunc:
    span = WIDE_SPAN if wide else 1  # micro-panels per micro-kernel
    nb = min(NB, -(-n // NR) * NR)  # columns per task, a multiple of NR
    npan = nb // NR
    nblocks = -(-n // nb)
    last = n - (nblocks - 1) * nb  # valid columns of the last block
    # micro-panels the last block runs: packed blocks are zero-filled to npan; weight panels
    # stop at the last one holding a column
    last_used = -(-last // NR) if kind == "panels" else npan
    kc = min(KC, k)
    nkb, ktail = divmod(k, kc)
    kp = padded_k(k)
    kw, kg = kp // NIBBLES_PER_WORD, kp // GROUP_SIZE

    panels = kind == "panels"  # W already [n / NR, k, NR]: read in place, never packed
    if kind in ("float", "panels"):

        def value(w, s, j, kk):
            return T.Cast(F32, w[j, kk])

    elif kind == "q4":

        def value(w, s, j, kk):
            return T.Cast(F32, _nibble(w, j, kk) - 8) * T.Cast(F32, s[j, kk // GROUP_SIZE])

    else:
        layout = asym_layout(scale_dtype)

        def value(w, s, j, kk):
            g = kk // GROUP_SIZE
            return T.Cast(F32, _nibble(w, j, kk)) * group_param(s, j, g, 0, layout) + \
                group_param(s, j, g, 1, layout)

    @T.macro
    def pack_w(wp, w, s, j0, cols, k0, klen):
        # rows of W along k (contiguous reads), each into column e of its micro-panel
        for jj, kk in T.grid(cols, klen):
            wp[jj // NR, kk, jj % NR] = value(w, s, j0 + jj, k0 + kk)
        for jj, kk in T.grid(nb - cols, klen):
            wp[(cols + jj) // NR, kk, (cols + jj) % NR] = T.float32(0)

    direct = dtype == F32  # float32 X is read in place; other types are converted per block

    @T.macro
    def pack_x(xp, x, r0, rows, k0, klen):
        if not direct:
            for i in range(rows):
                for kk in T.vectorized(klen):
                    xp[i, kk] = T.Cast(F32, x[r0 + i, k0 + kk])

    def xv(x, xp, r0, i, k0, kk):
        """x[r0 + i, k0 + kk] as float32 (i counts rows from the task's first)."""
        if direct:
            return x[r0 + i, k0 + kk]
        return xp[i, kk]

    def wv(w, wp, j0, jr, k0, kk, e):
        """Lane e of micro-panel jr of the task's W block at k0 + kk, as float32: from the
        weight panels in place, or from the block packed into wp."""
        if panels:
            return T.Cast(F32, w[j0 // NR + jr, k0 + kk, e])
        return wp[jr, kk, e]

    @T.macro
    def micro(x, xp, w, wp, cb, r0, j0, k0, t, rows, i0, jr, klen, span):
        # rows x (span x NR) accumulators, micro-panels jr .. jr + span - 1; the loops are
        # unrolled so LLVM keeps `acc` in registers
        acc = T.alloc_buffer((MR, span * NR), F32)
        for ii in T.unroll(rows):
            for p in T.unroll(span):
                for e in T.vectorized(NR):
                    acc[ii, p * NR + e] = cb[t * MR + i0 + ii, (jr + p) * NR + e]
        for kk in range(klen):
            for ii in T.unroll(rows):
                for p in T.unroll(span):
                    for e in T.vectorized(NR):
                        acc[ii, p * NR + e] = acc[ii, p * NR + e] + xv(
                            x, xp, r0, t * MR + i0 + ii, k0, kk
                        ) * wv(w, wp, j0, jr + p, k0, kk, e)
        for ii in T.unroll(rows):
            for p in T.unroll(span):
                for e in T.vectorized(NR):
                    cb[t * MR + i0 + ii, (jr + p) * NR + e] = acc[ii, p * NR + e]

    @T.macro
    def tail(x, xp, w, wp, cb, r0, j0, k0, rows, jr, klen, span):
        # The rows past the last full tile, together: one row alone keeps only two vector
        # accumulators busy (FMA latency, not throughput, bounds it), and in a 16-row batch
        # the 4 tail rows cost more than the 12 others. Each output is still its own chain.
        if rows % MR == 1:
            micro(x, xp, w, wp, cb, r0, j0, k0, rows // MR, 1, 0, jr, klen, span)
        elif rows % MR == 2:
            micro(x, xp, w, wp, cb, r0, j0, k0, rows // MR, 2, 0, jr, klen, span)
        elif rows % MR == 3:
            micro(x, xp, w, wp, cb, r0, j0, k0, rows // MR, 3, 0, jr, klen, span)
        elif rows % MR == 4:
            micro(x, xp, w, wp, cb, r0, j0, k0, rows // MR, 4, 0, jr, klen, span)
        elif rows % MR == 5:
            micro(x, xp, w, wp, cb, r0, j0, k0, rows // MR, 5, 0, jr, klen, span)

    @T.macro
    def block(x, w, s, xp, wp, cb, r0, rows, j0, cols, k0, klen, used):
        # `used`: the micro-panels that hold columns (the weight panels end at n; a packed
        # block is zero-padded to npan)
        if not panels:
            pack_w(wp, w, s, j0, cols, k0, klen)
        pack_x(xp, x, r0, rows, k0, klen)
        for jw in range(used // span):
            for t in range(rows // MR):
                micro(x, xp, w, wp, cb, r0, j0, k0, t, MR, 0, jw * span, klen, span)
            tail(x, xp, w, wp, cb, r0, j0, k0, rows, jw * span, klen, span)
        if used % span == 1:  # a last single micro-panel (an odd count, wide)
            for t in range(rows // MR):
                micro(x, xp, w, wp, cb, r0, j0, k0, t, MR, 0, used - 1, klen, 1)
            tail(x, xp, w, wp, cb, r0, j0, k0, rows, used - 1, klen, 1)

    def out(cb, b, i, j0, jj):
        v = cb[i, jj]
        if bias:
            v = v + T.Cast(F32, b[j0 + jj])
        return T.Cast(dtype, v)

    @T.macro
    def write(cb, b, y, r0, rows, j0, cols):
        for i in range(rows):
            for jv in range(cols // NR):
                for e in T.vectorized(NR):
                    y[r0 + i, j0 + jv * NR + e] = out(cb, b, i, j0, jv * NR + e)
            for e in range(cols % NR):
                y[r0 + i, j0 + cols // NR * NR + e] = out(cb, b, i, j0, cols // NR * NR + e)

    @T.macro
    def task(x, w, s, b, y, r0, rows, j0, cols, used):
        cb = T.alloc_buffer((MC, nb), F32)
        xp = T.alloc_buffer((MC if not direct else 1, kc), F32)
        wp = T.alloc_buffer((npan if not panels else 1, kc, NR), F32)
        for i in range(rows):
            for e in T.vectorized(nb):
                cb[i, e] = T.float32(0)
        for kb in range(nkb):
            block(x, w, s, xp, wp, cb, r0, rows, j0, cols, kb * kc, kc, used)
        if ktail > 0:
            block(x, w, s, xp, wp, cb, r0, rows, j0, cols, nkb * kc, ktail, used)
        write(cb, b, y, r0, rows, j0, cols)

    @T.macro
    def body(var_x, w, s, b, var_y):
        m = T.int64()
        x = T.match_buffer(var_x, (m, k), dtype)
        y = T.match_buffer(var_y, (m, n), dtype)
        # Rows split into chunks of equal size (a multiple of MR, at most MC): the thread pool
        # gives each thread a contiguous run of tasks, so with chunks of MC and a short last one
        # (512 rows: 480 + 32) one thread would do 15 times the other's work.
        chunks = (m + MC - 1) // MC
        per = T.min(MC, ((m + chunks - 1) // chunks + MR - 1) // MR * MR)
        # row chunk major: consecutive tasks of a thread share the X rows it packs
        for t in T.parallel((m + per - 1) // per * nblocks):
            if t % nblocks < nblocks - 1:
                task(x, w, s, b, y, t // nblocks * per, T.min(per, m - t // nblocks * per),
                     t % nblocks * nb, nb, npan)
            else:
                task(x, w, s, b, y, t // nblocks * per, T.min(per, m - t // nblocks * per),
                     (nblocks - 1) * nb, last, last_used)

    asym = kind == "q4_asym"
    ks = asym_width(asym_layout(scale_dtype), kg) if asym else kg
    sdt = scale_dtype or ("float16" if asym else dtype)  # q4f32_k: uint8 (`K_SCALE_DTYPE`)
    quantized = kind not in ("float", "panels")
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

    elif panels and bias:

        @T.prim_func(private=True)
        def func(
            var_x: T.handle,
            w: T.Buffer((-(-n // NR), k, NR), dtype),
            b: T.Buffer((n,), dtype),
            var_y: T.handle,
        ):
            body(var_x, w, None, b, var_y)

    elif panels:

        @T.prim_func(private=True)
        def func(var_x: T.handle, w: T.Buffer((-(-n // NR), k, NR), dtype), var_y: T.handle):
            body(var_x, w, None, None, var_y)

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
