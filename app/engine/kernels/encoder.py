"""CPU kernels of the encoder block (BERT family): LayerNorm with bias over a residual sum,
the exact (erf) GELU, and attention over a packed batch of texts: bidirectional (BERT), or
causal with grouped-query heads (a decoder used as an embedding model: Qwen3-Embedding).

A batch of texts runs packed, without padding: the tokens of every text follow each other in
one [1, n, hidden] tensor and `starts` [texts + 1] (int32) says where each text begins, so a
token attends to every token of its own text and to no other (the padding mask, without the
padding); with `causal` a token attends only to itself and the tokens before it in its text.
The attention of one (text, head) pair is one work item: its keys are copied
transposed (and rotated, for rotary models) into a scratch of `max_len` columns, queries are
taken four at a time, the scores vectorized along the keys, the softmax along them with
`common.exp2`, and the values summed along the head dimension. Everything accumulates in
float32 whatever the activation dtype.
"""

from __future__ import annotations

import functools
import math

from tvm import tirx
from tvm.script import tirx as T

from localchat.engine.kernels.common import LANES, LOG2E, exp2, lane_tree, scheduled

F32 = "float32"
OPAQUE = 8  # Relax's op pattern for a kernel that fusion leaves whole
SERIAL_ROWS = 2  # up to this many rows the row kernels run on the calling thread
Q_TILE = 4  # queries scored together (they share each loaded key vector)
INV_SQRT2 = 1.0 / math.sqrt(2.0)
# Abramowitz & Stegun 7.1.26: erf(x) = 1 - t (a1 + t (a2 + ...)) e^-x^2, t = 1 / (1 + p x),
# absolute error below 1.5e-7 for x >= 0 (odd symmetry for x < 0); it vectorizes, libm's does not
ERF_P = 0.3275911
ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def _erf(x):
    """erf(x) of a float32 expression (scalar or vector lane)."""
    a = T.fabs(x)
    t = T.float32(1) / (T.float32(1) + T.float32(ERF_P) * a)
    poly = T.float32(ERF_A[4])
    for c in reversed(ERF_A[:4]):
        poly = poly * t + T.float32(c)
    y = T.float32(1) - poly * t * exp2(a * a * T.float32(-LOG2E))
    return T.if_then_else(x < T.float32(0), -y, y)


