"""TIR kernels of the RWKV-7 ("Goose") time-mix: the token shift with its six interpolations and
the generalized delta-rule scan over a flat batch of sequences (the layout of `kernels.wkv`:
`ends[b]` is the position of sequence b's last token).

Per head (N = head size), with the state S [N, N] (row i: value channel, column j: key channel),
the decay w = exp(-exp(-0.5) * sigmoid(w_raw)), the normalized key kk and the in-context learning
rate a, one step of a token is

    S[i, j] = S[i, j] * w[j] + (sum_m S[i, m] * -kk[m]) * kk[j] * a[j] + v[i] * k[j]
    y[i]    = sum_j S[i, j] * r[j]

(the reference's `S = S diag(w) + S (-kk)(kk a)^T + v k^T`, `y = S r`, both terms on the state
before the step). Rows of S never mix, which is what lets the GPU variant give each thread a row.
"""

from __future__ import annotations

import functools

from tvm import te, tirx
from tvm.script import tirx as T

from localchat.engine.kernels.common import LOG2E, add, exp2, lane_tree, scheduled, vec_width

DECAY_SCALE = -0.606531  # -exp(-0.5): the reference's w = exp(-0.606531 * sigmoid(w0 + lora))


def token_lerp(x: te.Tensor, prev: te.Tensor, start_of: te.Tensor, *mixes: te.Tensor):
    """For each mix m: x + (shifted(x) - x) * m, the reference's own form (`x + xx * x_r` with
    xx = x_prev - x), where shifted(x)[t] is x[t - 1] within a sequence and the state `prev[b]`
    for the first token of sequence b (`start_of`: see `wkv.segment_starts`)."""
    n, h = x.shape

    def shifted(t, c):
        s = start_of[t]
        return tirx.if_then_else(s >= 0, prev[tirx.max(s, 0), c], x[tirx.max(t - 1, 0), c])

    def lerp(m: te.Tensor):
        return lambda t, c: x[t, c] + (shifted(t, c) - x[t, c]) * m[c]

    outs = [te.compute((n, h), lerp(m), name=f"token_lerp{i}") for i, m in enumerate(mixes)]
    return outs if len(outs) > 1 else outs[0]


