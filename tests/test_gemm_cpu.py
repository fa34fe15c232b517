"""The outer-product GEMM of `kernels.gemm` (prefill and encoder linear layers) on the CPU.

Against numpy for odd shapes (row, reduction and column tails; several K blocks; rows over more
than one task), with bias, float16 weights and activations, and the 4-bit layouts against
`quantization.dequantize_q4`. Then the invariant the engine's batching rests on: a row's bits do
not depend on how many rows the call has or where the row sits among them. Compiled for this
CPU (`device.cpu_target`, as models are), so the FMA code paths are the ones tested; the last
test reads the assembly: FMAs on ymm/zmm vectors, no gathers.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import tvm

from localchat.engine.build.quantization import dequantize_q4, quantize_q4, quantize_q4_asym
from localchat.engine.device import cpu_target
from localchat.engine.kernels import gemm, matmul

DEV = tvm.cpu()
TARGET = cpu_target()


@functools.cache
def _compiled(func: tvm.tirx.PrimFunc) -> tvm.runtime.Executable:
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    return tvm.compile(mod, TARGET)


def _run(func: tvm.tirx.PrimFunc, x: np.ndarray, *weights: np.ndarray, n: int = 0) -> np.ndarray:
    """y = func(x, *weights), y filled with NaN first so a skipped element shows; `n`: y's
    columns (default: the rows of w, or of the 4-bit words)."""
    n = n or weights[0].shape[0]
    y = tvm.runtime.tensor(np.full((x.shape[0], n), np.nan, x.dtype), DEV)
    args = [tvm.runtime.tensor(np.ascontiguousarray(a), DEV) for a in (x, *weights)]
    _compiled(func)["main"](*args, y)
    return y.numpy()


def _data(m: int, k: int, n: int, seed: int, dtype: str = "float32"):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), dtype=np.float32).astype(dtype)
    w = (rng.standard_normal((n, k), dtype=np.float32) * 0.5).astype(dtype)
    b = rng.standard_normal(n, dtype=np.float32).astype(dtype)
    return x, w, b


def _ref(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    y = x.astype(np.float64) @ w.astype(np.float64).T
    return y if b is None else y + b.astype(np.float64)


# every k of (17, 384, 1000) with two of the n (7, 48, 1536), every n with two of the k
SHAPES = [(17, 7), (17, 1536), (384, 7), (384, 48), (1000, 48), (1000, 1536)]


@pytest.mark.parametrize("k,n", SHAPES, ids=[f"k{k}-n{n}" for k, n in SHAPES])
def test_float32_with_bias_matches_numpy(k: int, n: int) -> None:
    """1, 2, 5, 16 and 33 rows (row tails of 1, 2, 5, 4 and 3); k 17 (one short block),
    384 (a full block and a half), 1000 (three blocks and a tail); n 7 (one padded
    micro-panel), 48, 1536 (many tasks)."""
    func = gemm.gemm_f(k, n, "float32", True)
    for m in (1, 2, 5, 16, 33):
        x, w, b = _data(m, k, n, seed=k + n + m)
        np.testing.assert_allclose(_run(func, x, w, b), _ref(x, w, b), rtol=1e-5, atol=1e-4)


def test_without_bias_and_rows_over_several_tasks() -> None:
    """More rows than one task holds (MC), split into chunks of about equal size, multiples of MR
    but the last (336, 336 and 323 here), the last with a tail of 5."""
    k, n, m = 1000, 48, 2 * gemm.MC + 35
    x, w, _ = _data(m, k, n, seed=3)
    np.testing.assert_allclose(_run(gemm.gemm_f(k, n, "float32", False), x, w),
                               _ref(x, w, None), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("k,n", [(17, 7), (384, 48), (1000, 70)])
def test_float16(k: int, n: int) -> None:
    """float16 x, w, b and y, fp32 accumulation: within float16 rounding of the exact result."""
    func = gemm.gemm_f(k, n, "float16", True)
    for m in (1, 5, 33):
        x, w, b = _data(m, k, n, seed=k + m, dtype="float16")
        y = _run(func, x, w, b)
        assert y.dtype == np.float16
        ref = _ref(x, w, b)
        np.testing.assert_allclose(y.astype(np.float64), ref, rtol=2e-3,
                                   atol=2e-3 * np.abs(ref).max())


Q4_CASES = [
    # (k, n, dtype, scales, asym): scales "same" = the activation type
    (17, 7, "float32", "same", False),
    (384, 48, "float32", "same", False),
    (1000, 48, "float32", "float16", False),
    (384, 20, "float16", "same", False),
    (17, 48, "float32", None, True),
    (1000, 7, "float32", None, True),
    (384, 48, "float16", None, True),
]


@pytest.mark.parametrize("k,n,dtype,scales,asym", Q4_CASES)
def test_q4_matches_dequantized(k: int, n: int, dtype: str, scales: str | None,
                                asym: bool) -> None:
    """The 4-bit variants against numpy on `dequantize_q4`'s weights (k 17 and 1000 are stored
    padded to whole groups; the padding never shows), with a bias."""
    x, w, b = _data(33, k, n, seed=k * n, dtype=dtype)
    if asym:
        words, scale = quantize_q4_asym(w.astype(np.float32))
        func = gemm.gemm_q4(k, n, dtype, True, asym=True)
    else:
        sdt = dtype if scales == "same" else scales
        words, scale = quantize_q4(w.astype(np.float32), sdt)
        func = gemm.gemm_q4(k, n, dtype, True, scale_dtype=None if scales == "same" else sdt)
    dense = dequantize_q4(words, scale, k, asymmetric=asym)
    tol = 1e-5 if dtype == "float32" else 2e-3
    for m in (1, 5, 33):
        ref = _ref(x[:m], dense, b)
        y = _run(func, x[:m], words, scale, b).astype(np.float64)
        np.testing.assert_allclose(y, ref, rtol=tol, atol=tol * max(1.0, np.abs(ref).max()))


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16 if a.dtype == np.float16 else np.uint32)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_weight_panels_give_the_gemms_bits(dtype: str) -> None:
    """W laid out at convert time (`weight_panels`, what the encoders store) gives exactly
    gemm_f's output: n 80 and 7 end inside a block and inside a micro-panel, 1536 spans
    many tasks; rows 1 to 995 (tails, equal chunks)."""
    for k, n in ((17, 7), (384, 80), (1000, 1536)):
        panels = gemm.gemm_f_panels(k, n, dtype, True)
        plain = gemm.gemm_f(k, n, dtype, True)
        for m in (1, 4, 16, 995):
            x, w, b = _data(m, k, n, seed=m + n, dtype=dtype)
            y = tvm.runtime.tensor(np.full((m, n), np.nan, dtype), DEV)
            args = [tvm.runtime.tensor(a, DEV) for a in (x, gemm.weight_panels(w), b)]
            _compiled(panels)["main"](*args, y)
            np.testing.assert_array_equal(y.numpy(), _run(plain, x, w, b), err_msg=f"{k} {n} {m}")


@pytest.mark.parametrize("case", ["f32", "f16", "q4-asym"])
def test_a_row_has_the_same_bits_in_any_batch(case: str) -> None:
    """Row r of a call with m rows equals, bit for bit, the same row computed alone, in a call of
    5 rows at another position, and in the full batch reversed: full tiles, tail rows and rows of
    a second task all run the same summation chain."""
    k, n, m = 1000, 48, gemm.MC + 11
    dtype = "float16" if case == "f16" else "float32"
    x, w, b = _data(m, k, n, seed=11, dtype=dtype)
    weights: tuple[np.ndarray, ...] = (w, b)
    func = gemm.gemm_f(k, n, dtype, True)
    if case == "q4-asym":
        weights = (*quantize_q4_asym(w), b)
        func = gemm.gemm_q4(k, n, dtype, True, asym=True)
    full = _bits(_run(func, x, *weights))
    reverse = _bits(_run(func, x[::-1], *weights))[::-1]
    assert np.array_equal(full, reverse)
    for r in (0, 4, 5, 6, gemm.MC - 1, gemm.MC, m - 1):
        alone = _bits(_run(func, x[r : r + 1], *weights))
        assert np.array_equal(alone[0], full[r]), f"row {r} alone"
        start = max(0, r - 3)
        five = _bits(_run(func, x[start : start + 5], *weights))
        assert np.array_equal(five[r - start], full[r]), f"row {r} among 5"


def test_prefill_linears_run_the_gemm() -> None:
    """Prefill's Linears (`matmul.linear_f`, `matmul.linear_q4`) are these kernels."""
    assert matmul.linear_f(384, 48, "float32", True).same_as(
        gemm.gemm_f(384, 48, "float32", True, False))
    assert matmul.linear_f(384, 48, "float32", True, True).same_as(
        gemm.gemm_f(384, 48, "float32", True, True))
    assert matmul.linear_q4(384, 48, "float32", False, True).same_as(
        gemm.gemm_q4(384, 48, "float32", False, True, None, False))


