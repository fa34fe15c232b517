"""Attention sinks (gpt-oss) in the CPU paged-attention kernels, against numpy in float64.

The sink of each (layer, query head) rides in lane d_real of q (the cache's head dim is
d_real + SINK_PAD); the runtime merges several kernel calls per query (ragged part, one paged
call per depth), and the sink must be counted in exactly one of them. Driven through TVM's KV
cache runtime with the cache's own rotary (RopeMode.NORMAL, rotary_dim = d_real, which must leave
the sink lane alone): batches, chunked prefill, forks (a shared-prefix depth) and decode past
several splits, on a full and a windowed layer. Sinks include large positive ones, so a sink
missing or counted twice moves a head's output by a large fraction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.relax.frontend.nn.llm.kv_cache import (
    PagedKVCache,
    RopeMode,
    llama_rope_with_position_map,
)
from tvm.runtime import ShapeTuple

from localchat.engine.kernels import attention, tvm_private
from localchat.engine.kernels.attention import SINK_PAD

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
DEV = tvm.cpu()

H_Q, H_KV, D_REAL = 4, 2, 16
D = D_REAL + SINK_PAD
H = H_Q + 2 * H_KV
THETA = 1e4
WINDOW = 8
SM_SCALE = D_REAL**-0.5
WINDOWED = (False, True)  # layer 0 sees every key, layer 1 the last WINDOW positions
# natural-log sink logits per (layer, query head); scores are about +-3, so 6 and 9 dominate
SINKS = np.array([[0.5, -2.0, 6.0, 1.0], [9.0, -1.0, 0.0, 3.0]])
PAGE_SIZE = 16

_kv_add = tvm.get_global_func("vm.builtin.kv_state_add_sequence")
_kv_fork = tvm.get_global_func("vm.builtin.kv_state_fork_sequence")
_kv_begin = tvm.get_global_func("vm.builtin.kv_state_begin_forward")
_kv_end = tvm.get_global_func("vm.builtin.kv_state_end_forward")


def _t(a: np.ndarray) -> tvm.runtime.Tensor:
    return tvm.runtime.tensor(np.ascontiguousarray(a), DEV)


def _rope(x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """HF's rotary embedding (rotate half) of x [n, h, D_REAL] at positions pos [n]."""
    f32 = np.float32
    denom = np.power(f32(THETA), np.arange(0, D_REAL, 2, dtype=f32) / f32(D_REAL))
    ang = (pos[:, None].astype(f32) / denom[None, :]).astype(np.float64)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    half = D_REAL // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@pytest.fixture(scope="module")
