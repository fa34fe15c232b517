"""Constants and helpers shared by the hand-written TIR kernels: weight packing, vector widths,
thread counts, the function attributes that mark a kernel as scheduled, the AVX-512 probe and the
input transposition of the 4-bit GEMV.

Function attributes: TVM 0.27 reads `tirx.noalias` (pointer arguments become `noalias` in the
generated LLVM IR / `__restrict__` in CUDA) and `tirx.is_scheduled` (dlight and the default
pipelines leave the function alone). The older `tir.*` spellings are accepted and silently
ignored, so every kernel gets its attributes from `scheduled` (tests/test_kernel_attrs.py checks
that they take effect).
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T
from tvm.target import Target

from localchat.engine.build.quantization import (
    GROUP_SIZE,
    K_SCALE_DTYPE,
    NIBBLES_PER_WORD,
    Q4_K_PARAM_BYTES,
    SUPER_GROUPS,
    padded_k,
    q4_k_width,
)

__all__ = [
    "FP4_DOUBLED",
    "GPU_COPY_THREADS",
    "GPU_THREADS",
    "GROUP_SIZE",
    "INT8_ISAS",
    "K_SCALE_DTYPE",
    "MX",
    "Q4K",
    "LANES",
    "LOG2E",
    "NIBBLES_PER_WORD",
    "SCHEDULED_ATTRS",
    "WORDS_PER_GROUP",
    "asym_layout",
    "asym_width",
    "divisor",
    "e8m0",
    "exp2",
    "gemv_isa",
    "group_param",
    "group_params_vec",
    "has_avx2",
    "has_avx512",
    "has_amx",
    "has_avx512_vnni",
    "int8_activations",
    "lane_tree",
    "padded_k",
    "scheduled",
    "tanh",
    "transpose_x",
    "vec_width",
    "wide_registers",
    "x_group",
]

WORDS_PER_GROUP = GROUP_SIZE // NIBBLES_PER_WORD  # 4 uint32 words hold one group of 32 nibbles
LANES = 16  # float32 lanes of one AVX-512 register
GPU_THREADS = 64  # threads per block of the GPU scan kernel
GPU_COPY_THREADS = 256  # threads per block of the GPU state-copy kernels
LOG2E = math.log2(math.e)
INT8_ISAS = ("vnni", "avx2")  # `gemv_isa` values whose 4-bit GEMV rounds activations to int8
# The kernels' `asym` value for q4f32_k's Q4_K super-block parameters (`quantization`): truthy,
# so every asymmetric code path serves it and only the reads of scale and min differ.
Q4K = "q4k"


# The kernels' `mx` layout: MXFP4 (OCP microscaling FP4: E2M1 codes, an E8M0 exponent per 32)
MX = "mxfp4"
# FP4 (E2M1) codes 0..15 doubled, so integers in [-12, 12]: the int8 kernels' weights
FP4_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def e8m0(v, lanes: int = 1):
    """2 ** (v - 127) as float32 for uint8 E8M0 exponents v (scalar or `lanes` lanes): the
    exponent field set directly (v = 0, 2 ** -127, would be a denormal: the quantizer never
    stores it)."""
    i32, f32 = ("int32", "float32") if lanes == 1 else (f"int32x{lanes}", f"float32x{lanes}")
    return T.reinterpret(f32, T.shift_left(T.Cast(i32, v), T.int32(23) if lanes == 1
                                           else T.Broadcast(T.int32(23), lanes)))


def f16_bytes(s, row, at):
    """The little-endian float16 at bytes `at`, `at` + 1 of row `row` of a uint8 buffer, as
    float32 (q4f32_k's and Q6_K's super-block parameters)."""
    bits = T.bitwise_or(
        T.Cast("uint16", s[row, at]), T.shift_left(T.Cast("uint16", s[row, at + 1]), T.uint16(8))
    )
    return T.Cast("float32", T.reinterpret("float16", bits))


def _super_param(s, row, g, which: int):
    """Float32 d (which 0) or -dmin (1) of the super-block holding group g, from the
    little-endian float16 bytes 12 and 14 of its `Q4_K_PARAM_BYTES` in a q4f32_k row."""
    value = f16_bytes(s, row, (g // SUPER_GROUPS) * Q4_K_PARAM_BYTES + 12 + 2 * which)
    return value if which == 0 else T.float32(0) - value


def _six_bit(lo, hi, which: int, hi_shift):
    """Group parameter `which` (0 sc, 1 m) from its super-block's low-nibble byte `lo` and
    high-bits byte `hi` (int32, scalar or vector), `hi_shift` = 2 (i % 2) for group i."""
    low = T.bitwise_and(lo, 15) if which == 0 else T.shift_right(lo, 4)
    high = T.bitwise_and(T.shift_right(hi, hi_shift + 4 * which), 3)
    return T.bitwise_or(low, T.shift_left(high, 4))


def asym_layout(scale_dtype: str | None):
    """The kernels' `asym` layout for an asymmetric weight whose group parameters have
    `scale_dtype`: Q4K for q4f32_k's bytes, else True (scale and min side by side)."""
    return Q4K if scale_dtype == K_SCALE_DTYPE else True


