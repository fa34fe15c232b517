"""Quantization modes by name, and how each packs a weight matrix.

`qAfB_1` follows MLC-LLM's naming: A is the weight bit width (0 = unquantized), fB the float type
of activations and scales. The `_1` 4-bit modes are symmetric group quantization: groups of 32
consecutive values along the reduction axis share one scale (max |w| / 7); each value is stored
as a nibble q in [0, 15] meaning (q - 8) * scale, eight nibbles per uint32 word, the first value
of a word in its lowest bits.

`q4f32_asym` and `q4f16_asym` are asymmetric (llama.cpp's Q4_1): the same groups and nibble
packing, but each group has a scale and a min, both stored as float16 whatever the activation
type, and q means q * scale + min. The quantizer takes min = the group's min and scale = (group
max - min) / 15, both rounded to float16 as stored before q = round((w - min) / scale) is
computed, so 32 weights take 20 bytes as in q4f32_1, and a group that came from a Q4_1 GGUF
(value d * q + m in float32) round-trips exactly: min is m, scale is d, q is q. Scale and min sit
side by side in one float16 array [N, 2 Kp/32] (scale of group g at 2 g, its min at 2 g + 1), so
a row's group parameters are one stream of 4 bytes per group, as q4f32_1's float32 scales (kept
apart, the mins cost the decode GEMV 10-15% on the 1B shape's layers). The suffix says what the
mode is rather than MLC's number (MLC's q4f16_2 etc. are other layouts).

`q4f32_k` holds llama.cpp's Q4_K in its own super-block form: per row, super-blocks of 8 groups
(256 weights) with a float16 d and dmin, and per group of 32 a 6-bit sc and m; value
d * sc * q - dmin * m. The nibbles are packed as in the other 4-bit modes; the group parameters
are one uint8 row of 16 bytes per super-block (`Q4_K_PARAM_BYTES`; a last, partial super-block
takes 16 too): for its group i (0..7) byte i holds the low 4 bits of sc (bits 0-3) and of m (bits
4-7), byte 8 + i // 2 the high 2 bits of sc at bit 2 (i % 2) and of m at bit 4 + 2 (i % 2), then
d and dmin as little-endian float16 at bytes 12 and 14. 32 weights take 18 bytes: 4.5 bits a
weight, as Q4_K (the same bits, ordered for the kernels: a lane finds its group's sc or m with two
byte shuffles, two shifts and an or), against q4f32_1's 5. The
kernels take the scale d * sc and the min -(dmin * m) in float32, both exact there (as
llama.cpp's dequantization computes them), so q * scale + min rounds as its d1 * q - m1 does.
The quantizer finds each group's scale and min (`_q4_k_groups`: min = the group's min, and S
found again from the group's max at q = 15 .. 1, within a few float32 ulps of (max - min) / q:
exact for every group that has its min at q = 0, as llama.cpp's Q4_K quantizer gives each group,
checked on the 1B shape's Q4_K_M file), then each super-block's d and sc with d * sc = S exactly
(d = S / j for the largest S, j = 63 .. 1, as float16; likewise dmin and m): a super-block that
came from a Q4_K block keeps its d, dmin, sc, m and q exactly. Other super-blocks (float weights,
a Q6_K matrix converted to q4f32_k by another route) are quantized as llama.cpp's simple
Q4_K quantizer does: min clamped to <= 0, scale (max - min) / 15, d = the largest scale / 63 and
dmin = the largest -min / 63 as float16, sc and m rounded to 6 bits, q from the 6-bit values.
q4f32_k keeps the token embedding and LM head in Q6_K (`q6_k`, 6.5625 bits a weight, as
llama.cpp keeps them) where their rows are whole super-blocks of 256, else in the 8-bit layout
below (llama.cpp's Q8_0 fallback for such rows). A Q4_K_M file's Q6_K attn_v and ffn_down (the
layers llama.cpp gives more bits) are held in Q6_K too, v apart from q and k there: the GGUF
import records which (`llama.LlamaConfig.q6_k_layers`), so every matrix of the file comes back
exactly.

`q4f32_0` and `q4f16_0` hold llama.cpp's Q4_0: the symmetric modes' arithmetic, (q - 8) * d, with
d stored as float16 whatever the activation type, so 32 weights take 18 bytes as in a Q4_0 block.
The quantizer is llama.cpp's (d = the group's value of largest magnitude / -8, so that value is
q = 0, q = trunc(w / d + 8.5) clamped to 15), except that a group already of the form (q - 8) * d
for a float16 d (a group dequantized from any Q4_0 file, llama.cpp's own or one with other
rounding, e.g. importance-weighted) keeps exactly that d and those q: a GGUF import dequantizes
to float32 and re-quantizes to the same bits. Their embedding and LM head are 8-bit, as in the
asymmetric modes (llama.cpp's Q4_0 files keep the output head in Q6_K, held to 8 bits, and the
token embedding of an untied model in Q4_0, which the 8-bit quantizer holds exactly: each group's
scale is then |d| and its values q - 8).

In the asymmetric modes (q4f32_k: where not Q6_K) the token embedding table and the LM head (tied to
it or not) are 8-bit instead, as llama.cpp keeps them in its Q4_1 files (Q8_0 or Q6_K): per group of
32 a float16 scale (max |w| / 127) and int8 values q in [-127, 127], value q * scale, stored as an
int8 matrix [N, Kp] (zero padding), 34 bytes per 32 weights. A Q8_0 tensor round-trips exactly. With
the embedding re-quantized to 4 bits instead, SmolLM2-135M's greedy top-1 agreement with q0f32 is
87% (its Q4_1 GGUF holds the embedding in Q8_0, the rest round-trips exactly); with 8 bits, 100% in
float arithmetic.

`q8f32_0` and `q8f16_0` hold llama.cpp's Q8_0: every weight matrix in that 8-bit layout (the
embedding and LM head too), run by the 8-bit GEMV (`kernels.gemv.gemv_q8`) at every step and in
the grouped expert GEMV of MoE models. A Q8_0 file's blocks come back exactly (each group's
largest |q| is 127, so the quantizer finds d again, and d * q is exact in float32).

A reduction size K that is not a multiple of 32 is padded to the next multiple before packing (as
MLC-LLM's group quantization does): the stored matrix is [N, ceil(K/32)*32] and its last group
holds the K % 32 real values plus padding. In the symmetric modes the padding is zero weights,
nibble 8, exactly 0 whatever the scale; in the asymmetric ones it repeats the row's last value
(so the group's min and max are those of its real values), and is not 0. Kernels read only the
first K inputs (x is taken as zero past K), so the padding never shows in either.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from localchat.errors import QuantizationError

GROUP_SIZE = 32
NIBBLES_PER_WORD = 8
SUPER_GROUPS = 8  # groups of 32 per Q4_K super-block (256 weights)
SUPER_MAX = 63  # Q4_K's sc and m are 6-bit
K_SCALE_DTYPE = "uint8"  # q4f32_k's group parameters: bytes, `Q4_K_PARAM_BYTES` a super-block
Q4_K_PARAM_BYTES = 16  # 6-bit sc and m of 8 groups (12 bytes), float16 d and dmin


@dataclass(frozen=True)
class QuantMode:
    """One quantization mode: weight bits (0 = none) and the model's float type."""

    name: str
    bits: int
    dtype: str
    asymmetric: bool = False  # 4-bit: a min per group as well as a scale (value q * scale + min)
    gguf_type: str = ""  # the llama.cpp block type the mode holds exactly ("Q4_0", "Q4_1", "Q4_K")
    scale_type: str = ""  # the group parameters' type when not the default (`group_dtype`)
    experts: str = ""  # the MoE experts' format when not the mode's own ("MXFP4")
    head_format: str = ""  # the embedding / LM head's llama.cpp type when not 8-bit ("Q6_K")

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    @property
    def head_bits(self) -> int:
        """Weight bits of the token embedding and the LM head: 8 in the modes that hold a
        llama.cpp type (Q4_0, Q4_1, Q4_K), as llama.cpp keeps them (Q8_0, Q6_K); q4f32_k's
        are Q6_K (`head_format`) where their rows are whole super-blocks."""
        return 8 if self.gguf_type else self.bits

    @property
    def kv_dtype(self) -> str:
        """The KV cache's type: float16 in the quantized modes (half the bytes a long context
        reads per token, and half its memory, as llama.cpp keeps it), the activation type in
        the float modes (q0f32 stays exact)."""
        return "float16" if self.quantized else self.dtype

    def state_dtype(self, state: str) -> str:
        """The type of an architecture's per-sequence state (`Architecture.state`): a KV
        cache's `kv_dtype`, a recurrent state's activation type."""
        return self.kv_dtype if state == "kv" else self.dtype

    @property
    def group_dtype(self) -> str:
        """The type the group scales (and mins) are stored in: float16 in the modes that hold a
        llama.cpp type (its blocks' d and m), the activation type in the others; uint8 in
        q4f32_k (Q4_K's super-block form, `K_SCALE_DTYPE`)."""
        return self.scale_type or ("float16" if self.gguf_type else self.dtype)

    def group_width(self, groups: int) -> int:
        """The length of a 4-bit weight's row of group parameters for `groups` groups."""
        if self.group_dtype == K_SCALE_DTYPE:
            return q4_k_width(groups)
        return 2 * groups if self.asymmetric else groups


