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

With AVX-512 VNNI (`avx512="vnni"`, `gemv_q4_vnni_macro`; llama.cpp's route) x is quantized
instead, once per call, per row and group of 32 to int8 (scale max|x| / 127), laid out so that
`vpdpbusd` multiplies the weight bytes taken straight from the words: 16 groups (64 words) are
transposed by shuffles so that lane e of 4 vectors holds the 4 words of group e;
`words & 0x0F0F0F0F` and `(words >> 4) & 0x0F0F0F0F` are then 4 unsigned nibbles per byte lane,
8 vpdpbusd give each lane its group's integer dot product (the -8 offset is the accumulator's start
value, -8 times the group's int8 sum), and one conversion, multiply and FMA per 16 groups apply
the two scales. The rows of x run inside the word loop, in blocks of 8 that share every unpacked
vector, so batched decode reads and unpacks each weight once per call; each row's float
operations are the same whatever the batch, so a row's bits never depend on the others. It reads
~2.5x fewer instructions per weight than the table lookup, so one row streams weights at the
memory's speed; 16 rows cost ~5x one row. Without AVX-512 (`avx512="avx2"`) the same kernel runs
on AVX2: pmaddubsw (unsigned nibbles times signed x, pairs summed to int16), the 8 partial sums of
a unit added in int16 and widened once by pmaddwd, in units of 8 groups so that a unit's unpacked
weights fit AVX2's 16 registers (2.6-3.6x the float kernel's GB/s at one row, Zen 4). With many
rows (prefill) the rows of W run in tiles of 64 per block of x, so the block's int8 x is read
from L1 rather than from L2 once per row of W; past 4,096 values of k the block is walked in
chunks of 2,048 (its accumulators carried between them), so that the chunk fits L1.

