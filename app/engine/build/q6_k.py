"""llama.cpp's Q6_K held exactly: the 6-bit layout of q4f32_k's embedding and LM head.

llama.cpp keeps the output head of its Q4_K_M (and Q4_0, Q4_1) files in Q6_K: super-blocks of
256 weights, each with a float16 d and per sub-block of 16 an int8 sc, value d * sc * (q - 32)
for a 6-bit q. Held in 8 bits instead (our other modes' heads) a 3B model's head reads 30% more
bytes per token than llama.cpp's, and its values are rounded a second time. Here a row of K
weights (K a multiple of 256) is two uint8 arrays, 6.5625 bits a weight as in Q6_K:

* the codes, 192 bytes per super-block, laid out for the kernel (`kernels.gemv_q6`): sub-block
  e's 16 codes are 4 quads, quad v (codes 4 v .. 4 v + 3) at bytes 4 e .. 4 e + 3 of "vector" v;
  vectors 0 and 1 share 64 bytes as low and high nibbles of the codes' low 4 bits (bytes 0-63),
  vectors 2 and 3 likewise (bytes 64-127), and bytes 128-191 hold the 2 high bits of all four
  (vector v at bits 2 v, 2 v + 1). So one 64-byte load per part and a few masks give 64 codes
  as bytes, lane e (4 bytes) of every vector belonging to sub-block e;
* the parameters, K / 16 + K / 128 bytes: the sub-blocks' sc (int8 as uint8), then each
  super-block's d as little-endian float16 bytes.

`quantize_q6_k` finds a block's d, sc and q again from the float32 values a Q6_K block
dequantizes to (d * sc is exact in float32, and so is its product with q - 32: at most 19 and 5
significant bits), so a GGUF import keeps llama.cpp's head exactly; other weights are quantized
as llama.cpp's reference Q6_K quantizer does (without its error search).
"""

from __future__ import annotations

import numpy as np

from localchat.errors import QuantizationError

SUPER = 256  # weights per super-block
SUB = 16  # weights per sub-block (one int8 sc)
SUBS = SUPER // SUB  # sub-blocks per super-block
CODE_BYTES = 192  # bytes of codes per super-block (6 bits a weight)
_Q6_MIN, _Q6_MAX = -32, 31  # q - 32
_SC_MIN, _SC_MAX = -128, 127
_CHUNK = 1 << 14  # super-blocks quantized at a time (bounds the temporaries)


def holds(cols: int) -> bool:
    """Whether a matrix with `cols` columns (its reduction size) can be held in Q6_K: whole
    super-blocks only, as llama.cpp requires (it keeps other heads in Q8_0, as we do)."""
    return cols % SUPER == 0


def param_width(cols: int) -> int:
    """Bytes of a row's parameters: an sc per sub-block, a float16 d per super-block."""
    return cols // SUB + 2 * (cols // SUPER)


def code_width(cols: int) -> int:
    """Bytes of a row's 6-bit codes."""
    return cols // SUPER * CODE_BYTES


