"""Scheduled CPU attention kernels for TVM's paged KV cache, and a cache that uses them.

TVM's `TIRPagedKVCache` gives the llvm target serial scalar loop nests for attention; on a
135M-parameter model they take most of a prefill. The kernels here keep the exact PrimFunc
signatures the KV-cache runtime calls (`vm.builtin.paged_attention_kv_cache_create`) and are
written already scheduled:

* prefill (ragged and paged): one work item is a block of queries x some query heads that share
  one KV head (3 heads x 16 queries for SmolLM2; see `_prefill_shape`). The scores of a key block
  are computed transposed, S^T[key, row], with 16 queries of a head in the 16 lanes of a vector,
  so the online-softmax max and sum are lane-wise (no horizontal reductions) and K is read in its
  stored layout (one broadcast per element). P.V accumulates into (rows x head_dim) register
  tiles. Work items are dealt round-robin to the threads (causal blocks differ in cost).
* decode: one work item is (sequence, KV head, KV split); a sequence's pages are split in up to
  `DECODE_SPLITS` ranges so that a single sequence still fills the cores; partial states are merged
  after the parallel loop. Dot products run along head_dim.
* merge-state: parallel over tokens, vectorized along head_dim.
* split-rotary (`split_rotary_cpu`, the cache's "tir_split_rotary"): fused QKV split into q, k, v
  with rotary embedding; TVM's kernel computes a power, a cosine and a sine for every element,
  serially (about 5 ms per layer for a 560-token prefill, 9 us per layer per decode token);
  here each token's angles are computed once for all heads, tokens run in parallel (about 20x
  faster) and one or two tokens stay on the calling thread (0.7 us).

Softmax runs in base 2 on fp32 (inputs of any float dtype are widened), with a polynomial exp2
accurate to ~2e-7 relative. `lse` follows TVM's convention: log2-sum-exp2 of the scaled scores
(score * sm_scale * log2(e)); a query with no key to attend to (a sequence without cached pages)
gets output 0 and lse -5e4, which the runtime's merge weighs as zero.

Rotary position embedding is applied by the cache before attention in RopeMode.NORMAL (and not
at all in NONE), so the kernels ignore `rotary_mode`/rope arguments; INLINE mode, MLA and the
sliding-window variants (attn_kind "mha_sliding") are left to TVM's kernels
(`create_paged_kv_cache_cpu` falls back to `TIRPagedKVCache` for INLINE and MLA, and keeps TVM's
sliding-window kernels).

Options for other decoder blocks (issue 22), all off by default, and off they build exactly the
kernels there were before them:
* an attention-logit soft-cap, c * tanh(s / c) on the scaled scores (`attn_soft_cap`);
* a sliding window (`sliding_window` W): the runtime gives a kernel no layer id, so a layer asks
  for the window through the sign of its sm_scale (`windowed_sm_scale`), and the kernels find
  the keys in it from the rope positions the runtime passes them (query position - key position
  < W), which stays exact across chunks, batches and forked sequences; windowed decode and
  prefill skip the keys before the window;
* the attention scale is the `sm_scale` each call passes (Gemma's query_pre_attn_scalar^-0.5);
* rotary embedding the model applies itself (`rotary_qkv_cpu`, with the cache in
  RopeMode.NONE): per-layer theta, no rope on a layer, partial width. The cache's own rotary
  (`split_rotary_cpu`) does partial width too (`rotary_dim`), the same for every layer;
* attention sinks (gpt-oss, `attn_sinks`): a learned logit per (layer, head) joins each query's
  softmax as one more key with value 0. No buffer reaches a kernel, so the sink rides in q: the
  head dim is the model's plus `SINK_PAD` lanes, the sink in the first pad lane of each query
  head, zeros in the other pad lanes and in K's and V's. The runtime computes one query's
  attention as several calls (ragged part, one paged call per depth) whose states it merges, so
  the sink must be counted exactly once: by the call whose keys include the query's own position
  (the ragged causal kernel always; a paged prefill or decode call iff the query's position lies
  within its keys' positions, i.e. the decode depth holding the just-appended key).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

import tvm
from tvm import relax as rx
from tvm import tirx
from tvm.relax.frontend.nn.llm.kv_cache import (
    AttnKind,
    PagedKVCache,
    RopeMode,
    TIRPagedKVCache,
    llama_rope_with_position_map,
    tree_attn_cpu,
    tree_attn_with_paged_kv_cache_cpu,
)
from tvm.script import tirx as T
from tvm.target import Target

from localchat.engine.kernels import tvm_private
from localchat.engine.kernels.common import (
    LANES,
    LOG2E,
    add,
    exp2,
    lane_tree,
    prefetch,
    scheduled,
    tanh,
    vec_width,
)

# LANES (16 float32 lanes of one AVX-512 register) is also the query rows per prefill work item.
KEY_BLOCK = 64  # keys per online-softmax step in prefill
DECODE_KEY_BLOCK = 16  # keys per online-softmax step in decode
DECODE_SPLITS = 4  # most KV ranges one decode sequence is split into
DECODE_MIN_SPLIT = 64  # fewest keys in a decode split
# Decode prefetches the K and V lines of the key this many key blocks ahead as it reads each key
# (3B shape, 4,000 keys, 28 layers of random pages, Zen 5, 2 threads: 18 GB/s with the next
# block's pages prefetched at once as each block starts, 22 with them 2 blocks ahead, 29-30
# spread over the block as here, 1 or 4 blocks ahead no better).
DECODE_PREFETCH_BLOCKS = 2
NEG_INF = -1.0e30  # "minus infinity" that stays finite through subtraction
EMPTY_LSE = -5.0e4  # lse of a query with no keys (TVM's kernels use the same value)
TARGET_ACCUMULATORS = 24  # vector registers given to an accumulator tile (of 32 zmm)
# Attention sinks (gpt-oss): the cache's head dim is the model's plus SINK_PAD lanes, and each
# query head carries its sink logit in lane d - SINK_PAD (see `ScoreOptions.sinks`). 16 keeps a
# head dim that is a multiple of 16 (gpt-oss: 64 -> 80) in whole 16-lane vectors.
SINK_PAD = 16


def _row_tile(rows: int, vecs_per_row: int) -> int:
    """Rows of a P.V register tile: the most that fit TARGET_ACCUMULATORS and divide `rows`."""
    best = 1
    for rt in range(1, rows + 1):
        if rows % rt == 0 and rt * vecs_per_row <= TARGET_ACCUMULATORS:
            best = rt
    return best


def _check_heads(h_kv: int, h_q: int) -> int:
    if h_kv <= 0 or h_q % h_kv != 0:
        raise ValueError(f"query heads ({h_q}) must be a multiple of KV heads ({h_kv})")
    return h_q // h_kv


@dataclass(frozen=True)
class ScoreOptions:
    """What a kernel does to the scores beyond q.k * sm_scale, fixed when it is built.

    soft_cap: c > 0 replaces each scaled score s by c * tanh(s / c) before the softmax (Gemma
    2's attention soft-cap); 0: off.
    sliding_window: W > 0 lets a call whose `sm_scale` is negative (`windowed_sm_scale`) attend
    only to the keys of the last W positions (the query's own included), at |sm_scale|; calls
    with a positive sm_scale attend to all keys. 0: off (sm_scale is used as given).
    sinks: per-(layer, head) attention sinks (gpt-oss), one more key with a learned score and
    value 0: o = sum_j e^s_j v_j / (sum_j e^s_j + e^sink). The head dim d is the model's
    d_real + `SINK_PAD`; query head h carries its sink logit (natural-log units, not scaled by
    sm_scale) in lane d_real = d - SINK_PAD of q, and q's other pad lanes and all of K's and V's
    are 0 (so q.k over all d lanes is the real q.k, and the output's pad lanes are 0). The
    runtime merges several calls per query (ragged part, paged depths), so the sink is counted
    in exactly one: the call whose keys include the query's own position (the ragged causal
    kernel always; a paged call iff the query's position lies in its keys' positions). Not
    subject to the sliding window; not combined with soft_cap.

    The helpers return the expressions of the kernels; with the options off they are exactly
    the expressions the kernels had before the options existed, so default kernels are unchanged.
    """

    soft_cap: float = 0.0
    sliding_window: int = 0
    sinks: bool = False

    def __post_init__(self) -> None:
        if self.sinks and self.soft_cap:
            raise ValueError("attention sinks are not combined with an attention soft-cap")
        if self.soft_cap < 0:
            raise ValueError(f"the attention soft-cap must be >= 0, not {self.soft_cap}")
        if self.sliding_window < 0:
            raise ValueError(f"the sliding window must be >= 0, not {self.sliding_window}")

    def q_scale(self, sm_scale):
        """The factor applied to q: log2 units, or s / c in natural units under a soft-cap."""
        if self.sliding_window:
            sm_scale = T.abs(sm_scale)
        if self.soft_cap:
            return sm_scale * T.float32(1.0 / self.soft_cap)
        return sm_scale * T.float32(LOG2E)

    def score(self, dot):
        """The score in log2 units of `dot`, q.k times `q_scale`."""
        if self.soft_cap:
            return T.float32(self.soft_cap * LOG2E) * tanh(dot)
        return dot

    def sink(self, q_raw):
        """The sink score in log2 units from lane d - SINK_PAD of the (unscaled) query."""
        return T.Cast("float32", q_raw) * T.float32(LOG2E)

    def has_sink(self, q_pos, k_pos0, kv_n):
        """Whether a paged call's keys (positions k_pos0 .. k_pos0 + kv_n - 1) include the
        query's own position q_pos: then that call is the one that counts the query's sink."""
        return tirx.And(q_pos >= k_pos0, q_pos < k_pos0 + kv_n)

    def first_key(self, sm_scale, q_pos, k_pos0):
        """The first key (index from the one at position k_pos0) that a query at position q_pos
        sees: beyond the window only when the call is windowed; 0 without a window."""
        if not self.sliding_window:
            return 0
        return T.if_then_else(
            sm_scale < T.float32(0), T.max(q_pos - (self.sliding_window - 1) - k_pos0, 0), 0
        )


def windowed_sm_scale(sm_scale: float) -> float:
    """The `sm_scale` to give `attention_with_fused_qkv` for a layer with a sliding window, on a
    cache from `create_paged_kv_cache_cpu(..., sliding_window=W)`: its negative, which the
    kernels read as "this call is windowed" (the runtime tells kernels nothing else per layer).
    Layers that see every key pass sm_scale itself."""
    if not sm_scale > 0:
        raise ValueError(f"sm_scale must be positive, not {sm_scale}")
    return -sm_scale


# --------------------------------------------------------------------------------------------
# Prefill
# --------------------------------------------------------------------------------------------


def _prefill_shape(group: int, d: int) -> tuple[int, int]:
    """(query heads, query vectors of 16) in one prefill work item; its rows are their product.

    All rows share one KV head. Several heads at 16 queries each beat longer query blocks (less
    causal waste on the diagonal), up to heads x head_dim of 512 (Q^T and O of the item stay in
    L1); MHA takes 48 queries of its one head.
    """
    if group == 1:
        return 1, 3
    fits = [h for h in range(1, group + 1) if group % h == 0 and h * d <= 512]
    heads = max(fits, default=1)
    return heads, 1 if heads > 1 else 3


def _prefill_macros(
    h_kv: int,
    h_q: int,
    d_qk: int,
    d_v: int,
    dtype: str,
    paged: bool,
    ps: int = 0,
    opts: ScoreOptions = ScoreOptions(),
):
    """The work item shared by the ragged and paged prefill kernels."""
    group = _check_heads(h_kv, h_q)
    gs, qv_n = _prefill_shape(group, max(d_qk, d_v))
    rv = gs * qv_n  # row vectors: v = head_in_item * qv_n + query_vector
    rows = rv * LANES  # row r = v * LANES + e
    bq = qv_n * LANES  # queries per work item
    key_tile = max(1, min(16, TARGET_ACCUMULATORS // rv))
    while KEY_BLOCK % key_tile:
        key_tile -= 1
    vw = vec_width(d_v)
    dvv = d_v // vw
    row_tile = _row_tile(rows, dvv)
    f32 = "float32"
    window = opts.sliding_window > 0
    # lim[qi]: keys visible to query qi are col < lim[qi]; with a window also col >= lim[bq + qi]
    lim_len = 2 * bq if window else bq

    def visible(lim, col, qi):
        if window:
            return tirx.And(col < lim[qi], col >= lim[bq + qi])
        return col < lim[qi]

    def key_blocks(kv_stop, lim):
        # key blocks from the first key any query of the item sees (lim[bq]) to kv_stop
        if window:
            return (kv_stop - T.min(lim[bq], kv_stop) + KEY_BLOCK - 1) // KEY_BLOCK
        return (kv_stop + KEY_BLOCK - 1) // KEY_BLOCK

    def block_start(kb, kv_stop, lim):
        if window:
            return T.min(lim[bq], kv_stop) + kb * KEY_BLOCK
        return kb * KEY_BLOCK

    @T.macro
    def fold_sink(qf, o, m, lsum, alpha, tok, h, r):
        # row r (query token tok, head h) <- its state with the head's sink as one more key
        sk: T.let[T.float32] = opts.sink(qf[(tok * h_q + h) * d_qk + d_qk - SINK_PAD])
        mx1: T.let[T.float32] = T.max(m[r], sk)
        alpha[r] = exp2(m[r] - mx1)
        lsum[r] = lsum[r] * alpha[r] + exp2(sk - mx1)
        m[r] = mx1
        for c in T.vectorized(d_v):
            o[r, c] = o[r, c] * alpha[r]

    @T.macro
    def seq_block(
        qf,
        outf,
        lse,
        kf,
        vf,
        b_tok0,
        qo_n,
        q0,
        nq,
        kv_n,
        hk,
        h0,
        causal,
        scale,
        kv_base,
        page_values,
        q_pos,
        k_pos0,
        sm_scale,
    ):
        # Queries q0 .. q0 + nq of a sequence (its tokens start at b_tok0) x query heads
        # h0 .. h0 + gs, against its kv_n keys of KV head hk. kv_base: the sequence's first token
        # in k/v (ragged) or its first page_values entry (paged). With a window: q_pos holds the
        # positions of the queries, k_pos0 is the position of key 0.
        qt = T.alloc_buffer((d_qk, rv, LANES), f32)
        s_t = T.alloc_buffer((KEY_BLOCK, rows), f32)
        o = T.alloc_buffer((rows, d_v), f32)
        m = T.alloc_buffer((rows,), f32)
        lsum = T.alloc_buffer((rows,), f32)
        alpha = T.alloc_buffer((rows,), f32)
        lim = T.alloc_buffer((lim_len,), "int32")
        koff = T.alloc_buffer((KEY_BLOCK,), "int32")
        voff = T.alloc_buffer((KEY_BLOCK,), "int32")
        acc = T.alloc_buffer((key_tile, rv, LANES), f32)
        oacc = T.alloc_buffer((row_tile, dvv, vw), f32)
        mx = T.alloc_buffer((LANES,), f32)
        ls = T.alloc_buffer((LANES,), f32)

        # Q^T of this block, pre-scaled to log2 units; rows past the sequence repeat its last row.
        for g in range(gs):
            for qi in range(bq):
                for dd in range(d_qk):
                    qt[dd, g * qv_n + qi // LANES, qi % LANES] = (
                        T.Cast(
                            f32,
                            qf[((b_tok0 + T.min(q0 + qi, qo_n - 1)) * h_q + h0 + g) * d_qk + dd],
                        )
                        * scale
                    )
        # Keys visible to each query: col < lim (causal: kv_n - qo_n + row + 1).
        for qi in T.vectorized(bq):
            lim[qi] = T.if_then_else(causal > 0, T.min(kv_n, kv_n - qo_n + q0 + qi + 1), kv_n)
        if window:
            for qi in range(bq):
                lim[bq + qi] = opts.first_key(
                    sm_scale, q_pos[b_tok0 + T.min(q0 + qi, qo_n - 1)], k_pos0
                )
        kv_stop: T.let[T.int32] = T.if_then_else(
            causal > 0, T.max(T.min(kv_n, kv_n - qo_n + q0 + nq), 0), kv_n
        )
        for r in T.vectorized(rows):
            m[r] = T.float32(NEG_INF)
            lsum[r] = T.float32(0)
        for r in range(rows):
            for c in T.vectorized(d_v):
                o[r, c] = T.float32(0)

        for kb in range(key_blocks(kv_stop, lim)):
            j0: T.let[T.int32] = block_start(kb, kv_stop, lim)
            nk: T.let[T.int32] = T.min(KEY_BLOCK, kv_stop - j0)
            # Element offsets of the block's K and V rows (past the end: repeat the last row).
            for jj in range(KEY_BLOCK):
                jc: T.let[T.int32] = T.min(j0 + jj, kv_stop - 1)
                if paged:
                    pg: T.let[T.int32] = page_values[kv_base + jc // ps]
                    koff[jj] = ((pg * 2 * h_kv + hk) * ps + jc % ps) * d_qk
                    voff[jj] = (((pg * 2 + 1) * h_kv + hk) * ps + jc % ps) * d_v
                else:
                    koff[jj] = ((kv_base + jc) * h_kv + hk) * d_qk
                    voff[jj] = ((kv_base + jc) * h_kv + hk) * d_v
            # S^T[j, r] = sum_d K[j, d] * Q^T[d, r]
            for jt in range((nk + key_tile - 1) // key_tile):
                for jj, v in T.grid(key_tile, rv):
                    for e in T.vectorized(LANES):
                        acc[jj, v, e] = T.float32(0)
                for dd in range(d_qk):
                    for jj in T.unroll(key_tile):
                        for v in T.unroll(rv):
                            for e in T.vectorized(LANES):
                                acc[jj, v, e] = (
                                    acc[jj, v, e]
                                    + T.Cast(f32, kf[koff[jt * key_tile + jj] + dd]) * qt[dd, v, e]
                                )
                for jj, v in T.grid(key_tile, rv):
                    for e in T.vectorized(LANES):
                        s_t[jt * key_tile + jj, v * LANES + e] = opts.score(acc[jj, v, e])
            # Online softmax, lane-wise over each vector of 16 rows.
            for v in range(rv):
                for e in T.vectorized(LANES):
                    mx[e] = m[v * LANES + e]
                for jj in range(nk):
                    for e in T.vectorized(LANES):
                        mx[e] = T.max(
                            mx[e],
                            T.Select(
                                visible(lim, j0 + jj, v % qv_n * LANES + e),
                                s_t[jj, v * LANES + e],
                                T.float32(NEG_INF),
                            ),
                        )
                for e in T.vectorized(LANES):
                    alpha[v * LANES + e] = exp2(m[v * LANES + e] - mx[e])
                    m[v * LANES + e] = mx[e]
                    ls[e] = T.float32(0)
                for jj in range(nk):
                    for e in T.vectorized(LANES):
                        s_t[jj, v * LANES + e] = T.Select(
                            visible(lim, j0 + jj, v % qv_n * LANES + e),
                            exp2(s_t[jj, v * LANES + e] - mx[e]),
                            T.float32(0),
                        )
                        ls[e] = ls[e] + s_t[jj, v * LANES + e]
                for e in T.vectorized(LANES):
                    lsum[v * LANES + e] = lsum[v * LANES + e] * alpha[v * LANES + e] + ls[e]
            # O = O * alpha + P @ V, in (row_tile x d_v) register tiles.
            for rt in range(rows // row_tile):
                for ii in T.unroll(row_tile):
                    for c in T.unroll(dvv):
                        for e in T.vectorized(vw):
                            oacc[ii, c, e] = (
                                o[rt * row_tile + ii, c * vw + e] * alpha[rt * row_tile + ii]
                            )
                for jj in range(nk):
                    for ii in T.unroll(row_tile):
                        for c in T.unroll(dvv):
                            for e in T.vectorized(vw):
                                oacc[ii, c, e] = oacc[ii, c, e] + s_t[
                                    jj, rt * row_tile + ii
                                ] * T.Cast(f32, vf[voff[jj] + c * vw + e])
                for ii in T.unroll(row_tile):
                    for c in T.unroll(dvv):
                        for e in T.vectorized(vw):
                            o[rt * row_tile + ii, c * vw + e] = oacc[ii, c, e]

        # Normalize and store the rows that exist.
        for g in range(gs):
            for qi in range(nq):
                tok: T.let[T.int32] = b_tok0 + q0 + qi
                r: T.let[T.int32] = (g * qv_n + qi // LANES) * LANES + qi % LANES
                if opts.sinks and not paged:  # causal over the new tokens: the query's own key
                    fold_sink(qf, o, m, lsum, alpha, tok, h0 + g, r)
                if opts.sinks and paged:
                    if opts.has_sink(q_pos[tok], k_pos0, kv_n):
                        fold_sink(qf, o, m, lsum, alpha, tok, h0 + g, r)
                if lsum[r] > T.float32(0):
                    for c in T.vectorized(d_v):
                        outf[(tok * h_q + h0 + g) * d_v + c] = T.Cast(dtype, o[r, c] / lsum[r])
                    lse[tok, h0 + g] = m[r] + T.log2(lsum[r])
                else:
                    for c in T.vectorized(d_v):
                        outf[(tok * h_q + h0 + g) * d_v + c] = T.Cast(dtype, T.float32(0))
                    lse[tok, h0 + g] = T.float32(EMPTY_LSE)

    @T.macro
    def locate(loc, t, q_indptr, batch_size):
        # loc <- (sequence, query block within it) of the t-th query block of the batch, or -1.
        loc[0] = -1
        loc[1] = 0
        loc[2] = 0
        for bb in range(batch_size):
            nqb: T.let[T.int32] = (q_indptr[bb + 1] - q_indptr[bb] + bq - 1) // bq
            if t >= loc[2] and t < loc[2] + nqb:
                loc[0] = bb
                loc[1] = t - loc[2]
            loc[2] = loc[2] + nqb

    # work item w: head subgroup w % n_sub, KV head (w // n_sub) % h_kv, query block of the batch
    n_sub = group // gs
    return seq_block, locate, bq, n_sub, gs


def attention_prefill_ragged_cpu(
    h_kv: int,
    h_q: int,
    d_qk: int,
    d_v: int,
    dtype: str,
    *,
    soft_cap: float = 0.0,
    sliding_window: int = 0,
    sinks: bool = False,
) -> tirx.PrimFunc:
    """Causal (or full) attention of a batch of new tokens to themselves: k/v ragged in memory.

    Same signature as TVM's `_attention_prefill_ragged_cpu`; rope arguments are ignored.
    `soft_cap`, `sliding_window`, `sinks`: see `ScoreOptions` (a window reads the rope
    positions; with sinks every query counts its sink here).
    """
    opts = ScoreOptions(soft_cap, sliding_window, sinks)
    seq_block, locate, bq, n_sub, gs = _prefill_macros(
        h_kv, h_q, d_qk, d_v, dtype, paged=False, opts=opts
    )
    group = h_q // h_kv

    @T.prim_func(private=True)
    def batch_prefill_ragged_kv(
        var_q: T.handle,  # [total_len, h_q, d_qk]
        var_q_indptr: T.handle,  # [batch_size + 1]
        var_k: T.handle,  # [total_len, h_kv, d_qk]
        var_v: T.handle,  # [total_len, h_kv, d_v]
        var_kv_indptr: T.handle,  # [batch_size + 1]
        var_q_rope_position: T.handle,  # [total_q_len]
        var_k_rope_pos_offset: T.handle,  # [b]
        var_output: T.handle,  # [total_len, h_q, d_v]
        var_lse: T.handle,  # [total_len, h_q]
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        batch_size = T.int32()
        qo_len = T.int32()
        kv_len = T.int32()
        q_indptr_elem_offset = T.int32()
        kv_indptr_elem_offset = T.int32()
        q = T.match_buffer(var_q, (qo_len, h_q, d_qk), dtype)
        q_indptr = T.match_buffer(
            var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset
        )
        k = T.match_buffer(var_k, (kv_len, h_kv, d_qk), dtype)
        v = T.match_buffer(var_v, (kv_len, h_kv, d_v), dtype)
        kv_indptr = T.match_buffer(
            var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_indptr_elem_offset
        )
        output = T.match_buffer(var_output, (qo_len, h_q, d_v), dtype)
        lse = T.match_buffer(var_lse, (qo_len, h_q), "float32")
        # unused (rope is applied before attention), matched for their shapes and offsets
        _q_rope_position = T.match_buffer(
            var_q_rope_position, (qo_len,), "int32", elem_offset=T.int32()
        )
        _k_rope_pos_offset = T.match_buffer(
            var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=T.int32()
        )
        qf = T.decl_buffer((qo_len * h_q * d_qk,), dtype, data=q.data)
        kf = T.decl_buffer((kv_len * h_kv * d_qk,), dtype, data=k.data)
        vf = T.decl_buffer((kv_len * h_kv * d_v,), dtype, data=v.data)
        outf = T.decl_buffer((qo_len * h_q * d_v,), dtype, data=output.data)

        scale: T.let[T.float32] = opts.q_scale(sm_scale)
        n_items: T.let[T.int32] = h_kv * n_sub * ((qo_len + bq - 1) // bq + batch_size)
        with T.attr(0, "pragma_parallel_launch_point", 1):
            with T.attr(0, "pragma_parallel_stride_pattern", 1):
                for w in T.parallel(n_items):
                    loc = T.alloc_buffer((3,), "int32")
                    locate(loc, w // (n_sub * h_kv), q_indptr, batch_size)
                    if loc[0] >= 0:
                        b: T.let[T.int32] = loc[0]
                        qo_n: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                        q0: T.let[T.int32] = loc[1] * bq
                        seq_block(
                            qf,
                            outf,
                            lse,
                            kf,
                            vf,
                            q_indptr[b],
                            qo_n,
                            q0,
                            T.min(bq, qo_n - q0),
                            kv_indptr[b + 1] - kv_indptr[b],
                            w // n_sub % h_kv,
                            w // n_sub % h_kv * group + w % n_sub * gs,
                            causal,
                            scale,
                            kv_indptr[b],
                            None,
                            _q_rope_position,
                            _k_rope_pos_offset[b],
                            sm_scale,
                        )

    return scheduled(batch_prefill_ragged_kv)


def attention_prefill_paged_cpu(
    h_kv: int,
    h_q: int,
    d: int,
    dtype: str,
    page_size: int = 16,
    *,
    soft_cap: float = 0.0,
    sliding_window: int = 0,
    sinks: bool = False,
) -> tirx.PrimFunc:
    """Attention of a batch of new tokens to the pages already in the cache.

    Same signature as TVM's `_attention_prefill_cpu(..., sliding_window=False)`, and like it
    compiled for one page size (16 by default). Rope arguments are ignored.
    `soft_cap`, `sliding_window`, `sinks`: see `ScoreOptions` (a window, and the test whether a
    query's sink belongs to this call, read the rope positions).
    """
    opts = ScoreOptions(soft_cap, sliding_window, sinks)
    seq_block, locate, bq, n_sub, gs = _prefill_macros(
        h_kv, h_q, d, d, dtype, paged=True, ps=page_size, opts=opts
    )
    group = h_q // h_kv

    @T.prim_func(private=True)
    def batch_prefill_paged_kv_cpu(
        var_q: T.handle,  # [total_len, h_q, d]
        var_q_indptr: T.handle,  # [batch_size + 1]
        var_pages: T.handle,  # [max_num_pages, 2, h_kv, page_size, d]
        var_page_indptr: T.handle,  # [batch_size + 1]
        var_page_values: T.handle,  # [nnz_pages]
        var_length_info: T.handle,  # [b]: tokens in the last page
        var_k_rope_pos_offset: T.handle,  # [b]
        var_q_rope_position: T.handle,  # [total_len]
        var_output: T.handle,  # [total_len, h_q, d]
        var_lse: T.handle,  # [total_len, h_q]
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        q = T.match_buffer(var_q, (total_len, h_q, d), dtype)
        q_indptr = T.match_buffer(
            var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset
        )
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, page_size, d), dtype)
        page_indptr = T.match_buffer(
            var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset
        )
        page_values = T.match_buffer(
            var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset
        )
        output = T.match_buffer(var_output, (total_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (total_len, h_q), "float32")
        _q_rope_position = T.match_buffer(
            var_q_rope_position, (total_len,), "int32", elem_offset=T.int32()
        )
        _k_rope_pos_offset = T.match_buffer(
            var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=T.int32()
        )
        length_info = T.match_buffer(
            var_length_info, (batch_size,), "int32", elem_offset=length_info_elem_offset
        )
        qf = T.decl_buffer((total_len * h_q * d,), dtype, data=q.data)
        pf = T.decl_buffer((max_num_pages * 2 * h_kv * page_size * d,), dtype, data=pages.data)
        outf = T.decl_buffer((total_len * h_q * d,), dtype, data=output.data)

        scale: T.let[T.float32] = opts.q_scale(sm_scale)
        n_items: T.let[T.int32] = h_kv * n_sub * ((total_len + bq - 1) // bq + batch_size)
        with T.attr(0, "pragma_parallel_launch_point", 1):
            with T.attr(0, "pragma_parallel_stride_pattern", 1):
                for w in T.parallel(n_items):
                    loc = T.alloc_buffer((3,), "int32")
                    locate(loc, w // (n_sub * h_kv), q_indptr, batch_size)
                    if loc[0] >= 0:
                        b: T.let[T.int32] = loc[0]
                        qo_n: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                        q0: T.let[T.int32] = loc[1] * bq
                        npg: T.let[T.int32] = page_indptr[b + 1] - page_indptr[b]
                        seq_block(
                            qf,
                            outf,
                            lse,
                            pf,
                            pf,
                            q_indptr[b],
                            qo_n,
                            q0,
                            T.min(bq, qo_n - q0),
                            T.if_then_else(npg > 0, (npg - 1) * page_size + length_info[b], 0),
                            w // n_sub % h_kv,
                            w // n_sub % h_kv * group + w % n_sub * gs,
                            causal,
                            scale,
                            page_indptr[b],
                            page_values,
                            _q_rope_position,
                            _k_rope_pos_offset[b],
                            sm_scale,
                        )

    return scheduled(batch_prefill_paged_kv_cpu)


# --------------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------------


def attention_decode_paged_cpu(
    h_kv: int,
    h_q: int,
    d: int,
    dtype: str,
    page_size: int = 16,
    *,
    soft_cap: float = 0.0,
    sliding_window: int = 0,
    sinks: bool = False,
) -> tirx.PrimFunc:
    """One new token per sequence attending to all its pages (the new token's K/V included).

    Same signature as TVM's `_attention_decode_cpu(..., sliding_window=False)`, and like it
    compiled for one page size (16 by default). Rope arguments are ignored.
    `soft_cap`, `sliding_window`, `sinks`: see `ScoreOptions`; a windowed call splits and reads
    only the keys in the window; a sink is added once, after the splits are merged, when the
    sequence's keys in this call include the query's own position.
    """
    opts = ScoreOptions(soft_cap, sliding_window, sinks)
    group = _check_heads(h_kv, h_q)
    vw = vec_width(d)
    nv = d // vw
    blk = DECODE_KEY_BLOCK
    n_split = DECODE_SPLITS
    f32 = "float32"

    def lanes_of(buf, lanes: int, *index):
        """`lanes` consecutive elements of `buf` along its last axis from `index` (a scalar
        for 1)."""
        *lead, base = index
        return buf[(*lead, base if lanes == 1 else T.Ramp(base, 1, lanes))]

    def key_dot(ql, pf, koff, g, jj):
        """q[g] . K[jj] as `vw` lanes of partial sums, each a chain along head_dim from 0."""
        acc = T.Broadcast(T.float32(0), vw) if vw > 1 else T.float32(0)
        for c in range(nv):
            k_part = lanes_of(pf, vw, koff[jj] + c * vw)
            acc = acc + lanes_of(ql, vw, g, c * vw) * T.Cast(
                f"float32x{vw}" if vw > 1 else f32, k_part)
        return acc

    def maximum(a, b):
        return T.max(a, b)

    def splits_used(n_keys):
        return T.max(T.min((n_keys + DECODE_MIN_SPLIT - 1) // DECODE_MIN_SPLIT, n_split), 1)

    def split_span(n_keys, used):
        return ((n_keys + used - 1) // used + blk - 1) // blk * blk

    def skipped(kv_n, q_pos, k_pos0, sm_scale):
        # keys before the window, not read at all
        return T.min(opts.first_key(sm_scale, q_pos, k_pos0), kv_n)

    def keys_read(kv_n, q_pos, k_pos0, sm_scale):
        if opts.sliding_window:
            return kv_n - skipped(kv_n, q_pos, k_pos0, sm_scale)
        return kv_n

    def seq_keys(page_indptr, length_info, b):
        # the keys of sequence b in this call
        npg = page_indptr[b + 1] - page_indptr[b]
        return T.if_then_else(npg > 0, (npg - 1) * page_size + length_info[b], 0)

    def split_start(start, kv_n, q_pos, k_pos0, sm_scale):
        if opts.sliding_window:
            return skipped(kv_n, q_pos, k_pos0, sm_scale) + start
        return start

    line = 64 // tvm.DataType(dtype).itemsize  # elements of one cache line
    key_lines = -(-d // line)  # cache lines of one key's K (or V)
    v_off = h_kv * page_size * d  # a page's V from its K, in elements
    ahead = DECODE_PREFETCH_BLOCKS * blk
    # o's vectors per pass over a block's V: all of them while the group's fit the registers
    # (group 3, d = 128: 24); more query heads per KV head take them in passes, same sums in the
    # same order (in L1 at 2,000 keys, 2 threads: group 8 15.9 -> 25.8 GB/s, group 4 35.6 -> 43.4;
    # all at once spilled o to the stack through every key)
    cols = max(c for c in range(1, nv + 1)
               if nv % c == 0 and (group * c <= TARGET_ACCUMULATORS or c == 1))

    def key_offset(page_table_values, pbeg, hk, j):
        """Where key j's K of head hk starts in the flat pages (its V: `v_off` further)."""
        return (
            (page_table_values[pbeg + j // page_size] * 2 * h_kv + hk) * page_size
            + j % page_size
        ) * d

    @T.macro
    def prefetch_key(pf, page_table_values, pbeg, hk, jp, k_end, v: bool):
        """Prefetch the K (or V) lines of key jp of this head, if there is such a key."""
        if jp < k_end:
            for i in T.unroll(key_lines):
                prefetch(pf, key_offset(page_table_values, pbeg, hk, jp) + (v_off if v else 0)
                         + i * line)

    @T.prim_func(private=True)
    def batch_decode_paged_kv(
        Q_handle: T.handle,
        pages_handle: T.handle,
        page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle,
        var_length_info: T.handle,  # [b]: tokens in the last page
        k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle,
        output_handle: T.handle,
        lse_handle: T.handle,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        Q = T.match_buffer(Q_handle, (B, h_q, d), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, h_kv, page_size, d), dtype)
        page_table_indptr = T.match_buffer(
            page_table_indptr_handle, (B + 1,), "int32", elem_offset=page_indptr_elem_offset
        )
        page_table_values = T.match_buffer(
            page_table_values_handle, (nnz_pages,), "int32", elem_offset=page_values_elem_offset
        )
        output = T.match_buffer(output_handle, (B, h_q, d), dtype)
        lse = T.match_buffer(lse_handle, (B, h_q), "float32")
        _q_rope_position = T.match_buffer(
            q_rope_position_handle, (B,), "int32", elem_offset=T.int32()
        )
        _k_rope_pos_offset = T.match_buffer(
            k_rope_pos_offset_handle, (B,), "int32", elem_offset=T.int32()
        )
        length_info = T.match_buffer(
            var_length_info, (B,), "int32", elem_offset=length_info_elem_offset
        )
        pf = T.decl_buffer((max_num_pages * 2 * h_kv * page_size * d,), dtype, data=pages.data)

        part_o = T.alloc_buffer((B * h_kv * n_split, group, d), f32)
        part_m = T.alloc_buffer((B * h_kv * n_split, group), f32)
        part_l = T.alloc_buffer((B * h_kv * n_split, group), f32)
        scale: T.let[T.float32] = opts.q_scale(sm_scale)

        with T.attr(0, "pragma_parallel_launch_point", 1):
            with T.attr(0, "pragma_parallel_stride_pattern", 1):
                for w in T.parallel(B * h_kv * n_split):
                    ql = T.alloc_buffer((group, d), f32)
                    o = T.alloc_buffer((group, d), f32)
                    s = T.alloc_buffer((group, blk), f32)
                    ml = T.alloc_buffer((2, group), f32)  # running max, running sum
                    alpha = T.alloc_buffer((group,), f32)
                    koff = T.alloc_buffer((blk,), "int32")
                    split: T.let[T.int32] = w % n_split
                    hk: T.let[T.int32] = (w // n_split) % h_kv
                    b: T.let[T.int32] = w // (n_split * h_kv)
                    pbeg: T.let[T.int32] = page_table_indptr[b]
                    npg: T.let[T.int32] = page_table_indptr[b + 1] - pbeg
                    kv_n: T.let[T.int32] = T.if_then_else(
                        npg > 0, (npg - 1) * page_size + length_info[b], 0
                    )
                    # the keys read (all, or those in the window) in `used` splits of `span`
                    used: T.let[T.int32] = splits_used(
                        keys_read(kv_n, _q_rope_position[b], _k_rope_pos_offset[b], sm_scale)
                    )
                    span: T.let[T.int32] = split_span(
                        keys_read(kv_n, _q_rope_position[b], _k_rope_pos_offset[b], sm_scale), used
                    )
                    k_beg: T.let[T.int32] = split_start(
                        split * span, kv_n, _q_rope_position[b], _k_rope_pos_offset[b], sm_scale
                    )
                    k_end: T.let[T.int32] = T.min(kv_n, k_beg + span)
                    for g in T.unroll(group):
                        for c in T.vectorized(d):
                            ql[g, c] = T.Cast(f32, Q[b, hk * group + g, c]) * scale
                            o[g, c] = T.float32(0)
                        ml[0, g] = T.float32(NEG_INF)
                        ml[1, g] = T.float32(0)
                    for kb in range((T.max(k_end - k_beg, 0) + blk - 1) // blk):
                        j0: T.let[T.int32] = k_beg + kb * blk
                        nk: T.let[T.int32] = T.min(blk, k_end - j0)
                        for jj in range(blk):
                            jc: T.let[T.int32] = T.min(j0 + jj, k_end - 1)
                            koff[jj] = key_offset(page_table_values, pbeg, hk, jc)
                        # s[g, jj] = q[g] . K[jj]; the lanes are summed in registers (a tree
                        # of halves), not through memory
                        for jj in range(blk):
                            # a head's keys are a few KB strided by all heads' pages, which the
                            # hardware prefetcher only follows after a miss at each page's
                            # start; a key's lines at a time keep the core's queue of misses
                            # from overflowing (`DECODE_PREFETCH_BLOCKS`)
                            prefetch_key(pf, page_table_values, pbeg, hk, j0 + ahead + jj, k_end,
                                         False)
                            for g in T.unroll(group):
                                s[g, jj] = opts.score(
                                    lane_tree(key_dot(ql, pf, koff, g, jj), vw, add)
                                )
                        # online softmax over the block
                        for g in T.unroll(group):
                            mx: T.let[T.float32] = T.max(ml[0, g], lane_tree(T.Select(
                                T.Ramp(0, 1, blk) < T.Broadcast(nk, blk),
                                s[g, T.Ramp(0, 1, blk)],
                                T.Broadcast(T.float32(NEG_INF), blk),
                            ), blk, maximum))
                            alpha[g] = exp2(ml[0, g] - mx)
                            ml[0, g] = mx
                            for e in T.vectorized(blk):
                                s[g, e] = T.Select(e < nk, exp2(s[g, e] - mx), T.float32(0))
                            ml[1, g] = ml[1, g] * alpha[g] + lane_tree(
                                s[g, T.Ramp(0, 1, blk)], blk, add
                            )
                            for c in T.vectorized(d):
                                o[g, c] = o[g, c] * alpha[g]
                        # o += p @ V, `cols` vectors of each query's o at a time (held in
                        # registers through the block's keys)
                        for cp in T.unroll(nv // cols):
                            for jj in range(nk):
                                if cp == 0:
                                    prefetch_key(pf, page_table_values, pbeg, hk, j0 + ahead + jj,
                                                 k_end, True)
                                for ci in T.unroll(cols):
                                    for g in T.unroll(group):
                                        for e in T.vectorized(vw):
                                            o[g, (cp * cols + ci) * vw + e] = o[
                                                g, (cp * cols + ci) * vw + e
                                            ] + s[g, jj] * T.Cast(f32, pf[
                                                koff[jj] + v_off + (cp * cols + ci) * vw + e
                                            ])
                    for g in T.unroll(group):
                        for c in T.vectorized(d):
                            part_o[w, g, c] = o[g, c]
                        part_m[w, g] = ml[0, g]
                        part_l[w, g] = ml[1, g]

        # Merge the splits of each (sequence, head).
        for bh in range(B * h_kv):
            mo = T.alloc_buffer((d,), f32)
            st = T.alloc_buffer((3,), f32)  # max, sum, weight
            for g in range(group):
                st[0] = T.float32(NEG_INF)
                for sp in range(n_split):
                    st[0] = T.max(st[0], part_m[bh * n_split + sp, g])
                st[1] = T.float32(0)
                for c in T.vectorized(d):
                    mo[c] = T.float32(0)
                for sp in range(n_split):
                    st[2] = exp2(part_m[bh * n_split + sp, g] - st[0])
                    st[1] = st[1] + part_l[bh * n_split + sp, g] * st[2]
                    for c in T.vectorized(d):
                        mo[c] = mo[c] + part_o[bh * n_split + sp, g, c] * st[2]
                if opts.sinks:
                    if opts.has_sink(
                        _q_rope_position[bh // h_kv],
                        _k_rope_pos_offset[bh // h_kv],
                        seq_keys(page_table_indptr, length_info, bh // h_kv),
                    ):
                        sk: T.let[T.float32] = opts.sink(
                            Q[bh // h_kv, (bh % h_kv) * group + g, d - SINK_PAD]
                        )
                        mx1: T.let[T.float32] = T.max(st[0], sk)
                        st[2] = exp2(st[0] - mx1)
                        st[1] = st[1] * st[2] + exp2(sk - mx1)
                        st[0] = mx1
                        for c in T.vectorized(d):
                            mo[c] = mo[c] * st[2]
                if st[1] > T.float32(0):
                    for c in T.vectorized(d):
                        output[bh // h_kv, (bh % h_kv) * group + g, c] = T.Cast(
                            dtype, mo[c] / st[1]
                        )
                    lse[bh // h_kv, (bh % h_kv) * group + g] = st[0] + T.log2(st[1])
                else:
                    for c in T.vectorized(d):
                        output[bh // h_kv, (bh % h_kv) * group + g, c] = T.Cast(dtype, T.float32(0))
                    lse[bh // h_kv, (bh % h_kv) * group + g] = T.float32(EMPTY_LSE)

    return scheduled(batch_decode_paged_kv)


# --------------------------------------------------------------------------------------------
# Merge of two attention states
# --------------------------------------------------------------------------------------------


def merge_state_inplace_cpu(h: int, d: int, dtype: str) -> tirx.PrimFunc:
    """(v, s) <- merge of (v, s) and (v_other, s_other), with s in log2 units, as TVM's kernel."""
    rows_per_item = 16
    f32 = "float32"

    @T.prim_func(private=True)
    def merge_state_inplace_cpu(v: T.handle, s: T.handle, v_other: T.handle, s_other: T.handle):
        N = T.int32()
        V = T.match_buffer(v, (N, h, d), dtype)
        S = T.match_buffer(s, (N, h), "float32")
        V_other = T.match_buffer(v_other, (N, h, d), dtype)
        S_other = T.match_buffer(s_other, (N, h), "float32")
        for item in T.parallel((N + rows_per_item - 1) // rows_per_item):
            st = T.alloc_buffer((4,), f32)  # max, weight, other weight, 1 / (weight + other)
            for i in range(T.min(rows_per_item, N - item * rows_per_item)):
                for hh in range(h):
                    n: T.let[T.int32] = item * rows_per_item + i
                    st[0] = T.max(S[n, hh], S_other[n, hh])
                    st[1] = exp2(S[n, hh] - st[0])
                    st[2] = exp2(S_other[n, hh] - st[0])
                    st[3] = T.float32(1) / (st[1] + st[2])
                    for c in T.vectorized(d):
                        V[n, hh, c] = T.Cast(
                            dtype,
                            (
                                T.Cast(f32, V[n, hh, c]) * st[1]
                                + T.Cast(f32, V_other[n, hh, c]) * st[2]
                            )
                            * st[3],
                        )
                    S[n, hh] = T.log2(st[1] + st[2]) + st[0]

    return scheduled(merge_state_inplace_cpu)


# Rope scalings whose frequency depends on a dimension only through d * 2 % rotary_dim (so the
# two halves of a head share it): the ones `split_rotary_cpu` computes once per position. YaRN
# is one in HF's definition (dims i and i + rotary_dim / 2 share frequency i); TVM's own kernel
# evaluates YaRN's ramp at the second half's index, which HF does not, so it is only right here.
SHARED_FREQ_ROPE = (None, "llama3", "llama4", "yarn")
SERIAL_ROPE_TOKENS = 2  # up to this many tokens the rotary kernel runs on the calling thread


def _rope_macros(
    theta: float,
    scale: float,
    head_dim: int,
    dtype: str,
    rope_scaling: dict[str, Any],
    rotary_dim: int,
):
    """(angle, rotate) shared by the rotary kernels: angle(pos, i, 0 or 1) is the cosine or sine
    of dimension i (and i + rotary_dim / 2) at position pos, TVM's frequency expression with its
    shared lets; rotate(qkv, out, t, h, src, cs, sn) writes head `src` of token t of qkv to head
    h of out, its first rotary_dim features rotated by the cosines cs and sines sn."""
    from tvm.relax.frontend.nn.llm.position_embedding import switch_rope_freq_func

    f32 = "float32"
    half = rotary_dim // 2
    freq = switch_rope_freq_func(rope_scaling)

    def angle(pos, i, which: int):
        cos_sin = freq(T.Cast(f32, pos) * tirx.const(scale, f32), i, rotary_dim, theta, f32)
        expr = cos_sin[which]
        for var, value in cos_sin[2].items():
            expr = tirx.Let(var, value, expr)
        return expr

    @T.macro
    def rotate(qkv, out, t, h, src, cs, sn):
        for i in T.vectorized(half):
            out[t, h, i] = T.Cast(
                dtype,
                T.Cast(f32, qkv[t, src, i]) * cs[i] - T.Cast(f32, qkv[t, src, i + half]) * sn[i],
            )
            out[t, h, i + half] = T.Cast(
                dtype,
                T.Cast(f32, qkv[t, src, i + half]) * cs[i] + T.Cast(f32, qkv[t, src, i]) * sn[i],
            )
        for d in range(head_dim - rotary_dim):
            out[t, h, rotary_dim + d] = qkv[t, src, rotary_dim + d]

    return angle, rotate


def split_rotary_cpu(
    theta: float,
    scale: float,
    head_dim: int,
    h_q: int,
    h_kv: int,
    dtype: str,
    rope_scaling: dict[str, Any],
    rotary_dim: int,
) -> tirx.PrimFunc | None:
    """Split fused QKV into q, k, v, with rotary position embedding on q and k (the first
    `rotary_dim` features, halves rotated, NORMAL mode); the signature of TVM's
    `llama_rope_with_position_map`, whose kernel runs serially with a power, a cosine and a sine
    for every element. Here tokens run in parallel and each token's `rotary_dim / 2` cosines and
    sines are computed once, shared by all its heads; the heads are vectorized along a half.
    None for the scalings this does not cover (TVM's kernel then)."""
    if rope_scaling.get("rope_type") not in SHARED_FREQ_ROPE or rotary_dim % 2:
        return None
    f32 = "float32"
    half = rotary_dim // 2
    fused = h_q + 2 * h_kv
    _angle, rotate = _rope_macros(theta, scale, head_dim, dtype, rope_scaling, rotary_dim)

    @T.macro
    def one_token(qkv, position_map, q, k, v, apply_rope, t):
        cs = T.alloc_buffer((half,), f32)
        sn = T.alloc_buffer((half,), f32)
        for i in range(half):
            cs[i] = T.if_then_else(apply_rope > 0, _angle(position_map[t], i, 0), 1.0)
            sn[i] = T.if_then_else(apply_rope > 0, _angle(position_map[t], i, 1), 0.0)
        for h in range(h_q):
            rotate(qkv, q, t, h, h, cs, sn)
        for h in range(h_kv):
            rotate(qkv, k, t, h, h_q + h, cs, sn)
            for d in T.vectorized(head_dim):
                v[t, h, d] = qkv[t, h_q + h_kv + h, d]

    @T.prim_func(private=True)
    def split_rotary(
        var_qkv: T.handle,
        var_position_map: T.handle,
        var_q: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        apply_rope: T.int64,
    ):
        T.func_attr({"op_pattern": 8})
        seq_len = T.int32()
        qkv = T.match_buffer(var_qkv, (seq_len, fused, head_dim), dtype)
        q = T.match_buffer(var_q, (seq_len, h_q, head_dim), dtype)
        k = T.match_buffer(var_k, (seq_len, h_kv, head_dim), dtype)
        v = T.match_buffer(var_v, (seq_len, h_kv, head_dim), dtype)
        position_map = T.match_buffer(
            var_position_map, (seq_len,), "int32", elem_offset=T.int32()
        )
        if seq_len <= SERIAL_ROPE_TOKENS:  # a thread-pool launch costs more than the work
            for t in range(seq_len):
                one_token(qkv, position_map, q, k, v, apply_rope, t)
        else:
            for t in T.parallel(seq_len):
                one_token(qkv, position_map, q, k, v, apply_rope, t)

    return scheduled(split_rotary)


def rotary_qkv_cpu(
    theta: float,
    scale: float,
    head_dim: int,
    h_q: int,
    h_kv: int,
    dtype: str,
    rope_scaling: dict[str, Any] | None = None,
    rotary_dim: int | None = None,
) -> tirx.PrimFunc:
    """Rotary position embedding on the q and k heads of fused QKV, for a model that applies it
    itself (a cache in RopeMode.NONE): per-layer theta (one kernel per theta), no rope on some
    layers (no call), partial width (`rotary_dim` < head_dim: the rest passes through).

    Arguments (qkv [b, s, h_q + 2 h_kv, head_dim], positions [b * s] int32, out shaped as qkv),
    v copied; positions are the tokens' positions in their sequences
    (`PagedKVCache.get_query_positions`). The math of `split_rotary_cpu` (HF's rotate-half;
    `scale` multiplies positions: 1 / factor for linear rope scaling); `rope_scaling` with a
    rope_type of `SHARED_FREQ_ROPE` (None: plain rope)."""
    items = tuple(sorted((rope_scaling or {}).items()))
    return _rotary_qkv_cpu(theta, scale, head_dim, h_q, h_kv, dtype, items, rotary_dim)


@functools.cache  # one parse per model, not per layer
def _rotary_qkv_cpu(
    theta: float,
    scale: float,
    head_dim: int,
    h_q: int,
    h_kv: int,
    dtype: str,
    rope_scaling: tuple[tuple[str, Any], ...],
    rotary_dim: int | None,
) -> tirx.PrimFunc:
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    scaling = dict(rope_scaling)
    if scaling.get("rope_type") not in SHARED_FREQ_ROPE:
        raise ValueError(f"rotary_qkv_cpu does not cover rope scaling {scaling.get('rope_type')!r}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, {head_dim}], not {rotary_dim}")
    f32 = "float32"
    half = rotary_dim // 2
    fused = h_q + 2 * h_kv
    angle, rotate = _rope_macros(theta, scale, head_dim, dtype, scaling, rotary_dim)

    @T.macro
    def one_token(qkv, positions, out, t):
        cs = T.alloc_buffer((half,), f32)
        sn = T.alloc_buffer((half,), f32)
        for i in range(half):
            cs[i] = angle(positions[t], i, 0)
            sn[i] = angle(positions[t], i, 1)
        for h in range(h_q + h_kv):
            rotate(qkv, out, t, h, h, cs, sn)
        for h in range(h_q + h_kv, fused):
            for d in T.vectorized(head_dim):
                out[t, h, d] = qkv[t, h, d]

    @T.prim_func(private=True)
    def rotary_qkv(var_qkv: T.handle, var_positions: T.handle, var_out: T.handle):
        T.func_attr({"op_pattern": 8})
        b, s = T.int64(), T.int64()
        qkv = T.match_buffer(var_qkv, (b, s, fused, head_dim), dtype)
        positions = T.match_buffer(var_positions, (b * s,), "int32")
        out = T.match_buffer(var_out, (b, s, fused, head_dim), dtype)
        qkv_t = T.decl_buffer((b * s, fused, head_dim), dtype, data=qkv.data)
        out_t = T.decl_buffer((b * s, fused, head_dim), dtype, data=out.data)
        if b * s <= SERIAL_ROPE_TOKENS:  # a thread-pool launch costs more than the work
            for t in range(b * s):
                one_token(qkv_t, positions, out_t, t)
        else:
            for t in T.parallel(b * s):
                one_token(qkv_t, positions, out_t, t)

    return scheduled(rotary_qkv)


# --------------------------------------------------------------------------------------------
# The KV cache
# --------------------------------------------------------------------------------------------

KERNEL_PAGE_SIZE = 16  # page size the paged kernels are compiled for (as TVM's CPU kernels)


def create_paged_kv_cache_cpu(
    attn_kind: Literal["mha", "mla"] | list[Literal["mha", "mla", "mha_sliding"]],
    max_batch_size: tirx.Var,
    max_total_seq_len: tirx.Var,
    prefill_chunk_size: tirx.Var,
    page_size: tirx.Var,
    support_sliding_window: tirx.Var,
    layer_partition: rx.ShapeExpr,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    qk_head_dim: int,
    v_head_dim: int,
    mla_original_qk_head_dim: int,
    mla_original_v_head_dim: int,
    rope_mode: RopeMode,
    rope_scale: int,
    rope_theta: int,
    rope_scaling: dict[str, Any],
    rope_ext_factors: rx.Expr,
    rotary_dim: int,
    enable_disaggregation: bool,
    dtype: str,
    target: Target,
    name: str = "paged_kv_cache",
    *,
    layer_sliding_window_size: int = 1024,
    attn_soft_cap: float = 0.0,
    sliding_window: int = 0,
    attn_sinks: bool = False,
) -> PagedKVCache:
    """A paged KV cache like `TIRPagedKVCache(...)` (same arguments), with fast CPU attention.

    For an llvm target with MHA layers and rope_mode NORMAL or NONE, this emits the same
    `vm.builtin.paged_attention_kv_cache_create` call as TVM's llvm branch, with the ragged
    prefill, paged prefill, paged decode and merge-state kernels of this module in place of
    TVM's. Anything else (other targets, MLA, RopeMode.INLINE) gets `TIRPagedKVCache` itself.
    The runtime page size must be 16, as for TVM's CPU kernels.

    Our own options (all need our kernels, so an llvm target, MHA layers, NORMAL or NONE rope):
    - `attn_soft_cap`: c > 0 soft-caps every layer's scaled attention scores, c * tanh(s / c),
      before the softmax (Gemma 2: 50); 0 off.
    - `sliding_window`: W > 0 compiles a window of W positions into the kernels; the layers that
      use it say so per call with `sm_scale=windowed_sm_scale(scale)`, the others attend to every
      key. Every layer keeps its full KV (attn_kind stays "mha"), and a window is exact whatever
      the chunking, batching or forking of the sequences (positions decide it). TVM's own
      per-layer window (attn_kind "mha_sliding", `layer_sliding_window_size`) still goes to TVM's
      serial kernels and cannot be combined with these options.
    - `attn_sinks`: per-(layer, head) attention sinks (gpt-oss; see `ScoreOptions.sinks`). The
      model passes qk_head_dim = v_head_dim = d_real + SINK_PAD and rotary_dim = d_real (the
      cache's rotary leaves the pad lanes as they are), puts each query head's sink logit (natural
      log units, not scaled) in lane d_real of q and zeros in the other pad lanes of q, k and v,
      and drops the pad lanes of the output. Not combined with `attn_soft_cap`.
    """
    kinds = attn_kind if isinstance(attn_kind, list) else [attn_kind] * num_hidden_layers
    ours = not (
        target.kind.name != "llvm"
        or any(k == "mla" for k in kinds)
        or int(rope_mode) == int(RopeMode.INLINE)
    )
    if attn_soft_cap or sliding_window or attn_sinks:
        if not ours:
            raise ValueError(
                "attn_soft_cap, sliding_window and attn_sinks need the CPU attention kernels: an "
                "llvm target, MHA layers and rope_mode NORMAL or NONE"
            )
        if "mha_sliding" in kinds:
            raise ValueError(
                "attn_soft_cap, sliding_window and attn_sinks do not apply to attn_kind "
                '"mha_sliding" layers (TVM\'s kernels run those): mark windowed layers with '
                "windowed_sm_scale instead"
            )
    if attn_sinks:
        if qk_head_dim != v_head_dim or qk_head_dim <= SINK_PAD:
            raise ValueError(
                f"attn_sinks needs qk_head_dim = v_head_dim = head_dim + SINK_PAD ({SINK_PAD}), "
                f"not {qk_head_dim} and {v_head_dim}"
            )
        if int(rope_mode) == int(RopeMode.NORMAL) and rotary_dim > qk_head_dim - SINK_PAD:
            raise ValueError(
                f"attn_sinks needs rotary_dim <= qk_head_dim - SINK_PAD "
                f"({qk_head_dim - SINK_PAD}), not {rotary_dim}: rotary would move the sink"
            )
    score_opts = {
        "soft_cap": float(attn_soft_cap),
        "sliding_window": int(sliding_window),
        "sinks": bool(attn_sinks),
    }
    ScoreOptions(**score_opts)  # checks the values
    if not ours:
        return TIRPagedKVCache(
            attn_kind=attn_kind,
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=layer_partition,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            qk_head_dim=qk_head_dim,
            v_head_dim=v_head_dim,
            mla_original_qk_head_dim=mla_original_qk_head_dim,
            mla_original_v_head_dim=mla_original_v_head_dim,
            rope_mode=rope_mode,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_ext_factors=rope_ext_factors,
            rotary_dim=rotary_dim,
            enable_disaggregation=enable_disaggregation,
            dtype=dtype,
            target=target,
            name=name,
            layer_sliding_window_size=layer_sliding_window_size,
        )

    rope_scaling = tvm_private.prepare_yarn_rope_scaling(rope_scaling, rope_theta)
    h_q, h_kv, d = num_attention_heads, num_key_value_heads, qk_head_dim
    ps = KERNEL_PAGE_SIZE
    bb = rx.BlockBuilder.current()

    def add(func: tirx.PrimFunc, fname: str) -> rx.GlobalVar:
        return bb.add_func(func, fname)

    def tir_kernel(func: tirx.PrimFunc, fname: str) -> rx.Tuple:
        # attention kernels are passed as ("tirx", function)
        return rx.Tuple([tvm.ir.StringImm("tirx"), add(func, fname)])

    kind_ids = [int(getattr(AttnKind, k.upper())) for k in kinds]
    args = [
        rx.ShapeExpr(
            [
                max_batch_size,
                max_total_seq_len,
                prefill_chunk_size,
                page_size,
                support_sliding_window,
                layer_sliding_window_size,
            ]
        ),
        layer_partition,
        rx.prim_value(h_q),
        rx.prim_value(h_kv),
        rx.prim_value(qk_head_dim),
        rx.prim_value(v_head_dim),
        rx.ShapeExpr(kind_ids),
        rx.prim_value(enable_disaggregation),
        rx.prim_value(rope_mode),
        rx.prim_value(rope_scale),
        rx.prim_value(rope_theta),
        rope_ext_factors,
        rx.op.zeros((), dtype),
        add(tvm_private.kv_cache_transpose_append(h_kv, d, dtype), "kv_cache_transpose_append"),
        add(tvm_private.kv_cache_transpose_append_mla(d, dtype), "kv_cache_transpose_append_mla"),
        # ours
        tir_kernel(
            attention_prefill_ragged_cpu(h_kv, h_q, d, v_head_dim, dtype, **score_opts),
            "tir_attention_prefill_ragged_cpu",
        ),
        tir_kernel(
            attention_prefill_paged_cpu(h_kv, h_q, d, dtype, ps, **score_opts),
            "tir_attention_prefill_cpu",
        ),
        tir_kernel(
            attention_decode_paged_cpu(h_kv, h_q, d, dtype, ps, **score_opts),
            "tir_attention_decode_cpu",
        ),
        # TVM's: sliding window (attn_kind "mha_sliding"), tree attention
        tir_kernel(
            tvm_private.attention_prefill_cpu(
                h_kv,
                h_q,
                d,
                dtype,
                True,
                rope_scaling,
                sliding_window_size=layer_sliding_window_size,
            ),
            "tir_attention_prefill_cpu_sliding_window",
        ),
        tir_kernel(
            tvm_private.attention_decode_cpu(h_kv, h_q, d, dtype, True, rope_scaling),
            "tir_attention_decode_cpu_sliding_window",
        ),
        # TVM's tree-mask kernels (speculative decoding: never called here), their buffers
        # marked no-alias as ours are (they are distinct tensors): without it, the paged one
        # in the same library kept LLVM from holding our prefill kernels' accumulator tiles in
        # registers (SmolLM2-135M's attention 2.7x slower in the model than alone)
        tir_kernel(
            tree_attn_cpu(h_kv, h_q, d, dtype, rope_scaling).with_attr("tirx.noalias", True),
            "tir_attention_prefill_with_tree_mask_cpu",
        ),
        tir_kernel(
            tree_attn_with_paged_kv_cache_cpu(h_kv, h_q, d, dtype, rope_scaling).with_attr(
                "tirx.noalias", True),
            "tir_attention_prefill_with_tree_mask_with_paged_kv_cache_cpu",
        ),
        rx.Tuple([]),  # no MLA prefill
        rx.Tuple(
            [add(merge_state_inplace_cpu(h_q, v_head_dim, dtype), "tir_attention_merge_state_cpu")]
        ),
        add(
            split_rotary_cpu(rope_theta, rope_scale, d, h_q, h_kv, dtype, rope_scaling, rotary_dim)
            or llama_rope_with_position_map(
                rope_theta, rope_scale, d, h_q, h_kv, dtype, rope_scaling, rotary_dim
            ),
            "tir_split_rotary",
        ),
        add(
            tvm_private.copy_single_page_cpu(h_kv, page_size, d, dtype),
            "kv_cache_copy_single_page_cpu",
        ),
        add(
            tvm_private.kv_cache_debug_get_kv(num_hidden_layers, h_kv, d, dtype),
            "kv_cache_debug_get_kv",
        ),
        add(tvm_private.compact_kv_copy_cpu(h_kv, d, dtype), "kv_cache_compact_kv_copy_cpu"),
    ]
    return tvm_private.wrap_expr(
        PagedKVCache,
        rx.call_pure_packed(
            "vm.builtin.paged_attention_kv_cache_create", *args, ty_args=rx.AnyType()
        ),
        name,
    )
