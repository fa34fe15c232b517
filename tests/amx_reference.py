"""What the AMX prefill matmul (`kernels.gemm_amx`) must compute, in numpy: weights made by the
project's quantizers in each 4-bit layout, x rounded to int8 per group as the kernels round it,
the products summed in float64. Shared by tests/test_gemm_amx.py and bench/amx_check.py's
kernel check (which runs where the CPU has AMX)."""

from __future__ import annotations

import numpy as np

from localchat.engine.build.quantization import (
    GROUP_SIZE,
    q4_k_scale_min,
    quantize_q4,
    quantize_q4_asym,
    quantize_q4_k,
    split_scale_min,
)

# layout name -> (asym argument of gemm_q4_amx, scale dtype)
LAYOUTS = {"q4": (False, "float32"), "q4_0": (False, "float16"), "asym": (True, "float16"),
           "q4_k": (True, "uint8")}


def weights(layout: str, n: int, k: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """(words, group parameters) of a random [n, k] matrix in `layout` (`LAYOUTS`)."""
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    if layout == "asym":
        return quantize_q4_asym(w)
    if layout == "q4_k":
        return quantize_q4_k(w)
    return quantize_q4(w, LAYOUTS[layout][1])


def quantize_x(x: np.ndarray, kp: int) -> tuple[np.ndarray, np.ndarray]:
    """x's int8 values and scales per group of 32 as the kernels round them (max |x| / 127,
    to nearest even), zero-padded to kp."""
    m, k = x.shape
    padded = np.zeros((m, kp), np.float32)
    padded[:, :k] = x
    groups = padded.reshape(m, kp // GROUP_SIZE, GROUP_SIZE)
    amax = np.abs(groups).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return np.rint(groups * inv[..., None]).astype(np.int32), amax / np.float32(127)


def reference(x: np.ndarray, words: np.ndarray, params: np.ndarray,
              bias: np.ndarray | None) -> np.ndarray:
    """y = x (int8-rounded) @ dequant(W)^T (+ bias) for any `LAYOUTS` weight."""
    n, kw = words.shape
    kp, kg = kw * 8, kw * 8 // GROUP_SIZE
    xq, xs = quantize_x(x, kp)
    q = ((words[:, :, None] >> (np.arange(8, dtype=np.uint32) * 4)) & 15).astype(np.int32)
    q = q.reshape(n, kg, GROUP_SIZE)
    if params.dtype == np.uint8:
        scale, low = split_scale_min(q4_k_scale_min(params, kg))
    elif params.shape[1] == 2 * kg:
        scale, low = split_scale_min(params.astype(np.float32))
    else:
        scale, low = params.astype(np.float32), None
        q = q - 8
    dots = np.einsum("mgk,ngk->mng", xq, q).astype(np.float64)
    y = (dots * xs[:, None, :] * scale[None]).sum(-1)
    if low is not None:
        y += (xq.sum(-1)[:, None, :] * xs[:, None, :] * low[None]).sum(-1)
    return y + bias if bias is not None else y