def _factor_subblocks(n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For integers n [R, 16, 16] (a super-block's values over d), each sub-block's sc with
    n == sc * m for m in [-32, 31] and sc in [-128, 127], the largest |sc| (the smallest |m|);
    returns (sc [R, 16], found [R, 16]). An all-zero sub-block has sc 0."""
    gs = np.gcd.reduce(np.abs(n), axis=-1)
    hi, lo = n.max(axis=-1), n.min(axis=-1)
    sc = np.zeros(gs.shape, np.int64)
    done = gs == 0

    def take(s: np.ndarray, mask: np.ndarray) -> None:
        pos = mask & (s <= _SC_MAX) & (hi <= _Q6_MAX * s) & (lo >= _Q6_MIN * s)
        neg = mask & ~pos & (-lo <= _Q6_MAX * s) & (-hi >= _Q6_MIN * s)
        sc[pos] = s[pos]
        sc[neg] = -s[neg]
        done[pos | neg] = True

    # the gcd itself is the answer unless the sub-block's m share a factor (rare)
    take(gs, ~done & (gs <= -_SC_MIN))
    if not done.all():
        for s in range(-_SC_MIN, 0, -1):
            rest = ~done & (gs % s == 0)
            if rest.any():
                take(np.full(gs.shape, s, np.int64), rest)
    return sc, done


def _exact_blocks(v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For super-blocks v [B, 16, 16] (float32), (found [B], d [B] float16, sc [B, 16], m
    [B, 16, 16]) with d * sc * m == v exactly, where a Q6_K factorization exists: all values are
    integer multiples of d (their float gcd divided by a small j, d float16), and each
    sub-block's multiples factor as sc * m with sc in [-128, 127] and m in [-32, 31] (the
    largest such |sc| is taken)."""
    b = v.shape[0]
    d = np.zeros(b, np.float16)
    sc = np.zeros((b, SUBS), np.int64)
    m = np.zeros((b, SUBS, SUB), np.int64)
    found = np.zeros(b, bool)
    v64 = v.astype(np.float64)
    amax = np.abs(v64).reshape(b, -1).max(axis=-1)
    zero = amax == 0
    found[zero] = True
    # every value as an integer at a common power of two: exact for Q6_K's values (their lowest
    # set bit is at most 35 bits below the block's largest value)
    exp = np.frexp(np.where(zero, 1.0, amax))[1]
    ints = v64 * np.ldexp(1.0, 40 - exp)[:, None, None]
    whole = (ints == np.rint(ints)).reshape(b, -1).all(axis=-1) & ~zero
    rows = np.flatnonzero(whole)
    if rows.size == 0:
        return found, d, sc, m
    i64 = np.rint(ints[rows]).astype(np.int64)
    g = np.gcd.reduce(np.abs(i64).reshape(rows.size, -1), axis=-1)
    n = i64 // g[:, None, None]  # the values over their gcd: d * sc * m = gcd * n
    small = np.abs(n).reshape(rows.size, -1).max(axis=-1) <= -_SC_MIN * -_Q6_MIN
    rows, g, n, e = rows[small], g[small], n[small], exp[rows][small]
    for j in range(1, 33):  # |d| = gcd / j
        for sign in (1, -1):  # d of either sign: sc is -128 .. 127, q - 32 is -32 .. 31
            if rows.size == 0:
                break
            cand = sign * np.ldexp(g.astype(np.float64), e - 40) / j
            with np.errstate(over="ignore"):
                c16 = cand.astype(np.float16)
            ok = (c16.astype(np.float64) == cand) & np.isfinite(c16)
            nj = n * (sign * j)
            sub_sc, done = _factor_subblocks(nj)
            hit = ok & done.all(axis=-1)
            idx = rows[hit]
            safe = np.where(sub_sc[hit] == 0, 1, sub_sc[hit])
            d[idx] = c16[hit]
            sc[idx] = sub_sc[hit]
            m[idx] = np.where(sub_sc[hit][..., None] == 0, 0, nj[hit] // safe[..., None])
            found[idx] = True
            keep = ~hit
            rows, g, n, e = rows[keep], g[keep], n[keep], e[keep]
    return found, d, sc, m


def _reference_blocks(v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's reference Q6_K of super-blocks v [B, 16, 16] without its error search: per
    sub-block the value of largest magnitude maps to q - 32 = -32; d = the largest such scale
    / -128 (float16), sc = its scale / d rounded (at most 127), q rounded at d * sc."""
    pick = np.take_along_axis(v, np.abs(v).argmax(axis=-1)[..., None], -1)[..., 0]
    scale = pick / np.float32(_Q6_MIN)  # [B, 16]: the picked value at q - 32 = -32
    top = np.take_along_axis(scale, np.abs(scale).argmax(axis=-1)[:, None], -1)[:, 0]
    safe_top = np.where(top == 0, np.float32(1), top)
    iscale = np.float32(_SC_MIN) / safe_top
    with np.errstate(over="ignore"):
        d = np.where(top == 0, 0, np.float32(1) / iscale).astype(np.float16)
    if not np.isfinite(d).all():
        raise QuantizationError("weights beyond float16's range cannot be held in Q6_K")
    sc = np.minimum(_SC_MAX, np.rint(iscale[:, None] * scale)).astype(np.int64)
    step = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    safe = np.where(step == 0, np.float32(1), step)
    m = np.clip(np.rint(v / safe[..., None]), _Q6_MIN, _Q6_MAX)
    m = np.where(step[..., None] == 0, 0, m).astype(np.int64)
    return d, sc, m


def _pack_codes(q: np.ndarray) -> np.ndarray:
    """Codes q [B, 16, 16] (0..63; sub-block e, position 4 v + b) as the kernel's 192 bytes per
    super-block (the module docstring's layout)."""
    quads = q.reshape(q.shape[0], SUBS, 4, 4).transpose(0, 2, 1, 3)  # [B, v, e, b]
    quads = quads.reshape(q.shape[0], 4, 64).astype(np.uint8)
    low, high = quads & 15, quads >> 4
    out = np.empty((q.shape[0], CODE_BYTES), np.uint8)
    out[:, :64] = low[:, 0] | (low[:, 1] << 4)
    out[:, 64:128] = low[:, 2] | (low[:, 3] << 4)
    out[:, 128:] = high[:, 0] | (high[:, 1] << 2) | (high[:, 2] << 4) | (high[:, 3] << 6)
    return out


def _unpack_codes(raw: np.ndarray) -> np.ndarray:
    """Inverse of `_pack_codes`: [B, 192] bytes -> codes [B, 16, 16]."""
    a, b, h = raw[:, :64], raw[:, 64:128], raw[:, 128:]
    low = np.stack([a & 15, a >> 4, b & 15, b >> 4], axis=1)  # [B, v, 64]
    high = np.stack([(h >> (2 * v)) & 3 for v in range(4)], axis=1)
    quads = (low | (high << 4)).reshape(raw.shape[0], 4, SUBS, 4)  # [B, v, e, b]
    return quads.transpose(0, 2, 1, 3).reshape(raw.shape[0], SUBS, SUB)


def quantize_q6_k(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pack a float [N, K] matrix (K a multiple of 256) into (codes uint8 [N, 3K/4], params
    uint8 [N, K/16 + K/128]); blocks dequantized from Q6_K come back exactly."""
    weight = np.asarray(weight, np.float32)
    n, k = weight.shape
    if not holds(k):
        raise QuantizationError(f"Q6_K holds rows of whole 256-weight super-blocks, not {k}")
    if not np.isfinite(weight).all():
        raise QuantizationError("weights must be finite to be quantized")
    blocks = weight.reshape(-1, SUBS, SUB)
    codes = np.empty((blocks.shape[0], CODE_BYTES), np.uint8)
    d_all = np.empty(blocks.shape[0], np.float16)
    sc_all = np.empty((blocks.shape[0], SUBS), np.int8)
    for start in range(0, blocks.shape[0], _CHUNK):
        v = blocks[start:start + _CHUNK]
        found, d, sc, m = _exact_blocks(v)
        if not found.all():  # float weights: quantized as llama.cpp's reference does
            rd, rsc, rm = _reference_blocks(v[~found])
            d[~found], sc[~found], m[~found] = rd, rsc, rm
        codes[start:start + _CHUNK] = _pack_codes(m + 32)
        d_all[start:start + _CHUNK] = d
        sc_all[start:start + _CHUNK] = sc
    sb = k // SUPER
    params = np.concatenate(
        [sc_all.reshape(n, sb * SUBS).view(np.uint8), d_all.reshape(n, sb).view(np.uint8)],
        axis=1)
    return codes.reshape(n, sb * CODE_BYTES), np.ascontiguousarray(params)


def dequantize_q6_k(codes: np.ndarray, params: np.ndarray) -> np.ndarray:
    """Inverse of `quantize_q6_k` (float32 [N, K]), computed as llama.cpp dequantizes Q6_K:
    (d * sc) * (q - 32)."""
    n = codes.shape[0]
    sb = codes.shape[1] // CODE_BYTES
    q = _unpack_codes(codes.reshape(n * sb, CODE_BYTES)).astype(np.float32) - 32
    sc = params[:, : sb * SUBS].view(np.int8).astype(np.float32).reshape(n * sb, SUBS)
    d = params[:, sb * SUBS:].copy().view(np.float16).astype(np.float32).reshape(n * sb, 1)
    return ((d * sc)[..., None] * q).reshape(n, sb * SUPER)
