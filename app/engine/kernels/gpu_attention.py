"""An attention-logit soft-cap (Gemma 2) in TVM's GPU attention kernels, which have none.

TVM's paged KV cache builds its GPU kernels (prefill over pages, prefill of a chunk's own
tokens, decode) as PrimFuncs in the module being exported. Each writes every query-key score
once, complete, before the softmax reads it: `S_smem[i, j] = S_local[i, j]` in the prefill
kernels, `S_local[j] = t0[0]` in decode (the cross-thread sum). `soft_cap_attention` rewrites
those stores to c * tanh(s / c). The scores are in log2 units there (q.k * scale * log2 e), so
the cap is scaled by log2 e as well: c' tanh(S / c') with c' = c log2 e is c tanh(s / c) in them.
"""

from __future__ import annotations

import math
from typing import Any

from tvm import relax, tirx
from tvm.tirx import stmt as tir_stmt
from tvm_ffi import structural_mutate

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


def soft_cap_attention(cap: float) -> None:
    """Soft-cap the scores of the GPU attention kernels the KV cache just added to the module
    being built (call right after creating the cache)."""
    bb = relax.BlockBuilder.current()
    mod = bb.get()
    done = []
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc) and gv.name_hint.startswith(_KERNELS) \
                and "with_tree_mask" not in gv.name_hint:
            capped, n = soft_capped(func, cap)
            if n:
                bb.update_func(gv, capped)
                done.append(gv.name_hint)
    # the chunk's own tokens (ragged), earlier pages and decode must all be capped
    if not any(name.startswith("tir_attention_prefill_ragged") for name in done) or not any(
            name.startswith("tir_attention_decode") for name in done):
        raise UnsupportedModelError(
            "attention soft-capping on this GPU: TVM's attention kernels are not the ones "
            f"localchat can cap (capped: {', '.join(done) or 'none'})")
