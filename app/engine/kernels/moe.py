"""Mixture-of-experts kernels on the CPU (and the router's on a GPU): the router's top-k and
the experts' grouped GEMV.

A MoE layer's experts are stored as one 2-D matrix per projection, expert e's rows at
[e * n, (e + 1) * n) (`models.moe`), in the dense Linear's storage formats (float, or the 4-bit
words and scales of `build.quantization`), so the quantizer and the GEMV bodies are the dense
ones:

* `router_topk`: per token, the softmax of the router's logits, the k largest (ties to the
  lower expert) and, with `norm`, their weights renormalized to sum to 1 (Qwen3-MoE's
  `norm_topk_prob`, Mixtral always; OLMoE's default keeps the softmax values).
* `moe_gemv`: y[t, j] = x[t, j or 0] @ W_{idx[t, j]}^T for every token t and slot j. Tokens are
  grouped by expert: for each expert, the rows routed to it are gathered into a contiguous
  block, the dense decode GEMV's body (`gemv.gemv_q4_macro`, or a float one here) runs over the
  block with the expert's slice of W as its matrix (a buffer aliasing W at the expert's
  offset), and the rows are scattered back. So each selected expert's weights are read once per
  call whatever the number of tokens routed to it, unselected experts are not read at all, and
  since the GEMV bodies compute each row of x with the same float operations whatever the other
  rows, a token's result does not depend on the batch it is in.
* `moe_combine`: out[t] = sum_j w[t, j] y[t, j], the slots in order.

Decode and prefill run the same kernels (the grouping is what prefill needs: an expert's weights
meet all its tokens at once).
"""

from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

from localchat.engine.kernels.common import (
    GROUP_SIZE,
    INT8_ISAS,
    K_SCALE_DTYPE,
    LANES,
    NIBBLES_PER_WORD,
    Q4K,
    asym_width,
    divisor,
    padded_k,
    scheduled,
)
from localchat.engine.kernels.gemv import gemv_q4_macro, gemv_q8_macro, gemv_q8_vnni_macro

F32 = "float32"
OPAQUE = 8  # Relax's op pattern for a kernel that fusion leaves whole
ROWS = 4  # rows of W per work item of the float GEMV body
VEC_UNROLL = 4  # 16-lane vectors of one row in flight (independent FMA chains)
BLOCK = 8  # rows of one expert that share each read of its weights (as the VNNI GEMV's block)


def _route_macro(experts: int, topk: int, norm: bool):
    """Token t's routing: the softmax (float32) of logits[t] over all experts, its `topk` largest
    in descending order into idx[t] and wt[t], renormalized to sum 1 with `norm`; `prob`, `acc`,
    `best`, `bestv` are the token's scratch ([experts], [2], [1], [1])."""

    @T.macro
    def route(logits, idx, wt, t, prob, acc, best, bestv):
        acc[0] = T.Cast(F32, logits[t, 0])
        for e in range(1, experts):
            acc[0] = T.max(acc[0], T.Cast(F32, logits[t, e]))
        acc[1] = T.float32(0)
        for e in range(experts):
            prob[e] = T.exp(T.Cast(F32, logits[t, e]) - acc[0])
            acc[1] = acc[1] + prob[e]
        for e in range(experts):
            prob[e] = prob[e] / acc[1]
        acc[1] = T.float32(0)
        for j in range(topk):
            # probabilities are >= 0; a chosen expert is marked -1 and never chosen again;
            # strictly greater: ties go to the lower expert
            best[0] = 0
            bestv[0] = T.float32(-2)
            for e in range(experts):
                if prob[e] > bestv[0]:
                    best[0] = e
                    bestv[0] = prob[e]
            idx[t, j] = best[0]
            wt[t, j] = prob[best[0]]
            acc[1] = acc[1] + prob[best[0]]
            prob[best[0]] = T.float32(-1)
        if norm:
            for j in range(topk):
                wt[t, j] = wt[t, j] / acc[1]

    return route