QUANT_MODES: dict[str, QuantMode] = {
    m.name: m
    for m in (
        QuantMode("q0f32", 0, "float32"),
        QuantMode("q0f16", 0, "float16"),
        QuantMode("q4f32_1", 4, "float32"),
        QuantMode("q4f16_1", 4, "float16"),
        QuantMode("q4f32_asym", 4, "float32", asymmetric=True, gguf_type="Q4_1"),
        QuantMode("q4f16_asym", 4, "float16", asymmetric=True, gguf_type="Q4_1"),
        QuantMode("q4f32_0", 4, "float32", gguf_type="Q4_0"),
        QuantMode("q4f16_0", 4, "float16", gguf_type="Q4_0"),
        QuantMode("q4f32_k", 4, "float32", asymmetric=True, gguf_type="Q4_K",
                  scale_type=K_SCALE_DTYPE, head_format="Q6_K"),
        QuantMode("q8f32_0", 8, "float32", gguf_type="Q8_0"),
        QuantMode("q4f32_mx", 8, "float32", gguf_type="Q8_0", experts="MXFP4"),
        QuantMode("q8f16_0", 8, "float16", gguf_type="Q8_0"),
    )
}


def get_quant_mode(name: str) -> QuantMode:
    """The mode called `name`, or a QuantizationError listing the known ones."""
    try:
        return QUANT_MODES[name]
    except KeyError:
        known = ", ".join(QUANT_MODES)
        raise QuantizationError(f"unknown quantization {name!r} (known: {known})") from None