@functools.cache  # one parse per model instead of one per layer and function
def wkv7_scan(heads: int, head_size: int, dtype: str, gpu: bool = False) -> tirx.PrimFunc:
    """(r [n, C] dtype; w_raw [n, C] f32; k, v, kk, a [n, C] dtype; S [B, H, N, N] f32;
    ends [B] i32) -> (y [n, C] dtype; S' [B, H, N, N] f32), C = H * N. The decay's
    pre-activation is float32 in every mode: float16 would round decays near 1 coarsely.

    The CPU schedule is parallel over (sequence, head) and sequential in time, the row loop
    vectorized over the key channels. It is an equal-result scan, not a chunked one: a chunked
    (WY / parallel-form) delta-rule scan needs O(chunk) more FLOPs per token for its
    intra-chunk matrices and only pays off with matrix units, and decode, the step that bounds
    chat speed, is one token per sequence anyway; here each (sequence, head) keeps its 16 KiB
    state hot in L1 across the whole prompt. The decay is computed in vectors by `exp2` (a
    libm exp is a call per lane), each row's two dot products are summed as a tree of lanes
    (a serial sum of 16 lanes was the step's critical path), and the first token reads S
    where later ones read S', so the state is never copied: 95 -> 42 us a decode step at
    40 heads of 64, 2 threads. `gpu`: one block per (sequence, head), one thread per state
    row, the step's vectors shared."""
    if gpu:
        return _wkv7_scan_gpu(heads, head_size, dtype)
    H, N = heads, head_size  # noqa: N806 (the paper's names)
    C = H * N  # noqa: N806
    cl = vec_width(N)
    f32 = "float32"

    @T.macro
    def step(r, w, k, v, kk, a, src, s_out, y, t, bh, ww, kv, nk, ab, rv, vv, acc, dot):
        """Token t (of sequence bh // H) in head bh % H: s_out = the step of src, y[t] = s_out r
        (the scratch vectors: the step's w, k, -kk, kk * a, r and v as float32)."""
        for jo in range(N // cl):
            for e in T.vectorized(cl):
                ww[jo * cl + e] = exp2(T.float32(DECAY_SCALE * LOG2E) / (
                    T.float32(1) + exp2(w[t, bh % H * N + jo * cl + e] * T.float32(-LOG2E))))
        for j in range(N):
            kv[j] = T.Cast(f32, k[t, bh % H * N + j])
            nk[j] = -T.Cast(f32, kk[t, bh % H * N + j])
            ab[j] = T.Cast(f32, kk[t, bh % H * N + j]) * T.Cast(f32, a[t, bh % H * N + j])
            rv[j] = T.Cast(f32, r[t, bh % H * N + j])
            vv[j] = T.Cast(f32, v[t, bh % H * N + j])
        for i in range(N):
            for e in T.vectorized(cl):
                acc[e] = T.float32(0)
            for jo in range(N // cl):
                for e in T.vectorized(cl):
                    acc[e] = acc[e] + src[bh // H, bh % H, i, jo * cl + e] * nk[jo * cl + e]
            dot[0] = lane_tree(acc[T.Ramp(0, 1, cl)], cl, add)
            for e in T.vectorized(cl):
                acc[e] = T.float32(0)
            for jo in range(N // cl):
                for e in T.vectorized(cl):
                    s_out[bh // H, bh % H, i, jo * cl + e] = (
                        src[bh // H, bh % H, i, jo * cl + e] * ww[jo * cl + e]
                        + dot[0] * ab[jo * cl + e]
                        + vv[i] * kv[jo * cl + e]
                    )
                    acc[e] = acc[e] + s_out[bh // H, bh % H, i, jo * cl + e] * rv[jo * cl + e]
            dot[1] = lane_tree(acc[T.Ramp(0, 1, cl)], cl, add)
            y[t, bh % H * N + i] = T.Cast(dtype, dot[1])

    @T.prim_func(private=True)
    def func(
        var_r: T.handle,
        var_w: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        var_kk: T.handle,
        var_a: T.handle,
        var_s: T.handle,
        var_ends: T.handle,
        var_y: T.handle,
        var_s_out: T.handle,
    ):
        n = T.int64()
        nb = T.int64()
        r = T.match_buffer(var_r, (n, C), dtype)
        w = T.match_buffer(var_w, (n, C), f32)
        k = T.match_buffer(var_k, (n, C), dtype)
        v = T.match_buffer(var_v, (n, C), dtype)
        kk = T.match_buffer(var_kk, (n, C), dtype)
        a = T.match_buffer(var_a, (n, C), dtype)
        s_in = T.match_buffer(var_s, (nb, H, N, N), f32)
        ends = T.match_buffer(var_ends, (nb,), "int32")
        y = T.match_buffer(var_y, (n, C), dtype)
        s_out = T.match_buffer(var_s_out, (nb, H, N, N), f32)
        for bh in T.parallel(nb * H):
            ww = T.alloc_buffer((N,), f32)
            kv = T.alloc_buffer((N,), f32)
            nk = T.alloc_buffer((N,), f32)  # -kk
            ab = T.alloc_buffer((N,), f32)  # kk * a
            rv = T.alloc_buffer((N,), f32)
            vv = T.alloc_buffer((N,), f32)
            acc = T.alloc_buffer((cl,), f32)
            dot = T.alloc_buffer((2,), f32)
            first = T.Cast(
                "int64", T.if_then_else(bh // H == 0, 0, ends[T.max(bh // H - 1, 0)] + 1)
            )
            count = T.Cast("int64", ends[bh // H]) + 1 - first
            if count == 0:  # (a flat batch gives every sequence a token; kept for safety)
                for i in range(N):
                    for jo in range(N // cl):
                        for e in T.vectorized(cl):
                            s_out[bh // H, bh % H, i, jo * cl + e] = s_in[
                                bh // H, bh % H, i, jo * cl + e
                            ]
            else:
                # the first token reads the state from s_in, later ones from s_out: no copy
                step(r, w, k, v, kk, a, s_in, s_out, y, first, bh, ww, kv, nk, ab, rv, vv, acc,
                     dot)
                for t in range(1, count):
                    step(r, w, k, v, kk, a, s_out, s_out, y, first + t, bh, ww, kv, nk, ab, rv, vv,
                         acc, dot)

    return scheduled(func)


def _wkv7_scan_gpu(heads: int, head_size: int, dtype: str) -> tirx.PrimFunc:
    """`wkv7_scan` with one block per (sequence, head) and one thread per state row: each thread
    keeps its row in registers; the step's w, k, -kk, kk * a and r are computed once per channel
    into shared memory."""
    H, N = heads, head_size  # noqa: N806
    C = H * N  # noqa: N806
    f32 = "float32"

    @T.prim_func(private=True)
    def func(
        var_r: T.handle,
        var_w: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        var_kk: T.handle,
        var_a: T.handle,
        var_s: T.handle,
        var_ends: T.handle,
        var_y: T.handle,
        var_s_out: T.handle,
    ):
        n = T.int64()
        nb = T.int64()
        r = T.match_buffer(var_r, (n, C), dtype)
        w = T.match_buffer(var_w, (n, C), f32)
        k = T.match_buffer(var_k, (n, C), dtype)
        v = T.match_buffer(var_v, (n, C), dtype)
        kk = T.match_buffer(var_kk, (n, C), dtype)
        a = T.match_buffer(var_a, (n, C), dtype)
        s_in = T.match_buffer(var_s, (nb, H, N, N), f32)
        ends = T.match_buffer(var_ends, (nb,), "int32")
        y = T.match_buffer(var_y, (n, C), dtype)
        s_out = T.match_buffer(var_s_out, (nb, H, N, N), f32)
        for bx in T.thread_binding(nb * H, thread="blockIdx.x"):
            for tx in T.thread_binding(N, thread="threadIdx.x"):
                row = T.alloc_buffer((N,), f32, scope="local")
                acc = T.alloc_buffer((2,), f32, scope="local")
                sh = T.alloc_buffer((5, N), f32, scope="shared")  # w, k, -kk, kk * a, r
                for j in range(N):
                    row[j] = s_in[bx // H, bx % H, tx, j]
                first = T.Cast(
                    "int64", T.if_then_else(bx // H == 0, 0, ends[T.max(bx // H - 1, 0)] + 1)
                )
                for t in range(T.Cast("int64", ends[bx // H]) + 1 - first):
                    sh[0, tx] = T.exp(
                        T.float32(DECAY_SCALE)
                        / (T.float32(1) + T.exp(-T.Cast(f32, w[first + t, bx % H * N + tx])))
                    )
                    sh[1, tx] = T.Cast(f32, k[first + t, bx % H * N + tx])
                    sh[2, tx] = -T.Cast(f32, kk[first + t, bx % H * N + tx])
                    sh[3, tx] = T.Cast(f32, kk[first + t, bx % H * N + tx]) * T.Cast(
                        f32, a[first + t, bx % H * N + tx]
                    )
                    sh[4, tx] = T.Cast(f32, r[first + t, bx % H * N + tx])
                    T.tvm_storage_sync("shared")
                    acc[0] = T.float32(0)
                    for j in range(N):
                        acc[0] = acc[0] + row[j] * sh[2, j]
                    acc[1] = T.float32(0)
                    for j in range(N):
                        row[j] = (
                            row[j] * sh[0, j]
                            + acc[0] * sh[3, j]
                            + T.Cast(f32, v[first + t, bx % H * N + tx]) * sh[1, j]
                        )
                        acc[1] = acc[1] + row[j] * sh[4, j]
                    y[first + t, bx % H * N + tx] = T.Cast(dtype, acc[1])
                    T.tvm_storage_sync("shared")  # the next step overwrites `sh`
                for j in range(N):
                    s_out[bx // H, bx % H, tx, j] = row[j]

    return scheduled(func)
