"""Quantization modes by name, and how each packs a weight matrix.

`qAfB` follows MLC-LLM's naming: A is the weight bit width (0 = unquantized), fB the float type
of activations and scales. The 4-bit modes are symmetric group quantization: groups of 32
consecutive values along the reduction axis share one scale (max |w| / 7); each value is stored
as a nibble q in [0, 15] meaning (q - 8) * scale, eight nibbles per uint32 word, the first value
of a word in its lowest bits.
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


def quantize_q4(weight: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Pack a float [N, K] matrix into (uint32 words [N, K/8], scales [N, K/32] of `dtype`)."""
    n, k = weight.shape
    if k % GROUP_SIZE:
        raise QuantizationError(
            f"cannot 4-bit quantize a matrix whose rows have {k} values "
            f"(not a multiple of the group size {GROUP_SIZE})"
        )
    groups = weight.astype(np.float32).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    scale = (np.abs(groups).max(axis=-1) / 7.0).astype(dtype)
    # Divide by the scale as stored, so dequantization reproduces the rounding we chose here.
    safe = np.where(scale == 0, 1.0, scale.astype(np.float32))
    q = np.clip(np.rint(groups / safe[..., None]), -8, 7).astype(np.int32) + 8
    q = q.reshape(n, k // NIBBLES_PER_WORD, NIBBLES_PER_WORD).astype(np.uint32)
    shifts = (np.arange(NIBBLES_PER_WORD, dtype=np.uint32) * 4)[None, None, :]
    words = np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)
    return words, scale


def dequantize_q4(words: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Inverse of `quantize_q4` (as float32), for tests and for checking conversions."""
    n, kw = words.shape
    shifts = (np.arange(NIBBLES_PER_WORD, dtype=np.uint32) * 4)[None, None, :]
    q = ((words[..., None] >> shifts) & 15).astype(np.int32) - 8
    q = q.reshape(n, kw * NIBBLES_PER_WORD // GROUP_SIZE, GROUP_SIZE).astype(np.float32)
    return (q * scale.astype(np.float32)[..., None]).reshape(n, kw * NIBBLES_PER_WORD)