def q4_k_width(groups: int) -> int:
    """Bytes of q4f32_k's group parameters for a row of `groups` groups: `Q4_K_PARAM_BYTES` per
    super-block of `SUPER_GROUPS` (6-bit sc and m per group, float16 d and dmin)."""
    return Q4_K_PARAM_BYTES * -(-groups // SUPER_GROUPS)


def pack_q4_k_params(sc: np.ndarray, m: np.ndarray, d: np.ndarray,
                     dmin: np.ndarray) -> np.ndarray:
    """q4f32_k's parameter bytes [N, 16 SB] from sc and m [N, SB, 8] (integers 0..63) and d and
    dmin [N, SB] (float16); the layout is the module docstring's."""
    n, nsb = d.shape
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    out = np.empty((n, nsb, Q4_K_PARAM_BYTES), np.uint8)
    out[..., :8] = (sc & 15) | ((m & 15) << 4)
    hi = ((sc >> 4) & 3) | (((m >> 4) & 3) << 4)  # [N, SB, 8]: bits of sc at 0, of m at 4
    out[..., 8:12] = hi[..., 0::2] | (hi[..., 1::2] << 2)
    out[..., 12:16] = np.stack([d.astype(np.float16), dmin.astype(np.float16)],
                               axis=-1).view(np.uint8).reshape(n, nsb, 4)
    return out.reshape(n, nsb * Q4_K_PARAM_BYTES)


def unpack_q4_k_params(params: np.ndarray) -> tuple[np.ndarray, ...]:
    """(sc, m [N, SB, 8] as uint8; d, dmin [N, SB] as float16) of q4f32_k's parameter bytes."""
    n = params.shape[0]
    blocks = params.reshape(n, -1, Q4_K_PARAM_BYTES)
    lo = blocks[..., :8]
    hi = np.repeat(blocks[..., 8:12], 2, axis=-1) >> np.tile(np.array([0, 2], np.uint8), 4)
    sc = (lo & 15) | ((hi & 3) << 4)
    m = (lo >> 4) | (((hi >> 4) & 3) << 4)
    dd = np.ascontiguousarray(blocks[..., 12:16]).view(np.float16)
    return sc, m, dd[..., 0], dd[..., 1]


def padded_k(k: int) -> int:
    """The reduction size `k` rounded up to whole quantization groups (the stored width)."""
    return -(-k // GROUP_SIZE) * GROUP_SIZE


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Nibbles q [N, Kp] (0..15) as uint32 words [N, Kp/8], the first nibble in the lowest bits."""
    n, kp = q.shape
    q = q.reshape(n, kp // NIBBLES_PER_WORD, NIBBLES_PER_WORD).astype(np.uint32)
    shifts = (np.arange(NIBBLES_PER_WORD, dtype=np.uint32) * 4)[None, None, :]
    return np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)


def _unpack_nibbles(words: np.ndarray) -> np.ndarray:
    """Inverse of `_pack_nibbles`: int32 nibbles [N, Kw*8]."""
    n, kw = words.shape
    shifts = (np.arange(NIBBLES_PER_WORD, dtype=np.uint32) * 4)[None, None, :]
    return ((words[..., None] >> shifts) & 15).astype(np.int32).reshape(n, kw * NIBBLES_PER_WORD)


def _groups(weight: np.ndarray, bits: int, edge: bool = False) -> tuple[int, int, np.ndarray]:
    """(N, Kp, float32 groups [N, Kp/32, 32]) of a float [N, K] matrix padded to Kp =
    `padded_k(K)`: with zeros, or with each row's last value (`edge`)."""
    if weight.ndim != 2:
        raise QuantizationError(f"cannot {bits}-bit quantize a tensor of shape {weight.shape}")
    n, k = weight.shape
    kp = padded_k(k)
    weight = weight.astype(np.float32)
    if kp != k:
        weight = np.pad(weight, ((0, 0), (0, kp - k)), mode="edge" if edge else "constant")
    return n, kp, weight.reshape(n, kp // GROUP_SIZE, GROUP_SIZE)


def quantize_q4(weight: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Pack a float [N, K] matrix into (uint32 words [N, Kp/8], scales [N, Kp/32] of `dtype`),
    Kp = `padded_k(K)`: the columns past K are zero weights."""
    n, kp, groups = _groups(weight, 4)
    scale = (np.abs(groups).max(axis=-1) / 7.0).astype(dtype)
    # Divide by the scale as stored, so dequantization reproduces the rounding we chose here.
    safe = np.where(scale == 0, 1.0, scale.astype(np.float32))
    q = np.clip(np.rint(groups / safe[..., None]), -8, 7).astype(np.int32) + 8
    return _pack_nibbles(q.reshape(n, kp)), scale


def quantize_q4_asym(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pack a float [N, K] matrix asymmetrically into (uint32 words [N, Kp/8], float16 scales
    and mins [N, 2 Kp/32], side by side), Kp = `padded_k(K)`; value = q * scale + min. The
    columns past K repeat each row's last value (not 0: kernels read only the first K)."""
    n, kp, groups = _groups(weight, 4, edge=True)
    low = groups.min(axis=-1).astype(np.float16)
    # The range from the min as stored, and q from the scale and min as stored, so that
    # dequantization reproduces the rounding chosen here.
    with np.errstate(over="ignore", invalid="ignore"):
        scale = ((groups.max(axis=-1) - low.astype(np.float32)) / np.float32(15)).astype(np.float16)
    if not (np.isfinite(low).all() and np.isfinite(scale).all()):
        raise QuantizationError("weights beyond float16's range cannot be 4-bit quantized "
                                "asymmetrically (the group scales and mins are float16)")
    s32 = scale.astype(np.float32)
    safe = np.where(s32 == 0, np.float32(1), s32)
    q = np.rint((groups - low.astype(np.float32)[..., None]) / safe[..., None])
    q = np.clip(q, 0, 15).astype(np.int32)
    scale_min = np.stack([scale, low], axis=-1).reshape(n, 2 * (kp // GROUP_SIZE))
    return _pack_nibbles(q.reshape(n, kp)), scale_min


def _exact_q4_0(groups: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Which groups [..., 32] (float32) are exactly (q - 8) * d with q in 0..15 for their float16
    d [...] (a product that float32 holds exactly)."""
    d32 = d.astype(np.float32)
    safe = np.where(d32 == 0, np.float32(1), d32)
    k = np.rint(groups / safe[..., None])
    ok = (k >= -8) & (k <= 7) & (k * d32[..., None] == groups)
    return ok.all(axis=-1) & np.isfinite(d32)


def quantize_q4_0(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pack a float [N, K] matrix as llama.cpp's Q4_0 into (uint32 words [N, Kp/8], float16
    scales [N, Kp/32]), value (q - 8) * d, Kp = `padded_k(K)` (zero padding). A group that is
    already (q - 8) * d for a float16 d keeps that d (see the module docstring)."""
    n, kp, groups = _groups(weight, 4)
    # llama.cpp: d = (the value of largest magnitude, sign kept) / -8, rounded to float16
    pick = np.take_along_axis(groups, np.abs(groups).argmax(axis=-1)[..., None], -1)[..., 0]
    d_full = pick / np.float32(-8)  # llama.cpp rounds q with 1 / this, unrounded
    with np.errstate(over="ignore"):
        d = d_full.astype(np.float16)
    if not np.isfinite(d).all():
        raise QuantizationError("weights beyond float16's range cannot be 4-bit quantized "
                                "as Q4_0 (the group scales are float16)")
    exact = _exact_q4_0(groups, d)
    # A group of the form (q - 8) * d whose extreme value is not q = 0: its extreme is
    # j * |d| for j in 1..8, one of 16 candidate d (signs both ways).
    top = np.abs(pick)
    flat_d, flat_exact = d.reshape(-1), exact.reshape(-1)
    flat_groups, flat_top = groups.reshape(-1, GROUP_SIZE), top.reshape(-1)
    for j in range(8, 0, -1):
        for sign in (-1, 1):
            todo = np.flatnonzero(~flat_exact)
            if todo.size == 0:
                break
            cand = (flat_top[todo] / np.float32(sign * j)).astype(np.float16)
            hit = _exact_q4_0(flat_groups[todo], cand)
            flat_d[todo[hit]] = cand[hit]
            flat_exact[todo[hit]] = True
        if not flat_exact.any():
            break  # no group is on a Q4_0 lattice: float weights, not a Q4_0 file's
    d32 = d.astype(np.float32)
    inv = np.where(d_full == 0, np.float32(0),
                   np.float32(1) / np.where(d_full == 0, np.float32(1), d_full))
    # llama.cpp's rounding (x * (1/d) + 8.5, truncated, d before its rounding to float16); the
    # exact groups by division by the stored d, which gives their integers exactly
    q = np.minimum(np.trunc(groups * inv[..., None] + np.float32(8.5)), 15)
    q_exact = np.rint(groups / np.where(d32 == 0, 1, d32)[..., None]) + 8
    q = np.where(exact[..., None], q_exact, q)
    q = np.clip(q, 0, 15).astype(np.int32)
    return _pack_nibbles(q.reshape(n, kp)), d


def _q4_k_groups(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scale, min, exact) per group of `flat` [M, 32] (float32): a group of the form
    q * S + min with its min at q = 0 (every group of a Q4_K block llama.cpp wrote: S = d * sc
    and -min = dmin * m, exact in float32) gets that S and min and `exact`; others min = the
    group's min and scale = (max - min) / 15."""
    low, high = flat.min(axis=-1), flat.max(axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):
        scale = ((high - low) / np.float32(15)).astype(np.float32)
    if not (np.isfinite(low).all() and np.isfinite(scale).all()):
        raise QuantizationError("weights beyond float32's range cannot be 4-bit quantized")

    def lattice(g: np.ndarray, lo: np.ndarray, sc: np.ndarray) -> np.ndarray:
        """Whether q * sc + lo gives the groups g [M, 32] exactly."""
        safe = np.where(sc == 0, np.float32(1), sc)
        q = np.clip(np.rint((g - lo[:, None]) / safe[:, None]), 0, 15).astype(np.float32)
        return (q * sc[:, None] + lo[:, None] == g).all(axis=-1)

    exact = lattice(flat, low, scale)
    # The block's S from its largest value, at q = 15 .. 1: within a few float32 ulps of
    # (max - min) / q, the rounding of max = S q - (-min) in float32.
    found = bool(exact.any())
    for top in range(15, 0, -1):
        for step in (0, -1, 1, -2, 2, -3, 3, -4, 4):
            todo = np.flatnonzero(~exact)
            if todo.size == 0:
                break
            cand = ((high[todo] - low[todo]) / np.float32(top)).astype(np.float32)
            direction = np.float32(np.inf if step > 0 else -np.inf)
            for _ in range(abs(step)):
                cand = np.nextafter(cand, direction)
            hit = lattice(flat[todo], low[todo], cand)
            found = found or bool(hit.any())
            scale[todo[hit]] = cand[hit]
            exact[todo[hit]] = True
        if top == 15 and not found:
            break  # no group is on such a lattice: float weights, not a Q4_K file's
    return scale, low, exact


def _six_bit_factor(values: np.ndarray, todo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For super-blocks `values` [B, 8] (float32), a float16 factor f and 6-bit integers c
    [B, 8] with f * c == values exactly, found for the rows `todo` (bool [B]) where one exists
    (f = the value of largest magnitude / j, j = 63 .. 1); returns (f, found)."""
    f = np.zeros(values.shape[0], np.float16)
    found = np.zeros(values.shape[0], bool)
    pick = np.take_along_axis(values, np.abs(values).argmax(axis=-1)[:, None], -1)[:, 0]
    zero = todo & (pick == 0)
    found[zero] = True
    rows = np.flatnonzero(todo & ~zero)
    for j in range(SUPER_MAX, 0, -1):
        if rows.size == 0:
            break
        with np.errstate(over="ignore"):
            cand = (pick[rows] / np.float32(j)).astype(np.float16)
        c32 = cand.astype(np.float32)
        safe = np.where(c32 == 0, np.float32(1), c32)
        c = np.rint(values[rows] / safe[:, None])
        hit = ((c * c32[:, None] == values[rows]).all(axis=-1) & (c >= 0).all(axis=-1)
               & (c <= SUPER_MAX).all(axis=-1) & np.isfinite(c32) & (c32 != 0))
        f[rows[hit]] = cand[hit]
        found[rows[hit]] = True
        rows = rows[~hit]
    return f, found


def _shifted_mins(values: np.ndarray, scale: np.ndarray, low: np.ndarray
                  ) -> tuple[np.float16, np.ndarray] | None:
    """For a super-block's groups `values` [8, 32] held exactly by q * scale + low with low the
    group's smallest value: a float16 dmin and the groups' mins -(dmin * m), m in 0..63, such
    that each group's values are q * scale - dmin * m with q in 0..15 (some group's smallest
    value at q > 0), or None. Candidates: dmin = (j scale - low) / c of one group."""
    j = np.arange(16, dtype=np.float32)
    mins = j[None, :] * scale[:, None] - low[:, None]  # [8, 16]: -min if the low is at q = j
    c = np.arange(1, SUPER_MAX + 1, dtype=np.float32)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        cands = np.unique((mins.reshape(-1)[:, None] / c[None, :]).astype(np.float16))
        cands = cands[np.isfinite(cands) & (cands > 0)].astype(np.float32)
        m = np.rint(mins[None] / cands[:, None, None])  # [C, 8, 16]
        fits = (m >= 0) & (m <= SUPER_MAX) & (m * cands[:, None, None] == mins[None])
    for ci in np.flatnonzero(fits.any(axis=-1).all(axis=-1)):
        dm = cands[ci]
        for_groups = []
        for g in range(SUPER_GROUPS):
            for jj in np.flatnonzero(fits[ci, g]):
                lo = -(m[ci, g, jj] * dm)
                safe = scale[g] if scale[g] != 0 else np.float32(1)
                q = np.clip(np.rint((values[g] - lo) / safe), 0, 15)
                if np.array_equal(q * scale[g] + lo, values[g]):
                    for_groups.append(lo)
                    break
            else:
                break
        if len(for_groups) == SUPER_GROUPS:
            return np.float16(dm), np.array(for_groups, np.float32)
    return None


def quantize_q4_k(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pack a float [N, K] matrix in q4f32_k's Q4_K super-block form into (uint32 words
    [N, Kp/8], uint8 group parameters [N, `q4_k_width`(Kp/32)]), value d * sc * q - dmin * m
    (see the module docstring): a super-block dequantized from a Q4_K block keeps its values
    exactly. Columns past K repeat each row's last value."""
    n, kp, groups = _groups(weight, 4, edge=True)
    kg = kp // GROUP_SIZE
    nsb = -(-kg // SUPER_GROUPS)
    # super-blocks of 8 groups, the last padded with groups of zeros (parameters 0, unused)
    blocks = np.zeros((n, nsb * SUPER_GROUPS, GROUP_SIZE), np.float32)
    blocks[:, :kg] = groups
    flat = blocks.reshape(-1, GROUP_SIZE)
    supers_of = blocks.reshape(-1, SUPER_GROUPS, GROUP_SIZE)  # [super-blocks, 8, 32]
    scale, low, exact = _q4_k_groups(flat)
    scale, low = scale.reshape(-1, SUPER_GROUPS), low.reshape(-1, SUPER_GROUPS)
    whole = exact.reshape(-1, SUPER_GROUPS).all(axis=-1)
    d, d_ok = _six_bit_factor(scale, whole)
    dmin, m_ok = _six_bit_factor(-low, whole)
    for b in np.flatnonzero(whole & d_ok & ~m_ok):
        # a group whose smallest value is not at q = 0: its min is dmin * m below that value
        found = _shifted_mins(supers_of[b], scale[b], low[b])
        if found is not None:
            dmin[b], low[b] = found
            m_ok[b] = True
    held = whole & d_ok & m_ok
    # the others as llama.cpp's simple Q4_K quantizer: mins <= 0, 6-bit scales and mins
    free = ~held
    lo = np.minimum(low[free], 0)
    hi = supers_of[free].max(axis=-1)
    sc_f = (hi - lo) / np.float32(15)
    with np.errstate(over="ignore"):
        d[free] = (sc_f.max(axis=-1) / np.float32(SUPER_MAX)).astype(np.float16)
        dmin[free] = ((-lo).max(axis=-1) / np.float32(SUPER_MAX)).astype(np.float16)
    if not (np.isfinite(d).all() and np.isfinite(dmin).all()):
        raise QuantizationError("weights beyond float16's range cannot be quantized as Q4_K "
                                "(its super-block scales are float16)")
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.rint(scale / np.where(d32 == 0, np.float32(1), d32)[:, None])
    m = np.rint(-low / np.where(dmin32 == 0, np.float32(1), dmin32)[:, None])
    with np.errstate(invalid="ignore", divide="ignore"):
        sc[free] = np.rint(sc_f / np.where(d32[free] == 0, np.float32(1), d32[free])[:, None])
        m[free] = np.rint(-lo / np.where(dmin32[free] == 0, np.float32(1), dmin32[free])[:, None])
    sc = np.clip(sc, 0, SUPER_MAX).astype(np.float32)
    m = np.clip(m, 0, SUPER_MAX).astype(np.float32)
    s_eff = sc * d32[:, None]  # exact in float32, as the kernels compute them
    min_eff = -(m * dmin32[:, None])
    safe = np.where(s_eff == 0, np.float32(1), s_eff)
    q = np.rint((supers_of - min_eff[..., None]) / safe[..., None])
    q = np.clip(q, 0, 15).astype(np.int32).reshape(n, nsb * SUPER_GROUPS * GROUP_SIZE)[:, :kp]
    params = pack_q4_k_params(sc.reshape(n, nsb, SUPER_GROUPS), m.reshape(n, nsb, SUPER_GROUPS),
                              d.reshape(n, nsb), dmin.reshape(n, nsb))
    return _pack_nibbles(q), params


def q4_k_scale_min(params: np.ndarray, groups: int) -> np.ndarray:
    """q4f32_k's group parameters [N, `q4_k_width`(groups)] as float32 scales and mins side
    by side [N, 2 groups] (d * sc and -(dmin * m), as the kernels compute them)."""
    n = params.shape[0]
    sc, m, d, dmin = unpack_q4_k_params(params)
    out = np.empty((n, groups, 2), np.float32)
    scales = sc.astype(np.float32) * d.astype(np.float32)[..., None]  # [N, SB, 8]
    mins = m.astype(np.float32) * dmin.astype(np.float32)[..., None]
    out[..., 0] = scales.reshape(n, -1)[:, :groups]
    out[..., 1] = -mins.reshape(n, -1)[:, :groups]
    return out.reshape(n, 2 * groups)


# FP4 (E2M1) values of the 16 codes, sign in the high bit (OCP microscaling)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
_FP4_MAGNITUDES = (6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5)
_E8M0_BIAS = 127


_MX_CHUNK = 1 << 18  # groups of 32 quantized at a time: bounds the temporaries (~32 MB each)


def quantize_mx(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pack a float [N, K] matrix as MXFP4 into (uint32 words [N, Kp/8] of FP4 codes, uint8 E8M0
    exponents [N, Kp/32]), value FP4(q) * 2 ** (e - 127), Kp = `padded_k(K)` (zero padding). A
    group that already is FP4 values times a power of two (an MXFP4 checkpoint's or GGUF's,
    expanded to float) keeps exactly those values; others get the OCP rule: e from the group's
    largest magnitude (2 ** (floor(log2 amax) - 2)), each value rounded to the nearest FP4
    value (ties to the even code), beyond 6 saturated."""
    n, kp, groups = _groups(weight, 4)
    flat = groups.reshape(-1, GROUP_SIZE)
    codes = np.empty(flat.shape, np.uint8)
    exps = np.empty(flat.shape[0], np.uint8)
    for start in range(0, flat.shape[0], _MX_CHUNK):
        part = slice(start, start + _MX_CHUNK)
        codes[part], exps[part] = _mx_groups(flat[part])
    return _pack_nibbles(codes.reshape(n, kp)), exps.reshape(n, kp // GROUP_SIZE)


# the midpoints between consecutive FP4 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6
_FP4_MIDPOINTS = ((FP4_VALUES[:7] + FP4_VALUES[1:8]) / 2).astype(np.float32)


def _mx_groups(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes [M, 32] uint8, E8M0 exponents [M] uint8) of float32 groups [M, 32]
    (`quantize_mx`)."""
    amax = np.abs(flat).max(axis=-1)
    if not np.isfinite(amax).all():
        raise QuantizationError("weights that are not finite cannot be quantized as MXFP4")
    exps = np.full(flat.shape[0], _E8M0_BIAS, np.int32)  # an all-zero group: scale 1
    done = amax == 0
    # exact: amax = t * 2 ** (e - 127) for an FP4 magnitude t, every value then on the grid
    for t in _FP4_MAGNITUDES:
        todo = np.flatnonzero(~done)
        if todo.size == 0:
            break
        mant, ex = np.frexp(amax[todo] / np.float32(t))
        cand = ex.astype(np.int32) - 1 + _E8M0_BIAS  # amax / t = 2 ** (ex - 1) when mant == .5
        ok = (mant == 0.5) & (cand >= 1) & (cand <= 254)
        todo, cand = todo[ok], cand[ok]
        if todo.size == 0:
            continue
        scaled = flat[todo] / np.ldexp(np.float32(1), cand - _E8M0_BIAS)[:, None]
        hit = np.isin(scaled, FP4_VALUES).all(axis=-1)
        exps[todo[hit]] = cand[hit]
        done[todo[hit]] = True
    rest = np.flatnonzero(~done)
    if rest.size:
        e = np.floor(np.log2(amax[rest])).astype(np.int32) - 2 + _E8M0_BIAS
        exps[rest] = np.clip(e, 1, 254)
    scaled = flat / np.ldexp(np.float32(1), exps - _E8M0_BIAS)[:, None]
    mag = np.abs(scaled)
    # nearest FP4 magnitude; at a midpoint (a tie) the even code, as round-to-nearest-even
    best = np.searchsorted(_FP4_MIDPOINTS, mag, side="left")
    tie = (best < 7) & (best % 2 == 1)
    tie[tie] = mag[tie] == _FP4_MIDPOINTS[np.minimum(best[tie], 6)]
    best = best + tie
    codes = best + np.where((scaled < 0) & (best > 0), 8, 0)
    return codes.astype(np.uint8), exps.astype(np.uint8)


def dequantize_mx(words: np.ndarray, exps: np.ndarray, k: int | None = None) -> np.ndarray:
    """Inverse of `quantize_mx` (float32); `k`: the real reduction size."""
    n, kw = words.shape
    codes = _unpack_nibbles(words).reshape(n, -1, GROUP_SIZE)
    full = np.ldexp(FP4_VALUES[codes], exps.astype(np.int32)[..., None] - _E8M0_BIAS)
    full = full.astype(np.float32).reshape(n, kw * NIBBLES_PER_WORD)
    return full if k is None else full[:, :k]


def split_scale_min(scale_min: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scales, mins) [N, G] of an asymmetric weight's side-by-side array [N, 2 G]."""
    return scale_min[:, 0::2], scale_min[:, 1::2]


def dequantize_q4(
    words: np.ndarray, scale: np.ndarray, k: int | None = None, asymmetric: bool = False
) -> np.ndarray:
    """Inverse of `quantize_q4` (as float32), or with `asymmetric` of `quantize_q4_asym` (`scale`
    then holds scales and mins side by side; q * scale + min in float32, as llama.cpp's Q4_1),
    for tests and for checking conversions; `k`: the real reduction size, to drop the padding
    columns (default: keep the stored width)."""
    n, kw = words.shape
    q = _unpack_nibbles(words)
    low = None
    if scale.dtype == np.uint8:  # q4f32_k's super-block form
        scale = q4_k_scale_min(scale, kw * NIBBLES_PER_WORD // GROUP_SIZE)
        asymmetric = True
    if asymmetric:
        scale, low = split_scale_min(scale)
    else:
        q = q - 8
    q = q.reshape(n, kw * NIBBLES_PER_WORD // GROUP_SIZE, GROUP_SIZE).astype(np.float32)
    full = q * scale.astype(np.float32)[..., None]
    if low is not None:
        full = full + low.astype(np.float32)[..., None]
    full = full.reshape(n, kw * NIBBLES_PER_WORD)
    return full if k is None else full[:, :k]


def quantize_q8(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pack a float [N, K] matrix into (int8 values [N, Kp], float16 scales [N, Kp/32]), Kp =
    `padded_k(K)`, value = q * scale (llama.cpp's Q8_0); the columns past K are 0."""
    n, kp, groups = _groups(weight, 8)
    with np.errstate(over="ignore"):
        scale = (np.abs(groups).max(axis=-1) / np.float32(127)).astype(np.float16)
    if not np.isfinite(scale).all():
        raise QuantizationError("weights beyond float16's range cannot be 8-bit quantized "
                                "(the group scales are float16)")
    s32 = scale.astype(np.float32)
    safe = np.where(s32 == 0, np.float32(1), s32)
    q = np.clip(np.rint(groups / safe[..., None]), -127, 127)
    _hold_q4_0_groups(groups, q, scale)
    return q.astype(np.int8).reshape(n, kp), scale


def _hold_q4_0_groups(groups: np.ndarray, q: np.ndarray, scale: np.ndarray) -> None:
    """Make the 8-bit groups [N, G, 32] that came from a Q4_0 block ((q - 8) * d, float16 d, as a
    Q4_0 file's token embedding) exact: scale = |d|, q - 8 as the int8 value (q, scale updated in
    place). |d| is the group's largest magnitude over j = 8 (llama.cpp's own blocks) or a smaller
    j; if no group is exact at j = 8 the weights are not from Q4_0 and nothing more is tried."""
    flat_g, flat_q, flat_s = groups.reshape(-1, GROUP_SIZE), q.reshape(-1, GROUP_SIZE), \
        scale.reshape(-1)
    exact = (flat_q * flat_s.astype(np.float32)[:, None] == flat_g).all(axis=-1)
    top = np.abs(flat_g).max(axis=-1)
    for j in range(8, 0, -1):
        todo = np.flatnonzero(~exact)
        if todo.size == 0:
            return
        cand = (top[todo] / np.float32(j)).astype(np.float16)
        c32 = cand.astype(np.float32)
        k = np.rint(flat_g[todo] / np.where(c32 == 0, np.float32(1), c32)[:, None])
        hit = (k * c32[:, None] == flat_g[todo]).all(axis=-1) & (np.abs(k) <= 127).all(axis=-1)
        if j == 8 and not hit.any():
            return
        flat_q[todo[hit]] = k[hit]
        flat_s[todo[hit]] = cand[hit]
        exact[todo[hit]] = True


def dequantize_q8(q: np.ndarray, scale: np.ndarray, k: int | None = None) -> np.ndarray:
    """Inverse of `quantize_q8` (as float32); `k`: the real reduction size."""
    n, kp = q.shape
    groups = q.reshape(n, kp // GROUP_SIZE, GROUP_SIZE).astype(np.float32)
    full = (groups * scale.astype(np.float32)[..., None]).reshape(n, kp)
    return full if k is None else full[:, :k]


def quantize_weight(weight: np.ndarray, mode: QuantMode) -> dict[str, np.ndarray]:
    """The stored parameters of one 4-bit weight matrix in `mode`, by name suffix: "weight"
    (the packed words) and "scale" (in the asymmetric modes scales and mins side by side). (The
    8-bit embedding and head of the asymmetric modes: `quantize_q8`.)"""
    if mode.experts == "MXFP4":  # the only 4-bit matrices of that mode: the experts
        words, exps = quantize_mx(weight)
        return {"weight": words, "scale": exps}
    if mode.gguf_type == "Q4_K":
        words, scale_min = quantize_q4_k(weight)
        return {"weight": words, "scale": scale_min}
    if mode.asymmetric:
        words, scale_min = quantize_q4_asym(weight)
        return {"weight": words, "scale": scale_min}
    if mode.gguf_type == "Q4_0":
        words, d = quantize_q4_0(weight)
        return {"weight": words, "scale": d}
    words, scale = quantize_q4(weight, mode.dtype)
    return {"weight": words, "scale": scale}
