"""The CPU kernels of the decoder block's small operators: RMSNorm, the MLP's gate (SiLU or
GELU-tanh) and the logit soft-cap.

TVM's default CPU pipeline leaves legalized operators as serial scalar loops, and SiLU calls
libm's `expf` per element. At one token they cost about 8 % of a SmolLM2 decode step; at 16
sequences, or in a prefill, they grow with the rows while the other threads wait. Here rows run
in parallel beyond `SERIAL_ROWS` (a thread-pool launch costs more than a few rows), each row
is vectorized in `LANES`-wide steps, and the exponentials (SiLU, GELU-tanh, tanh) are the
polynomial `common.exp2`. A row's result never depends on the other rows.

Options beyond the Llama block (issue 22's shared block), each off by default so that a default
call builds the very kernel it always did:
- `rms_norm(..., ndim=4)`: any number of leading axes, e.g. a per-head q/k norm over head_dim of
  [batch, seq, heads, head_dim] (Qwen3, Gemma 3); `weight_offset=1.0`: Gemma's x * (1 + w).
- `gated_mul(n, dtype, "gelu_tanh")`: GELU-tanh gate x up (Gemma's `gelu_pytorch_tanh`).
- `soft_cap(n, cap, dtype)`: c * tanh(x / c), e.g. on the final logits (Gemma 2).
"""

from __future__ import annotations

import functools
import math

from tvm import tirx
from tvm.script import tirx as T

from localchat.engine.kernels.common import LANES, LOG2E, exp2, scheduled, tanh

SERIAL_ROWS = 2  # up to this many rows the kernels run on the calling thread
F32 = "float32"
OPAQUE = 8  # Relax's op pattern for a kernel that fusion leaves whole (it has no blocks)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
SOFT_CAP_CHUNK = 64 * LANES  # elements of one soft-cap work item


def _silu(g):
    """silu(g) = g / (1 + e^-g)"""
    return g / (T.float32(1) + exp2(g * T.float32(-LOG2E)))


def _gelu_tanh(g):
    """0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), computed as g / (1 + e^-2u):
    the same value, without tanh's cancellation near 0."""
    return g / (
        T.float32(1)
        + exp2((g + T.float32(0.044715) * g * g * g) * T.float32(-2 * SQRT_2_OVER_PI * LOG2E))
    )


# activation name (ours and HF's `hidden_act`) -> its float32 expression
ACTIVATIONS = {"silu": _silu, "gelu_tanh": _gelu_tanh, "gelu_pytorch_tanh": _gelu_tanh}


@functools.cache
def silu_mul(n: int, dtype: str) -> tirx.PrimFunc:
    """y[b, s, :] = silu(x[b, s, :n]) * x[b, s, n:] (the gate and up halves of a fused
    projection), silu(g) = g / (1 + e^-g), computed in float32."""
    return _gated_mul(n, dtype, _silu)


@functools.cache
def gated_mul(n: int, dtype: str, activation: str = "silu") -> tirx.PrimFunc:
    """y[b, s, :] = act(x[b, s, :n]) * x[b, s, n:] in float32, act one of `ACTIVATIONS`:
    "silu" (the very kernel of `silu_mul`) or "gelu_tanh" (also spelled "gelu_pytorch_tanh")."""
    if activation not in ACTIVATIONS:
        known = ", ".join(ACTIVATIONS)
        raise ValueError(f"unknown gate activation {activation!r} (known: {known})")
    if ACTIVATIONS[activation] is _silu:
        return silu_mul(n, dtype)
    return _gated_mul(n, dtype, ACTIVATIONS[activation])


