"""Prefill's linear layers on the CPU: Y[m, n] = X[m, k] @ W[n, k]^T (+ b) for many rows of X,
with weights in float or in the 4-bit group layouts of `build.quantization`.

Legalization leaves matmuls as naive loop nests 10-50x slower than the FMA bound, and dlight's
CPU rules do not cover quantized GEMM, so both run `gemm`'s register-blocked outer-product
kernel, written already scheduled: a thread copies (or dequantizes) a block of W into a K-major
scratch panel that serves every row of X, so no full-precision copy of a 4-bit weight exists at
run time. Decode runs the register-unpacking GEMV of `gemv` instead; which of the two runs is
the caller's choice, never the row count's, because the two sum in different orders and a
sequence must get the same bits whether it is alone in a call or batched with others (within a
kernel a row's bits never depend on the other rows).
"""

from __future__ import annotations

from tvm import tirx

from localchat.engine.kernels import gemm


def linear_f(k: int, n: int, dtype: str, bias: bool, wide: bool = False) -> tirx.PrimFunc:
    """Y[m, n] = X[m, k] @ W[n, k]^T (+ b) with float weights of `dtype`, fp32 accumulation;
    `wide`: for AVX-512 (`gemm.gemm_f`)."""
    return gemm.gemm_f(k, n, dtype, bias, wide)


def linear_f_panels(k: int, n: int, dtype: str, bias: bool, wide: bool = False
                    ) -> tirx.PrimFunc:
    """`linear_f` on weights stored as `gemm.weight_panels` lays them out (the encoders')."""
    return gemm.gemm_f_panels(k, n, dtype, bias, wide)


def linear_q4(
    k: int, n: int, dtype: str, bias: bool, asym: bool = False, scale_dtype: str | None = None,
    wide: bool = False,
) -> tirx.PrimFunc:
    """Y[m, n] = X[m, k] @ dequant(Wq[n, kp/8], S)^T (+ b), kp = `padded_k(k)`, dequantized
    in-kernel. `asym`: the asymmetric modes' weights, q * scale + min, S [n, 2 kp/32] holding each
    group's scale and min side by side; otherwise (q - 8) * S, S [n, kp/32]. S is of
    `scale_dtype` (default: float16 with `asym`, else `dtype`)."""
    return gemm.gemm_q4(k, n, dtype, bias, asym, scale_dtype, wide)
