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

`q4f32_k` holds llama.cpp's Q4_K (super-blocks of 256 with float16 d and dmin and, per group of
32, 6-bit sc and m; value d * sc * q - dmin * m): the asymmetric layout with the scale S = d * sc
and the min -dmin * m as float32 (both exact in float32, as llama.cpp's dequantization computes
them, and q * S + min then rounds as its S * q - dmin * m does), 24 bytes per 32 weights (6 bits
a weight, more than Q4_K's 4.5: the super-block form is not kept). Its quantizer takes min = the
group's min and finds S again from the group's max at q = 15 .. 1 (within a few float32 ulps of
(max - min) / q): exact for every group that has its min at q = 0, which llama.cpp's Q4_K
quantizer gives each group (checked on the 1B shape's Q4_K_M file: all); other groups, and float
weights, get scale = (max - min) / 15. Q4_K_M files also hold a few matrices in Q6_K (some attn_v
and ffn_down): those are dequantized and re-quantized to this 4-bit layout (not exact).

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

In the asymmetric modes the token embedding table and the LM head (tied to it or not) are 8-bit
instead, as llama.cpp keeps them in its Q4_1 files (Q8_0 or Q6_K): per group of 32 a float16
scale (max |w| / 127) and int8 values q in [-127, 127], value q * scale, stored as an int8 matrix
[N, Kp] (zero padding), 34 bytes per 32 weights. A Q8_0 tensor round-trips exactly. With the
embedding re-quantized to 4 bits instead, SmolLM2-135M's greedy top-1 agreement with q0f32 is
87% (its Q4_1 GGUF holds the embedding in Q8_0, the rest round-trips exactly); with 8 bits, 100%
in float arithmetic.

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


@dataclass(frozen=True)
class QuantMode:
    """One quantization mode: weight bits (0 = none) and the model's float type."""

    name: str
    bits: int
    dtype: str
    asymmetric: bool = False  # 4-bit: a min per group as well as a scale (value q * scale + min)
    gguf_type: str = ""  # the llama.cpp block type the mode holds exactly ("Q4_0", "Q4_1", "Q4_K")
    scale_type: str = ""  # the group parameters' type when not the default (`group_dtype`)

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    @property
    def head_bits(self) -> int:
        """Weight bits of the token embedding and the LM head: 8 in the modes that hold a
        llama.cpp type (Q4_0, Q4_1, Q4_K), as llama.cpp keeps them (Q8_0, Q6_K)."""
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
        llama.cpp type (its blocks' d and m), the activation type in the others."""
        return self.scale_type or ("float16" if self.gguf_type else self.dtype)


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
                  scale_type="float32"),
        QuantMode("q8f32_0", 8, "float32", gguf_type="Q8_0"),
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


def quantize_q4_k(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pack a float [N, K] matrix asymmetrically with float32 scales and mins into (uint32 words
    [N, Kp/8], float32 scales and mins [N, 2 Kp/32] side by side), value q * scale + min: the
    layout of q4f32_k, which holds llama.cpp's Q4_K (see the module docstring). A group already
    of the form q * S + min with its min at q = 0 (every group of a Q4_K block llama.cpp wrote:
    S = d * sc and -min = dmin * m, exact in float32) keeps that S and min; others get min = the
    group's min and scale = (max - min) / 15. Columns past K repeat each row's last value."""
    n, kp, groups = _groups(weight, 4, edge=True)
    flat = groups.reshape(-1, GROUP_SIZE)
    low, high = flat.min(axis=-1), flat.max(axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):
        scale = ((high - low) / np.float32(15)).astype(np.float32)
    if not (np.isfinite(low).all() and np.isfinite(scale).all()):
        raise QuantizationError("weights beyond float32's range cannot be 4-bit quantized")

    def lattice(g: np.ndarray, lo: np.ndarray, sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(q, whether q * sc + lo gives g exactly) for groups g [M, 32]."""
        safe = np.where(sc == 0, np.float32(1), sc)
        q = np.clip(np.rint((g - lo[:, None]) / safe[:, None]), 0, 15).astype(np.float32)
        return q, (q * sc[:, None] + lo[:, None] == g).all(axis=-1)

    q, exact = lattice(flat, low, scale)
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
            cq, hit = lattice(flat[todo], low[todo], cand)
            found = found or bool(hit.any())
            scale[todo[hit]] = cand[hit]
            q[todo[hit]] = cq[hit]
            exact[todo[hit]] = True
        if top == 15 and not found:
            break  # no group is on such a lattice: float weights, not a Q4_K file's
    scale_min = np.stack([scale, low], axis=-1).reshape(n, 2 * (kp // GROUP_SIZE))
    return _pack_nibbles(q.astype(np.int32).reshape(n, kp)), scale_min


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