def _gated_mul(n: int, dtype: str, act) -> tirx.PrimFunc:
    vecs, tail = divmod(n, LANES)

    def gated(x, i, j, c):
        g = T.Cast(F32, x[i, j, c])
        return T.Cast(dtype, act(g) * T.Cast(F32, x[i, j, n + c]))

    @T.macro
    def row(x, y, i, j):
        for c in range(vecs):
            for e in T.vectorized(LANES):
                y[i, j, c * LANES + e] = gated(x, i, j, c * LANES + e)
        for e in range(tail):
            y[i, j, vecs * LANES + e] = gated(x, i, j, vecs * LANES + e)

    @T.prim_func(private=True, s_tir=True)
    def func(var_x: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": OPAQUE})
        b, s = T.int64(), T.int64()
        x = T.match_buffer(var_x, (b, s, 2 * n), dtype)
        y = T.match_buffer(var_y, (b, s, n), dtype)
        # A root block: Relax's reshape detection (one-input calls) reads the body as blocks.
        with T.sblock("root"):
            if b * s <= SERIAL_ROWS:
                for i, j in T.grid(b, s):
                    row(x, y, i, j)
            else:
                for r in T.parallel(b * s):
                    row(x, y, r // s, r % s)

    return scheduled(func)


@functools.cache
def rms_norm(
    n: int, eps: float, dtype: str, *, ndim: int = 3, weight_offset: float = 0.0
) -> tirx.PrimFunc:
    """y[..., :] = x[..., :] / sqrt(mean(x[..., :]^2) + eps) * (w + weight_offset), in float32
    (LANES partial sums per row, added in a fixed order), over the last axis (of size n) of an
    `ndim`-axis x: 3 for [batch, seq, hidden], 4 for one norm per head of [batch, seq, heads,
    head_dim]; `weight_offset` 1.0 is Gemma's x * (1 + w). Arguments (x, w [n], y)."""
    if ndim < 1:
        raise ValueError(f"rms_norm needs at least one axis, not ndim={ndim}")
    if ndim != 3 or weight_offset:
        return _rms_norm_rows(n, eps, dtype, ndim, float(weight_offset))
    vecs, tail = divmod(n, LANES)

    def square(x, i, j, c):
        return T.Cast(F32, x[i, j, c]) * T.Cast(F32, x[i, j, c])

    def scaled(x, w, i, j, c, inv_rms):
        return T.Cast(dtype, T.Cast(F32, x[i, j, c]) * inv_rms * T.Cast(F32, w[c]))

    @T.macro
    def row(x, w, y, i, j):
        acc = T.alloc_buffer((LANES,), F32)
        total = T.alloc_buffer((1,), F32)
        for e in T.vectorized(LANES):
            acc[e] = T.float32(0)
        for c in range(vecs):
            for e in T.vectorized(LANES):
                acc[e] = acc[e] + square(x, i, j, c * LANES + e)
        total[0] = T.float32(0)
        for e in range(LANES):
            total[0] = total[0] + acc[e]
        for e in range(tail):
            total[0] = total[0] + square(x, i, j, vecs * LANES + e)
        total[0] = T.rsqrt(total[0] / T.float32(n) + T.float32(eps))
        for c in range(vecs):
            for e in T.vectorized(LANES):
                y[i, j, c * LANES + e] = scaled(x, w, i, j, c * LANES + e, total[0])
        for e in range(tail):
            y[i, j, vecs * LANES + e] = scaled(x, w, i, j, vecs * LANES + e, total[0])

    @T.prim_func(private=True)
    def func(var_x: T.handle, w: T.Buffer((n,), dtype), var_y: T.handle):
        T.func_attr({"op_pattern": OPAQUE})
        b, s = T.int64(), T.int64()
        x = T.match_buffer(var_x, (b, s, n), dtype)
        y = T.match_buffer(var_y, (b, s, n), dtype)
        if b * s <= SERIAL_ROWS:
            for i, j in T.grid(b, s):
                row(x, w, y, i, j)
        else:
            for r in T.parallel(b * s):
                row(x, w, y, r // s, r % s)

    return scheduled(func)


def _leading_axes(ndim: int) -> tuple[list[tirx.Var], tirx.PrimExpr]:
    """Symbolic sizes of the `ndim - 1` leading axes of a row-wise kernel, and their product
    (the rows)."""
    lead = [tirx.Var(f"d{i}", "int64") for i in range(ndim - 1)]
    rows = tirx.const(1, "int64")
    for v in lead:
        rows = rows * v
    return lead, rows


def _rms_norm_rows(n: int, eps: float, dtype: str, ndim: int, offset: float) -> tirx.PrimFunc:
    """`rms_norm` over any leading axes (flattened into rows) and with a weight offset."""
    vecs, tail = divmod(n, LANES)
    lead, rows = _leading_axes(ndim)

    def square(x, r, c):
        return T.Cast(F32, x[r * n + c]) * T.Cast(F32, x[r * n + c])

    def scaled(x, w, r, c, inv_rms):
        weight = T.Cast(F32, w[c])
        if offset:
            weight = weight + T.float32(offset)
        return T.Cast(dtype, T.Cast(F32, x[r * n + c]) * inv_rms * weight)

    @T.macro
    def row(x, w, y, r):
        acc = T.alloc_buffer((LANES,), F32)
        total = T.alloc_buffer((1,), F32)
        for e in T.vectorized(LANES):
            acc[e] = T.float32(0)
        for c in range(vecs):
            for e in T.vectorized(LANES):
                acc[e] = acc[e] + square(x, r, c * LANES + e)
        total[0] = T.float32(0)
        for e in range(LANES):
            total[0] = total[0] + acc[e]
        for e in range(tail):
            total[0] = total[0] + square(x, r, vecs * LANES + e)
        total[0] = T.rsqrt(total[0] / T.float32(n) + T.float32(eps))
        for c in range(vecs):
            for e in T.vectorized(LANES):
                y[r * n + c * LANES + e] = scaled(x, w, r, c * LANES + e, total[0])
        for e in range(tail):
            y[r * n + vecs * LANES + e] = scaled(x, w, r, vecs * LANES + e, total[0])

    @T.prim_func(private=True)
    def func(var_x: T.handle, w: T.Buffer((n,), dtype), var_y: T.handle):
        T.func_attr({"op_pattern": OPAQUE})
        x = T.match_buffer(var_x, (*lead, n), dtype)
        y = T.match_buffer(var_y, (*lead, n), dtype)
        xf = T.decl_buffer((rows * n,), dtype, data=x.data)
        yf = T.decl_buffer((rows * n,), dtype, data=y.data)
        if rows <= SERIAL_ROWS:
            for r in range(rows):
                row(xf, w, yf, r)
        else:
            for r in T.parallel(rows):
                row(xf, w, yf, r)

    return scheduled(func)


@functools.cache
def soft_cap(n: int, cap: float, dtype: str = "float32", ndim: int = 2) -> tirx.PrimFunc:
    """y = cap * tanh(x / cap) elementwise (in float32) on an `ndim`-axis x whose last axis has
    n elements, e.g. Gemma 2's final-logit soft-cap on [batch, vocab]. Arguments (x, y). Work
    items are chunks of the flattened tensor, so one row of a large vocabulary is spread over the
    threads as well."""
    if cap <= 0:
        raise ValueError(f"the soft-cap must be positive, not {cap}")
    if ndim < 1:
        raise ValueError(f"soft_cap needs at least one axis, not ndim={ndim}")
    lead, rows = _leading_axes(ndim)
    chunk_vecs = SOFT_CAP_CHUNK // LANES

    def capped(x, i):
        return T.Cast(dtype, T.float32(cap) * tanh(T.Cast(F32, x[i]) * T.float32(1.0 / cap)))

    @T.macro
    def chunk(xf, yf, ci, total):
        for v in range(chunk_vecs):
            base: T.let[T.int64] = T.Cast("int64", ci * SOFT_CAP_CHUNK + v * LANES)
            if base + LANES <= total:
                for e in T.vectorized(LANES):
                    yf[base + e] = capped(xf, base + e)
            elif base < total:
                for e in range(total - base):
                    yf[base + e] = capped(xf, base + e)

    @T.prim_func(private=True, s_tir=True)
    def func(var_x: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": OPAQUE})
        x = T.match_buffer(var_x, (*lead, n), dtype)
        y = T.match_buffer(var_y, (*lead, n), dtype)
        # A root block: Relax's reshape detection (one-input calls) reads the body as blocks.
        with T.sblock("root"):
            xf = T.decl_buffer((rows * n,), dtype, data=x.data)
            yf = T.decl_buffer((rows * n,), dtype, data=y.data)
            if rows * n <= SOFT_CAP_CHUNK:
                chunk(xf, yf, T.int64(0), rows * n)
            else:
                for ci in T.parallel((rows * n + SOFT_CAP_CHUNK - 1) // SOFT_CAP_CHUNK):
                    chunk(xf, yf, ci, rows * n)

    return scheduled(func)
