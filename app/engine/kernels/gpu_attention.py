"""What TVM's GPU attention kernels lack, written into them: an attention-logit soft-cap
(Gemma 2) and attention sinks (gpt-oss).

TVM's paged KV cache builds its GPU kernels (prefill over pages, prefill of a chunk's own
tokens, decode) as PrimFuncs in the module being exported. Each writes every query-key score
once, complete, before the softmax reads it: `S_smem[i, j] = S_local[i, j]` in the prefill
kernels, `S_local[j] = t0[0]` in decode (the cross-thread sum). `soft_cap_attention` rewrites
those stores to c * tanh(s / c). The scores are in log2 units there (q.k * scale * log2 e), so
the cap is scaled by log2 e as well: c' tanh(S / c') with c' = c log2 e is c tanh(s / c) in them.

Sinks (`sink_attention`) ride in q as on the CPU (`kernels.attention`: the cache's head dim is
the model's plus `SINK_PAD` lanes, query head h's sink logit in lane d_real, K's and V's pad
lanes 0). Each kernel ends with one softmax state per query row, its running max m and sum
d = sum_j 2^(S_j - m) (log2 units), and stores o / d and the log-sum-exp m + log2 d that the
runtime merges across calls. A sink s is one more key of value 0: d' = d + 2^(s log2 e - m),
written into those two final stores, so the output is O / d' and the LSE counts it, and the
merge of several calls stays right as long as exactly one call counts the sink: the ragged
kernel (a chunk's own tokens, causal: the query's own key always in it), and a paged prefill or
decode call iff the query's position lies among its keys' positions (the decode depth holding
the just-appended key), the rule the CPU kernels follow.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from tvm import relax, tirx
from tvm.ir.expr import Call, TensorLoad
from tvm.tirx import stmt as tir_stmt
from tvm_ffi import structural_mutate

from localchat.engine.kernels.common import LOG2E
from localchat.errors import UnsupportedModelError

# (score buffer, what it is written from) of the complete scores in each kernel
_SCORE_STORES = {("S_smem", "S_local"), ("S_local", "t0")}
# TVM's attention kernels that read scores: all prefill and decode forms (the tree-mask ones
# serve speculative decoding, which localchat does not use: left alone)
_KERNELS = ("tir_attention_prefill", "tir_attention_decode")


def _loaded_from(expr: Any) -> str | None:
    """The name of the buffer `expr` loads one element of, or None when it is no load."""
    if type(expr).__name__ not in ("BufferLoad", "TensorLoad"):
        return None
    source = expr.source if hasattr(expr, "source") else getattr(expr, "buffer", None)
    return None if source is None else source.name


def soft_capped(func: tirx.PrimFunc, cap: float) -> tuple[tirx.PrimFunc, int]:
    """`func` with its complete scores soft-capped at `cap`, and how many stores it rewrote."""
    c = tirx.const(cap * math.log2(math.e), "float32")
    rewritten = 0

    def store(node: Any, mutator: Any) -> Any:
        nonlocal rewritten
        value = node.value
        if (node.buffer.name, _loaded_from(value)) in _SCORE_STORES:
            rewritten += 1
            return tir_stmt.BufferStore(node.buffer, c * tirx.tanh(value / c), node.indices)
        return mutator.default_mutate(node)

    return structural_mutate(func, [(tir_stmt.BufferStore, store)]), rewritten


def _rewrite_kernels(rewrite: Callable[[str, tirx.PrimFunc], tuple[tirx.PrimFunc, int]],
                     what: str) -> None:
    """Apply `rewrite(name, func)` -> (func, stores rewritten) to the GPU attention kernels the
    KV cache just added to the module being built; those of a chunk's own tokens (ragged) and of
    decode must both be among the rewritten, or the model is refused."""
    bb = relax.BlockBuilder.current()
    done = []
    for gv, func in bb.get().functions.items():
        if isinstance(func, tirx.PrimFunc) and gv.name_hint.startswith(_KERNELS) \
                and "with_tree_mask" not in gv.name_hint:
            new, n = rewrite(gv.name_hint, func)
            if n:
                bb.update_func(gv, new)
                done.append(gv.name_hint)
    if not any(name.startswith("tir_attention_prefill_ragged") for name in done) or not any(
            name.startswith("tir_attention_decode") for name in done):
        raise UnsupportedModelError(
            f"{what} on this GPU: TVM's attention kernels are not the ones localchat can "
            f"rewrite (rewritten: {', '.join(done) or 'none'})")


def soft_cap_attention(cap: float) -> None:
    """Soft-cap the scores of the GPU attention kernels the KV cache just added to the module
    being built (call right after creating the cache)."""
    _rewrite_kernels(lambda _name, func: soft_capped(func, cap), "attention soft-capping")


# 2^(sink - max) is taken with the exponent capped here (log2 units): a sink that far above
# every score has all the weight anyway, and the sum stays finite in float32
_SINK_GAP = 120.0


def _load(buffer: Any, indices: list[Any]) -> Any:
    return tirx.BufferLoad(buffer, list(indices))


def _is_load_of(expr: Any, buffer: Any | None = None) -> bool:
    """Whether `expr` loads an element (of `buffer`, when given)."""
    name = _loaded_from(expr)
    return name is not None and (buffer is None or name == buffer.name)


def _kernel_parts(func: tirx.PrimFunc) -> dict[str, Any]:
    """The buffers and the batch index a sink rewrite reads: q, the rope positions, the
    kv-chunk length and the sequence index it was computed for, and the final softmax state's
    max and sum (from the LSE store m + log2(d))."""
    loaded: dict[str, Any] = {}  # the buffers the kernel reads, by name

    def load(node: Any, mutator: Any) -> Any:
        loaded.setdefault(node.source.name, node.source)
        return mutator.default_mutate(node)

    structural_mutate(func.body, [(TensorLoad, load)])
    parts: dict[str, Any] = {"q": loaded["q"] if "q" in loaded else loaded.get("Q"),
                             "q_pos": loaded.get("q_rope_position"),
                             "k_pos0": loaded.get("k_rope_pos_offset")}

    def visit(node: Any, mutator: Any) -> Any:
        name = node.buffer.name
        if name == "kv_chunk_len" and "length_info" in str(node.value):
            parts["kv_len"] = node.buffer
            found: list[Any] = []

            def seq(load: Any, inner: Any) -> Any:
                if load.source.name == "length_info":
                    found.append(load.indices[-1])
                return inner.default_mutate(load)

            structural_mutate(node.value, [(TensorLoad, seq)])
            parts["seq"] = found[0] if found else None
        elif name == "lse":
            value = node.value
            if isinstance(value, tirx.Add) and _is_load_of(value.a) \
                    and isinstance(value.b, Call) and value.b.args \
                    and _is_load_of(value.b.args[0]):
                parts["m"], parts["d"] = value.a.source, value.b.args[0].source
        return mutator.default_mutate(node)

    structural_mutate(func.body, [(tir_stmt.BufferStore, visit)])
    return parts


def with_sinks(func: tirx.PrimFunc, d_real: int, ragged: bool) -> tuple[tirx.PrimFunc, int]:
    """`func` counting each query row's sink (lane `d_real` of q) in its final softmax state,
    and how many stores it rewrote (2: the output and the LSE). `ragged`: the kernel over a
    chunk's own tokens, which always counts it; other kernels count it where the query's
    position lies among their keys'."""
    parts = _kernel_parts(func)
    need = ["q", "m", "d"] + ([] if ragged else ["q_pos", "k_pos0", "kv_len", "seq"])
    if any(parts.get(k) is None for k in need):
        return func, 0
    q, m_buf, d_buf = parts["q"], parts["m"], parts["d"]
    rewritten = 0

    def extra(row: Any, head: Any, m: Any) -> Any:
        """2^(sink - m): the sink's term of the sum, or 0 where this call does not count it."""
        sink = tirx.Cast("float32", _load(q, [row, head, d_real])) * tirx.const(LOG2E, "float32")
        term = tirx.exp2(tirx.min(sink - m, tirx.const(_SINK_GAP, "float32")))
        if ragged:
            return term
        q_pos = _load(parts["q_pos"], [row])
        k_pos0 = _load(parts["k_pos0"], [parts["seq"]])
        kv_len = _load(parts["kv_len"], [0])
        ours = tirx.And(q_pos >= k_pos0, q_pos < k_pos0 + kv_len)
        return tirx.Select(ours, term, tirx.const(0.0, "float32"))

    def store(node: Any, mutator: Any) -> Any:
        nonlocal rewritten
        name, value, idx = node.buffer.name, node.value, node.indices
        if name == "output" and len(idx) == 3:
            cast = str(value.ty) if isinstance(value, tirx.Cast) else None
            if cast is not None:  # a float16 output: the float32 value it is cast from
                value = value.value
            if isinstance(value, tirx.Div) and _is_load_of(value.b, d_buf):
                # prefill: O / d[row] -> O / (d[row] + 2^(s - m[row]))
                d = value.b
                m = _load(m_buf, d.indices)
                new = value.a / (d + extra(idx[0], idx[1], m))
            else:
                # decode: O already divided by its (thread-local, final) d
                d, m = _load(d_buf, [0]), _load(m_buf, [0])
                new = value * (d / (d + extra(idx[0], idx[1], m)))
            if cast is not None:
                new = tirx.Cast(cast, new)
            rewritten += 1
            return tir_stmt.BufferStore(node.buffer, new, idx)
        if name == "lse" and len(idx) == 2 and isinstance(value, tirx.Add) \
                and isinstance(value.b, Call):
            m, d = value.a, value.b.args[0]
            rewritten += 1
            return tir_stmt.BufferStore(
                node.buffer, m + tirx.log2(d + extra(idx[0], idx[1], m)), idx)
        return mutator.default_mutate(node)

    return structural_mutate(func, [(tir_stmt.BufferStore, store)]), rewritten


def sink_attention(head_dim: int) -> None:
    """Count attention sinks in the GPU attention kernels the KV cache just added to the
    module being built (call right after creating the cache); `head_dim` is the model's, the
    sink in q's lane `head_dim` of the cache's head_dim + SINK_PAD."""

    def rewrite(name: str, func: tirx.PrimFunc) -> tuple[tirx.PrimFunc, int]:
        sunk, n = with_sinks(func, head_dim, name.startswith("tir_attention_prefill_ragged"))
        if n not in (0, 2):
            raise UnsupportedModelError(f"attention sinks on this GPU: {name} has {n} final "
                                        f"stores, not the 2 localchat rewrites")
        return sunk, n

    _rewrite_kernels(rewrite, "attention sinks")
