"""Quantization modes by name, and how each packs a weight matrix.

`qAfB` follows MLC-LLM's naming: A is the weight bit width (0 = unquantized), fB the float type
of activations and scales. The 4-bit modes are symmetric group quantization: groups of 32
consecutive values along the reduction axis share one scale (max |w| / 7); each value is stored
as a nibble q in [0, 15] meaning (q - 8) * scale, eight nibbles per uint32 word, the first value
of a word in its lowest bits.

A reduction size K that is not a multiple of 32 is padded to the next multiple with zero weights
before packing (as MLC-LLM's group quantization does): the stored matrix is [N, ceil(K/32)*32]
and its last group holds the K % 32 real values plus zeros, which quantize to the nibble 8, i.e.
exactly 0 whatever the scale. Kernels read only the first K inputs, so the padding never shows.
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

    @property
    def quantized(self) -> bool:
        return self.bits > 0


QUANT_MODES: dict[str, QuantMode] = {
    m.name: m
    for m in (
        QuantMode("q0f32", 0, "float32"),
        QuantMode("q0f16", 0, "float16"),
        QuantMode("q4f32_1", 4, "float32"),
        QuantMode("q4f16_1", 4, "float16"),
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


def quantize_q4(weight: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Pack a float [N, K] matrix into (uint32 words [N, Kp/8], scales [N, Kp/32] of `dtype`),
    Kp = `padded_k(K)`: the columns past K are zero weights."""
    if weight.ndim != 2:
        raise QuantizationError(f"cannot 4-bit quantize a tensor of shape {weight.shape}")
    n, k = weight.shape
    kp = padded_k(k)
    weight = weight.astype(np.float32)
    if kp != k:
        weight = np.pad(weight, ((0, 0), (0, kp - k)))
    groups = weight.reshape(n, kp // GROUP_SIZE, GROUP_SIZE)
    scale = (np.abs(groups).max(axis=-1) / 7.0).astype(dtype)
    # Divide by the scale as stored, so dequantization reproduces the rounding we chose here.
    safe = np.where(scale == 0, 1.0, scale.astype(np.float32))
    q = np.clip(np.rint(groups / safe[..., None]), -8, 7).astype(np.int32) + 8
    q = q.reshape(n, kp // NIBBLES_PER_WORD, NIBBLES_PER_WORD).astype(np.uint32)
    shifts = (np.arange(NIBBLES_PER_WORD, dtype=np.uint32) * 4)[None, None, :]
    words = np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)
    return words, scale


def dequantize_q4(words: np.ndarray, scale: np.ndarray, k: int | None = None) -> np.ndarray:
    """Inverse of `quantize_q4` (as float32), for tests and for checking conversions; `k`: the
    real reduction size, to drop the padding columns (default: keep the stored width)."""
    n, kw = words.shape
    shifts = (np.arange(NIBBLES_PER_WORD, dtype=np.uint32) * 4)[None, None, :]
    q = ((words[..., None] >> shifts) & 15).astype(np.int32) - 8
    q = q.reshape(n, kw * NIBBLES_PER_WORD // GROUP_SIZE, GROUP_SIZE).astype(np.float32)
    full = (q * scale.astype(np.float32)[..., None]).reshape(n, kw * NIBBLES_PER_WORD)
    return full if k is None else full[:, :k]
