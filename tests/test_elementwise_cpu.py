"""The CPU kernels of the Llama block's small operators (localchat.engine.kernels.elementwise)
against numpy in float64: row counts on both sides of the serial/parallel switch, widths with and
without a vector tail, float16 storage, and rows that must not affect each other."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import tvm

from localchat.engine.kernels import elementwise

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
ROWS = [(1, 1), (1, elementwise.SERIAL_ROWS), (3, 1), (1, 37)]  # (batch, tokens)


@functools.cache
def _built(kind: str, n: int, dtype: str):
    func = (elementwise.silu_mul(n, dtype) if kind == "silu" else
            elementwise.rms_norm(n, 1e-5, dtype))
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                       TARGET)["main"]


def _silu_mul(x: np.ndarray) -> np.ndarray:
    n = x.shape[-1] // 2
    g = x[..., :n].astype(np.float64)
    return g / (1 + np.exp(-g)) * x[..., n:]


def _rms_norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5) * w


@pytest.mark.parametrize("n", [576, 100])  # 100: six vectors and a tail of 4
@pytest.mark.parametrize("b,s", ROWS)
def test_silu_mul_matches_numpy(n: int, b: int, s: int) -> None:
    rng = np.random.default_rng(n + b + s)
    # wide range: exp overflows and underflows at the ends
    x = (rng.standard_normal((b, s, 2 * n)) * 30).astype(np.float32)
    y = tvm.runtime.tensor(np.full((b, s, n), np.nan, np.float32), tvm.cpu())
    _built("silu", n, "float32")(tvm.runtime.tensor(x, tvm.cpu()), y)
    ref = _silu_mul(x)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("n", [576, 100])
@pytest.mark.parametrize("b,s", ROWS)
def test_rms_norm_matches_numpy(n: int, b: int, s: int) -> None:
    rng = np.random.default_rng(n * b + s)
    x = (rng.standard_normal((b, s, n)) * 3).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    y = tvm.runtime.tensor(np.full((b, s, n), np.nan, np.float32), tvm.cpu())
    dev = tvm.cpu()
    _built("rms", n, "float32")(tvm.runtime.tensor(x, dev), tvm.runtime.tensor(w, dev), y)
    np.testing.assert_allclose(y.numpy(), _rms_norm(x, w), rtol=1e-5, atol=1e-5)


def test_float16_storage_computes_in_float32() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 5, 2 * 64)).astype(np.float16)
    y = tvm.runtime.tensor(np.zeros((1, 5, 64), np.float16), tvm.cpu())
    _built("silu", 64, "float16")(tvm.runtime.tensor(x, tvm.cpu()), y)
    np.testing.assert_allclose(y.numpy().astype(np.float64), _silu_mul(x.astype(np.float32)),
                               rtol=2e-3, atol=2e-3)


def test_a_rows_result_does_not_depend_on_the_others() -> None:
    """The same row alone (serial branch) and among many (parallel branch): the same bits."""
    rng = np.random.default_rng(4)
    many = rng.standard_normal((1, 40, 2 * 576)).astype(np.float32)
    for kind in ("silu", "rms"):
        n = 576 if kind == "silu" else 2 * 576
        w = tvm.runtime.tensor(rng.standard_normal(n).astype(np.float32), tvm.cpu())
        outs = []
        for x in (many, many[:, 7:8]):
            y = tvm.runtime.tensor(np.zeros((1, x.shape[1], 576 if kind == "silu" else n),
                                            np.float32), tvm.cpu())
            args = [tvm.runtime.tensor(np.ascontiguousarray(x), tvm.cpu())]
            _built(kind, n, "float32")(*args, *([w] if kind == "rms" else []), y)
            outs.append(y.numpy())
        np.testing.assert_array_equal(outs[0][:, 7:8], outs[1])
