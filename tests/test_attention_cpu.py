"""The CPU attention kernels of localchat.engine.kernels.attention, driven through TVM's KV cache.

A one-layer module computes `cache.attention_with_fused_qkv` on random q/k/v. Each scenario runs
the same inputs through a cache built by `create_paged_kv_cache_cpu` (our kernels) and, where
cheap, by TVM's `TIRPagedKVCache` (its reference CPU kernels), and checks ours against a numpy
causal attention with HF-style rotary embedding.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from paged_attention_session import (
    TARGET,
    Layer,
    Session,
    Spec,
    cache_args,
    forward_steps,
)
from tvm import relax
from tvm.relax.frontend.nn.llm.kv_cache import RopeMode, TIRPagedKVCache

from localchat.engine.kernels import attention
from localchat.engine.kernels.attention import create_paged_kv_cache_cpu

ROPE_THETA = 10000.0
TOL = 1e-5  # max abs error relative to the largest reference value


def _spec(
    h_q: int, h_kv: int, d: int, dtype: str = "float32", factory=create_paged_kv_cache_cpu
) -> Spec:
    """A one-layer module computing `cache.attention_with_fused_qkv` (the cache's rotary)."""
    layers = (Layer(ROPE_THETA, d),)
    return Spec(
        h_q, h_kv, d, layers, d**-0.5, cache_rope=True, shared_qkv=True, dtype=dtype,
        factory=factory,
    )


def _rope(x: np.ndarray, pos: np.ndarray, theta: float, rotary_dim: int) -> np.ndarray:
    """HF Llama rotary embedding (rotate half) of x [n, h, d = rotary_dim] at positions pos [n]."""
    d = rotary_dim
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = pos[:, None].astype(np.float64) * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _close(a: np.ndarray, b: np.ndarray, tol: float = TOL) -> None:
    err = float(np.abs(a - b).max()) / max(float(np.abs(b).max()), 1e-30)
    assert err < tol, f"max relative error {err:.3g} >= {tol}"


CONFIGS = [(4, 2, 64), (4, 2, 32), (3, 3, 32), (9, 3, 64)]  # (h_q, h_kv, head_dim)


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"hq{c[0]}-hkv{c[1]}-d{c[2]}")
def vms(request) -> tuple[Spec, Spec]:
    """The same module on a cache with our kernels and on TVM's `TIRPagedKVCache`."""
    return _spec(*request.param), _spec(*request.param, factory=TIRPagedKVCache)


def _both(vms: tuple[Spec, Spec]) -> tuple[Session, Session]:
    return Session(vms[0], rotary=_rope), Session(vms[1], rotary=_rope)


def _qkv(rng: np.random.Generator, n: int, spec: Spec) -> np.ndarray:
    return rng.uniform(-2, 2, (n, spec.width, spec.head_dim)).astype("float32")


def _run(sessions, steps, rng, vms):
    """Run each step ({seq: n_tokens} or ("decode", [seqs]) or ("add"/"fork", ...)) on both."""
    for _, lens, decode in forward_steps(sessions, steps):
        chunks = {i: _qkv(rng, n, vms[0]) for i, n in lens.items()}
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
    spec = _spec(4, 2, 32)
    s = Session(spec, rotary=_rope)
    rng = np.random.default_rng(6)
    s.add(0)
    for n in (200, 150, 1, 1):
        chunks = {0: _qkv(rng, n, spec)}
        got, ref = s.forward(chunks, decode=n == 1)
        _close(got, ref)


@pytest.mark.parametrize("h_q,h_kv,d", [(4, 2, 64), (16, 2, 64), (12, 3, 128)],
                         ids=["group2", "group8", "group4-d128"])
def test_float16(h_q: int, h_kv: int, d: int):
    # float16 storage, float32 accumulation: error is that of the float16 inputs and output;
    # groups of 8 (d 64) and 4 (d 128) hold more of o than the registers do, so decode sums V
    # into it in passes over each block's keys
    spec = _spec(h_q, h_kv, d, "float16")
    s = Session(spec, rotary=_rope)
    rng = np.random.default_rng(7)
    s.add(0)
    for n in (40, 25, 1, 1, 1):
        got, ref = s.forward({0: _qkv(rng, n, spec)}, decode=n == 1)
        _close(got, ref, tol=2e-3)


def test_decode_prefetches_keys_ahead():
    """Paged decode prefetches the K and V lines of the keys `DECODE_PREFETCH_BLOCKS` blocks
    ahead (a head's keys are scattered over pages the hardware prefetcher does not follow:
    18 GB/s without, 29-30 with, 3B shape at 4,000 keys); the numbers are the other tests'."""
    func = attention.attention_decode_paged_cpu(2, 6, 128, "float16")
    ir = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                     TARGET).mod.inspect_source("ll")
    # one K and one V prefetch per cache line of a key (256 bytes: 4 lines), in the loops over
    # keys; not a block's pages at once (128 prefetches here)
    assert ir.count("call void @llvm.prefetch") == 8


def test_falls_back_for_inline_rope_and_other_targets():
    bb = relax.BlockBuilder()
    with bb.function("f", []):
        common = cache_args(layers=1, rope_theta=ROPE_THETA)
        inline = create_paged_kv_cache_cpu(**(common | {"rope_mode": RopeMode.INLINE}))
        cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
        gpu = create_paged_kv_cache_cpu(**(common | {"target": cuda}))
        ours = create_paged_kv_cache_cpu(**common)
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