def test_llvm_output_uses_fma_vectors_and_no_gathers() -> None:
    from tvm.target import codegen

    if not codegen.llvm_cpu_has_features(["avx2", "fma"], TARGET):
        pytest.skip("this CPU has no AVX2/FMA")
    for func in (gemm.gemm_f(384, 48, "float32", False),
                 gemm.gemm_f_panels(384, 48, "float32", False)):
        asm = _compiled(func).mod.inspect_source("asm")
        fmas = re.findall(r"vfmadd\w*ps\s+[^\n]*%([yz])mm", asm)
        assert len(fmas) >= 2 * gemm.MR  # at least one micro-kernel's worth
        assert "gather" not in asm


WIDE_CASES = [  # (kind, k, n): n 7 one micro-panel, 48 three (a pair and a single), 80 a
    # block of four and a block of one, 1536 many tasks of four
    ("f32", 17, 7), ("f32", 1000, 1536), ("f16", 384, 48), ("q4-asym", 384, 80),
    ("panels", 384, 80),
]


@pytest.mark.parametrize("kind,k,n", WIDE_CASES, ids=[f"{c}-k{k}-n{n}" for c, k, n in WIDE_CASES])
def test_wide_micro_kernel_gives_the_same_bits(kind: str, k: int, n: int) -> None:
    """AVX-512's micro-kernel spanning two micro-panels (`wide`, 12 accumulators) runs every
    output in the same chain as the one-panel kernel: equal bit for bit, with an odd count of
    micro-panels left for a single one, over row tails and several tasks."""
    dtype = "float16" if kind == "f16" else "float32"
    x, w, b = _data(gemm.MC + 13, k, n, seed=k + n, dtype=dtype)
    weights: tuple[np.ndarray, ...] = (w, b)
    if kind == "q4-asym":
        weights = (*quantize_q4_asym(w), b)
        narrow, wide = (gemm.gemm_q4(k, n, dtype, True, asym=True, wide=v) for v in (False, True))
    elif kind == "panels":
        weights = (gemm.weight_panels(w), b)
        narrow, wide = (gemm.gemm_f_panels(k, n, dtype, True, v) for v in (False, True))
    else:
        narrow, wide = (gemm.gemm_f(k, n, dtype, True, v) for v in (False, True))
    for m in (1, 5, 16, gemm.MC + 13):
        np.testing.assert_array_equal(_bits(_run(wide, x[:m], *weights, n=n)),
                                      _bits(_run(narrow, x[:m], *weights, n=n)), err_msg=f"m={m}")