def asym_width(layout, kg: int) -> int:
    """The length of a row of an asymmetric weight's group parameters for kg groups."""
    return q4_k_width(kg) if layout == Q4K else 2 * kg


def group_param(s, row, g, which: int, asym):
    """Float32 scale (which 0) or min (1) of group g of row `row` of an asymmetric weight's
    parameters s: side by side at 2 g + which, or in q4f32_k's form (`asym` == Q4K) d * sc and
    -dmin * m, exact in float32."""
    if asym == Q4K:
        base = (g // SUPER_GROUPS) * Q4_K_PARAM_BYTES
        i = g % SUPER_GROUPS
        value = _six_bit(T.Cast("int32", s[row, base + i]),
                         T.Cast("int32", s[row, base + 8 + i // 2]), which, 2 * (i % 2))
        return T.Cast("float32", value) * _super_param(s, row, g, which)
    return T.Cast("float32", s[row, 2 * g + which])


def group_params_vec(s, row, g0, lanes: int, which: int, asym):
    """`group_param` of the `lanes` groups from g0 as one float32 vector (one load of the pairs,
    split by a shuffle); in q4f32_k's form g0 must be a multiple of min(lanes, 8) (the lanes
    span whole super-blocks, or lie in one)."""
    if asym != Q4K:
        pairs = s[row, T.Ramp(2 * g0, 1, 2 * lanes)]
        return T.Cast(f"float32x{lanes}",
                      tirx.Shuffle([pairs], [2 * i + which for i in range(lanes)]))
    assert lanes in (4, 8, 16), lanes
    i32 = f"int32x{lanes}"
    # 2 (i % 2) for the lanes' groups i (the first is even)
    shift = T.shift_left(T.bitwise_and(T.Ramp(0, 1, lanes), T.Broadcast(1, lanes)),
                         T.Broadcast(1, lanes))
    if lanes == 4:
        # half a super-block (g0 % 8 is 0 or 4, known only at run time): its 4 low-nibble
        # bytes and 2 high-bits bytes loaded directly, its d or dmin broadcast
        at, first = g0 // SUPER_GROUPS * Q4_K_PARAM_BYTES, g0 % SUPER_GROUPS
        lo = T.Cast(i32, s[row, T.Ramp(at + first, 1, 4)])
        pair = s[row, T.Ramp(at + 8 + first // 2, 1, 2)]
        hi = T.Cast(i32, tirx.Shuffle([pair, pair], [0, 0, 1, 1]))
        return T.Cast(f"float32x{lanes}", _six_bit(lo, hi, which, shift)) * T.Broadcast(
            _super_param(s, row, g0, which), lanes)
    # whole super-blocks: one load of their bytes; each lane takes its group's low-nibble byte
    # and high-bits byte by shuffles, and its super-block's d or dmin (float16 bytes, converted
    # together)
    blocks = lanes // SUPER_GROUPS
    raw = s[row, T.Ramp(g0 // SUPER_GROUPS * Q4_K_PARAM_BYTES, 1, Q4_K_PARAM_BYTES * blocks)]
    at = [(i // SUPER_GROUPS) * Q4_K_PARAM_BYTES for i in range(lanes)]
    part = [i % SUPER_GROUPS for i in range(lanes)]
    lo = T.Cast(i32, tirx.Shuffle([raw], [at[i] + part[i] for i in range(lanes)]))
    hi = T.Cast(i32, tirx.Shuffle([raw], [at[i] + 8 + part[i] // 2 for i in range(lanes)]))
    value = T.Cast(f"float32x{lanes}", _six_bit(lo, hi, which, shift))
    dd = tirx.Shuffle([raw], [b * Q4_K_PARAM_BYTES + 12 + j for b in range(blocks)
                              for j in range(4)])
    supers = T.Cast(f"float32x{2 * blocks}", T.reinterpret(f"float16x{2 * blocks}", dd))
    # (a Shuffle returns at most as many lanes as its inputs have: the pair repeated)
    copies = -(-lanes // (2 * blocks))
    factor = tirx.Shuffle([supers] * copies,
                          [2 * (i // SUPER_GROUPS) + which for i in range(lanes)])
    if which == 1:
        factor = T.Broadcast(T.float32(0), lanes) - factor
    return value * factor


def exp2(x):
    """2**x for float32 (scalar or vector) x, by 2**round(x) * poly(frac); ~2e-7 relative error.

    x is clamped to [-126, 127]. Unlike a call to libm's exp, it vectorizes."""
    x = T.max(T.min(x, T.float32(127.0)), T.float32(-126.0))
    n = T.floor(x + T.float32(0.5))
    y = (x - n) * T.float32(math.log(2.0))  # |y| <= ln(2)/2
    p = T.float32(1.0 / 720)
    for c in (1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0):
        p = p * y + T.float32(c)
    two_n = T.reinterpret("float32", T.shift_left(T.Cast("int32", n) + 127, 23))
    return p * two_n


def exp(x):
    """e**x for float32 (scalar or vector) x by `exp2` (x * log2 e rounds: for |x| of a few
    units its error is a few units in the last place). Unlike libm's, it vectorizes."""
    return exp2(x * T.float32(LOG2E))


def sigmoid(x):
    """1 / (1 + e^-x) for float32 (scalar or vector) x by `exp2`: it vectorizes."""
    return T.float32(1) / (T.float32(1) + exp2(x * T.float32(-LOG2E)))


def tanh(x):
    """tanh(x) for float32 (scalar or vector) x, as 1 - 2 / (e^2x + 1) with `exp2`: it
    vectorizes (libm's tanhf does not); absolute error ~2e-7, exactly +-1 for large |x|."""
    return T.float32(1) - T.float32(2) / (exp2(x * T.float32(2 * LOG2E)) + T.float32(1))


# How far ahead of its weight reads a decode GEMV prefetches (`row_prefetch`), in bytes.
PREFETCH_AHEAD = 4096
# Rows of W longer than this prefetch line by line as they are read (`prefetch_ahead`), not a
# whole row as each row starts (a row's worth at once overflows the core's queue of misses).
LONG_ROW_BYTES = 2048


def prefetch(buf, *index):
    """A read prefetch of the cache line holding buf[index] into every cache level (prefetches
    never fault, so an index past the data is harmless)."""
    return T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(buf[index]), T.int32(0),
                              T.int32(3), T.int32(1))


def prefetch_ahead(flat, index, size: int, elem_bytes: int):
    """A prefetch of the element `PREFETCH_AHEAD` bytes past flat[index] (at most the last of
    `size`): how rows longer than `LONG_ROW_BYTES` prefetch, each line read fetching one ahead
    (k = 8192: 42-43 GB/s with whole-row prefetches, 51-52 so, the probe 51)."""
    return prefetch(flat, T.min(index + PREFETCH_AHEAD // elem_bytes, size - 1))


def row_prefetch(n: int, row_len: int, elem_bytes: int):
    """A macro `(buf, row)` that prefetches every cache line of the row `PREFETCH_AHEAD` bytes
    ahead of `row` (at most the last) in a buffer of `n` rows of `row_len` elements.

    Why: a decode GEMV thread reads its rows of W as one sequential stream, and the hardware
    prefetchers keep too few lines in flight for one stream per core: a 4-bit GEMV read 35-41
    GB/s where the bandwidth probe (four streams per thread) read 44-49; prefetching the row
    4 KiB ahead as each row starts read 47-52 (Zen 5, 2 threads, k = 2048, 240 MB of weights;
    the next row only 40-45, 8 KiB ahead 46-50)."""
    ahead = max(1, -(-PREFETCH_AHEAD // (row_len * elem_bytes)))
    per_line = max(1, 64 // elem_bytes)
    lines = -(-row_len // per_line)

    @T.macro
    def fetch(buf, row):
        for i in T.unroll(lines):
            prefetch(buf, T.min(row + ahead, n - 1), i * per_line)

    return fetch


# The attributes every hand-scheduled kernel carries, in the spelling TVM 0.27 honours.
SCHEDULED_ATTRS = {"tirx.noalias": True, "tirx.is_scheduled": True}


def scheduled(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` marked as already scheduled (no dlight / default schedule) with no-alias buffers."""
    return func.with_attrs(SCHEDULED_ATTRS)


def divisor(total: int, options: tuple[int, ...]) -> int:
    """The first of `options` that divides `total`, else 1."""
    for d in options:
        if total % d == 0:
            return d
    return 1


def vec_width(n: int) -> int:
    """The widest vector (16, 8, 4, 2 or 1 lanes) that divides `n`."""
    return divisor(n, (LANES, 8, 4, 2))


def _has_features(target: Target, features: list[str]) -> bool:
    if target.kind.name != "llvm":
        return False
    from tvm.target import codegen

    try:
        return bool(codegen.llvm_cpu_has_features(features, target))
    except Exception:  # an LLVM without x86, or a CPU it does not know
        return False


def has_avx2(target: Target) -> bool:
    """Whether `target` is an llvm CPU target with AVX2 (the int8 GEMV's pmaddubsw route)."""
    return _has_features(target, ["avx2"])


def has_avx512(target: Target) -> bool:
    """Whether `target` is an llvm CPU target with AVX-512F (the GEMV's table-lookup unpack)."""
    return _has_features(target, ["avx512f"])


def has_avx512_vnni(target: Target) -> bool:
    """Whether `target` is an llvm CPU target with AVX-512F and AVX-512 VNNI (the int8 GEMV)."""
    return _has_features(target, ["avx512f", "avx512vnni", "avx512vl"])


def has_amx(target: Target) -> bool:
    """Whether `target` is an llvm CPU target with Intel AMX's int8 tiles (prefill's
    `gemm_amx`)."""
    return _has_features(target, ["amx-tile", "amx-int8", "avx512f"])


def gemv_isa(target: Target) -> bool | str:
    """Which 4-bit decode GEMV suits `target`, as the `avx512` argument of `gemv.gemv_q4` and of
    the models' Linear layers: "vnni" (int8 activations, AVX-512 VNNI dot products), True
    (AVX-512F without VNNI: float activations, table-lookup unpacking), "avx2" (int8 activations,
    AVX2 pmaddubsw) or False (the generic float kernel)."""
    if has_avx512_vnni(target):
        return "vnni"
    if has_avx512(target):
        return True
    return "avx2" if has_avx2(target) else False


def wide_registers(isa: bool | str) -> bool:
    """Whether a `gemv_isa` value means AVX-512 (32 vector registers: `gemm`'s wide
    micro-kernel)."""
    return isa is True or isa == "vnni"


def x_group(x, r, g, k: int, masked: bool):
    """The 32 values of group g of row r of x [m, k] as float32x32; with `masked` (a group
    reaching past k) zeros past k, read without going past the row."""
    idx = T.Ramp(g * GROUP_SIZE, 1, GROUP_SIZE)
    v32 = f"float32x{GROUP_SIZE}"
    if not masked:
        return T.Cast(v32, x[r, idx])
    return T.Select(
        idx < T.Broadcast(k, GROUP_SIZE),
        T.Cast(v32, x[r, T.min(idx, T.Broadcast(k - 1, GROUP_SIZE))]),
        T.Broadcast(T.float32(0), GROUP_SIZE),
    )


def add(a, b):
    """a + b: the op of a summing `lane_tree`."""
    return a + b


def lane_tree(vec, lanes: int, op):
    """op-reduction of the `lanes` lanes of `vec` as a tree of halves (lane i with i + lanes/2):
    a fixed order, as few shuffles as there are levels, in registers."""
    while lanes > 1:
        half = lanes // 2
        vec = op(
            tirx.Shuffle([vec], list(range(half))), tirx.Shuffle([vec], list(range(half, lanes)))
        )
        lanes = half
    return vec


def rows_lane_tree(vectors: list, lanes: int, op):
    """`lane_tree` of each row of several: `vectors` hold rows of `lanes` lanes side by side
    (a vector of W lanes holds W / lanes rows); the result has one lane per row, in order, each
    the same tree of halves as `lane_tree`'s, but a level of two vectors' rows is one
    pair of shuffles and one op (a row alone takes as many as the tree has levels)."""
    width = int(vectors[0].ty.dtype.lanes)
    vecs, w = list(vectors), lanes
    while w > 1:
        half, out = w // 2, []
        for i in range(0, len(vecs), 2):
            pair = vecs[i:i + 2]
            rows = len(pair) * width // w
            lo = [r * w + j for r in range(rows) for j in range(half)]
            hi = [r * w + half + j for r in range(rows) for j in range(half)]
            out.append(op(tirx.Shuffle(pair, lo), tirx.Shuffle(pair, hi)))
        vecs, w = out, half
        width = int(vecs[0].ty.dtype.lanes)
    return vecs[0] if len(vecs) == 1 else tirx.Shuffle(vecs, list(range(sum(
        int(v.ty.dtype.lanes) for v in vecs))))


def int8_activations(target: Target) -> bool:
    """Whether the 4-bit kernels for `target` round activations to int8 per group of 32 (the
    VNNI and AVX2 GEMVs, as llama.cpp does): results within that rounding, not float's."""
    return gemv_isa(target) in INT8_ISAS


def transpose_x(k: int, with_sums: bool):
    """The macro `(x, xp, xs, m)` that prepares x [m, k] for the 4-bit GEMV: xp[r, p, w] =
    x[r, 8 w + p] in float32, so nibble p of 16 consecutive words meets 16 contiguous values of
    x, and, `with_sums`, xs[r, w] = sum_p x[r, 8 w + p] (through which the generic GEMV applies
    the -8 offset of every nibble once per word instead of once per weight).

    xp and xs span the padded width `padded_k(k)` of the stored weights; past k they hold
    zeros, so the padding weights meet zeros and the GEMV needs no tail of its own."""
    kw = padded_k(k) // NIBBLES_PER_WORD
    padded = padded_k(k) != k
    f32 = "float32"

    @T.macro
    def macro(x, xp, xs, m):
        for r, wd in T.grid(m, kw):
            if with_sums:
                xs[r, wd] = T.float32(0)
            for p in range(NIBBLES_PER_WORD):
                if padded:
                    # clamped index: the select may evaluate both arms
                    xp[r, p, wd] = T.Select(
                        wd * NIBBLES_PER_WORD + p < k,
                        T.Cast(f32, x[r, T.min(wd * NIBBLES_PER_WORD + p, k - 1)]),
                        T.float32(0),
                    )
                else:
                    xp[r, p, wd] = T.Cast(f32, x[r, wd * NIBBLES_PER_WORD + p])
                if with_sums:
                    if padded:
                        xs[r, wd] = xs[r, wd] + xp[r, p, wd]
                    else:
                        xs[r, wd] = xs[r, wd] + T.Cast(f32, x[r, wd * NIBBLES_PER_WORD + p])

    return macro
