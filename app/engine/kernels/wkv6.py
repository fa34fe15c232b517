"""TIR kernel of the RWKV-6 ("Finch") time-mix: the matrix-valued linear-attention scan over a
flat batch of sequences (the layout of `kernels.wkv`: `ends[b]` is the position of sequence b's
last token). The token shift and its interpolations are plain tensor ops in `models.rwkv6`.

Per head (N = head size), with the state S [N, N] (the `rwkv` package's layout: row j = key
channel, column i = value channel), the data-dependent decay w = exp(-exp(w_raw)) and the bonus
u (`time_faaaa`), one step of a token is

    y[i]    = sum_j r[j] * (u[j] * k[j] * v[i] + S[j, i])
    S[j, i] = k[j] * v[i] + w[j] * S[j, i]

(the reference's `y = r @ (u * k^T v + S)`, `S = k^T v + w * S`). Columns of S never mix, which
is what lets the GPU variant give each thread a column.
"""

from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

from localchat.engine.kernels.common import exp, scheduled, vec_width


@functools.cache  # one parse per model instead of one per layer and function
def wkv6_scan(heads: int, head_size: int, dtype: str, gpu: bool = False) -> tirx.PrimFunc:
    """(r [n, C] dtype; w_raw [n, C] f32; k, v [n, C] dtype; u [C] f32; S [B, H, N, N] f32;
    ends [B] i32) -> (y [n, C] dtype; S' [B, H, N, N] f32), C = H * N. The decay's
    pre-activation is float32 in every mode: decays near 1 (long memory) need its precision.

    The CPU schedule is parallel over (sequence, head) and sequential in time, the inner loop
    vectorized over the value channels (a row of S). It is an equal-result scan, not a chunked
    one: the chunked (parallel-form) scan trades O(chunk) more FLOPs per token for matrix-unit
    throughput a CPU does not have, and decode, the step that bounds chat speed, is one token
    per sequence anyway; here each (sequence, head) keeps its state hot in L1 across the whole
    prompt and the heads of all sequences fill the cores. The decay is computed in vectors by
    `exp2` (a libm exp is a call per lane) and the first token reads S where later ones read
    S', so the state is never copied: 71 -> 34 us a decode step at 40 heads of 64, 2
    threads. `gpu`: one block per (sequence, head), one thread per state column, the step's
    r, k and w shared."""
    if gpu:
        return _wkv6_scan_gpu(heads, head_size, dtype)
    H, N = heads, head_size  # noqa: N806 (the paper's names)
    C = H * N  # noqa: N806
    cl = vec_width(N)
    f32 = "float32"

    @T.macro
    def step(r, w, k, v, u, src, s_out, y, t, bh, ww, kv, rv, vv, acc):
        """Token t (of sequence bh // H) in head bh % H: s_out = the step of src and y[t] (the
        scratch vectors: the step's w, k, r and v as float32, y's sums)."""
        for jo in range(N // cl):
            for e in T.vectorized(cl):  # common.exp vectorizes, libm's does not
                ww[jo * cl + e] = exp(-exp(w[t, bh % H * N + jo * cl + e]))
        for j in range(N):
            kv[j] = T.Cast(f32, k[t, bh % H * N + j])
            rv[j] = T.Cast(f32, r[t, bh % H * N + j])
            vv[j] = T.Cast(f32, v[t, bh % H * N + j])
            acc[j] = T.float32(0)
        for j in range(N):
            for io in range(N // cl):
                for e in T.vectorized(cl):
                    acc[io * cl + e] = acc[io * cl + e] + rv[j] * (
                        u[bh % H * N + j] * kv[j] * vv[io * cl + e]
                        + src[bh // H, bh % H, j, io * cl + e]
                    )
                    s_out[bh // H, bh % H, j, io * cl + e] = (
                        kv[j] * vv[io * cl + e] + ww[j] * src[bh // H, bh % H, j, io * cl + e]
                    )
        for io in range(N // cl):
            for e in T.vectorized(cl):
                y[t, bh % H * N + io * cl + e] = T.Cast(dtype, acc[io * cl + e])

    @T.prim_func(private=True)
    def func(
        var_r: T.handle,
        var_w: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        var_u: T.handle,
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
        u = T.match_buffer(var_u, (C,), f32)
        s_in = T.match_buffer(var_s, (nb, H, N, N), f32)
        ends = T.match_buffer(var_ends, (nb,), "int32")
        y = T.match_buffer(var_y, (n, C), dtype)
        s_out = T.match_buffer(var_s_out, (nb, H, N, N), f32)
        for bh in T.parallel(nb * H):
            ww = T.alloc_buffer((N,), f32)
            kv = T.alloc_buffer((N,), f32)
            rv = T.alloc_buffer((N,), f32)
            vv = T.alloc_buffer((N,), f32)
            acc = T.alloc_buffer((N,), f32)
            first = T.Cast(
                "int64", T.if_then_else(bh // H == 0, 0, ends[T.max(bh // H - 1, 0)] + 1)
            )
            count = T.Cast("int64", ends[bh // H]) + 1 - first
            if count == 0:  # (a flat batch gives every sequence a token; kept for safety)
                for j in range(N):
                    for io in range(N // cl):
                        for e in T.vectorized(cl):
                            s_out[bh // H, bh % H, j, io * cl + e] = s_in[
                                bh // H, bh % H, j, io * cl + e
                            ]
            else:
                # the first token reads the state from s_in, later ones from s_out: no copy
                step(r, w, k, v, u, s_in, s_out, y, first, bh, ww, kv, rv, vv, acc)
                for t in range(1, count):
                    step(r, w, k, v, u, s_out, s_out, y, first + t, bh, ww, kv, rv, vv, acc)

    return scheduled(func)


def _wkv6_scan_gpu(heads: int, head_size: int, dtype: str) -> tirx.PrimFunc:
    """`wkv6_scan` with one block per (sequence, head) and one thread per state column (value
    channel): each thread keeps its column in registers; the step's decay, k, r and u * k are
    computed once per key channel into shared memory."""
    H, N = heads, head_size  # noqa: N806
    C = H * N  # noqa: N806
    f32 = "float32"

    @T.prim_func(private=True)
    def func(
        var_r: T.handle,
        var_w: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        var_u: T.handle,
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
        u = T.match_buffer(var_u, (C,), f32)
        s_in = T.match_buffer(var_s, (nb, H, N, N), f32)
        ends = T.match_buffer(var_ends, (nb,), "int32")
        y = T.match_buffer(var_y, (n, C), dtype)
        s_out = T.match_buffer(var_s_out, (nb, H, N, N), f32)
        for bx in T.thread_binding(nb * H, thread="blockIdx.x"):
            for tx in T.thread_binding(N, thread="threadIdx.x"):
                col = T.alloc_buffer((N,), f32, scope="local")
                acc = T.alloc_buffer((2,), f32, scope="local")  # y[tx], v[tx]
                sh = T.alloc_buffer((4, N), f32, scope="shared")  # w, k, r, u * k
                for j in range(N):
                    col[j] = s_in[bx // H, bx % H, j, tx]
                first = T.Cast(
                    "int64", T.if_then_else(bx // H == 0, 0, ends[T.max(bx // H - 1, 0)] + 1)
                )
                for t in range(T.Cast("int64", ends[bx // H]) + 1 - first):
                    sh[0, tx] = T.exp(-T.exp(w[first + t, bx % H * N + tx]))
                    sh[1, tx] = T.Cast(f32, k[first + t, bx % H * N + tx])
                    sh[2, tx] = T.Cast(f32, r[first + t, bx % H * N + tx])
                    sh[3, tx] = u[bx % H * N + tx] * T.Cast(f32, k[first + t, bx % H * N + tx])
                    T.tvm_storage_sync("shared")
                    acc[1] = T.Cast(f32, v[first + t, bx % H * N + tx])
                    acc[0] = T.float32(0)
                    for j in range(N):
                        acc[0] = acc[0] + sh[2, j] * (sh[3, j] * acc[1] + col[j])
                        col[j] = sh[1, j] * acc[1] + sh[0, j] * col[j]
                    y[first + t, bx % H * N + tx] = T.Cast(dtype, acc[0])
                    T.tvm_storage_sync("shared")  # the next step overwrites `sh`
                for j in range(N):
                    s_out[bx // H, bx % H, j, tx] = col[j]

    return scheduled(func)