@functools.cache
def router_topk(experts: int, topk: int, norm: bool, dtype: str) -> tirx.PrimFunc:
    """(idx [m, topk] int32, weight [m, topk] float32) from router logits [m, experts]: the
    softmax (float32) over all experts, its `topk` largest in descending order, renormalized to
    sum 1 with `norm`."""
    route = _route_macro(experts, topk, norm)

    @T.prim_func(private=True, s_tir=True)
    def func(var_logits: T.handle, var_idx: T.handle, var_w: T.handle):
        m = T.int64()
        logits = T.match_buffer(var_logits, (m, experts), dtype)
        idx = T.match_buffer(var_idx, (m, topk), "int32")
        wt = T.match_buffer(var_w, (m, topk), F32)
        # a root block: Relax's reshape detection (one-input calls) reads the body as blocks
        with T.sblock("root"):
            for t in T.parallel(m):
                prob = T.alloc_buffer((experts,), F32)
                acc = T.alloc_buffer((2,), F32)  # the max, then the sum
                best = T.alloc_buffer((1,), "int32")
                bestv = T.alloc_buffer((1,), F32)
                route(logits, idx, wt, t, prob, acc, best, bestv)

    return _opaque(func)


GPU_THREADS = 64  # tokens per thread block of the GPU router (one thread per token)


