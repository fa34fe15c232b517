"""The CPU attention kernels of localchat.engine.kernels.attention, driven through TVM's KV cache.

A one-layer module computes `cache.attention_with_fused_qkv` on random q/k/v. Each scenario runs
the same inputs through a cache built by `create_paged_kv_cache_cpu` (our kernels) and, where
cheap, by TVM's `TIRPagedKVCache` (its reference CPU kernels), and checks ours against a numpy
causal attention with HF-style rotary embedding.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache
from tvm.runtime import ShapeTuple

from localchat.engine.kernels import attention
from localchat.engine.kernels.attention import create_paged_kv_cache_cpu

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
ROPE_THETA = 10000.0
PAGE_SIZE = 16
TOL = 1e-5  # max abs error relative to the largest reference value

_kv_add = tvm.get_global_func("vm.builtin.kv_state_add_sequence")
_kv_fork = tvm.get_global_func("vm.builtin.kv_state_fork_sequence")
_kv_begin = tvm.get_global_func("vm.builtin.kv_state_begin_forward")
_kv_end = tvm.get_global_func("vm.builtin.kv_state_end_forward")


@functools.cache
def _build(factory, h_q: int, h_kv: int, d: int, dtype: str = "float32") -> relax.VirtualMachine:
    class AttnOnly(nn.Module):
        def attn(self, qkv: nn.Tensor, cache: PagedKVCache) -> nn.Tensor:
            return cache.attention_with_fused_qkv(0, qkv, h_q, sm_scale=d**-0.5)

        def create_paged_kv_cache(
            self, max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, sliding
        ) -> PagedKVCache:
            return factory(
                attn_kind="mha",
                max_batch_size=max_batch_size,
                max_total_seq_len=max_total_seq_len,
                prefill_chunk_size=prefill_chunk_size,
                page_size=page_size,
                support_sliding_window=sliding,
                layer_partition=relax.ShapeExpr([0, 1]),
                num_hidden_layers=1,
                num_attention_heads=h_q,
                num_key_value_heads=h_kv,
                qk_head_dim=d,
                v_head_dim=d,
                mla_original_qk_head_dim=0,
                mla_original_v_head_dim=0,
                rope_mode=RopeMode.NORMAL,
                rope_scale=1,
                rope_theta=ROPE_THETA,
                rope_scaling={},
                rope_ext_factors=relax.prim_value(0),
                rotary_dim=d,
                enable_disaggregation=False,
                dtype=dtype,
                target=TARGET,
            )

    none = {"$": {"param_mode": "none", "effect_mode": "none"}}
    spec = {
        "attn": {
            "qkv": nn.spec.Tensor(["b", "s", h_q + 2 * h_kv, d], dtype),
            "cache": nn.spec.Object(object_type=PagedKVCache),
            **none,
        },
        "create_paged_kv_cache": {
            "max_batch_size": int,
            "max_total_seq_len": int,
            "prefill_chunk_size": int,
            "page_size": int,
            "sliding": int,
            **none,
        },
    }
    mod, _ = AttnOnly().export_tvm(spec=spec)
    return relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())


def _rope(x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """HF Llama rotary embedding (rotate half) of x [n, h, d] at positions pos [n]."""
    d = x.shape[-1]
    inv = ROPE_THETA ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = pos[:, None].astype(np.float64) * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@dataclass
class _Seq:
    k: list[np.ndarray] = field(default_factory=list)  # rope'd keys [h_kv, d] per token
    v: list[np.ndarray] = field(default_factory=list)


class Session:
    """One cache on one compiled module, with a numpy reference of what the cache holds."""

    def __init__(
        self, vm: relax.VirtualMachine, h_q: int, h_kv: int, d: int, dtype: str = "float32"
    ) -> None:
        self.vm, self.h_q, self.h_kv, self.d, self.dtype = vm, h_q, h_kv, d, dtype
        self.cache = vm["create_paged_kv_cache"](
            ShapeTuple([4]),
            ShapeTuple([1024]),
            ShapeTuple([256]),
            ShapeTuple([PAGE_SIZE]),
            ShapeTuple([0]),
        )
        self.seqs: dict[int, _Seq] = {}

    def add(self, seq_id: int) -> None:
        _kv_add(self.cache, seq_id)
        self.seqs[seq_id] = _Seq()

    def fork(self, parent: int, child: int) -> None:
        _kv_fork(self.cache, parent, child, -1)
        p = self.seqs[parent]
        self.seqs[child] = _Seq(list(p.k), list(p.v))

    def forward(self, chunks: dict[int, np.ndarray], decode: bool = False):
        """Append chunks[seq] (qkv [n, h_q + 2 h_kv, d]) to each sequence; (ours, reference)."""
        chunks = {i: c.astype(self.dtype) for i, c in chunks.items()}
        ids = list(chunks)
        lens = [len(chunks[i]) for i in ids]
        if decode:
            assert all(n == 1 for n in lens)
            qkv = np.stack([chunks[i] for i in ids])  # [b, 1, H, d]
        else:
            qkv = np.concatenate([chunks[i] for i in ids])[None]  # [1, n, H, d]
        _kv_begin(self.cache, ShapeTuple(ids), ShapeTuple(lens))
        out = self.vm["attn"](tvm.runtime.tensor(qkv, tvm.cpu()), self.cache).numpy()
        out = out.astype("float64")
        _kv_end(self.cache)
        out = out.reshape(sum(lens), self.h_q, self.d)
        return out, np.concatenate([self._reference(i, chunks[i]) for i in ids])

    def _reference(self, seq_id: int, qkv: np.ndarray) -> np.ndarray:
        h_q, h_kv, group = self.h_q, self.h_kv, self.h_q // self.h_kv
        s = self.seqs[seq_id]
        n, past = len(qkv), len(s.k)
        pos = np.arange(past, past + n)
        q = _rope(qkv[:, :h_q].astype(np.float64), pos)
        k_new = _rope(qkv[:, h_q : h_q + h_kv].astype(np.float64), pos)
        s.k.extend(k_new)
        s.v.extend(qkv[:, h_q + h_kv :].astype(np.float64))
        k, v = np.stack(s.k), np.stack(s.v)  # [L, h_kv, d]
        visible = np.arange(len(k))[None, :] <= pos[:, None]
        out = np.empty((n, h_q, self.d))
        for h in range(h_q):
            sc = q[:, h] @ k[:, h // group].T * self.d**-0.5
            sc = np.where(visible, sc, -np.inf)
            p = np.exp(sc - sc.max(axis=1, keepdims=True))
            out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ v[:, h // group]
        return out


def _close(a: np.ndarray, b: np.ndarray, tol: float = TOL) -> None:
    err = float(np.abs(a - b).max()) / max(float(np.abs(b).max()), 1e-30)
    assert err < tol, f"max relative error {err:.3g} >= {tol}"


CONFIGS = [(4, 2, 64), (4, 2, 32), (3, 3, 32), (9, 3, 64)]  # (h_q, h_kv, head_dim)


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"hq{c[0]}-hkv{c[1]}-d{c[2]}")
def vms(request):
    h_q, h_kv, d = request.param
    ours = _build(create_paged_kv_cache_cpu, h_q, h_kv, d)
    tvms = _build(TIRPagedKVCache, h_q, h_kv, d)
    return (h_q, h_kv, d), ours, tvms


def _both(vms):
    (h_q, h_kv, d), ours, tvms = vms
    return Session(ours, h_q, h_kv, d), Session(tvms, h_q, h_kv, d)


def _qkv(rng: np.random.Generator, n: int, vms) -> np.ndarray:
    h_q, h_kv, d = vms[0]
    return rng.uniform(-2, 2, (n, h_q + 2 * h_kv, d)).astype("float32")


def _run(sessions, steps, rng, vms):
    """Run each step ({seq: n_tokens} or ("decode", [seqs]) or ("add"/"fork", ...)) on both."""
    for step in steps:
        if step[0] == "add":
            for s in sessions:
                s.add(step[1])
            continue
        if step[0] == "fork":
            for s in sessions:
                s.fork(step[1], step[2])
            continue
        decode = step[0] == "decode"
        lens = {i: 1 for i in step[1]} if decode else step[1]
        chunks = {i: _qkv(rng, n, vms) for i, n in lens.items()}
        (ours, ref), (theirs, _) = (s.forward(chunks, decode) for s in sessions)
        _close(ours, ref)
        _close(ours, theirs)


def test_single_prefill(vms):
    rng = np.random.default_rng(1)
    _run(_both(vms), [("add", 0), ("prefill", {0: 37})], rng, vms)


def test_prefill_in_two_chunks(vms):
    # the second chunk attends to the first through the paged kernel, merged with the ragged one
    rng = np.random.default_rng(2)
    _run(_both(vms), [("add", 0), ("prefill", {0: 20}), ("prefill", {0: 45})], rng, vms)


def test_decode_steps(vms):
    rng = np.random.default_rng(3)
    steps = [("add", 0), ("prefill", {0: 30})] + [("decode", [0])] * 4
    steps += [("prefill", {0: 3}), ("decode", [0])]
    _run(_both(vms), steps, rng, vms)


def test_batch_of_two_lengths(vms):
    rng = np.random.default_rng(4)
    steps = [
        ("add", 0),
        ("add", 1),
        ("prefill", {0: 19, 1: 50}),
        ("decode", [0, 1]),
        ("decode", [1, 0]),
        ("prefill", {1: 7, 0: 33}),
        ("add", 2),
        # a sequence without cached pages next to ones with pages (lse of the empty part)
        ("prefill", {2: 5, 0: 4}),
        ("decode", [0, 1, 2]),
    ]
    _run(_both(vms), steps, rng, vms)


def test_forked_sequences(vms):
    # forks share pages: attention runs over several depths of the page tree
    rng = np.random.default_rng(5)
    steps = [
        ("add", 0),
        ("prefill", {0: 40}),
        ("fork", 0, 1),
        ("prefill", {0: 6, 1: 9}),
        ("decode", [0, 1]),
        ("fork", 1, 2),
        ("decode", [2, 0, 1]),
    ]
    _run(_both(vms), steps, rng, vms)


def test_long_prefill_and_decode():
    # several key blocks, queries past the first 16-row block, decode splits
    h_q, h_kv, d = 4, 2, 32
    ours = _build(create_paged_kv_cache_cpu, h_q, h_kv, d)
    s = Session(ours, h_q, h_kv, d)
    rng = np.random.default_rng(6)
    cfg = ((h_q, h_kv, d), ours, None)
    s.add(0)
    for n in (200, 150, 1, 1):
        chunks = {0: _qkv(rng, n, cfg)}
        got, ref = s.forward(chunks, decode=n == 1)
        _close(got, ref)


def test_float16():
    # float16 storage, float32 accumulation: error is that of the float16 inputs and output
    h_q, h_kv, d = 4, 2, 64
    ours = _build(create_paged_kv_cache_cpu, h_q, h_kv, d, "float16")
    s = Session(ours, h_q, h_kv, d, "float16")
    rng = np.random.default_rng(7)
    cfg = ((h_q, h_kv, d), ours, None)
    s.add(0)
    for n in (40, 25, 1, 1):
        got, ref = s.forward({0: _qkv(rng, n, cfg)}, decode=n == 1)
        _close(got, ref, tol=2e-3)


def test_falls_back_for_inline_rope_and_other_targets():
    bb = relax.BlockBuilder()
    common = dict(
        attn_kind="mha",
        max_batch_size=1,
        max_total_seq_len=64,
        prefill_chunk_size=16,
        page_size=16,
        support_sliding_window=0,
        layer_partition=relax.ShapeExpr([0, 1]),
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        qk_head_dim=16,
        v_head_dim=16,
        mla_original_qk_head_dim=0,
        mla_original_v_head_dim=0,
        rope_scale=1,
        rope_theta=ROPE_THETA,
        rope_scaling={},
        rope_ext_factors=relax.prim_value(0),
        rotary_dim=16,
        enable_disaggregation=False,
        dtype="float32",
    )
    with bb.function("f", []):
        inline = create_paged_kv_cache_cpu(rope_mode=RopeMode.INLINE, target=TARGET, **common)
        cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
        gpu = create_paged_kv_cache_cpu(rope_mode=RopeMode.NORMAL, target=cuda, **common)
        ours = create_paged_kv_cache_cpu(rope_mode=RopeMode.NORMAL, target=TARGET, **common)
        bb.emit_func_output(relax.const(0))
    assert isinstance(inline, TIRPagedKVCache)
    assert isinstance(gpu, TIRPagedKVCache)
    assert not isinstance(ours, TIRPagedKVCache)
    names = {gv.name_hint for gv in bb.get().functions}
    assert "tir_attention_decode_cpu" in names


def test_kernels_reject_bad_heads():
    with pytest.raises(ValueError):
        attention.attention_decode_paged_cpu(3, 4, 32, "float32")


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("scaling,rotary_dim", [({}, 64), (LLAMA3_ROPE, 64), ({}, 32)],
                         ids=["default", "llama3", "partial"])
def test_split_rotary_matches_tvms_kernel(scaling: dict, rotary_dim: int) -> None:
    """Our split-and-rotate kernel gives TVM's outputs, rope on and off, for one token (the
    serial branch) and for many (the parallel one), at positions where the angles are large."""
    from tvm.relax.frontend.nn.llm.kv_cache import llama_rope_with_position_map

    h_q, h_kv, d = 9, 3, 64
    args = (500000.0, 1.0, d, h_q, h_kv, "float32", scaling, rotary_dim)

    def build(func):
        return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                           TARGET)["main"]

    ours = build(attention.split_rotary_cpu(*args))
    theirs = build(llama_rope_with_position_map(*args))
    rng = np.random.default_rng(0)
    dev = tvm.cpu()
    for n in (1, 37):
        qkv = tvm.runtime.tensor(rng.standard_normal((n, h_q + 2 * h_kv, d), dtype=np.float32), dev)
        pos = tvm.runtime.tensor(rng.integers(0, 100_000, n, dtype=np.int32), dev)
        for apply_rope in (1, 0):
            outs = []
            for fn in (ours, theirs):
                q, k, v = (tvm.runtime.tensor(np.full((n, h, d), np.nan, np.float32), dev)
                           for h in (h_q, h_kv, h_kv))
                fn(qkv, pos, q, k, v, apply_rope)
                outs.append([a.numpy() for a in (q, k, v)])
            for a, b in zip(*outs, strict=True):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
            if not apply_rope:  # a plain split
                np.testing.assert_array_equal(outs[0][0], qkv.numpy()[:, :h_q])


def test_split_rotary_leaves_other_scalings_to_tvm() -> None:
    longrope = {"rope_type": "longrope", "max_position_embeddings": 8192,
                "original_max_position_embeddings": 4096}
    assert attention.split_rotary_cpu(1e4, 1.0, 64, 4, 2, "float32", longrope, 64) is None
    assert attention.split_rotary_cpu(1e4, 1.0, 64, 4, 2, "float32", {}, 63) is None
