"""CPU-scheduled TIR kernels of the RWKV-4 time-mix, and the copy kernels of its RNN state.

The model runs every forward (prefill, batched prefill, decode, batched decode) on a flat list of
tokens `[n, channels]` that holds `B` sequences back to back. `ends[b]` (int32) is the position of
the last token of sequence b, so sequence b spans `ends[b-1] + 1 .. ends[b]` (from 0 for b = 0);
a prefill is B = 1, ends = [n - 1]; a batched decode is n = B, ends = [0, 1, ..., B - 1].

* `segment_starts`: per token, the sequence it opens (or -1 when it continues one): what the
  token shift needs to pick the state instead of the previous row.
* `token_mix`: the token shift fused with the interpolations `x * mix + x_prev * (1 - mix)`,
  one output per mix vector (TE, so the compile pipeline may fuse it further).
* `wkv_scan`: the WKV recurrence over each sequence, with the running state (a, b, p) per channel
  in float32 whatever the activation dtype. Parallel over blocks of 16 channels, vectorized across
  them, sequential over time. Per step, with u = time_first and w = -exp(time_decay):

      out:   q = max(p, u + k);  e1 = exp(p - q);  e2 = exp(u + k - q)
             y = (e1 a + e2 v) / (e1 b + e2)
      state: q = max(p + w, k);  e1 = exp(p + w - q);  e2 = exp(k - q)
             a = e1 a + e2 v;  b = e1 b + e2;  p = q

* `state_get` / `state_set`: the functions TVM's RNN-state runtime object
  (`vm.builtin.rnn_state_create`) calls to copy one state tensor of a batch of sequences out of
  and into its storage `[max_seqs, max_history, *shape]`; a set writes the slot after the current
  history slot, modulo max_history, which the runtime then makes current at end_forward.
"""

from __future__ import annotations

import functools

from tvm import te, tirx
from tvm.script import tirx as T

from localchat.engine.kernels.common import GPU_COPY_THREADS, GPU_THREADS, exp, scheduled, vec_width


def segment_starts(ends: te.Tensor, n: tirx.PrimExpr) -> te.Tensor:
    """start_of[t] = b if token t is the first of sequence b, else -1 (ends: int32 [B])."""
    nb = ends.shape[0]
    r = te.reduce_axis((0, nb), name="r")

    def first(i):
        return tirx.if_then_else(i == 0, 0, ends[tirx.max(i - 1, 0)] + 1)

    i = r.var
    return te.compute(
        (n,),
        lambda t: te.max(
            tirx.if_then_else(first(i) == t.astype("int32"), i.astype("int32"), -1), axis=r
        ),
        name="segment_starts",
    )


def token_mix(x: te.Tensor, prev: te.Tensor, start_of: te.Tensor, *mixes: te.Tensor):
    """For each mix m: x * m + shifted(x) * (1 - m), where shifted(x)[t] is x[t - 1] within a
    sequence and the state `prev[b]` for the first token of sequence b."""
    n, h = x.shape

    def shifted(t, c):
        s = start_of[t]
        return tirx.if_then_else(s >= 0, prev[tirx.max(s, 0), c], x[tirx.max(t - 1, 0), c])

    def mixer(m: te.Tensor):
        one = tirx.const(1, m.dtype)
        return lambda t, c: x[t, c] * m[c] + shifted(t, c) * (one - m[c])

    outs = [te.compute((n, h), mixer(m), name=f"token_mix{i}") for i, m in enumerate(mixes)]
    return outs if len(outs) > 1 else outs[0]


