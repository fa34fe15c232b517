"""q4f32_k's embedding and LM head in llama.cpp's Q6_K (`build.q6_k`, `kernels.gemv_q6`).

Values dequantized from Q6_K blocks (d * sc * (q - 32): float16 d, int8 sc per 16, 6-bit q) must
quantize back to the same values (a GGUF import keeps llama.cpp's head exactly; the real file's
head is checked in test_quant_gguf_exact); float weights quantize within a step of their
sub-block; the GEMV (each form this CPU runs) equals numpy on the dequantized weights within
int8 rounding of x, gives a row of x the same bits alone as among others, and the inline
dequantization (embedding lookup, GPU linears) equals numpy exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from localchat.engine.build.q6_k import (
    code_width,
    dequantize_q6_k,
    holds,
    param_width,
    quantize_q6_k,
)
from localchat.errors import QuantizationError


def _q6_k_values(n: int, blocks: int, seed: int) -> np.ndarray:
    """Float32 [n, 256 blocks] weights as llama.cpp dequantizes Q6_K blocks: random float16 d
    (either sign), int8 sc with one sub-block at -128 (llama.cpp's largest scale), 6-bit q."""
    rng = np.random.default_rng(seed)
    d = (rng.standard_normal((n, blocks, 1)) * 1e-4).astype(np.float16).astype(np.float32)
    sc = rng.integers(-128, 128, (n, blocks, 16)).astype(np.float32)
    sc[:, :, 3] = -128
    q = rng.integers(0, 64, (n, blocks, 16, 16)).astype(np.float32) - 32
    q[0, 0, 5] = 0  # an all-zero sub-block
    q[1, 0, 2] = 2 * rng.integers(-16, 16, 16)  # a sub-block whose q share a factor of 2
    q[2, 1, 7] = -32 * (rng.random(16) < 0.1)  # a sparse one: only -32 and 0
    return ((d * sc)[..., None] * q).reshape(n, blocks * 256).astype(np.float32)


def test_q6_k_blocks_round_trip_exactly_in_6_5625_bits() -> None:
    w = _q6_k_values(12, 3, 0)
    codes, params = quantize_q6_k(w)
    assert codes.dtype == params.dtype == np.uint8
    assert codes.shape == (12, code_width(768)) and params.shape == (12, param_width(768))
    assert codes.nbytes + params.nbytes == 12 * 3 * 210  # Q6_K: 210 bytes per 256 weights
    assert np.array_equal(dequantize_q6_k(codes, params), w)


def test_float_weights_quantize_within_a_step_of_their_sub_block() -> None:
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((64, 512)) * 0.02).astype(np.float32)
    w[3, :16] = 0  # an all-zero sub-block
    w[4, 256:] = 0  # an all-zero super-block
    w[5, 7] = 1.0  # an outlier: its sub-block's scale, the others' sc coarser
    codes, params = quantize_q6_k(w)
    back = dequantize_q6_k(codes, params)
    assert (back[3, :16] == 0).all() and (back[4, 256:] == 0).all()
    sc = params[:, :32].view(np.int8).astype(np.float32)
    d = params[:, 32:].copy().view(np.float16).astype(np.float32)
    step = np.abs(np.repeat(d, 16, axis=1) * sc)  # [64, 32]: each sub-block's step
    err = np.abs(back - w).reshape(64, 32, 16).max(axis=-1)
    # (beside the outlier, sub-blocks' sc round coarsely, to 0 for the smallest: as llama.cpp's)
    normal = np.delete(np.arange(64), 5)
    assert (err[normal] <= 1.5 * step[normal] + 1e-12).all()
    assert np.sqrt(((back - w)[normal] ** 2).mean()) < 0.03 * w.std()
    assert not holds(576) and holds(2048)
    with pytest.raises(QuantizationError, match="256"):
        quantize_q6_k(w[:, :320])


def _compile(funcs: dict):
    import tvm

    from localchat.engine.device import cpu_target

    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    return tvm.compile(mod, cpu_target())


@pytest.mark.parametrize("k", [512, 2304, 2816])  # 2 super-blocks; 9: chunks of 8 and 1
# (prefill); 11: rows of more than 2 KiB, whose decode spreads its prefetches
def test_gemv_q6_k_equals_numpy_and_does_not_depend_on_the_batch(k: int) -> None:
    """Every form (VNNI or AVX2 int8, float) against numpy; 21 rows of x (tiles of W rows per
    block of 8 rows of x, then 4 and 1) give each row the bits it gets alone."""
    import tvm

    from localchat.engine.device import cpu_target
    from localchat.engine.kernels.common import gemv_isa
    from localchat.engine.kernels.gemv_q6 import gemv_q6_k

    n = 40
    rng = np.random.default_rng(2)
    codes, params = quantize_q6_k(_q6_k_values(n, k // 256, 3))
    dense = dequantize_q6_k(codes, params)
    isas = {gemv_isa(cpu_target()), "avx2", False}
    lib = _compile({f"q6_{isa}_{bias}": gemv_q6_k(k, n, "float32", isa, bias)
                    for isa in isas for bias in (False, True)})
    dev = tvm.cpu()
    x = rng.standard_normal((21, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    for isa in isas:
        for bias in (False, True):
            name = f"q6_{isa}_{bias}"

            def run(rows: np.ndarray, name=name, bias=bias) -> np.ndarray:
                y = tvm.runtime.tensor(np.zeros((rows.shape[0], n), np.float32), dev)
                args = [rows, codes, params] + ([b] if bias else [])
                lib[name](*[tvm.runtime.tensor(a, dev) for a in args], y)
                return y.numpy()

            out = run(x)
            want = x @ dense.T + (b if bias else 0)
            tol = 2e-2 if isa in ("vnni", "avx2") else 1e-5
            assert np.abs(out - want).max() <= tol * np.abs(want).max(), name
            for r in (0, 9, 20):
                assert np.array_equal(run(x[r:r + 1])[0], out[r]), (name, r)


def test_inline_dequantization_equals_numpy_exactly() -> None:
    """`layers._dequant_value` on Q6_K codes (the embedding lookup, the GPU linears' inline
    dequantization) gives llama.cpp's float32 values."""
    import tvm
    from tvm import te

    from localchat.engine.device import cpu_target
    from localchat.engine.models.layers import _dequant_value

    codes, params = quantize_q6_k(_q6_k_values(6, 2, 4))
    w = te.placeholder(codes.shape, "uint8", name="w")
    s = te.placeholder(params.shape, "uint8", name="s")
    out = te.compute((6, 512), lambda i, j: _dequant_value(w, s, i, j, "float32"), name="deq")
    lib = tvm.compile(te.create_prim_func([w, s, out]), cpu_target())
    dev = tvm.cpu()
    y = tvm.runtime.tensor(np.zeros((6, 512), np.float32), dev)
    lib(tvm.runtime.tensor(codes, dev), tvm.runtime.tensor(params, dev), y)
    assert np.array_equal(y.numpy(), dequantize_q6_k(codes, params))