The asymmetric modes (value q * scale + min, float16 scale and min per group) run the same three
kernels with `asym=True`: per group, sum (q s + min) x = s sum q x + min sum x, so the nibbles
count from 0 instead of -8 and the mins meet sums of x the kernels already have (the generic one's
per-word sums; the VNNI one's int8 group sums) or compute (the table one). Their 8-bit embedding /
LM head runs `gemv_q8`: with VNNI, int8 x against the weight bytes taken directly (no unpacking,
no transposition: a 64-byte vector is two groups), otherwise float arithmetic.

This is the one decode GEMV: the models' Linear layers run `gemv_q4` / `gemv_f` (and `gemv_q8`
for an 8-bit head) for every decode step and logits (`models.layers`), with the variant
`common.gemv_isa` picks for the target. Float weights: the same shape without the unpacking
(16-lane loads of W and x, fp32 accumulation).
"""

from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

from localchat.engine.kernels.common import (
    FP4_DOUBLED,
    GROUP_SIZE,
    INT8_ISAS,
    LANES,
    LONG_ROW_BYTES,
    MX,
    NIBBLES_PER_WORD,
    WORDS_PER_GROUP,
    add,
    asym_layout,
    asym_width,
    divisor,
    e8m0,
    group_param,
    group_params_vec,
    lane_tree,
    padded_k,
    prefetch_ahead,
    row_prefetch,
    rows_lane_tree,
    scheduled,
    transpose_x,
    x_group,
)

GROUPS_PER_VEC = LANES // WORDS_PER_GROUP  # 4 groups in one vector of 16 words
ROWS = 4  # rows of W per work item (generic kernel)
VEC_UNROLL = 4  # word vectors of one row in flight (independent FMA chains)
LONG_K = 4096  # beyond this reduction size the AVX-512 kernel shares x between rows
LONG_ROWS = 8  # rows sharing each load of x when k > LONG_K
LONG_VEC_UNROLL = 1  # word vectors in flight per row when k > LONG_K
F32 = "float32"


def _fp4(code):
    """The FP4 (E2M1) value of a uint32 code 0..15 as float32: sign bit 3, exponent bits 1-2,
    mantissa bit 0 (exponent 0: 0 or 0.5; else (2 + m) 2 ** (e - 2))."""
    e = T.bitwise_and(T.shift_right(code, T.uint32(1)), T.uint32(3))
    m = T.Cast(F32, T.bitwise_and(code, T.uint32(1)))
    scale = T.Cast(F32, T.shift_left(T.uint32(1), e)) * T.float32(0.25)
    mag = T.Select(e == T.uint32(0), m * T.float32(0.5), (T.float32(2) + m) * scale)
    return T.Select(T.bitwise_and(code, T.uint32(8)) != T.uint32(0), T.float32(0) - mag, mag)


def _nibble_dot(w, xp, row, r, word, centered: bool = False, mx: bool = False):
    """sum over the 8 nibbles q_p of w[row, word] of q_p * x[r, 8 word + p] (or of (q_p - 8) * x
    when `centered`, or of FP4(q_p) * x with `mx`), as one expression so the products chain in
    registers."""
    total = None
    for p in range(NIBBLES_PER_WORD):
        code = T.bitwise_and(T.shift_right(w[row, word], T.uint32(p * 4)), T.uint32(15))
        q = _fp4(code) if mx else T.Cast(F32, code)
        if centered and not mx:
            q = q - T.float32(8)
        term = q * xp[r, p, word]
        total = term if total is None else total + term
    return total


def _param(s, row, group, stride: int, offset: int, layout=True):
    """Group `group`'s parameter as float32: s[row, group] (symmetric scale; MX: an E8M0
    exponent), or with `stride` 2 the asymmetric scale (offset 0) or min (1) in `layout`
    (`common.group_param`'s `asym`: True, or Q4K)."""
    if stride == 2:
        return group_param(s, row, group, offset, layout)
    if layout == MX:
        return e8m0(s[row, group])
    return T.Cast(F32, s[row, group])


def _lane_scale(s, row, group0, e, groups: int = GROUPS_PER_VEC, stride: int = 1, offset: int = 0,
                layout=True):
    """The scale of lane e's group, s[row, group0 + e // 4], as a select over the `groups` groups
    of a vector, so the vectorizer emits broadcasts and blends instead of a gather (`stride`,
    `offset`: s[row, (group0 + e // 4) * stride + offset], the asymmetric scale or min; `layout`:
    as `_param`'s)."""
    value = _param(s, row, group0 + groups - 1, stride, offset, layout)
    for g in range(groups - 2, -1, -1):
        value = T.Select(
            e < (g + 1) * WORDS_PER_GROUP,
            _param(s, row, group0 + g, stride, offset, layout),
            value,
        )
    return value


def _sum_lanes(acc, vecs: int, first: int = 0):
    """The sum of `vecs` * 16 lanes of the flat accumulator `acc`, from vector `first`."""
    total = None
    for a in range(vecs):
        for e in range(LANES):
            value = acc[(first + a) * LANES + e]
            total = value if total is None else total + value
    return total


def _store_macro(dtype: str, bias: bool):
    """A macro `(y, b, r, row, total)` writing y[r, row] = total (+ b[row]) in `dtype`."""

    @T.macro
    def store(y, b, r, row, total):
        if bias:
            y[r, row] = T.Cast(dtype, total + T.Cast(F32, b[row]))
        else:
            y[r, row] = T.Cast(dtype, total)

    return store


def gemv_q4_macro(
    k: int, n: int, dtype: str, bias: bool, avx512: bool | str = False, asym: bool = False,
    mx: bool = False,
):
    """The 4-bit GEMV as a macro `(x, w, s, b, y, m)` over buffers x [m, k], w [n, kp/8] uint32,
    s [n, kp/32] (kp = `padded_k(k)`; with `asym` [n, 2 kp/32] float16, scale and min of each
    group side by side), b [n] (None without `bias`) and y [m, n], for use inside other kernels.

    `asym`: value q * scale + min (the asymmetric modes) instead of (q - 8) * scale. Per group,
    sum (q scale + min) x = scale sum q x + min sum x: the nibbles are taken as 0..15 and the mins
    meet per-word sums of x (the generic kernel's sums for the -8 offset; the table kernel
    computes them too).

    `mx`: MXFP4 weights (the nibbles FP4 codes, s [n, kp/32] uint8 E8M0 exponents: value
    FP4(q) * 2 ** (s - 127)), symmetric."""
    if avx512 in INT8_ISAS:
        return gemv_q4_vnni_macro(k, n, dtype, bias, asym=asym, isa=avx512, mx=mx)
    # the group parameters' layout (`common.group_param`); `asym` a bool for TVMScript's ifs
    layout, asym = (MX if mx else asym), bool(asym)
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
    prepare = transpose_x(k, with_sums=not avx512 or asym)
    v16 = f"float32x{LANES}"

    def lookup(words_u32, p: int):
        """float(q_p - 8) (asym: float(q_p)) for nibble p of 16 words: vpermps over the table
        -8..7 (0..15)."""
        shifted = (
            words_u32 if p == 0 else T.shift_right(words_u32, T.Broadcast(T.uint32(4 * p), LANES))
        )
        if mx:
            table = tirx.Shuffle([T.float32(v / 2) for v in FP4_DOUBLED], list(range(LANES)))
        else:
            table = T.Cast(v16, T.Ramp(T.int32(0 if asym else -8), T.int32(1), LANES))
        return T.call_llvm_pure_intrin(
            v16, "llvm.x86.avx512.permvar.sf.512", table, T.reinterpret(f"int32x{LANES}", shifted)
        )

    def vec_scale(s, row, g0, stride: int = 1, offset: int = 0):
        """s[row, g0 + lane // 4] for the 16 lanes: 4 broadcasts and 3 blends (`stride`,
        `offset`: as `_lane_scale`'s)."""
        lane = T.Ramp(T.int32(0), T.int32(1), LANES)
        value = T.Broadcast(
            _param(s, row, g0 + GROUPS_PER_VEC - 1, stride, offset, layout), LANES
        )
        for g in range(GROUPS_PER_VEC - 2, -1, -1):
            value = T.Select(
                lane < T.Broadcast(T.int32((g + 1) * WORDS_PER_GROUP), LANES),
                T.Broadcast(_param(s, row, g0 + g, stride, offset, layout), LANES),
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

    store = _store_macro(dtype, bias)

    def word_term(w, xp, xs, s, row, r, g0, wd0, e, groups: int = GROUPS_PER_VEC):
        """Lane e's share of row `row` of W times row r of x: word wd0 + e, of the groups from
        g0 (4 words each)."""
        if asym:
            return _lane_scale(s, row, g0, e, groups, 2, 0, layout) * _nibble_dot(
                w, xp, row, r, wd0 + e
            ) + _lane_scale(s, row, g0, e, groups, 2, 1, layout) * xs[r, wd0 + e]
        if mx:
            return _lane_scale(s, row, g0, e, groups, 1, 0, layout) * _nibble_dot(
                w, xp, row, r, wd0 + e, mx=True)
        return _lane_scale(s, row, g0, e, groups) * (
            _nibble_dot(w, xp, row, r, wd0 + e) - T.float32(8) * xs[r, wd0 + e]
        )

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
                            acc[u * LANES + e] = acc[u * LANES + e] + word_term(
                                w, xp, xs, s, jo * rb + jj, r, (vo * vu + u) * GROUPS_PER_VEC,
                                (vo * vu + u) * LANES, e,
                            )
                if tw > 0:
                    for e in T.vectorized(tw):
                        acc[e] = acc[e] + word_term(
                            w, xp, xs, s, jo * rb + jj, r, nv * GROUPS_PER_VEC,
                            nv * LANES, e, tw // WORDS_PER_GROUP,
                        )
                store(y, b, r, jo * rb + jj, _sum_lanes(acc, vu))

    def vec_term(w, xp, xs, s, row, r, g0, wd0):
        """The 16 lanes of row `row` of W times row r of x over the 16 words from wd0."""
        if asym:
            return vec_scale(s, row, g0, 2, 0) * vec_dot(w, xp, row, r, wd0) + vec_scale(
                s, row, g0, 2, 1
            ) * xs[r, T.Ramp(wd0, 1, LANES)]
        return vec_scale(s, row, g0) * vec_dot(w, xp, row, r, wd0)

    def tail_term(w, xp, xs, s, row, r, e):
        """Lane e of the last, narrower vector of words."""
        g0, groups = nv * GROUPS_PER_VEC, tw // WORDS_PER_GROUP
        if asym:
            return _lane_scale(s, row, g0, e, groups, 2, 0, layout) * _nibble_dot(
                w, xp, row, r, nv * LANES + e
            ) + _lane_scale(s, row, g0, e, groups, 2, 1, layout) * xs[r, nv * LANES + e]
        return _lane_scale(s, row, g0, e, groups, 1, 0, layout) * _nibble_dot(
            w, xp, row, r, nv * LANES + e, centered=True, mx=mx
        )

    @T.macro
    def table(x, w, s, b, y, m):
        xp = T.alloc_buffer((m, NIBBLES_PER_WORD, kw), F32)
        if asym:
            xs = T.alloc_buffer((m, kw), F32)
            prepare(x, xp, xs, m)
        else:
            xs = T.meta_var(None)
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
                            ] + vec_term(
                                w, xp, xs, s, jo * rb + jj, r,
                                (vo * vu + u) * GROUPS_PER_VEC, (vo * vu + u) * LANES,
                            )
                if tw > 0:
                    for jj in T.unroll(rb):
                        for e in T.vectorized(tw):
                            acc[jj * vu * LANES + e] = acc[jj * vu * LANES + e] + tail_term(
                                w, xp, xs, s, jo * rb + jj, r, e
                            )
                for jj in range(rb):
                    store(y, b, r, jo * rb + jj, _sum_lanes(acc, vu, jj * vu))

    return table if avx512 else generic


VNNI_ROWS = 8  # rows of x sharing each unpacked weight vector in the VNNI GEMV
# rows of W per tile when many rows of x run (prefill; 16: 3% slower, 256: k = 8192 overflows L2)
TILE_ROWS = 64
AVX2_UNIT = 8  # groups per unit in the AVX2 int8 GEMV (16 with VNNI)
AVX2_ROWS = 8  # rows of x per block in the AVX2 int8 GEMV (4 and 16: no faster)
# Prefill with k past LONG_CHUNKED_K walks the reduction in chunks of CHUNK_K values, so that a
# block's int8 x (VNNI_ROWS x CHUNK_K bytes) stays in L1 while a tile of W passes.
CHUNK_K = 2048
LONG_CHUNKED_K = 4096
XQ_WORDS_PER_GROUP = GROUP_SIZE // 4  # int8 x of one group: 32 bytes = 8 int32 words
NIBBLE_MASK = 0x0F0F0F0F  # the low nibble of each byte of a word


def _many_rows(m) -> bool:
    """Whether a macro's row count is the call's symbolic m (prefill) rather than decode's 1:
    work per row of x is then worth a parallel loop."""
    return not isinstance(m, int)


def _dpbusd(acc, a_u8, b_s8, groups: int):
    """vpdpbusd: acc[lane] += sum of the 4 products u8(a) * s8(b) of the lane's bytes (LLVM 22
    types the byte operands as <4G x i8>)."""
    bits = groups * 32
    name = f"llvm.x86.avx512.vpdpbusd.{bits}"
    return T.call_llvm_pure_intrin(
        f"int32x{groups}",
        name,
        acc,
        T.reinterpret(f"int8x{4 * groups}", a_u8),
        T.reinterpret(f"int8x{4 * groups}", b_s8),
    )


def _chunks(vec, lanes: int, size: int) -> list:
    """`vec` (`lanes` lanes) as consecutive pieces of `size` lanes."""
    if lanes == size:
        return [vec]
    return [tirx.Shuffle([vec], list(range(i, i + size))) for i in range(0, lanes, size)]


def _x86_bytes(name: str, ret: str, a, b, nbytes: int):
    """An SSSE3 / AVX2 intrinsic on byte vectors of `nbytes` (16: the 128-bit form; otherwise
    32-byte pieces joined back): `name` without its width suffix, `ret` the lane type of a
    32-byte piece's result with its lane count for 32 bytes (e.g. ("int16", 16))."""
    lane, per32 = ret
    if nbytes == 16:
        return T.call_llvm_pure_intrin(
            f"{lane}x{per32 // 2}", f"llvm.x86.ssse3.{name}.128", a, b
        )
    parts = [
        T.call_llvm_pure_intrin(f"{lane}x{per32}", f"llvm.x86.avx2.{name}", ah, bh)
        for ah, bh in zip(_chunks(a, nbytes, 32), _chunks(b, nbytes, 32))
    ]
    return parts[0] if len(parts) == 1 else tirx.Shuffle(parts, list(range(per32 * len(parts))))


def _maddubs(a_u8, b_s8, groups: int):
    """pmaddubsw over the 4 `groups` bytes of a and b: int16 lane i = u8(a[2i]) s8(b[2i]) +
    u8(a[2i+1]) s8(b[2i+1]) (saturating, which the GEMVs never reach: |products| are at most
    15 * 127 for 4-bit weights and 128 * 127 for 8-bit ones), so lanes 2e and 2e + 1 hold 32-bit
    lane e's four products. AVX2 does 32 bytes at a time: wider vectors are split and joined."""
    a = T.reinterpret(f"int8x{4 * groups}", a_u8)
    b = T.reinterpret(f"int8x{4 * groups}", b_s8)
    return _x86_bytes("pmadd.ub.sw", ("int16", 16), a, b, 4 * groups)


def _madd_pairs(v16, groups: int):
    """pmaddwd with ones: int32 lane e = int16 lanes 2e + 2e+1 of `v16` (2 `groups` lanes)."""
    ones = T.Broadcast(T.int16(1), 2 * groups)
    if groups == 4:
        return T.call_llvm_pure_intrin("int32x4", "llvm.x86.sse2.pmadd.wd", v16, ones)
    parts = [
        T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", h, o)
        for h, o in zip(_chunks(v16, 2 * groups, 16), _chunks(ones, 2 * groups, 16))
    ]
    return parts[0] if len(parts) == 1 else tirx.Shuffle(parts, list(range(groups)))


def _dot_s8s8(w_words, x_words, lanes: int):
    """int32 lane e = the dot product of the 4 signed bytes of w_words[e] and x_words[e]
    (AVX2: pmaddubsw takes unsigned times signed bytes, so |w| meets x with w's sign:
    psignb, llama.cpp's trick; |w| <= 128 and |x| <= 127 keep the pair sums in int16)."""
    w = T.reinterpret(f"int8x{4 * lanes}", w_words)
    x = T.reinterpret(f"int8x{4 * lanes}", x_words)
    mag = T.Select(w < T.Broadcast(T.int8(0), 4 * lanes), T.Broadcast(T.int8(0), 4 * lanes) - w, w)
    signed = _x86_bytes("psign.b", ("int8", 32), x, w, 4 * lanes)
    return _madd_pairs(_maddubs(mag, signed, lanes), lanes)


def _unpack_unit(vectors, groups: int):
    """The 8 byte vectors of a unit of `groups` groups (4 * groups words, given as 16-word
    vectors) concatenated: for j = 0..3, h = 0..1, slice 2j + h holds in lane e the nibbles h, h+2,
    h+4, h+6 (one per byte) of word 4e + j, i.e. lane e = group e."""
    mask = T.Broadcast(T.uint32(NIBBLE_MASK), groups)
    four = T.Broadcast(T.uint32(4), groups)
    parts = []
    for j in range(4):
        t = tirx.Shuffle(vectors, [4 * e + j for e in range(groups)])
        parts.append(T.bitwise_and(t, mask))
        parts.append(T.bitwise_and(T.shift_right(t, four), mask))
    return tirx.Shuffle(parts, list(range(8 * groups)))


MX_OFFSET = 12  # MXFP4's doubled FP4 values in [-12, 12] stored as unsigned bytes v + 12


def _fp4_bytes(words, lanes: int, width: int):
    """Each byte b (a nibble, 0..15) of the uint32 vector `words` (`lanes` lanes) replaced by
    FP4_DOUBLED[b] + MX_OFFSET: pshufb over a table repeated in each 128-bit lane, on pieces of
    `width` words (16: AVX-512BW's 512-bit form; 8: AVX2's)."""
    table = [v + MX_OFFSET for v in FP4_DOUBLED]
    name, nbytes = {16: ("llvm.x86.avx512.pshuf.b.512", 64),
                    8: ("llvm.x86.avx2.pshuf.b", 32)}[width]
    lut = tirx.Shuffle([T.int8(table[i % 16]) for i in range(nbytes)], list(range(nbytes)))
    parts = [
        T.reinterpret(f"uint32x{width}", T.call_llvm_pure_intrin(
            f"int8x{nbytes}", name, lut, T.reinterpret(f"int8x{nbytes}", piece)))
        for piece in _chunks(words, lanes, width)
    ]
    return parts[0] if len(parts) == 1 else tirx.Shuffle(parts, list(range(lanes)))


def gemv_q4_vnni_macro(
    k: int, n: int, dtype: str, bias: bool, rows: int = VNNI_ROWS, asym: bool = False,
    isa: str = "vnni", mx: bool = False,
):
    """The 4-bit GEMV with int8 activations and AVX-512 VNNI, as a macro `(x, w, s, b, y, m)`
    over the buffers of `gemv_q4_macro`. `isa` "avx2": the same layout with AVX2's pmaddubsw /
    pmaddwd in place of vpdpbusd (llama.cpp's AVX2 route) and units of 8 groups (`AVX2_UNIT`):
    at 128 rows 7-11% faster than 16 (Zen 4), whose 8 unpacked vectors fill all 16 registers.

    x is quantized once per call, per row and group of 32 values, to int8 (scale max|x| / 127,
    round to nearest even) in a layout matched to the weight words: a unit of G groups (16, or 4
    at the end of a row) is 4 G words; transposed (a 4 x G shuffle), lane e of vector j holds word
    4 e + j, all of group e; `words & 0x0F0F0F0F` and `(words >> 4) & 0x0F0F0F0F` are 4 unsigned
    bytes per lane, and the matching bytes of x sit at the same place in xq, so 8 vpdpbusd give
    lane e the integer dot product of group e. The -8 offset is the accumulator's start value,
    -8 * (sum of the group's int8 x). Each unit adds float(dot) * (w scale * x scale) to a float
    accumulator per row of x; rows of x run inside the unit loop in blocks of `rows`, so each
    unpacked weight vector serves the whole block, and a row's float operations are the same
    whatever the block, so its bits do not depend on the batch.

    `asym` (value q * scale + min; s holds scale and min side by side, split by a shuffle as a
    unit's are loaded): the accumulators start at 0 and each unit also adds min times the
    group's sum of the quantized x (x scale * the int8 sum, computed with the int8 values), so
    the result is the dequantized weights times the int8-rounded x, as in the symmetric modes
    (with the float sum of x instead, the min term would carry |w - min| rather than |w| times
    x's rounding: ~2.5x the error on Gaussian groups).

    `mx` (MXFP4: FP4 codes, E8M0 exponents): each unpacked nibble byte becomes its doubled FP4
    value plus 12 (an unsigned byte in [0, 24]) by one pshufb over a 16-entry table, the
    accumulators start at -12 * the group's int8 sum, and the scale is 2 ** (e - 128): the
    same integer dot products as the 4-bit kernel's, with a table lookup more per weight
    vector."""
    kp = padded_k(k)
    kw, kg = kp // NIBBLES_PER_WORD, kp // GROUP_SIZE
    layout, asym = asym, bool(asym)  # as in `gemv_q4_macro`
    offset = MX_OFFSET if mx else 8  # the unsigned weight bytes' offset from the signed value
    # groups per unit: 16 (one 512-bit vector of int32 lanes); with AVX2 8, so that a unit's 8
    # unpacked weight vectors fit in its 16 registers beside the row's accumulators
    ug = AVX2_UNIT if isa == "avx2" else LANES
    rows = AVX2_ROWS if isa == "avx2" and rows == VNNI_ROWS else rows
    nb = kg // ug  # full units of ug groups
    rem = kg % ug
    n4 = rem // 4  # whole units of 4 groups after them
    part = rem % 4  # groups of a last, partial unit of 4 (read through a zero-padded copy)
    has_part = part > 0
    both = nb > 0 and rem > 0
    only16 = nb > 0 and rem == 0
    kg4 = nb * ug + -(-rem // 4) * 4  # groups of xq: whole units
    g4 = nb * ug  # first group of the 4-group units
    gp = g4 + n4 * 4  # first group of the partial unit
    i32 = "int32"

    kfull = k // GROUP_SIZE  # groups wholly inside x: read with contiguous loads
    # The int8 bytes of a group in xq's order: word q = 2 j + h holds values 8 j + h + 2 b
    # (b = 0..3, byte b) of the group.
    perm = [8 * (q // 2) + q % 2 + 2 * bb for q in range(8) for bb in range(4)]

    def xgroup(x, r, g, masked: bool):
        return x_group(x, r, g, k, masked)

    @T.macro
    def prep_group(x, xq, xs, xo, r, g, word0, groups, e, masked):
        """Quantize group g of row r: xs = max |x| / 127, the 32 int8 values to their 8 words
        (word0 + q * groups + e, q = 0..7) and xo = -8 * their sum (`asym`: xo = xs * their
        sum, float)."""
        sc = T.alloc_buffer((2,), F32)
        qv = T.alloc_buffer((GROUP_SIZE,), i32)
        pk = T.alloc_buffer((8,), i32)
        sc[0] = lane_tree(T.fabs(xgroup(x, r, g, masked)), GROUP_SIZE, T.max)
        sc[1] = T.Select(sc[0] > T.float32(0), T.float32(127) / sc[0], T.float32(0))
        xs[r, g] = sc[0] / T.float32(127)
        qv[T.Ramp(0, 1, GROUP_SIZE)] = T.Cast(
            f"int32x{GROUP_SIZE}",
            T.nearbyint(xgroup(x, r, g, masked) * T.Broadcast(sc[1], GROUP_SIZE)),
        )
        pk[T.Ramp(0, 1, 8)] = T.reinterpret(
            "int32x8",
            tirx.Shuffle([T.Cast(f"int8x{GROUP_SIZE}", qv[T.Ramp(0, 1, GROUP_SIZE)])], perm),
        )
        for q in T.unroll(8):
            xq[r, word0 + q * groups + e] = pk[q]
        if asym:
            xo[r, g] = T.Cast(
                F32, lane_tree(qv[T.Ramp(0, 1, GROUP_SIZE)], GROUP_SIZE, add)
            ) * xs[r, g]
        else:
            xo[r, g] = lane_tree(qv[T.Ramp(0, 1, GROUP_SIZE)], GROUP_SIZE, add) * -offset

    # groups [0, g4) sit in units of 16, [g4, kg4) in units of 4; contiguous loads up to kfull
    f16, m16 = min(kfull, g4), g4
    f4, m4 = max(kfull, g4), kg4
    has_f16, has_m16, has_f4, has_m4 = f16 > 0, m16 > f16, f4 > g4, m4 > f4

    @T.macro
    def prep_row(x, xq, xs, xo, r):
        if has_f16:
            for g in range(f16):
                prep_group(x, xq, xs, xo, r, g, g // ug * 8 * ug, ug, g % ug, False)
        if has_m16:
            for g in range(f16, m16):
                prep_group(x, xq, xs, xo, r, g, g // ug * 8 * ug, ug, g % ug, True)
        if has_f4:
            for g in range(g4, f4):
                prep_group(
                    x, xq, xs, xo, r, g, (g4 + (g - g4) // 4 * 4) * 8, 4, (g - g4) % 4, False
                )
        if has_m4:
            for g in range(f4, m4):
                prep_group(
                    x, xq, xs, xo, r, g, (g4 + (g - g4) // 4 * 4) * 8, 4, (g - g4) % 4, True
                )

    @T.macro
    def prep(x, xq, xs, xo, m):
        if _many_rows(m):
            for r in T.parallel(m):
                prep_row(x, xq, xs, xo, r)
        else:
            for r in range(m):
                prep_row(x, xq, xs, xo, r)

    def unpack(vectors, groups: int):
        """A unit's weight bytes (`_unpack_unit`); MXFP4's through the FP4 table."""
        words = _unpack_unit(vectors, groups)
        return _fp4_bytes(words, 8 * groups, 16 if isa == "vnni" else 8) if mx else words

    def sym_scales(v, lanes: int):
        """A symmetric weight's scales as float32: MXFP4's E8M0 exponents as 2 ** (e - 128)
        (its bytes are doubled FP4 values)."""
        if mx:
            return e8m0(v, lanes) * (T.float32(0.5) if lanes == 1
                                     else T.Broadcast(T.float32(0.5), lanes))
        return T.Cast(F32 if lanes == 1 else f"float32x{lanes}", v)

    def chain(wl, xq, xo, r, g0, groups):
        acc = T.Broadcast(T.int32(0), groups) if asym else xo[r, T.Ramp(g0, 1, groups)]
        if isa == "avx2":
            # the 8 int16 partial sums add up in int16 (at most 8 * 2 * 15 * 127 = 30480 in
            # size), then one pmaddwd widens each lane pair: 8 + 7 + 1 operations per unit
            # where AVX-512 VNNI takes 8. MXFP4's bytes reach 24: 8 * 2 * 24 * 127 would
            # overflow int16, so its two halves are widened apart.
            span = 4 if mx else 8
            for half in range(8 // span):
                s16 = None
                for q in range(half * span, half * span + span):
                    p = _maddubs(
                        wl[T.Ramp(q * groups, 1, groups)],
                        xq[r, T.Ramp(g0 * XQ_WORDS_PER_GROUP + q * groups, 1, groups)],
                        groups,
                    )
                    s16 = p if s16 is None else s16 + p
                acc = acc + _madd_pairs(s16, groups)
            return T.Cast(f"float32x{groups}", acc)
        for q in range(8):
            acc = _dpbusd(
                acc,
                wl[T.Ramp(q * groups, 1, groups)],
                xq[r, T.Ramp(g0 * XQ_WORDS_PER_GROUP + q * groups, 1, groups)],
                groups,
            )
        return T.Cast(f"float32x{groups}", acc)

    def unit_term(wl, sl, ml, xq, xs, xo, r, g0, groups):
        value = chain(wl, xq, xo, r, g0, groups) * (
            sl[T.Ramp(0, 1, groups)] * xs[r, T.Ramp(g0, 1, groups)]
        )
        if asym:
            return value + ml[T.Ramp(0, 1, groups)] * xo[r, T.Ramp(g0, 1, groups)]
        return value

    @T.macro
    def unit(wl, sl, ml, facc, xq, xs, xo, r0, nrows, g0, groups):
        for rr in T.unroll(nrows):
            facc[T.Ramp(rr * groups, 1, groups)] = facc[T.Ramp(rr * groups, 1, groups)] + unit_term(
                wl, sl, ml, xq, xs, xo, r0 + rr, g0, groups
            )

    # Prefill (VNNI): a 4-group unit (or the partial one) of 4 rows of x at once, in 16 lanes
    # (row a's 4 beside the next rows', the weights' 4 lanes repeated), from copies of x's tail
    # interleaved by 4 rows (`prep4`): one vpdpbusd of 16 lanes for four of 4, which made a
    # short row's tail (k = 576: 16 groups then 2) cost as much as its 16-group unit. Each
    # lane's operations are `unit`'s, so the bits are the same.
    nu4 = n4 + int(has_part)  # the 4-group units of a row, the partial one included
    # prefill's blocks of rows (a multiple of 4) sum their lanes together (`rows_sums`) and,
    # with VNNI, take their 4-group units four rows at once
    tails4 = isa == "vnni" and nu4 > 0

    def fixed4(m) -> bool:
        """Whether a row-parallel call's rows (a constant m) run in blocks of 4 or more."""
        return isinstance(m, int) and m >= 4

    def blocks4(m):
        return (m + 3) // 4 if fixed4(m) else 1

    def rep4(v):  # 4 lanes, repeated to 16
        return tirx.Shuffle([v] * (LANES // 4), list(range(LANES)))

    def unit4_term(wr, sr, mr, xq4, xs4, xo4, rb, u):
        acc = T.Broadcast(T.int32(0), LANES) if asym else xo4[rb, T.Ramp(u * LANES, 1, LANES)]
        for q in range(8):
            acc = _dpbusd(
                acc,
                wr[T.Ramp(q * LANES, 1, LANES)],
                xq4[rb, T.Ramp((u * 8 + q) * LANES, 1, LANES)],
                LANES,
            )
        value = T.Cast(f"float32x{LANES}", acc) * (
            sr[T.Ramp(0, 1, LANES)] * xs4[rb, T.Ramp(u * LANES, 1, LANES)]
        )
        if asym:
            return value + mr[T.Ramp(0, 1, LANES)] * xo4[rb, T.Ramp(u * LANES, 1, LANES)]
        return value

    @T.macro
    def unit4(wl, sl, ml, f4, xq4, xs4, xo4, r0, nrows, u):
        """`unit` of 4 groups for the rows r0.. (nrows and r0 multiples of 4), four at once."""
        wr = T.alloc_buffer((8 * LANES,), "uint32")
        sr = T.alloc_buffer((LANES,), F32)
        if asym:
            mr = T.alloc_buffer((LANES,), F32)
            mr[T.Ramp(0, 1, LANES)] = rep4(ml[T.Ramp(0, 1, 4)])
        else:
            mr = T.meta_var(None)
        for q in T.unroll(8):
            wr[T.Ramp(q * LANES, 1, LANES)] = rep4(wl[T.Ramp(q * 4, 1, 4)])
        sr[T.Ramp(0, 1, LANES)] = rep4(sl[T.Ramp(0, 1, 4)])
        for a in T.unroll(nrows // 4):
            f4[T.Ramp(a * LANES, 1, LANES)] = f4[T.Ramp(a * LANES, 1, LANES)] + unit4_term(
                wr, sr, mr, xq4, xs4, xo4, r0 // 4 + a, u
            )

    @T.macro
    def tail_unit(wl, sl, ml, f4, xq, xs, xo, xq4, xs4, xo4, r0, nrows, g0, u, combined):
        if combined and tails4:
            unit4(wl, sl, ml, f4, xq4, xs4, xo4, r0, nrows, u)
        else:
            unit(wl, sl, ml, f4, xq, xs, xo, r0, nrows, g0, 4)

    @T.macro
    def prep4_row(xq, xs, xo, xq4, xs4, xo4, r):
        for u in range(nu4):
            for q in T.unroll(8):
                xq4[r // 4, T.Ramp((u * 8 + q) * LANES + r % 4 * 4, 1, 4)] = xq[
                    r, T.Ramp((g4 + u * 4) * XQ_WORDS_PER_GROUP + q * 4, 1, 4)
                ]
            xs4[r // 4, T.Ramp(u * LANES + r % 4 * 4, 1, 4)] = xs[r, T.Ramp(g4 + u * 4, 1, 4)]
            xo4[r // 4, T.Ramp(u * LANES + r % 4 * 4, 1, 4)] = xo[r, T.Ramp(g4 + u * 4, 1, 4)]

    @T.macro
    def prep4(xq, xs, xo, xq4, xs4, xo4, m):
        """x's 4-group units, rows interleaved by 4: lanes (r % 4) * 4 + e of row r // 4."""
        if _many_rows(m):
            for r in T.parallel(m):
                prep4_row(xq, xs, xo, xq4, xs4, xo4, r)
        else:
            for r in range(m):
                prep4_row(xq, xs, xo, xq4, xs4, xo4, r)

    def sum_lanes(buf, base, count):
        return lane_tree(buf[T.Ramp(base, 1, count)], count, add)

    def rows_sums(f16, f4, nrows):
        """Each of `nrows` rows' total, as `sum_lanes` of its f16 lanes plus of its f4 lanes."""
        sums16 = rows_lane_tree([f16[T.Ramp(a * ug, 1, ug)] for a in range(nrows)], ug, add)
        per = min(nrows * 4, LANES)
        sums4 = rows_lane_tree(
            [f4[T.Ramp(a, 1, per)] for a in range(0, nrows * 4, per)], 4, add)
        if both:
            return sums16 + sums4
        return sums16 if only16 else sums4

    # decode: rows longer than LONG_ROW_BYTES prefetch line by line (`prefetch_ahead`), shorter
    # rows the next rows' lines as each row starts (k = 2048, 2560: 3-6% faster than line by line)
    spread = kw * 4 > LONG_ROW_BYTES
    store = _store_macro(dtype, bias)
    nr = divisor(n, (TILE_ROWS, 32, 16, 8, 4, 2))  # rows of W per tile (prefill)
    # units per chunk of the reduction (prefill): CHUNK_K values of k; one chunk when k is short
    chunk_units = max(1, CHUNK_K // (ug * GROUP_SIZE))
    nchunks = -(-nb // chunk_units) if nb * ug * GROUP_SIZE > LONG_CHUNKED_K else 1

    @T.macro
    def units16(w, s, xq, xs, xo, f16, row, r0, nrows, u0, u1, pf):
        """Units [u0, u1) of 16 (AVX2: 8) groups of W's row `row`, added to the accumulators
        f16 [nrows * ug] of the rows r0.. of x; `pf` (decode, long rows): each unit prefetches
        the lines `PREFETCH_AHEAD` bytes past its own (`common.prefetch_ahead`)."""
        wl = T.alloc_buffer((8 * ug,), "uint32")
        if pf:
            wf = T.decl_buffer((n * kw,), "uint32", data=w.data, elem_offset=w.elem_offset)
        sl = T.alloc_buffer((ug,), F32)
        if asym:
            ml = T.alloc_buffer((ug,), F32)
        else:
            ml = T.meta_var(None)
        for u in range(u0, u1):
            if pf:
                for line in T.unroll(ug // 4):
                    prefetch_ahead(wf, row * kw + u * 4 * ug + line * 16, n * kw, 4)
            wl[T.Ramp(0, 1, 8 * ug)] = unpack(
                [w[row, T.Ramp(u * 4 * ug + v * ug, 1, ug)] for v in range(4)], ug
            )
            if asym:
                sl[T.Ramp(0, 1, ug)] = group_params_vec(s, row, u * ug, ug, 0, layout)
                ml[T.Ramp(0, 1, ug)] = group_params_vec(s, row, u * ug, ug, 1, layout)
            else:
                sl[T.Ramp(0, 1, ug)] = sym_scales(s[row, T.Ramp(u * ug, 1, ug)], ug)
            unit(wl, sl, ml, f16, xq, xs, xo, r0, nrows, u * ug, ug)

    @T.macro
    def finish(w, s, b, y, xq, xs, xo, wt, st, mt, tb, f16, row, r0, nrows, x4, combined):
        """The units of 4 groups and the partial unit of W's row `row` for the rows r0.. of x,
        then their outputs: the lanes of f16 (the units of 16, already summed) and of the
        4-group accumulators. `combined`: four rows of x at once (`unit4`, x4 = prep4's
        copies)."""
        wl = T.alloc_buffer((32,), "uint32")
        sl = T.alloc_buffer((4,), F32)
        if asym:
            ml = T.alloc_buffer((4,), F32)
        else:
            ml = T.meta_var(None)
        f4 = T.alloc_buffer((nrows * 4,), F32)
        for a in T.unroll(nrows):
            f4[T.Ramp(a * 4, 1, 4)] = T.Broadcast(T.float32(0), 4)
        for u in range(n4):
            wl[T.Ramp(0, 1, 32)] = unpack(
                [w[row, T.Ramp(g4 * WORDS_PER_GROUP + u * LANES, 1, LANES)]], 4
            )
            if asym:
                sl[T.Ramp(0, 1, 4)] = group_params_vec(s, row, g4 + u * 4, 4, 0, layout)
                ml[T.Ramp(0, 1, 4)] = group_params_vec(s, row, g4 + u * 4, 4, 1, layout)
            else:
                sl[T.Ramp(0, 1, 4)] = sym_scales(s[row, T.Ramp(g4 + u * 4, 1, 4)], 4)
            tail_unit(wl, sl, ml, f4, xq, xs, xo, x4[0], x4[1], x4[2], r0, nrows, g4 + u * 4, u,
                      combined)
        if has_part:
            wl[T.Ramp(0, 1, 32)] = unpack([wt[T.Ramp(tb * LANES, 1, LANES)]], 4)
            sl[T.Ramp(0, 1, 4)] = st[T.Ramp(tb * 4, 1, 4)]
            if asym:
                ml[T.Ramp(0, 1, 4)] = mt[T.Ramp(tb * 4, 1, 4)]
            tail_unit(wl, sl, ml, f4, xq, xs, xo, x4[0], x4[1], x4[2], r0, nrows, gp, n4,
                      combined)
        if combined:
            # the rows' lane sums together (`rows_lane_tree`: each row's tree as alone)
            tot = T.alloc_buffer((nrows,), F32)
            tot[T.Ramp(0, 1, nrows)] = rows_sums(f16, f4, nrows)
            for rr in range(nrows):
                store(y, b, r0 + rr, row, tot[rr])
        else:
            for rr in range(nrows):
                if both:
                    store(
                        y, b, r0 + rr, row,
                        sum_lanes(f16, rr * ug, ug) + sum_lanes(f4, rr * 4, 4),
                    )
                elif only16:
                    store(y, b, r0 + rr, row, sum_lanes(f16, rr * ug, ug))
                else:
                    store(y, b, r0 + rr, row, sum_lanes(f4, rr * 4, 4))

    @T.macro
    def block(w, s, b, y, xq, xs, xo, wt, st, mt, tb, row, r0, nrows, x4, combined, pf):
        f16 = T.alloc_buffer((nrows * ug,), F32)
        for a in T.unroll(nrows):
            f16[T.Ramp(a * ug, 1, ug)] = T.Broadcast(T.float32(0), ug)
        units16(w, s, xq, xs, xo, f16, row, r0, nrows, 0, nb, pf)
        finish(w, s, b, y, xq, xs, xo, wt, st, mt, tb, f16, row, r0, nrows, x4, combined)

    @T.macro
    def chunk(w, s, xq, xs, xo, acc, base, row, r0, c):
        """Chunk c of the units of 16 of W's row `row` for the `rows` rows r0.. of x, its
        accumulators carried in acc[base:base + rows * ug] (a store and a reload are exact)."""
        f16 = T.alloc_buffer((rows * ug,), F32)
        for a in T.unroll(rows):
            f16[T.Ramp(a * ug, 1, ug)] = acc[T.Ramp(base + a * ug, 1, ug)]
        units16(w, s, xq, xs, xo, f16, row, r0, rows, c * chunk_units,
                T.min(c * chunk_units + chunk_units, nb), False)
        for a in T.unroll(rows):
            acc[T.Ramp(base + a * ug, 1, ug)] = f16[T.Ramp(a * ug, 1, ug)]

    @T.macro
    def part_copy(w, s, wt, st, mt, tb, row):
        """The last, partial unit of W's row `row` (and its scales), zero-padded to 4 groups,
        into slot `tb` of wt, st (and mt)."""
        if has_part:
            for i in range(LANES):
                wt[tb * LANES + i] = T.Select(
                    i < part * WORDS_PER_GROUP,
                    w[row, T.min(gp * WORDS_PER_GROUP + i, kw - 1)],
                    T.uint32(0),
                )
            if asym:
                for i in range(4):
                    st[tb * 4 + i] = T.Select(
                        i < part, group_param(s, row, T.min(gp + i, kg - 1), 0, layout),
                        T.float32(0)
                    )
                    mt[tb * 4 + i] = T.Select(
                        i < part, group_param(s, row, T.min(gp + i, kg - 1), 1, layout),
                        T.float32(0),
                    )
            else:
                for i in range(4):
                    st[tb * 4 + i] = T.Select(
                        i < part, sym_scales(s[row, T.min(gp + i, kg - 1)], 1), T.float32(0)
                    )

    @T.macro
    def chunked_blocks(w, s, b, y, xq, xs, xo, wt, st, mt, acc, tile, rb, x4):
        """A block of `rows` rows of x against a tile of `nr` rows of W, the reduction split into
        chunks of `chunk_units` units: each chunk of the block's int8 x stays in L1 while the
        tile's rows pass (a block of a long row does not fit: 8 rows of k = 8192 are 64 KiB,
        and were read from L2 once per row of W). Each accumulator lane takes the same units in
        the same order as `block`'s, so the bits are the same."""
        for i in range(nr * rows):
            acc[T.Ramp(i * ug, 1, ug)] = T.Broadcast(T.float32(0), ug)
        for c in range(nchunks):
            for rr in range(nr):
                chunk(w, s, xq, xs, xo, acc, rr * rows * ug, tile * nr + rr, rb * rows, c)
        for rr in range(nr):
            f16 = T.alloc_buffer((rows * ug,), F32)
            for a in T.unroll(rows):
                f16[T.Ramp(a * ug, 1, ug)] = acc[T.Ramp((rr * rows + a) * ug, 1, ug)]
            finish(w, s, b, y, xq, xs, xo, wt, st, mt, rr, f16, tile * nr + rr, rb * rows, rows,
                   x4, True)

    @T.macro
    def tail_blocks(w, s, b, y, xq, xs, xo, wt, st, mt, tb, row, m, x4, combined, pf):
        """The rows of x after the whole blocks of `rows`, in blocks of 4, 2 and 1."""
        if m % rows >= 4:
            block(w, s, b, y, xq, xs, xo, wt, st, mt, tb, row, m - m % rows, 4, x4, combined,
                  pf)
        if m % 4 >= 2:
            block(w, s, b, y, xq, xs, xo, wt, st, mt, tb, row, m - m % 4, 2, x4, False, pf)
        if m % 2 == 1:
            block(w, s, b, y, xq, xs, xo, wt, st, mt, tb, row, m - 1, 1, x4, False, pf)

    ahead = row_prefetch(n, kw, 4)  # decode: W's rows ahead

    @T.macro
    def vnni(x, w, s, b, y, m):
        xq = T.alloc_buffer((m, kg4 * XQ_WORDS_PER_GROUP), i32)
        xs = T.alloc_buffer((m, kg4), F32)
        xo = T.alloc_buffer((m, kg4), F32 if asym else i32)
        prep(x, xq, xs, xo, m)
        if m > rows:
            # Many rows (prefill): a block of x (rows x k bytes of int8) meets a tile of `nr`
            # rows of W before the next block, so it is read from L1 rather than from L2 once
            # per row of W (which bounded the kernel at L2's bandwidth); the tile's weights
            # come from L2. A row's operations are the same as untiled.
            xq4 = T.alloc_buffer(((m + 3) // 4, max(nu4, 1) * 8 * LANES), i32)
            xs4 = T.alloc_buffer(((m + 3) // 4, max(nu4, 1) * LANES), F32)
            xo4 = T.alloc_buffer(((m + 3) // 4, max(nu4, 1) * LANES), F32 if asym else i32)
            x4 = T.meta_var((xq4, xs4, xo4))
            if tails4:
                prep4(xq, xs, xo, xq4, xs4, xo4, m)
            for tile in T.parallel(n // nr):
                # each row's partial unit, copied once per tile
                wt = T.alloc_buffer((nr * LANES,), "uint32")
                st = T.alloc_buffer((nr * 4,), F32)
                if asym:
                    mt = T.alloc_buffer((nr * 4,), F32)
                else:
                    mt = T.meta_var(None)
                for rr in range(nr):
                    part_copy(w, s, wt, st, mt, rr, tile * nr + rr)
                if nchunks > 1:
                    acc = T.alloc_buffer((nr * rows * ug,), F32)
                    for rb in range(m // rows):
                        chunked_blocks(w, s, b, y, xq, xs, xo, wt, st, mt, acc, tile, rb, x4)
                else:
                    for rb in range(m // rows):
                        for rr in range(nr):
                            block(w, s, b, y, xq, xs, xo, wt, st, mt, rr, tile * nr + rr,
                                  rb * rows, rows, x4, True, False)
                for rr in range(nr):
                    tail_blocks(w, s, b, y, xq, xs, xo, wt, st, mt, rr, tile * nr + rr, m, x4,
                                True, False)
        else:
            # a constant m of 4 or more (the MoE experts' blocks of rows) combines as prefill
            # does; decode's one row cannot
            xq4 = T.alloc_buffer((blocks4(m), max(nu4, 1) * 8 * LANES), i32)
            xs4 = T.alloc_buffer((blocks4(m), max(nu4, 1) * LANES), F32)
            xo4 = T.alloc_buffer((blocks4(m), max(nu4, 1) * LANES), F32 if asym else i32)
            x4 = T.meta_var((xq4, xs4, xo4))
            if tails4 and fixed4(m):
                prep4(xq, xs, xo, xq4, xs4, xo4, m)
            for row in T.parallel(n):
                wt = T.alloc_buffer((LANES,), "uint32")
                st = T.alloc_buffer((4,), F32)
                if asym:
                    mt = T.alloc_buffer((4,), F32)
                else:
                    mt = T.meta_var(None)
                if not spread:
                    ahead(w, row)
                part_copy(w, s, wt, st, mt, 0, row)
                for rb in range(m // rows):
                    block(w, s, b, y, xq, xs, xo, wt, st, mt, 0, row, rb * rows, rows, x4,
                          fixed4(m), spread)
                tail_blocks(w, s, b, y, xq, xs, xo, wt, st, mt, 0, row, m, x4, fixed4(m),
                            spread)

    return vnni


def gemv_prim_func(body, k: int, n: int, dtype: str, weight: tuple, scale: tuple,
                   bias: bool) -> tirx.PrimFunc:
    """The PrimFunc (x [m, k], w, s[, b [n]], y [m, n]) around a GEMV macro `body(x, w, s, b,
    y, m)`; `weight` and `scale`: (shape, dtype) of w and s. One row (single-sequence decode)
    has its own copy of the body with m = 1 known (see `gemv_q4`)."""
    (w_shape, w_dtype), (s_shape, s_dtype) = weight, scale
    if bias:

        @T.prim_func(private=True)
        def func(var_x: T.handle, w: T.Buffer(w_shape, w_dtype), s: T.Buffer(s_shape, s_dtype),
                 b: T.Buffer((n,), dtype), var_y: T.handle):
            m = T.int64()
            x = T.match_buffer(var_x, (m, k), dtype)
            y = T.match_buffer(var_y, (m, n), dtype)
            if m == 1:
                body(x, w, s, b, y, 1)
            else:
                body(x, w, s, b, y, m)

    else:

        @T.prim_func(private=True)
        def func(var_x: T.handle, w: T.Buffer(w_shape, w_dtype), s: T.Buffer(s_shape, s_dtype),
                 var_y: T.handle):
            m = T.int64()
            x = T.match_buffer(var_x, (m, k), dtype)
            y = T.match_buffer(var_y, (m, n), dtype)
            if m == 1:
                body(x, w, s, None, y, 1)
            else:
                body(x, w, s, None, y, m)

    return scheduled(func)


@functools.cache  # parsing the TVMScript is most of a model's export time
def gemv_q4(
    k: int, n: int, dtype: str, avx512: bool | str = False, bias: bool = False, asym: bool = False,
    scale_dtype: str | None = None, mx: bool = False,
) -> tirx.PrimFunc:
    """y[m, n] = x[m, k] @ dequant(W[n, kp/8], S[n, kp/32])^T (+ b), m small (decode); kp =
    `padded_k(k)`, the stored width (columns past k are padding).

    `asym`: the asymmetric modes' weights, value q * scale + min, S [n, 2 kp/32] of
    `scale_dtype` (default float16) with each group's scale and min side by side, or with
    uint8 (`K_SCALE_DTYPE`) q4f32_k's Q4_K super-block form [n, `q4_k_width`(kp/32)];
    otherwise (q - 8) * S with S of `scale_dtype` (default `dtype`; float16 in the modes
    holding llama.cpp's Q4_0); `mx`: MXFP4 (FP4 codes, S uint8 E8M0 exponents). Every kernel
    reads the group parameters through a conversion to float32, so only the buffer's type
    changes.
    `avx512`: True: unpack with a table lookup (the target must have AVX-512F;
    `common.has_avx512`); "vnni": int8 activations and VNNI dot products (`gemv_q4_vnni_macro`;
    the target must have AVX-512 VNNI, `common.has_avx512_vnni`), results within int8 rounding of
    x (~1e-3 relative) rather than float rounding; "avx2": the same with AVX2's pmaddubsw, in
    units of 8 groups instead of 16 (so not the same bits as "vnni": float partial sums differ).
    One row (single-sequence decode) has its own copy of the body with m = 1 known: with
    no-alias buffers LLVM schedules the short-k loops of the dynamic-m body ~1.4x slower
    (k = 512: 34 vs 24 us, Zen 4, 2 threads)."""
    kw, kg = padded_k(k) // NIBBLES_PER_WORD, padded_k(k) // GROUP_SIZE
    # the group parameters
    if asym:
        asym = asym_layout(scale_dtype)
        ks, sdt = asym_width(asym, kg), scale_dtype or "float16"
    else:
        ks, sdt = kg, "uint8" if mx else scale_dtype or dtype
    body = gemv_q4_macro(k, n, dtype, bias, avx512, asym, mx)
    return gemv_prim_func(body, k, n, dtype, ((n, kw), "uint32"), ((n, ks), sdt), bias)


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


def gemv_q8_macro(k: int, n: int, dtype: str, bias: bool):
    """The 8-bit GEMV in float arithmetic (any CPU), as a macro `(x, w, s, b, y, m)` over x [m,
    k], w [n, kp] int8, s [n, kp/32] float16, b [n] (None without `bias`) and y [m, n].

    Per row of W and of x, each group of 32 is two 16-lane products of the int8 weights
    (sign-extended and converted) with x, summed, times the group's scale into a 16-lane
    accumulator; a group that runs past k reads x through a select (zeros past k). Rows of W in
    blocks of 4 share each load of x; rows of x run outside, so a row's result does not depend
    on the others. About 9 instructions per 32 weights: ~5x slower than the VNNI form on a large
    head (SmolLM2's, 28 MB, Zen 4: 4-5 ms against 0.9 ms)."""
    kp = padded_k(k)
    kfull = k // GROUP_SIZE  # groups wholly inside x
    part = kp > k  # a last group that runs past k
    rb = divisor(n, (ROWS, 2))
    half = GROUP_SIZE // 2
    v16 = f"float32x{LANES}"

    def half_dot(w, x, row, r, g, h, masked: bool):
        """The 16 products of half h of group g of row `row` of W with row r of x."""
        idx = T.Ramp(g * GROUP_SIZE + h * half, 1, half)
        wv = T.Cast(v16, w[row, idx])
        if not masked:
            return wv * T.Cast(v16, x[r, idx])
        xv = T.Select(
            idx < T.Broadcast(k, half),
            T.Cast(v16, x[r, T.min(idx, T.Broadcast(k - 1, half))]),
            T.Broadcast(T.float32(0), half),
        )
        return wv * xv

    def group_term(w, s, x, row, r, g, masked: bool):
        return T.Broadcast(T.Cast(F32, s[row, g]), LANES) * (
            half_dot(w, x, row, r, g, 0, masked) + half_dot(w, x, row, r, g, 1, masked)
        )

    store = _store_macro(dtype, bias)

    @T.macro
    def body(x, w, s, b, y, m):
        for jo in T.parallel(n // rb):
            acc = T.alloc_buffer((rb * LANES,), F32)
            for r in range(m):
                for jj in T.unroll(rb):
                    acc[T.Ramp(jj * LANES, 1, LANES)] = T.Broadcast(T.float32(0), LANES)
                for g in range(kfull):
                    for jj in T.unroll(rb):
                        acc[T.Ramp(jj * LANES, 1, LANES)] = acc[
                            T.Ramp(jj * LANES, 1, LANES)
                        ] + group_term(w, s, x, jo * rb + jj, r, g, False)
                if part:
                    for jj in T.unroll(rb):
                        acc[T.Ramp(jj * LANES, 1, LANES)] = acc[
                            T.Ramp(jj * LANES, 1, LANES)
                        ] + group_term(w, s, x, jo * rb + jj, r, kfull, True)
                for jj in range(rb):
                    store(
                        y, b, r, jo * rb + jj,
                        lane_tree(acc[T.Ramp(jj * LANES, 1, LANES)], LANES, add),
                    )

    return body


SIGN_FLIP = -0x7F7F7F80  # 0x80808080 as int32: xor turns int8 bytes into uint8 bytes + 128


def gemv_q8_vnni_macro(
    k: int, n: int, dtype: str, bias: bool, rows: int = VNNI_ROWS, isa: str = "vnni"
):
    """The 8-bit GEMV with int8 activations and AVX-512 VNNI, as a macro `(x, w, s, b, y, m)`
    over the buffers of `gemv_q8_macro`; `isa` "avx2": the same with `_dot_s8s8` (pmaddubsw on
    |w| and x signed by w) in place of vpdpbusd.

    x is quantized once per call as in the 4-bit VNNI GEMV (per row and group of 32, int8 at scale
    max |x| / 127), in its natural order: xq word j of group g holds values 4 j .. 4 j + 3.
    vpdpbusd multiplies unsigned by signed bytes, so x is stored flipped to q + 128 (uint8) and
    each accumulator lane starts at -128 times the sum of its 4 weights (wc, once per row of W
    and block of x): a lane then holds the exact dot product of 4 weights with 4 x. One 64-byte
    vector is two groups (lanes 0-7 and 8-15); the lane's integer becomes float and is
    multiplied by its group's weight scale times x scale, both read as 16-lane vectors (x's
    scales written 8 times each by the quantization, xe), into a 16-lane accumulator per row of
    x; a last odd group runs in 8 lanes. Padding weights (past k, stored 0) meet x quantized to
    0. Rows of x run in blocks of `rows` sharing each loaded weight vector and its wc and
    scales; a row's operations do not depend on the block, nor on the tiling below."""
    kp = padded_k(k)
    kg = kp // GROUP_SIZE
    kfull = k // GROUP_SIZE
    npairs = kg // 2  # vectors of two groups
    odd = kg % 2 == 1  # a last single group
    g_odd = kg - 1
    wpg = GROUP_SIZE // 4  # int32 words of a group
    i32 = "int32"
    flip_x = isa != "avx2"  # vpdpbusd: x as uint8 (q + 128), started at -128 * sum(w)

    def xgroup(x, r, g, masked: bool):
        return x_group(x, r, g, k, masked)

    def x_words(qv):
        """A group's int8 x as 8 words, flipped to uint8 (q + 128) for vpdpbusd."""
        words = T.reinterpret(f"int32x{wpg}", T.Cast(f"int8x{GROUP_SIZE}", qv))
        return T.bitwise_xor(words, T.Broadcast(T.int32(SIGN_FLIP), wpg)) if flip_x else words

    @T.macro
    def prep_group(x, xq, xe, r, g, masked):
        sc = T.alloc_buffer((2,), F32)
        qv = T.alloc_buffer((GROUP_SIZE,), i32)
        sc[0] = lane_tree(T.fabs(xgroup(x, r, g, masked)), GROUP_SIZE, T.max)
        sc[1] = T.Select(sc[0] > T.float32(0), T.float32(127) / sc[0], T.float32(0))
        xe[r, T.Ramp(g * wpg, 1, wpg)] = T.Broadcast(sc[0] / T.float32(127), wpg)
        qv[T.Ramp(0, 1, GROUP_SIZE)] = T.Cast(
            f"int32x{GROUP_SIZE}",
            T.nearbyint(xgroup(x, r, g, masked) * T.Broadcast(sc[1], GROUP_SIZE)),
        )
        xq[r, T.Ramp(g * wpg, 1, wpg)] = x_words(qv[T.Ramp(0, 1, GROUP_SIZE)])

    @T.macro
    def prep_row(x, xq, xe, r):
        for g in range(kfull):
            prep_group(x, xq, xe, r, g, False)
        if kg > kfull:
            prep_group(x, xq, xe, r, kfull, True)

    @T.macro
    def prep(x, xq, xe, m):
        if _many_rows(m):
            for r in T.parallel(m):
                prep_row(x, xq, xe, r)
        else:
            for r in range(m):
                prep_row(x, xq, xe, r)

    def wvec(w, row, byte0, lanes):
        """`lanes` words of row `row` of W from byte byte0 (4 signed bytes each)."""
        return T.reinterpret(f"uint32x{lanes}", w[row, T.Ramp(byte0, 1, 4 * lanes)])

    def wsums(wv, lanes):
        """-128 times the sum of each word's 4 signed bytes: vpdpbusd's start for flipped x."""
        zero = T.Broadcast(T.int32(0), lanes)
        return zero - _dpbusd(zero, T.Broadcast(T.int32(SIGN_FLIP), lanes), wv, lanes)

    def dot(wv, wc, xq, r, word0, lanes):
        xw = xq[r, T.Ramp(word0, 1, lanes)]
        if isa == "avx2":
            return T.Cast(f"float32x{lanes}", _dot_s8s8(wv, xw, lanes))
        return T.Cast(f"float32x{lanes}", _dpbusd(wc, xw, wv, lanes))

    store = _store_macro(dtype, bias)

    @T.macro
    def block(w, s, b, y, xq, xe, row, r0, nrows):
        wv = T.alloc_buffer((LANES,), "uint32")
        wc = T.alloc_buffer((LANES,), i32)
        se = T.alloc_buffer((LANES,), F32)
        f16 = T.alloc_buffer((nrows * LANES,), F32)
        f8 = T.alloc_buffer((nrows * 8,), F32)
        for a in T.unroll(nrows):
            f16[T.Ramp(a * LANES, 1, LANES)] = T.Broadcast(T.float32(0), LANES)
            f8[T.Ramp(a * 8, 1, 8)] = T.Broadcast(T.float32(0), 8)
        for c in range(npairs):
            wv[T.Ramp(0, 1, LANES)] = wvec(w, row, c * 2 * GROUP_SIZE, LANES)
            if flip_x:
                wc[T.Ramp(0, 1, LANES)] = wsums(wv[T.Ramp(0, 1, LANES)], LANES)
            se[T.Ramp(0, 1, LANES)] = tirx.Shuffle(
                [T.Broadcast(T.Cast(F32, s[row, 2 * c + h]), 8) for h in range(2)],
                list(range(LANES)),
            )
            for rr in T.unroll(nrows):
                f16[T.Ramp(rr * LANES, 1, LANES)] = f16[T.Ramp(rr * LANES, 1, LANES)] + dot(
                    wv[T.Ramp(0, 1, LANES)], wc[T.Ramp(0, 1, LANES)], xq, r0 + rr,
                    c * LANES, LANES,
                ) * (se[T.Ramp(0, 1, LANES)] * xe[r0 + rr, T.Ramp(c * LANES, 1, LANES)])
        if odd:
            wv[T.Ramp(0, 1, 8)] = wvec(w, row, g_odd * GROUP_SIZE, 8)
            if flip_x:
                wc[T.Ramp(0, 1, 8)] = wsums(wv[T.Ramp(0, 1, 8)], 8)
            se[T.Ramp(0, 1, 8)] = T.Broadcast(T.Cast(F32, s[row, g_odd]), 8)
            for rr in T.unroll(nrows):
                f8[T.Ramp(rr * 8, 1, 8)] = f8[T.Ramp(rr * 8, 1, 8)] + dot(
                    wv[T.Ramp(0, 1, 8)], wc[T.Ramp(0, 1, 8)], xq, r0 + rr, g_odd * wpg, 8
                ) * (se[T.Ramp(0, 1, 8)] * xe[r0 + rr, T.Ramp(g_odd * wpg, 1, 8)])
        for rr in range(nrows):
            if odd:
                store(
                    y, b, r0 + rr, row,
                    lane_tree(f16[T.Ramp(rr * LANES, 1, LANES)], LANES, add)
                    + lane_tree(f8[T.Ramp(rr * 8, 1, 8)], 8, add),
                )
            else:
                store(y, b, r0 + rr, row, lane_tree(f16[T.Ramp(rr * LANES, 1, LANES)], LANES, add))

    @T.macro
    def tail_blocks(w, s, b, y, xq, xe, row, m):
        """The rows of x after the whole blocks of `rows`, in blocks of 4, 2 and 1."""
        if m % rows >= 4:
            block(w, s, b, y, xq, xe, row, m - m % rows, 4)
        if m % 4 >= 2:
            block(w, s, b, y, xq, xe, row, m - m % 4, 2)
        if m % 2 == 1:
            block(w, s, b, y, xq, xe, row, m - 1, 1)

    nr = divisor(n, (TILE_ROWS, 32, 16, 8, 4, 2))

    ahead = row_prefetch(n, kp, 1)  # decode: W's rows ahead

    @T.macro
    def vnni(x, w, s, b, y, m):
        xq = T.alloc_buffer((m, kg * wpg), i32)
        xe = T.alloc_buffer((m, kg * wpg), F32)
        prep(x, xq, xe, m)
        if m > rows:
            # Many rows (prefill, every matrix of the 8-bit modes): as in the 4-bit GEMV, a
            # block of x meets a tile of `nr` rows of W before the next block, so it is read
            # from L1; a row's operations are the same as untiled.
            for tile in T.parallel(n // nr):
                for rb in range(m // rows):
                    for rr in range(nr):
                        block(w, s, b, y, xq, xe, tile * nr + rr, rb * rows, rows)
                for rr in range(nr):
                    tail_blocks(w, s, b, y, xq, xe, tile * nr + rr, m)
        else:
            for row in T.parallel(n):
                ahead(w, row)
                for rb in range(m // rows):
                    block(w, s, b, y, xq, xe, row, rb * rows, rows)
                tail_blocks(w, s, b, y, xq, xe, row, m)

    return vnni


@functools.cache  # parsing the TVMScript is most of a model's export time
def gemv_q8(
    k: int, n: int, dtype: str, avx512: bool | str = False, bias: bool = False
) -> tirx.PrimFunc:
    """y[m, n] = x[m, k] @ dequant(W[n, kp], S[n, kp/32])^T (+ b) for the 8-bit embedding and LM
    head of the asymmetric modes (`quantization.quantize_q8`: int8 W, float16 S, value W * S; kp
    = `padded_k(k)`, the padding columns 0).

    `avx512`: "vnni" / "avx2": int8 activations and integer dot products (`gemv_q8_vnni_macro`;
    results within int8 rounding of x, as the 4-bit int8 GEMVs'); anything else: float arithmetic
    (`gemv_q8_macro`), which LLVM vectorizes for the target."""
    if avx512 in INT8_ISAS:
        body = gemv_q8_vnni_macro(k, n, dtype, bias, isa=avx512)
    else:
        body = gemv_q8_macro(k, n, dtype, bias)
    kp = padded_k(k)
    return gemv_prim_func(body, k, n, dtype, ((n, kp), "int8"),
                          ((n, kp // GROUP_SIZE), "float16"), bias)