@functools.cache  # one parse per model instead of one per layer and function
def wkv_scan(channels: int, dtype: str, gpu: bool = False) -> tirx.PrimFunc:
    """(k, v [n, C] dtype; w, u [C] f32; a, b, p [B, C] f32; ends [B] i32)
    -> (y [n, C] dtype; a', b', p' [B, C] f32).  `gpu`: one thread per channel."""
    if gpu:
        return _wkv_scan_gpu(channels, dtype)
    cl = vec_width(channels)
    f32 = "float32"

    @T.prim_func(private=True)
    def func(
        var_k: T.handle,
        var_v: T.handle,
        w: T.Buffer((channels,), "float32"),
        u: T.Buffer((channels,), "float32"),
        var_a: T.handle,
        var_b: T.handle,
        var_p: T.handle,
        var_ends: T.handle,
        var_y: T.handle,
        var_a_out: T.handle,
        var_b_out: T.handle,
        var_p_out: T.handle,
    ):
        n = T.int64()
        nb = T.int64()
        k = T.match_buffer(var_k, (n, channels), dtype)
        v = T.match_buffer(var_v, (n, channels), dtype)
        a_in = T.match_buffer(var_a, (nb, channels), f32)
        b_in = T.match_buffer(var_b, (nb, channels), f32)
        p_in = T.match_buffer(var_p, (nb, channels), f32)
        ends = T.match_buffer(var_ends, (nb,), "int32")
        y = T.match_buffer(var_y, (n, channels), dtype)
        a_out = T.match_buffer(var_a_out, (nb, channels), f32)
        b_out = T.match_buffer(var_b_out, (nb, channels), f32)
        p_out = T.match_buffer(var_p_out, (nb, channels), f32)
        for co in T.parallel(channels // cl):
            sa = T.alloc_buffer((cl,), f32)
            sb = T.alloc_buffer((cl,), f32)
            sp = T.alloc_buffer((cl,), f32)
            kk = T.alloc_buffer((cl,), f32)
            vv = T.alloc_buffer((cl,), f32)
            q = T.alloc_buffer((cl,), f32)
            e1 = T.alloc_buffer((cl,), f32)
            e2 = T.alloc_buffer((cl,), f32)
            for s in range(nb):
                for e in T.vectorized(cl):
                    sa[e] = a_in[s, co * cl + e]
                    sb[e] = b_in[s, co * cl + e]
                    sp[e] = p_in[s, co * cl + e]
                first = T.Cast("int64", T.if_then_else(s == 0, 0, ends[T.max(s - 1, 0)] + 1))
                for t in range(T.Cast("int64", ends[s]) + 1 - first):
                    for e in T.vectorized(cl):
                        kk[e] = T.Cast(f32, k[first + t, co * cl + e])
                        vv[e] = T.Cast(f32, v[first + t, co * cl + e])
                        # output at t
                        q[e] = T.max(sp[e], u[co * cl + e] + kk[e])
                        e1[e] = exp(sp[e] - q[e])
                        e2[e] = exp(u[co * cl + e] + kk[e] - q[e])
                        y[first + t, co * cl + e] = T.Cast(
                            dtype, (e1[e] * sa[e] + e2[e] * vv[e]) / (e1[e] * sb[e] + e2[e])
                        )
                        # state after t
                        q[e] = T.max(sp[e] + w[co * cl + e], kk[e])
                        e1[e] = exp(sp[e] + w[co * cl + e] - q[e])
                        e2[e] = exp(kk[e] - q[e])
                        sa[e] = e1[e] * sa[e] + e2[e] * vv[e]
                        sb[e] = e1[e] * sb[e] + e2[e]
                        sp[e] = q[e]
                for e in T.vectorized(cl):
                    a_out[s, co * cl + e] = sa[e]
                    b_out[s, co * cl + e] = sb[e]
                    p_out[s, co * cl + e] = sp[e]

    return scheduled(func)


def _wkv_scan_gpu(channels: int, dtype: str) -> tirx.PrimFunc:
    f32 = "float32"
    blocks = (channels + GPU_THREADS - 1) // GPU_THREADS

    @T.prim_func(private=True)
    def func(
        var_k: T.handle,
        var_v: T.handle,
        w: T.Buffer((channels,), "float32"),
        u: T.Buffer((channels,), "float32"),
        var_a: T.handle,
        var_b: T.handle,
        var_p: T.handle,
        var_ends: T.handle,
        var_y: T.handle,
        var_a_out: T.handle,
        var_b_out: T.handle,
        var_p_out: T.handle,
    ):
        n = T.int64()
        nb = T.int64()
        k = T.match_buffer(var_k, (n, channels), dtype)
        v = T.match_buffer(var_v, (n, channels), dtype)
        a_in = T.match_buffer(var_a, (nb, channels), f32)
        b_in = T.match_buffer(var_b, (nb, channels), f32)
        p_in = T.match_buffer(var_p, (nb, channels), f32)
        ends = T.match_buffer(var_ends, (nb,), "int32")
        y = T.match_buffer(var_y, (n, channels), dtype)
        a_out = T.match_buffer(var_a_out, (nb, channels), f32)
        b_out = T.match_buffer(var_b_out, (nb, channels), f32)
        p_out = T.match_buffer(var_p_out, (nb, channels), f32)
        for bx in T.thread_binding(blocks, thread="blockIdx.x"):
            for tx in T.thread_binding(GPU_THREADS, thread="threadIdx.x"):
                st = T.alloc_buffer((6,), f32, scope="local")  # a, b, p, k, v, q
                if bx * GPU_THREADS + tx < channels:
                    for s in range(nb):
                        st[0] = a_in[s, bx * GPU_THREADS + tx]
                        st[1] = b_in[s, bx * GPU_THREADS + tx]
                        st[2] = p_in[s, bx * GPU_THREADS + tx]
                        first = T.Cast(
                            "int64", T.if_then_else(s == 0, 0, ends[T.max(s - 1, 0)] + 1)
                        )
                        for t in range(T.Cast("int64", ends[s]) + 1 - first):
                            st[3] = T.Cast(f32, k[first + t, bx * GPU_THREADS + tx])
                            st[4] = T.Cast(f32, v[first + t, bx * GPU_THREADS + tx])
                            st[5] = T.max(st[2], u[bx * GPU_THREADS + tx] + st[3])
                            y[first + t, bx * GPU_THREADS + tx] = T.Cast(
                                dtype,
                                (
                                    T.exp(st[2] - st[5]) * st[0]
                                    + T.exp(u[bx * GPU_THREADS + tx] + st[3] - st[5]) * st[4]
                                )
                                / (
                                    T.exp(st[2] - st[5]) * st[1]
                                    + T.exp(u[bx * GPU_THREADS + tx] + st[3] - st[5])
                                ),
                            )
                            st[5] = T.max(st[2] + w[bx * GPU_THREADS + tx], st[3])
                            st[0] = (
                                T.exp(st[2] + w[bx * GPU_THREADS + tx] - st[5]) * st[0]
                                + T.exp(st[3] - st[5]) * st[4]
                            )
                            st[1] = T.exp(st[2] + w[bx * GPU_THREADS + tx] - st[5]) * st[1] + T.exp(
                                st[3] - st[5]
                            )
                            st[2] = st[5]
                        a_out[s, bx * GPU_THREADS + tx] = st[0]
                        b_out[s, bx * GPU_THREADS + tx] = st[1]
                        p_out[s, bx * GPU_THREADS + tx] = st[2]

    return scheduled(func)


def state_get(size: int, dtype: str, state_id: int, gpu: bool = False) -> tirx.PrimFunc:
    """out[i, :] = storage[seq_slot[i], history_slot[i], :]"""
    if gpu:
        return _state_copy_gpu(size, dtype, state_id, write=False)
    cl = vec_width(size)

    @T.prim_func(private=True)
    def func(var_storage: T.handle, var_seq: T.handle, var_hist: T.handle, var_out: T.handle):
        max_seqs = T.int64()
        max_history = T.int64()
        nb = T.int32()
        storage = T.match_buffer(var_storage, (max_seqs, max_history, size), dtype)
        seq = T.match_buffer(var_seq, (nb,), "int32")
        hist = T.match_buffer(var_hist, (nb,), "int32")
        out = T.match_buffer(var_out, (nb, size), dtype)
        for i in range(nb):
            for co in range(size // cl):
                for e in T.vectorized(cl):
                    out[i, co * cl + e] = storage[seq[i], hist[i], co * cl + e]

    return scheduled(func).with_attr("global_symbol", f"rnn_state_get_{state_id}")


def state_set(size: int, dtype: str, state_id: int, gpu: bool = False) -> tirx.PrimFunc:
    """storage[seq_slot[i], (history_slot[i] + 1) % max_history, :] = data[i, :]"""
    if gpu:
        return _state_copy_gpu(size, dtype, state_id, write=True)
    cl = vec_width(size)

    @T.prim_func(private=True)
    def func(var_storage: T.handle, var_seq: T.handle, var_hist: T.handle, var_data: T.handle):
        max_seqs = T.int64()
        max_history = T.int64()
        nb = T.int32()
        storage = T.match_buffer(var_storage, (max_seqs, max_history, size), dtype)
        seq = T.match_buffer(var_seq, (nb,), "int32")
        hist = T.match_buffer(var_hist, (nb,), "int32")
        data = T.match_buffer(var_data, (nb, size), dtype)
        for i in range(nb):
            for co in range(size // cl):
                for e in T.vectorized(cl):
                    storage[seq[i], (hist[i] + 1) % T.Cast("int32", max_history), co * cl + e] = (
                        data[i, co * cl + e]
                    )

    return scheduled(func).with_attr("global_symbol", f"rnn_state_set_{state_id}")


def _state_copy_gpu(size: int, dtype: str, state_id: int, write: bool) -> tirx.PrimFunc:
    """state_get / state_set with one thread per element."""
    threads = GPU_COPY_THREADS

    @T.prim_func(private=True)
    def func(var_storage: T.handle, var_seq: T.handle, var_hist: T.handle, var_data: T.handle):
        max_seqs = T.int64()
        max_history = T.int64()
        nb = T.int32()
        storage = T.match_buffer(var_storage, (max_seqs, max_history, size), dtype)
        seq = T.match_buffer(var_seq, (nb,), "int32")
        hist = T.match_buffer(var_hist, (nb,), "int32")
        data = T.match_buffer(var_data, (nb, size), dtype)
        for bx in T.thread_binding((nb * size + threads - 1) // threads, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                if bx * threads + tx < nb * size:
                    if write:
                        storage[
                            seq[(bx * threads + tx) // size],
                            (hist[(bx * threads + tx) // size] + 1) % T.Cast("int32", max_history),
                            (bx * threads + tx) % size,
                        ] = data[(bx * threads + tx) // size, (bx * threads + tx) % size]
                    else:
                        data[(bx * threads + tx) // size, (bx * threads + tx) % size] = storage[
                            seq[(bx * threads + tx) // size],
                            hist[(bx * threads + tx) // size],
                            (bx * threads + tx) % size,
                        ]

    kind = "set" if write else "get"
    return scheduled(func).with_attr("global_symbol", f"rnn_state_{kind}_{state_id}")