@functools.cache
def router_topk_gpu(experts: int, topk: int, norm: bool, dtype: str) -> tirx.PrimFunc:
    """`router_topk` on a GPU: one thread per token, the same operations in the same order."""
    route = _route_macro(experts, topk, norm)

    @T.prim_func(private=True, s_tir=True)
    def func(var_logits: T.handle, var_idx: T.handle, var_w: T.handle):
        m = T.int64()
        logits = T.match_buffer(var_logits, (m, experts), dtype)
        idx = T.match_buffer(var_idx, (m, topk), "int32")
        wt = T.match_buffer(var_w, (m, topk), F32)
        with T.sblock("root"):
            for bx in T.thread_binding((m + GPU_THREADS - 1) // GPU_THREADS, "blockIdx.x"):
                for tx in T.thread_binding(GPU_THREADS, "threadIdx.x"):
                    prob = T.alloc_buffer((experts,), F32, scope="local")
                    acc = T.alloc_buffer((2,), F32, scope="local")
                    best = T.alloc_buffer((1,), "int32", scope="local")
                    bestv = T.alloc_buffer((1,), F32, scope="local")
                    t = bx * GPU_THREADS + tx
                    if t < m:
                        route(logits, idx, wt, t, prob, acc, best, bestv)

    return _opaque(func)


def _opaque(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` scheduled (`common.scheduled`) and left whole by Relax's operator fusion."""
    return scheduled(func).with_attr("op_pattern", OPAQUE)


def _sum_lanes(acc, vecs: int):
    total = None
    for a in range(vecs):
        for e in range(LANES):
            value = acc[a * LANES + e]
            total = value if total is None else total + value
    return total


def gemv_f_macro(k: int, n: int, dtype: str):
    """The float decode GEMV as a macro `(x, w, s, b, y, m)` (s and b unused) over x [m, k],
    w [n, k] and y [m, n]: the body of `gemv.gemv_f` (copied here as a macro, the dense kernel
    module being another engineer's)."""
    kv = k // LANES
    kt = k % LANES
    vu = divisor(kv, (VEC_UNROLL, 2))
    rb = divisor(n, (ROWS, 2))

    @T.macro
    def body(x, w, s, b, y, m):
        for jo in T.parallel(n // rb):
            acc = T.alloc_buffer((vu * LANES,), F32)
            for r, jj in T.grid(m, rb):
                for u in T.unroll(vu):
                    for e in T.vectorized(LANES):
                        acc[u * LANES + e] = T.float32(0)
                for vo in range(kv // vu):
                    for u in T.unroll(vu):
                        for e in T.vectorized(LANES):
                            acc[u * LANES + e] = acc[u * LANES + e] + T.Cast(
                                F32, w[jo * rb + jj, (vo * vu + u) * LANES + e]
                            ) * T.Cast(F32, x[r, (vo * vu + u) * LANES + e])
                if kt > 0:
                    for e in range(kt):
                        acc[e] = acc[e] + T.Cast(F32, w[jo * rb + jj, kv * LANES + e]) * T.Cast(
                            F32, x[r, kv * LANES + e]
                        )
                y[r, jo * rb + jj] = T.Cast(dtype, _sum_lanes(acc, vu))

    return body


@functools.cache
def moe_gemv(
    k: int, n: int, experts: int, topk: int, dtype: str, quant: str,
    avx512: bool | str = False, shared: bool = True, scale_dtype: str | None = None,
) -> tirx.PrimFunc:
    """y [m, topk, n] = x @ W_e^T per token and slot, e = idx[t, j], W [experts * n, k] stored
    as `quant`: "f" (float of `dtype`), "q4" ((q - 8) * scale), "q4_asym" (float16 scale and
    min), "q4_k" (q4f32_k's Q4_K super-blocks), "mxfp4" (FP4 codes, E8M0 exponents) or "q8"
    (int8 q * float16 scale, `quantization.quantize_q8`); `avx512` as `gemv.gemv_q4`'s.
    `shared`: x is [m, 1, k], one input for every slot (the gate/up projection); otherwise
    [m, topk, k], each slot its own (the down projection). `scale_dtype`: "q4"'s scales'
    type when not `dtype` (float16 in the modes holding llama.cpp's Q4_0)."""
    kx = 1 if shared else topk
    if quant == "f":
        body = gemv_f_macro(k, n, dtype)
        kw, ks, wdt, sdt = k, 1, dtype, dtype
    elif quant == "q8":
        body = (gemv_q8_vnni_macro(k, n, dtype, False, isa=avx512) if avx512 in INT8_ISAS
                else gemv_q8_macro(k, n, dtype, False))
        kw, ks, wdt, sdt = padded_k(k), padded_k(k) // GROUP_SIZE, "int8", "float16"
    else:
        asym = {"q4_asym": True, "q4_k": Q4K}.get(quant, False)
        body = gemv_q4_macro(k, n, dtype, False, avx512, asym, mx=quant == "mxfp4")
        kw, kg = padded_k(k) // NIBBLES_PER_WORD, padded_k(k) // GROUP_SIZE
        ks, sdt = {"q4_asym": (2 * kg, "float16"), "q4_k": (asym_width(Q4K, kg), K_SCALE_DTYPE),
                   "mxfp4": (kg, "uint8")}.get(quant, (kg, scale_dtype or dtype))
        wdt = "uint32"

    @T.macro
    def init(pos, m):
        # written whole: otherwise TVM compacts `pos` to the range its data-dependent indices
        # seem to cover, and reads it wrongly
        for i in range(m * topk):
            pos[i] = T.int64(0)

    @T.macro
    def tail(xg, yg, we, se, cnt, size):
        """The block of `size` rows after the whole blocks of 2 `size` (BLOCK for 4), if the
        count has one."""
        if cnt[0] % (2 * size) >= size:
            row = T.meta_var(cnt[0] - cnt[0] % (2 * size))
            xt = T.decl_buffer((size, k), dtype, data=xg.data, elem_offset=row * k)
            yt = T.decl_buffer((size, n), dtype, data=yg.data, elem_offset=row * n)
            body(xt, we, se, None, yt, size)

    @T.macro
    def group(x, w, s, idx, y, xg, yg, pos, cnt, m, e):
        """Gather expert e's rows, run the GEMV body on them, scatter the results."""
        cnt[0] = T.int64(0)
        for t, j in T.grid(m, topk):
            if idx[t, j] == e:
                pos[cnt[0]] = t * topk + j
                for c in range(k):
                    xg[cnt[0], c] = x[t, 0 if shared else j, c]
                cnt[0] = cnt[0] + 1
        if cnt[0] > 0:
            we = T.decl_buffer((n, kw), wdt, data=w.data, elem_offset=e * (n * kw))
            if quant == "f":
                se = T.meta_var(None)
            else:
                se = T.decl_buffer((n, ks), sdt, data=s.data, elem_offset=e * (n * ks))
            # Blocks of BLOCK rows, then one block each of 4, 2 and 1 for the rest (each block
            # reads the expert's weights once; a row's arithmetic is the same in any block):
            # the GEMV bodies allocate by their row count, which TVM needs constant here (a
            # count read from memory fails to lower)
            for blk in range(cnt[0] // BLOCK):
                xb = T.decl_buffer((BLOCK, k), dtype, data=xg.data, elem_offset=blk * (BLOCK * k))
                yb = T.decl_buffer((BLOCK, n), dtype, data=yg.data, elem_offset=blk * (BLOCK * n))
                body(xb, we, se, None, yb, BLOCK)
            tail(xg, yg, we, se, cnt, 4)
            tail(xg, yg, we, se, cnt, 2)
            tail(xg, yg, we, se, cnt, 1)
            for r in range(cnt[0]):
                for c in range(n):
                    y[pos[r] // topk, pos[r] % topk, c] = yg[r, c]

    if quant == "f":

        @T.prim_func(private=True)
        def func(var_x: T.handle, w: T.Buffer((experts * n, kw), wdt), var_idx: T.handle,
                 var_y: T.handle):
            m = T.int64()
            x = T.match_buffer(var_x, (m, kx, k), dtype)
            idx = T.match_buffer(var_idx, (m, topk), "int32")
            y = T.match_buffer(var_y, (m, topk, n), dtype)
            xg = T.alloc_buffer((m * topk, k), dtype)
            yg = T.alloc_buffer((m * topk, n), dtype)
            pos = T.alloc_buffer((m * topk,), "int64")
            cnt = T.alloc_buffer((2,), "int64")  # (shape 1 would become a scalar)
            init(pos, m)
            for e in range(experts):
                group(x, w, None, idx, y, xg, yg, pos, cnt, m, e)

    else:

        @T.prim_func(private=True)
        def func(var_x: T.handle, w: T.Buffer((experts * n, kw), wdt),
                 s: T.Buffer((experts * n, ks), sdt), var_idx: T.handle, var_y: T.handle):
            m = T.int64()
            x = T.match_buffer(var_x, (m, kx, k), dtype)
            idx = T.match_buffer(var_idx, (m, topk), "int32")
            y = T.match_buffer(var_y, (m, topk, n), dtype)
            xg = T.alloc_buffer((m * topk, k), dtype)
            yg = T.alloc_buffer((m * topk, n), dtype)
            pos = T.alloc_buffer((m * topk,), "int64")
            cnt = T.alloc_buffer((2,), "int64")  # (shape 1 would become a scalar)
            init(pos, m)
            for e in range(experts):
                group(x, w, s, idx, y, xg, yg, pos, cnt, m, e)

    return _opaque(func)


@functools.cache
def moe_combine(n: int, topk: int, dtype: str) -> tirx.PrimFunc:
    """out [m, n] = sum_j weight[t, j] * y[t, j] (float32 accumulation, slots in order) for
    y [m, topk, n] and weight [m, topk] float32."""
    lanes = divisor(n, (LANES, 8, 4, 2))

    def _weighted(y, wt, t, c):
        total = None
        for j in range(topk):
            term = wt[t, j] * T.Cast(F32, y[t, j, c])
            total = term if total is None else total + term
        return total

    @T.prim_func(private=True)
    def func(var_y: T.handle, var_w: T.handle, var_out: T.handle):
        m = T.int64()
        y = T.match_buffer(var_y, (m, topk, n), dtype)
        wt = T.match_buffer(var_w, (m, topk), F32)
        out = T.match_buffer(var_out, (m, n), dtype)
        for t in T.parallel(m):
            for co in range(n // lanes):
                for ci in T.vectorized(lanes):
                    out[t, co * lanes + ci] = T.Cast(dtype, _weighted(y, wt, t, co * lanes + ci))

    return _opaque(func)