@functools.cache
def gelu_erf(n: int, dtype: str) -> tirx.PrimFunc:
    """y[b, s, :] = 0.5 x (1 + erf(x / sqrt 2)) (BERT's "gelu") over x [b, s, n], in float32."""
    vecs, tail = divmod(n, LANES)

    def gelu(x, i, j, c):
        g = T.Cast(F32, x[i, j, c])
        return T.Cast(dtype, T.float32(0.5) * g * (T.float32(1) + _erf(g * T.float32(INV_SQRT2))))

    @T.macro
    def row(x, y, i, j):
        for c in range(vecs):
            for e in T.vectorized(LANES):
                y[i, j, c * LANES + e] = gelu(x, i, j, c * LANES + e)
        for e in range(tail):
            y[i, j, vecs * LANES + e] = gelu(x, i, j, vecs * LANES + e)

    @T.prim_func(private=True, s_tir=True)
    def func(var_x: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": OPAQUE})
        b, s = T.int64(), T.int64()
        x = T.match_buffer(var_x, (b, s, n), dtype)
        y = T.match_buffer(var_y, (b, s, n), dtype)
        with T.sblock("root"):
            if b * s <= SERIAL_ROWS:
                for i, j in T.grid(b, s):
                    row(x, y, i, j)
            else:
                for r in T.parallel(b * s):
                    row(x, y, r // s, r % s)

    return scheduled(func)


@functools.cache
def layer_norm(n: int, eps: float, dtype: str, residual: bool = False,
               shift: bool = False) -> tirx.PrimFunc:
    """y[b, s, :] = LayerNorm(x + r + c) * w + bias over the last axis (n) of [b, s, n], in
    float32 with the variance of the centred values (as torch). Arguments (x, [r [b, s, n] with
    `residual`], [c [n] with `shift`], w [n], bias [n], y)."""
    vecs, tail = divmod(n, LANES)

    def value(x, r, c, i, j, k):
        v = T.Cast(F32, x[i, j, k])
        if residual:
            v = v + T.Cast(F32, r[i, j, k])
        if shift:
            v = v + T.Cast(F32, c[k])
        return v

    @T.macro
    def row(x, r, c, w, bias, y, i, j):
        buf = T.alloc_buffer((n,), F32)
        acc = T.alloc_buffer((LANES,), F32)
        st = T.alloc_buffer((2,), F32)  # mean, 1 / std
        for e in T.vectorized(LANES):
            acc[e] = T.float32(0)
        for k in range(vecs):
            for e in T.vectorized(LANES):
                buf[k * LANES + e] = value(x, r, c, i, j, k * LANES + e)
                acc[e] = acc[e] + buf[k * LANES + e]
        st[0] = T.float32(0)
        for e in range(LANES):
            st[0] = st[0] + acc[e]
        for e in range(tail):
            buf[vecs * LANES + e] = value(x, r, c, i, j, vecs * LANES + e)
            st[0] = st[0] + buf[vecs * LANES + e]
        st[0] = st[0] / T.float32(n)
        for e in T.vectorized(LANES):
            acc[e] = T.float32(0)
        for k in range(vecs):
            for e in T.vectorized(LANES):
                acc[e] = acc[e] + (buf[k * LANES + e] - st[0]) * (buf[k * LANES + e] - st[0])
        st[1] = T.float32(0)
        for e in range(LANES):
            st[1] = st[1] + acc[e]
        for e in range(tail):
            st[1] = st[1] + (buf[vecs * LANES + e] - st[0]) * (buf[vecs * LANES + e] - st[0])
        st[1] = T.rsqrt(st[1] / T.float32(n) + T.float32(eps))
        for k in range(vecs):
            for e in T.vectorized(LANES):
                y[i, j, k * LANES + e] = T.Cast(
                    dtype, (buf[k * LANES + e] - st[0]) * st[1] * T.Cast(F32, w[k * LANES + e])
                    + T.Cast(F32, bias[k * LANES + e]))
        for e in range(tail):
            k = vecs * LANES + e
            y[i, j, k] = T.Cast(dtype, (buf[k] - st[0]) * st[1] * T.Cast(F32, w[k])
                                + T.Cast(F32, bias[k]))

    @T.macro
    def body(x, r, c, w, bias, y, b, s):
        if b * s <= SERIAL_ROWS:
            for i, j in T.grid(b, s):
                row(x, r, c, w, bias, y, i, j)
        else:
            for q in T.parallel(b * s):
                row(x, r, c, w, bias, y, q // s, q % s)

    if residual and shift:

        @T.prim_func(private=True)
        def func(var_x: T.handle, var_r: T.handle, c: T.Buffer((n,), dtype),
                 w: T.Buffer((n,), dtype), bias: T.Buffer((n,), dtype), var_y: T.handle):
            T.func_attr({"op_pattern": OPAQUE})
            b, s = T.int64(), T.int64()
            x = T.match_buffer(var_x, (b, s, n), dtype)
            r = T.match_buffer(var_r, (b, s, n), dtype)
            y = T.match_buffer(var_y, (b, s, n), dtype)
            body(x, r, c, w, bias, y, b, s)

    elif residual:

        @T.prim_func(private=True)
        def func(var_x: T.handle, var_r: T.handle, w: T.Buffer((n,), dtype),
                 bias: T.Buffer((n,), dtype), var_y: T.handle):
            T.func_attr({"op_pattern": OPAQUE})
            b, s = T.int64(), T.int64()
            x = T.match_buffer(var_x, (b, s, n), dtype)
            r = T.match_buffer(var_r, (b, s, n), dtype)
            y = T.match_buffer(var_y, (b, s, n), dtype)
            body(x, r, None, w, bias, y, b, s)

    elif shift:

        @T.prim_func(private=True)
        def func(var_x: T.handle, c: T.Buffer((n,), dtype), w: T.Buffer((n,), dtype),
                 bias: T.Buffer((n,), dtype), var_y: T.handle):
            T.func_attr({"op_pattern": OPAQUE})
            b, s = T.int64(), T.int64()
            x = T.match_buffer(var_x, (b, s, n), dtype)
            y = T.match_buffer(var_y, (b, s, n), dtype)
            body(x, None, c, w, bias, y, b, s)

    else:

        @T.prim_func(private=True)
        def func(var_x: T.handle, w: T.Buffer((n,), dtype), bias: T.Buffer((n,), dtype),
                 var_y: T.handle):
            T.func_attr({"op_pattern": OPAQUE})
            b, s = T.int64(), T.int64()
            x = T.match_buffer(var_x, (b, s, n), dtype)
            y = T.match_buffer(var_y, (b, s, n), dtype)
            body(x, None, None, w, bias, y, b, s)

    return scheduled(func)


@functools.cache
def packed_attention(heads: int, head_dim: int, max_len: int, dtype: str,
                     rotary: bool = False, kv_heads: int = 0,
                     causal: bool = False) -> tirx.PrimFunc:
    """Attention of a packed batch: qkv [1, n, (heads + 2 * kv_heads) * head_dim] ([q | k | v],
    head-major within each), starts [texts + 1] int32 (text t is tokens starts[t] to
    starts[t + 1], at most `max_len` of them) -> out [1, n, heads * head_dim], scale
    head_dim^-0.5. With `rotary`, two more arguments cos, sin [max_len, head_dim / 2] (float32)
    rotate q and k (rotate-half layout) by each token's position in its text. `kv_heads` (0:
    `heads`) key/value heads are shared by groups of heads / kv_heads query heads; `causal`
    lets a token see only the tokens up to itself in its text (bidirectional otherwise)."""
    kv = kv_heads or heads
    if heads % kv:
        raise ValueError(f"{heads} query heads do not group into {kv} key/value heads")
    d, hd = head_dim, heads * head_dim
    group = heads // kv
    width = (heads + 2 * kv) * d
    half = d // 2
    cols = -(-max_len // LANES) * LANES  # key columns of the scratch, whole vectors
    scale = float(d) ** -0.5 * LOG2E  # scores in base 2: softmax by exp2
    dv, dtail = divmod(d, LANES)

    def rot(qkv, cos, sin, t, col, j, p):
        """Element j of the head starting at column `col` of token t (position p), rotated."""
        x = T.Cast(F32, qkv[0, t, col + j])
        if not rotary:
            return x
        k = T.if_then_else(j < half, j, j - half)
        partner = T.if_then_else(j < half, -T.Cast(F32, qkv[0, t, col + T.min(j + half, d - 1)]),
                                 T.Cast(F32, qkv[0, t, col + T.max(j - half, 0)]))
        return x * cos[p, k] + partner * sin[p, k]

    def keys(qt, ln):
        """How many keys the query tile qt of a text of ln tokens looks at (causal: up to its
        last row, so the masked half of the scores is never computed)."""
        return T.min(ln, (qt + 1) * Q_TILE) if causal else ln

    def visible(qt, r, j, ln):
        """Whether row r of query tile qt sees key j (rows past the text repeat its last)."""
        return j <= T.min(qt * Q_TILE + r, ln - 1) if causal else j < ln

    @T.macro
    def item(qkv, starts, cos, sin, out, w):
        kt = T.alloc_buffer((d, cols), F32)  # keys, transposed
        vb = T.alloc_buffer((max_len, d), F32)
        qv = T.alloc_buffer((Q_TILE, d), F32)
        sc = T.alloc_buffer((Q_TILE, cols), F32)
        acc = T.alloc_buffer((Q_TILE, LANES), F32)
        oacc = T.alloc_buffer((Q_TILE, d), F32)
        st = T.alloc_buffer((Q_TILE, 2), F32)  # max, sum
        mx = T.alloc_buffer((LANES,), F32)
        seg = w // heads
        h = w % heads
        s0 = T.Cast("int64", starts[seg])
        ln = T.Cast("int64", starts[seg + 1]) - s0
        for j, c in T.grid(ln, d):
            kt[c, j] = rot(qkv, cos, sin, s0 + j, hd + (h // group) * d, c, j)
            vb[j, c] = T.Cast(F32, qkv[0, s0 + j, hd + kv * d + (h // group) * d + c])
        # only the last key vector's tail: the scores never read past it, and a long context
        # (Qwen3-Embedding's 32k) would make zeroing every column cost more than short texts
        for c, j in T.grid(d, (ln + LANES - 1) // LANES * LANES - ln):
            kt[c, ln + j] = T.float32(0)
        for qt in range((ln + Q_TILE - 1) // Q_TILE):
            for r, c in T.grid(Q_TILE, d):
                # rows past the text repeat its last query (computed, never written)
                qv[r, c] = rot(qkv, cos, sin, s0 + T.min(qt * Q_TILE + r, ln - 1), h * d, c,
                               T.min(qt * Q_TILE + r, ln - 1)) * T.float32(scale)
            for kb in range((keys(qt, ln) + LANES - 1) // LANES):
                for r in T.unroll(Q_TILE):
                    for e in T.vectorized(LANES):
                        acc[r, e] = T.float32(0)
                for c in range(d):
                    for r in T.unroll(Q_TILE):
                        for e in T.vectorized(LANES):
                            acc[r, e] = acc[r, e] + qv[r, c] * kt[c, kb * LANES + e]
                for r in T.unroll(Q_TILE):
                    for e in T.vectorized(LANES):
                        sc[r, kb * LANES + e] = T.Select(visible(qt, r, kb * LANES + e, ln),
                                                         acc[r, e], T.float32(-3.0e38))
            for r in range(Q_TILE):
                # the row's max a vector at a time: the scores past its last key are -3e38
                # (written so above), and a max is the same in any order
                for e in T.vectorized(LANES):
                    mx[e] = T.float32(-3.0e38)
                for kb in range((keys(qt, ln) + LANES - 1) // LANES):
                    for e in T.vectorized(LANES):
                        mx[e] = T.max(mx[e], sc[r, kb * LANES + e])
                st[r, 0] = lane_tree(mx[T.Ramp(0, 1, LANES)], LANES, T.max)
                for e in T.vectorized(LANES):
                    acc[r, e] = T.float32(0)
                for kb in range((keys(qt, ln) + LANES - 1) // LANES):
                    for e in T.vectorized(LANES):
                        sc[r, kb * LANES + e] = exp2(sc[r, kb * LANES + e] - st[r, 0])
                        acc[r, e] = acc[r, e] + sc[r, kb * LANES + e]
                st[r, 1] = T.float32(0)
                for e in range(LANES):
                    st[r, 1] = st[r, 1] + acc[r, e]
                for c in range(d):
                    oacc[r, c] = T.float32(0)
            for j in range(keys(qt, ln)):
                for r in T.unroll(Q_TILE):
                    for cv in range(dv):
                        for e in T.vectorized(LANES):
                            oacc[r, cv * LANES + e] = (oacc[r, cv * LANES + e]
                                                       + sc[r, j] * vb[j, cv * LANES + e])
                    for e in range(dtail):
                        oacc[r, dv * LANES + e] = (oacc[r, dv * LANES + e]
                                                   + sc[r, j] * vb[j, dv * LANES + e])
            for r in range(Q_TILE):
                if qt * Q_TILE + r < ln:
                    for c in range(d):
                        out[0, s0 + qt * Q_TILE + r, h * d + c] = T.Cast(
                            dtype, oacc[r, c] / st[r, 1])

    if rotary:

        @T.prim_func(private=True)
        def func(var_qkv: T.handle, var_starts: T.handle, cos: T.Buffer((max_len, half), F32),
                 sin: T.Buffer((max_len, half), F32), var_out: T.handle):
            T.func_attr({"op_pattern": OPAQUE})
            n, b1 = T.int64(), T.int64()
            qkv = T.match_buffer(var_qkv, (1, n, width), dtype)
            starts = T.match_buffer(var_starts, (b1,), "int32")
            out = T.match_buffer(var_out, (1, n, hd), dtype)
            for w in T.parallel((b1 - 1) * heads):
                item(qkv, starts, cos, sin, out, w)

    else:

        @T.prim_func(private=True)
        def func(var_qkv: T.handle, var_starts: T.handle, var_out: T.handle):
            T.func_attr({"op_pattern": OPAQUE})
            n, b1 = T.int64(), T.int64()
            qkv = T.match_buffer(var_qkv, (1, n, width), dtype)
            starts = T.match_buffer(var_starts, (b1,), "int32")
            out = T.match_buffer(var_out, (1, n, hd), dtype)
            for w in T.parallel((b1 - 1) * heads):
                item(qkv, starts, None, None, out, w)

    return scheduled(func)