def vm() -> relax.VirtualMachine:
    """Every layer on its own slice of qkv [b, s, layers * H, D], one cache (the cache's rotary);
    the outputs side by side: [b, s, layers * H_Q, D]."""
    n_layers = len(WINDOWED)

    class Model(nn.Module):
        def attn(self, qkv: nn.Tensor, cache: PagedKVCache) -> nn.Tensor:
            outs = []
            for i, (x, windowed) in enumerate(zip(op.split(qkv, n_layers, axis=2), WINDOWED)):
                scale = attention.windowed_sm_scale(SM_SCALE) if windowed else SM_SCALE
                outs.append(cache.attention_with_fused_qkv(i, x, H_Q, sm_scale=scale))
            return op.concat(outs, dim=2)

        def create_paged_kv_cache(
            self, max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, sliding
        ) -> PagedKVCache:
            return attention.create_paged_kv_cache_cpu(
                attn_kind="mha",
                max_batch_size=max_batch_size,
                max_total_seq_len=max_total_seq_len,
                prefill_chunk_size=prefill_chunk_size,
                page_size=page_size,
                support_sliding_window=sliding,
                layer_partition=relax.ShapeExpr([0, n_layers]),
                num_hidden_layers=n_layers,
                num_attention_heads=H_Q,
                num_key_value_heads=H_KV,
                qk_head_dim=D,
                v_head_dim=D,
                mla_original_qk_head_dim=0,
                mla_original_v_head_dim=0,
                rope_mode=RopeMode.NORMAL,
                rope_scale=1,
                rope_theta=THETA,
                rope_scaling={},
                rope_ext_factors=relax.prim_value(0),
                rotary_dim=D_REAL,
                enable_disaggregation=False,
                dtype="float32",
                target=TARGET,
                sliding_window=WINDOW,
                attn_sinks=True,
            )

    none = {"$": {"param_mode": "none", "effect_mode": "none"}}
    spec = {
        "attn": {
            "qkv": nn.spec.Tensor(["b", "s", n_layers * H, D], "float32"),
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
    mod, _ = Model().export_tvm(spec=spec)
    return relax.VirtualMachine(tvm.compile(mod, target=TARGET), DEV)


@dataclass
class _Seq:
    qkv: list[np.ndarray] = field(default_factory=list)  # [layers, H, D_REAL] per token


class Session:
    """One cache and a float64 reference (HF's eager gpt-oss attention) of what it holds."""

    def __init__(self, vm: relax.VirtualMachine) -> None:
        self.vm = vm
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
        self.seqs[child] = _Seq(list(self.seqs[parent].qkv))

    def forward(self, chunks: dict[int, np.ndarray], decode: bool = False):
        """Append chunks[seq] ([n, layers, H, D_REAL]) to each sequence: (ours, reference),
        each [tokens, layers, H_Q, D] (the reference's pad lanes 0)."""
        ids = list(chunks)
        lens = [len(chunks[i]) for i in ids]
        padded = {i: _pad(c) for i, c in chunks.items()}
        if decode:
            qkv = np.stack([padded[i] for i in ids])  # [b, 1, layers * H, D]
        else:
            qkv = np.concatenate([padded[i] for i in ids])[None]  # [1, n, layers * H, D]
        _kv_begin(self.cache, ShapeTuple(ids), ShapeTuple(lens))
        out = self.vm["attn"](_t(qkv), self.cache).numpy().astype(np.float64)
        _kv_end(self.cache)
        out = out.reshape(sum(lens), len(WINDOWED), H_Q, D)
        ref = np.concatenate([self._reference(i, chunks[i]) for i in ids])
        return out, ref

    def _reference(self, seq_id: int, chunk: np.ndarray) -> np.ndarray:
        s = self.seqs[seq_id]
        past = len(s.qkv)
        s.qkv.extend(chunk.astype(np.float64))
        every = np.stack(s.qkv)  # [L, layers, H, D_REAL]
        pos = np.arange(len(every))
        q_pos = pos[past:]
        group = H_Q // H_KV
        out = np.zeros((len(chunk), len(WINDOWED), H_Q, D))
        for li, windowed in enumerate(WINDOWED):
            x = _rope(every[:, li, : H_Q + H_KV], pos)
            q, k, v = x[past:, :H_Q], x[:, H_Q:], every[:, li, H_Q + H_KV :]
            visible = pos[None, :] <= q_pos[:, None]
            if windowed:
                visible &= q_pos[:, None] - pos[None, :] < WINDOW
            for h in range(H_Q):
                sc = np.where(visible, q[:, h] @ k[:, h // group].T * SM_SCALE, -np.inf)
                sc = np.concatenate([sc, np.full((len(sc), 1), SINKS[li, h])], axis=1)
                p = np.exp(sc - sc.max(axis=1, keepdims=True))
                p = (p / p.sum(axis=1, keepdims=True))[:, :-1]  # the sink's column dropped
                out[:, li, h, :D_REAL] = p @ v[:, h // group]
        return out


def _pad(chunk: np.ndarray) -> np.ndarray:
    """[n, layers, H, D_REAL] -> [n, layers * H, D]: zero pad lanes, each query head's sink in
    lane D_REAL (natural-log units, unscaled)."""
    n = len(chunk)
    out = np.zeros((n, len(WINDOWED), H, D), np.float32)
    out[..., :D_REAL] = chunk
    out[:, :, :H_Q, D_REAL] = SINKS[None]
    return out.reshape(n, len(WINDOWED) * H, D)


def _check(step, ours: np.ndarray, ref: np.ndarray) -> None:
    """Per (layer, head) relative error: a head whose sink dominates has a small output, and a
    missing or doubled sink would change it by a large fraction of itself."""
    for li in range(len(WINDOWED)):
        for h in range(H_Q):
            scale = np.abs(ref[:, li, h]).max()
            err = np.abs(ours[:, li, h] - ref[:, li, h]).max() / scale
            assert err < 2e-5, f"{step}: layer {li} head {h} relative error {err:.3g}"
    assert not ours[..., D_REAL:].any(), "the output's pad lanes must be 0"


def _chunks(rng, lens: dict[int, int]) -> dict[int, np.ndarray]:
    return {
        i: rng.uniform(-2, 2, (n, len(WINDOWED), H, D_REAL)).astype(np.float32)
        for i, n in lens.items()
    }


def _run(session: Session, steps, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for step in steps:
        if step[0] == "add":
            session.add(step[1])
            continue
        if step[0] == "fork":
            session.fork(step[1], step[2])
            continue
        decode = step[0] == "decode"
        lens = {i: 1 for i in step[1]} if decode else step[1]
        ours, ref = session.forward(_chunks(rng, lens), decode)
        _check(step, ours, ref)


def test_batch_of_two_prefill_then_decode(vm) -> None:
    """Two sequences longer than the window, prefilled together, decoded in batches (the sink in
    the decode depth that holds the new key), then a chunk after cached pages (the sink in the
    ragged call only, not in the paged one)."""
    steps = [
        ("add", 0),
        ("add", 1),
        ("prefill", {0: 13, 1: 21}),
        ("decode", [0, 1]),
        ("decode", [1, 0]),
        ("decode", [0, 1]),
        ("prefill", {1: 5, 0: 11}),
        ("decode", [0, 1]),
    ]
    _run(Session(vm), steps, seed=1)


def test_prompt_in_two_chunks_equals_one_chunk(vm) -> None:
    """The same prompt in one chunk (sequence 0) and in two (sequence 1): the same outputs."""
    session = Session(vm)
    session.add(0)
    session.add(1)
    prompt = _chunks(np.random.default_rng(4), {0: 37})[0]
    whole, ref = session.forward({0: prompt})
    _check("one chunk", whole, ref)
    first, ref1 = session.forward({1: prompt[:20]})
    second, ref2 = session.forward({1: prompt[20:]})
    _check("first chunk", first, ref1)
    _check("second chunk", second, ref2)
    np.testing.assert_allclose(np.concatenate([first, second]), whole, rtol=0, atol=1e-5)


def test_forked_sequences_count_the_sink_once(vm) -> None:
    """Forks share pages, so a query attends over two or three depths (and the shared depth of
    a decode batch goes to the paged prefill kernel): only the depth holding the query's own key
    counts its sink."""
    steps = [
        ("add", 0),
        ("prefill", {0: 20}),
        ("fork", 0, 1),
        ("decode", [0, 1]),
        ("prefill", {0: 3, 1: 12}),
        ("decode", [0, 1]),
        ("fork", 1, 2),
        ("decode", [2, 0, 1]),
        ("prefill", {2: 9}),
        ("decode", [2]),
    ]
    _run(Session(vm), steps, seed=3)


def test_long_decode_uses_several_splits(vm) -> None:
    """Decode over more than DECODE_MIN_SPLIT * 2 keys (the full layer splits them; the sink is
    added once after the splits merge), also after a fork of the long prefix."""
    n = attention.DECODE_MIN_SPLIT * 2 + 30
    steps = [("add", 0), ("prefill", {0: n}), ("decode", [0]), ("decode", [0])]
    steps += [("fork", 0, 1), ("decode", [1, 0]), ("decode", [1])]
    _run(Session(vm), steps, seed=2)


def _yarn_reference(x: np.ndarray, pos: np.ndarray, theta: float, dim: int) -> np.ndarray:
    """transformers' YaRN rope (factor 32 over 4,096, beta 32 / 1, untruncated range, the
    attention factor left out: the model folds it into its scale) of x [n, heads, dim]."""
    import math

    def corr(rot: float) -> float:
        return dim * math.log(4096 / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(corr(32.0), 0), min(corr(1.0), dim - 1)
    freqs = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    extra = 1 - ramp
    inv = 1 / (32.0 * freqs) * (1 - extra) + 1 / freqs * extra
    ang = pos[:, None].astype(np.float64) * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    a, b = x[..., : dim // 2], x[..., dim // 2 :]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def test_yarn_rotary_leaves_the_sink_lane_alone() -> None:
    """gpt-oss's YaRN rope in the cache's split kernel (`split_rotary_cpu`, as
    `create_paged_kv_cache_cpu` picks it): transformers' rotation of the real lanes (each
    frequency shared by dims i and i + d/2) and lanes >= rotary_dim copied, sink included."""
    theta = 150000.0
    scaling = tvm_private.prepare_yarn_rope_scaling(
        {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        theta,
    )
    args = (theta, 1, D, H_Q, H_KV, "float32", scaling, D_REAL)
    func = attention.split_rotary_cpu(*args) or llama_rope_with_position_map(*args)
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    split = tvm.compile(mod, TARGET)["main"]
    n = 5
    rng = np.random.default_rng(7)
    qkv = _pad(rng.uniform(-2, 2, (n, len(WINDOWED), H, D_REAL)).astype(np.float32))[:, :H]
    pos = (np.arange(n) * 1000).astype(np.int32)
    q, k, v = (_t(np.full((n, h, D), np.nan, np.float32)) for h in (H_Q, H_KV, H_KV))
    split(_t(qkv), _t(pos), q, k, v, 1)
    np.testing.assert_array_equal(q.numpy()[..., D_REAL:], qkv[:, :H_Q, D_REAL:])
    np.testing.assert_array_equal(k.numpy()[..., D_REAL:], 0)
    assert (q.numpy()[:, :, D_REAL] == SINKS[0]).all()
    np.testing.assert_allclose(q.numpy()[..., :D_REAL],
                               _yarn_reference(qkv[:, :H_Q, :D_REAL], pos, theta, D_REAL),
                               rtol=0, atol=3e-4)  # float32 angles at positions up to 4,000


def test_options_off_give_the_same_kernels() -> None:
    """sinks=False builds exactly the kernels without the option."""
    kernels = (
        lambda **kw: attention.attention_prefill_ragged_cpu(2, 4, 32, 32, "float32", **kw),
        lambda **kw: attention.attention_prefill_paged_cpu(2, 4, 32, "float32", **kw),
        lambda **kw: attention.attention_decode_paged_cpu(2, 4, 32, "float32", **kw),
    )
    for make in kernels:
        assert make(sliding_window=4, sinks=False).script() == make(sliding_window=4).script()


def _cache_in_function(**overrides) -> None:
    args = dict(
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
        qk_head_dim=D,
        v_head_dim=D,
        mla_original_qk_head_dim=0,
        mla_original_v_head_dim=0,
        rope_mode=RopeMode.NORMAL,
        rope_scale=1,
        rope_theta=1e4,
        rope_scaling={},
        rope_ext_factors=relax.prim_value(0),
        rotary_dim=D_REAL,
        enable_disaggregation=False,
        dtype="float32",
        target=TARGET,
        attn_sinks=True,
    )
    args.update(overrides)
    bb = relax.BlockBuilder()
    with bb.function("f", []):
        attention.create_paged_kv_cache_cpu(**args)
        bb.emit_func_output(relax.const(0))


def test_sink_options_that_cannot_be_honoured_are_refused() -> None:
    with pytest.raises(ValueError, match="soft-cap"):
        attention.attention_decode_paged_cpu(1, 2, D, "float32", soft_cap=5.0, sinks=True)
    with pytest.raises(ValueError, match="soft-cap"):
        _cache_in_function(attn_soft_cap=30.0)
    with pytest.raises(ValueError, match="rotary_dim"):
        _cache_in_function(rotary_dim=D)  # the cache's rotary would move the sink
    with pytest.raises(ValueError, match="SINK_PAD"):
        _cache_in_function(v_head_dim=D_REAL)
    with pytest.raises(ValueError, match="llvm"):
        _cache_in_function(rope_mode=RopeMode.INLINE)
