"""The kernel options of issue 22's shared decoder block, against numpy in float64.

RMSNorm over any leading axes and with Gemma's (1 + w); the GELU-tanh gate; the logit soft-cap;
rotary embedding the model applies itself (per-layer theta, partial width, no rope); and the
paged attention's soft-cap and per-layer sliding window, driven through TVM's KV cache with
batches of sequences of different lengths, chunked prefill, decode and forks. Also that every
private TVM name goes through `kernels.tvm_private`, which fails loudly on another TVM.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode
from tvm.runtime import ShapeTuple

from localchat.engine.kernels import attention, elementwise, tvm_private
from localchat.engine.kernels.common import SCHEDULED_ATTRS
from localchat.errors import CompileError

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
DEV = tvm.cpu()
APP = Path(__file__).resolve().parent.parent / "app"


def _build(func) -> tvm.runtime.Module:
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    return tvm.compile(mod, TARGET)["main"]


def _t(a: np.ndarray) -> tvm.runtime.Tensor:
    return tvm.runtime.tensor(np.ascontiguousarray(a), DEV)


def _nan_like(shape, dtype="float32") -> tvm.runtime.Tensor:
    return tvm.runtime.tensor(np.full(shape, np.nan, dtype), DEV)


# --------------------------------------------------------------------------------------------
# Elementwise
# --------------------------------------------------------------------------------------------


@functools.cache
def _rms(n: int, ndim: int, offset: float, dtype: str = "float32"):
    return _build(elementwise.rms_norm(n, 1e-6, dtype, ndim=ndim, weight_offset=offset))


def _rms_ref(x: np.ndarray, w: np.ndarray, offset: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * (w.astype(np.float64) + offset)


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["plain", "gemma-offset"])
@pytest.mark.parametrize("n", [37, 100])  # odd head_dim; six vectors and a tail of 4
@pytest.mark.parametrize("lead", [(1, 1, 2), (2, 3, 5)], ids=["serial", "parallel"])
def test_rms_norm_per_head_4d(offset: float, n: int, lead: tuple[int, ...]) -> None:
    """[batch, seq, heads, head_dim] normalized over head_dim, one norm per head (Qwen3's
    q_norm/k_norm; Gemma 3's with (1 + w))."""
    rng = np.random.default_rng(n + len(lead))
    x = (rng.standard_normal((*lead, n)) * 3).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    y = _nan_like(x.shape)
    _rms(n, 4, offset)(_t(x), _t(w), y)
    np.testing.assert_allclose(y.numpy(), _rms_ref(x, w, offset), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ndim,lead", [(3, (1, 7)), (2, (3,))])
def test_rms_norm_whole_projection_with_offset(ndim: int, lead: tuple[int, ...]) -> None:
    """A norm over a whole projection (OLMo 2's q/k norm over heads x head_dim) with (1 + w),
    as [batch, seq, n] and as [rows, n]."""
    n = 3 * 37
    rng = np.random.default_rng(ndim)
    x = (rng.standard_normal((*lead, n)) * 2).astype(np.float32)
    w = (rng.standard_normal(n) * 0.1).astype(np.float32)
    y = _nan_like(x.shape)
    _rms(n, ndim, 1.0)(_t(x), _t(w), y)
    np.testing.assert_allclose(y.numpy(), _rms_ref(x, w, 1.0), rtol=1e-5, atol=1e-5)


def test_rms_norm_float16_per_head() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 3, 4, 64)).astype(np.float16)
    w = rng.standard_normal(64).astype(np.float16)
    y = tvm.runtime.tensor(np.zeros(x.shape, np.float16), DEV)
    _rms(64, 4, 1.0, "float16")(_t(x), _t(w), y)
    np.testing.assert_allclose(
        y.numpy().astype(np.float64), _rms_ref(x, w, 1.0), rtol=2e-3, atol=2e-3
    )


def test_default_options_give_the_llama_kernels() -> None:
    """Options at their defaults are the kernels that were there before them (same objects)."""
    assert elementwise.gated_mul(64, "float32") is elementwise.silu_mul(64, "float32")
    assert elementwise.gated_mul(64, "float32", "silu") is elementwise.silu_mul(64, "float32")
    default = elementwise.rms_norm(64, 1e-5, "float32")
    assert elementwise.rms_norm(64, 1e-5, "float32", ndim=3, weight_offset=0.0).script() == (
        default.script()
    )


def _gelu_tanh(g: np.ndarray) -> np.ndarray:
    return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))


@pytest.mark.parametrize("name", ["gelu_tanh", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("b,s", [(1, 1), (3, 5)])
def test_gelu_tanh_gate_matches_numpy(name: str, b: int, s: int) -> None:
    n = 100
    rng = np.random.default_rng(b * s)
    # wide range: the exponential saturates at both ends
    x = (rng.standard_normal((b, s, 2 * n)) * 8).astype(np.float32)
    y = _nan_like((b, s, n))
    _build(elementwise.gated_mul(n, "float32", name))(_t(x), y)
    g = x[..., :n].astype(np.float64)
    ref = _gelu_tanh(g) * x[..., n:]
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_unknown_gate_activation_is_refused() -> None:
    with pytest.raises(ValueError, match="relu"):
        elementwise.gated_mul(64, "float32", "relu")


@pytest.mark.parametrize(
    "shape,ndim",
    [((2, 5000), 2), ((1, 1, 37), 3), ((1, 4099), 2)],  # chunks and a tail; tiny; one row
    ids=["rows", "tiny", "one-row"],
)
def test_soft_cap_matches_numpy(shape: tuple[int, ...], ndim: int) -> None:
    cap = 30.0
    rng = np.random.default_rng(len(shape))
    x = (rng.standard_normal(shape) * 60).astype(np.float32)
    x.flat[:3] = [1e6, -1e6, 0.0]  # saturated both ways, and 0
    y = _nan_like(shape)
    _build(elementwise.soft_cap(shape[-1], cap, "float32", ndim))(_t(x), y)
    ref = cap * np.tanh(x.astype(np.float64) / cap)
    np.testing.assert_allclose(y.numpy(), ref, rtol=0, atol=1e-6 * cap)
    assert np.abs(y.numpy()).max() <= cap


# --------------------------------------------------------------------------------------------
# Rotary embedding
# --------------------------------------------------------------------------------------------


def _rope(x: np.ndarray, pos: np.ndarray, theta: float, rotary_dim: int) -> np.ndarray:
    """HF's rotary embedding (rotate half) of x [n, h, d] at positions pos [n] on the first
    rotary_dim features (Phi-3's partial_rotary_factor), the rest passed through."""
    # the angles in float32 as TVM's frequency function (and HF) compute them: at a position of
    # thousands their rounding, not the kernel, would decide the comparison
    f32 = np.float32
    denom = np.power(f32(theta), np.arange(0, rotary_dim, 2, dtype=f32) / f32(rotary_dim))
    ang = (pos[:, None].astype(f32) / denom[None, :]).astype(np.float64)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


@pytest.mark.parametrize("theta,rotary_dim", [(1e4, 32), (1e6, 24)], ids=["full", "partial"])
@pytest.mark.parametrize("b,s", [(1, 1), (2, 9)])
def test_rotary_qkv_matches_numpy(theta: float, rotary_dim: int, b: int, s: int) -> None:
    h_q, h_kv, d = 4, 2, 32
    func = _build(attention.rotary_qkv_cpu(theta, 1.0, d, h_q, h_kv, "float32", None, rotary_dim))
    rng = np.random.default_rng(b * s)
    qkv = rng.standard_normal((b, s, h_q + 2 * h_kv, d)).astype(np.float32)
    pos = rng.integers(0, 5000, b * s).astype(np.int32)
    out = _nan_like(qkv.shape)
    func(_t(qkv), _t(pos), out)
    flat = qkv.reshape(b * s, -1, d).astype(np.float64)
    ref = flat.copy()
    ref[:, : h_q + h_kv] = _rope(flat[:, : h_q + h_kv], pos, theta, rotary_dim)
    np.testing.assert_allclose(out.numpy().reshape(b * s, -1, d), ref, rtol=0, atol=2e-5)


def test_split_rotary_partial_width_matches_numpy() -> None:
    """The cache's own rotary (RopeMode.NORMAL) with rotary_dim < head_dim (Phi-4-mini)."""
    h_q, h_kv, d, rd = 4, 2, 32, 24
    func = _build(attention.split_rotary_cpu(1e4, 1.0, d, h_q, h_kv, "float32", {}, rd))
    rng = np.random.default_rng(3)
    n = 7
    qkv = rng.standard_normal((n, h_q + 2 * h_kv, d)).astype(np.float32)
    pos = rng.integers(0, 3000, n).astype(np.int32)
    q, k, v = (_nan_like((n, h, d)) for h in (h_q, h_kv, h_kv))
    func(_t(qkv), _t(pos), q, k, v, 1)
    x = qkv.astype(np.float64)
    np.testing.assert_allclose(q.numpy(), _rope(x[:, :h_q], pos, 1e4, rd), rtol=0, atol=2e-5)
    np.testing.assert_allclose(k.numpy(), _rope(x[:, h_q : h_q + h_kv], pos, 1e4, rd), atol=2e-5)
    np.testing.assert_array_equal(v.numpy(), qkv[:, h_q + h_kv :])


def test_rotary_qkv_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="longrope"):
        attention.rotary_qkv_cpu(1e4, 1.0, 32, 4, 2, "float32", {"rope_type": "longrope"})
    with pytest.raises(ValueError, match="rotary_dim"):
        attention.rotary_qkv_cpu(1e4, 1.0, 32, 4, 2, "float32", None, 33)


# --------------------------------------------------------------------------------------------
# Paged attention: soft-cap, sliding window, scale, per-layer rope
# --------------------------------------------------------------------------------------------

H_Q, H_KV, D = 4, 2, 32
WINDOW = 8  # shorter than every test sequence
SM_SCALE = 24**-0.5  # not head_dim^-0.5: Gemma's query_pre_attn_scalar


@dataclass(frozen=True)
class Layer:
    """One layer of the test model: its rope (theta, or None for none) and window."""

    theta: float | None
    rotary_dim: int = D
    windowed: bool = False


LAYERS = (
    Layer(1e4),  # Llama
    Layer(1e6, windowed=True),  # Gemma 3: local and global layers differ in theta and window
    Layer(None, windowed=True),  # SmolLM3: a layer without rope
    Layer(1e4, rotary_dim=24),  # Phi-4-mini: partial rotary
)
PAGE_SIZE = 16

_kv_add = tvm.get_global_func("vm.builtin.kv_state_add_sequence")
_kv_fork = tvm.get_global_func("vm.builtin.kv_state_fork_sequence")
_kv_begin = tvm.get_global_func("vm.builtin.kv_state_begin_forward")
_kv_end = tvm.get_global_func("vm.builtin.kv_state_end_forward")


@functools.cache
def _attention_vm(soft_cap: float) -> relax.VirtualMachine:
    """All LAYERS on the same qkv in one cache (RopeMode.NONE: the model applies rope itself),
    their outputs side by side: [b, s, len(LAYERS) * H_Q, D]."""

    class Model(nn.Module):
        def attn(self, qkv: nn.Tensor, cache: PagedKVCache) -> nn.Tensor:
            b, s = qkv.shape[0], qkv.shape[1]
            positions = cache.get_query_positions(b * s)
            outs = []
            for i, layer in enumerate(LAYERS):
                x = qkv
                if layer.theta is not None:
                    rope = attention.rotary_qkv_cpu(
                        layer.theta, 1.0, D, H_Q, H_KV, "float32", None, layer.rotary_dim
                    )
                    x = op.tensor_ir_op(
                        rope,
                        "rotary_qkv",
                        args=[qkv, positions],
                        out=nn.Tensor.placeholder(qkv.shape, qkv.dtype),
                    )
                scale = attention.windowed_sm_scale(SM_SCALE) if layer.windowed else SM_SCALE
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
                layer_partition=relax.ShapeExpr([0, len(LAYERS)]),
                num_hidden_layers=len(LAYERS),
                num_attention_heads=H_Q,
                num_key_value_heads=H_KV,
                qk_head_dim=D,
                v_head_dim=D,
                mla_original_qk_head_dim=0,
                mla_original_v_head_dim=0,
                rope_mode=RopeMode.NONE,
                rope_scale=1,
                rope_theta=1e4,
                rope_scaling={},
                rope_ext_factors=relax.prim_value(0),
                rotary_dim=D,
                enable_disaggregation=False,
                dtype="float32",
                target=TARGET,
                attn_soft_cap=soft_cap,
                sliding_window=WINDOW,
            )

    none = {"$": {"param_mode": "none", "effect_mode": "none"}}
    spec = {
        "attn": {
            "qkv": nn.spec.Tensor(["b", "s", H_Q + 2 * H_KV, D], "float32"),
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
    qkv: list[np.ndarray] = field(default_factory=list)  # [H, D] per token, as given


class Session:
    """One cache and a float64 reference of every layer on what each sequence holds."""

    def __init__(self, soft_cap: float) -> None:
        self.vm = _attention_vm(soft_cap)
        self.soft_cap = soft_cap
        self.cache = self.vm["create_paged_kv_cache"](
            ShapeTuple([4]),
            ShapeTuple([2048]),
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
        """Append chunks[seq] (qkv [n, H, D]) to each sequence: (ours, reference) per layer,
        each [tokens, H_Q, D]."""
        ids = list(chunks)
        lens = [len(chunks[i]) for i in ids]
        if decode:
            qkv = np.stack([chunks[i] for i in ids])  # [b, 1, H, D]
        else:
            qkv = np.concatenate([chunks[i] for i in ids])[None]  # [1, n, H, D]
        _kv_begin(self.cache, ShapeTuple(ids), ShapeTuple(lens))
        out = self.vm["attn"](_t(qkv), self.cache).numpy().astype(np.float64)
        _kv_end(self.cache)
        out = out.reshape(sum(lens), len(LAYERS), H_Q, D)
        ref = np.concatenate([self._reference(i, chunks[i]) for i in ids])
        return out, ref

    def _reference(self, seq_id: int, chunk: np.ndarray) -> np.ndarray:
        s = self.seqs[seq_id]
        past = len(s.qkv)
        s.qkv.extend(chunk.astype(np.float64))
        every = np.stack(s.qkv)  # [L, H, D]
        pos = np.arange(len(every))
        q_pos = pos[past:]
        group = H_Q // H_KV
        out = np.empty((len(chunk), len(LAYERS), H_Q, D))
        for li, layer in enumerate(LAYERS):
            x = every
            if layer.theta is not None:
                x = _rope(every, pos, layer.theta, layer.rotary_dim)
            q = x[past:, :H_Q]
            k, v = x[:, H_Q : H_Q + H_KV], every[:, H_Q + H_KV :]
            visible = pos[None, :] <= q_pos[:, None]
            if layer.windowed:
                visible &= q_pos[:, None] - pos[None, :] < WINDOW
            for h in range(H_Q):
                sc = q[:, h] @ k[:, h // group].T * SM_SCALE
                if self.soft_cap:
                    sc = self.soft_cap * np.tanh(sc / self.soft_cap)
                sc = np.where(visible, sc, -np.inf)
                p = np.exp(sc - sc.max(axis=1, keepdims=True))
                out[:, li, h] = (p / p.sum(axis=1, keepdims=True)) @ v[:, h // group]
        return out


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
        # large values: scores well past the soft-cap, and far-apart softmax weights
        chunks = {
            i: rng.uniform(-3, 3, (n, H_Q + 2 * H_KV, D)).astype(np.float32)
            for i, n in lens.items()
        }
        ours, ref = session.forward(chunks, decode)
        for li in range(len(LAYERS)):
            err = np.abs(ours[:, li] - ref[:, li]).max() / np.abs(ref[:, li]).max()
            assert err < 2e-5, f"{step}: layer {li} ({LAYERS[li]}) relative error {err:.3g}"


SOFT_CAPS = [0.0, 2.0]  # 2: most scores are well past it


@pytest.mark.parametrize("soft_cap", SOFT_CAPS, ids=["no-cap", "cap"])
def test_batch_of_two_lengths_prefill_and_decode(soft_cap: float) -> None:
    """Two sequences longer than the window: one prefill each (the window inside the chunk),
    batched decodes, then a chunk after cached pages (the window across the paged and ragged
    parts)."""
    steps = [
        ("add", 0),
        ("add", 1),
        ("prefill", {0: 13, 1: 21}),
        ("decode", [0, 1]),
        ("decode", [1, 0]),
        ("prefill", {1: 5, 0: 11}),
        ("decode", [0, 1]),
    ]
    _run(Session(soft_cap), steps, seed=1)


@pytest.mark.parametrize("soft_cap", SOFT_CAPS, ids=["no-cap", "cap"])
def test_long_sequence_skips_keys_outside_the_window(soft_cap: float) -> None:
    """Chunks longer than a key block (64) and decode past several splits: windowed layers skip
    whole blocks and splits, the others read every key."""
    steps = [("add", 0), ("prefill", {0: 150}), ("prefill", {0: 70})] + [("decode", [0])] * 3
    _run(Session(soft_cap), steps, seed=2)


def test_window_over_forked_sequences() -> None:
    """Forks share pages (the cache then attends over two depths of blocks): a window counts
    positions, so it holds across the shared prefix and each fork's own tokens."""
    steps = [
        ("add", 0),
        ("prefill", {0: 20}),
        ("fork", 0, 1),
        ("prefill", {0: 3, 1: 12}),
        ("decode", [0, 1]),
        ("fork", 1, 2),
        ("decode", [2, 0, 1]),
        ("prefill", {2: 9}),
    ]
    _run(Session(2.0), steps, seed=3)


def _cache_in_function(**overrides):
    args = dict(
        attn_kind="mha",
        max_batch_size=1,
        max_total_seq_len=64,
        prefill_chunk_size=16,
        page_size=16,
        support_sliding_window=0,
        layer_partition=relax.ShapeExpr([0, 2]),
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        qk_head_dim=16,
        v_head_dim=16,
        mla_original_qk_head_dim=0,
        mla_original_v_head_dim=0,
        rope_mode=RopeMode.NORMAL,
        rope_scale=1,
        rope_theta=1e4,
        rope_scaling={},
        rope_ext_factors=relax.prim_value(0),
        rotary_dim=16,
        enable_disaggregation=False,
        dtype="float32",
        target=TARGET,
    )
    args.update(overrides)
    bb = relax.BlockBuilder()
    with bb.function("f", []):
        attention.create_paged_kv_cache_cpu(**args)
        bb.emit_func_output(relax.const(0))


def test_cache_options_that_cannot_be_honoured_are_refused() -> None:
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with pytest.raises(ValueError, match="llvm"):
        _cache_in_function(target=cuda, attn_soft_cap=50.0)
    with pytest.raises(ValueError, match="llvm"):
        _cache_in_function(rope_mode=RopeMode.INLINE, sliding_window=8)
    with pytest.raises(ValueError, match="mha_sliding"):
        _cache_in_function(attn_kind=["mha_sliding", "mha"], sliding_window=8)
    with pytest.raises(ValueError, match="soft-cap"):
        _cache_in_function(attn_soft_cap=-1.0)
    with pytest.raises(ValueError, match="positive"):
        attention.windowed_sm_scale(0.0)


NEW_KERNELS = {
    "rms_norm_4d": lambda: elementwise.rms_norm(37, 1e-6, "float32", ndim=4, weight_offset=1.0),
    "gelu_tanh": lambda: elementwise.gated_mul(64, "float32", "gelu_tanh"),
    "soft_cap": lambda: elementwise.soft_cap(64, 30.0),
    "rotary_qkv": lambda: attention.rotary_qkv_cpu(1e4, 1.0, 16, 2, 1, "float32"),
    "prefill_ragged": lambda: attention.attention_prefill_ragged_cpu(
        1, 2, 16, 16, "float32", soft_cap=5.0, sliding_window=4
    ),
    "prefill_paged": lambda: attention.attention_prefill_paged_cpu(
        1, 2, 16, "float32", soft_cap=5.0, sliding_window=4
    ),
    "decode_paged": lambda: attention.attention_decode_paged_cpu(
        1, 2, 16, "float32", soft_cap=5.0, sliding_window=4
    ),
}


@pytest.mark.parametrize("name", sorted(NEW_KERNELS))
def test_new_kernels_are_marked_scheduled(name: str) -> None:
    """As every hand-scheduled kernel (tests/test_kernel_attrs.py checks the attributes work)."""
    attrs = NEW_KERNELS[name]().attrs
    for key, value in SCHEDULED_ATTRS.items():
        assert key in attrs and bool(attrs[key]) == value


# --------------------------------------------------------------------------------------------
# TVM's private names
# --------------------------------------------------------------------------------------------


def test_private_tvm_names_resolve_on_this_tvm() -> None:
    found = tvm_private.load_private()
    assert set(found) == {name for _, name in tvm_private.PRIVATE_SYMBOLS}
    assert all(callable(f) for f in found.values())


def test_another_tvm_version_fails_loudly_naming_symbols_and_versions() -> None:
    with pytest.raises(CompileError) as err:
        tvm_private.load_private(version="0.28.0")
    message = str(err.value)
    assert "0.28.0" in message and "0.27" in message
    assert "tvm.relax.frontend.nn.llm.kv_cache._kv_cache_transpose_append" in message


def test_a_missing_private_name_fails_loudly() -> None:
    symbols = (("tvm.relax.frontend.nn.llm.kv_cache", "_no_such_kernel"),)
    with pytest.raises(CompileError, match="_no_such_kernel") as err:
        tvm_private.load_private(symbols, version="0.27.0.post1")
    assert "0.27" in str(err.value)


def test_expr_helpers_reach_tvms_private_attribute() -> None:
    x = nn.Tensor.placeholder((2, 3), "float32")
    assert isinstance(tvm_private.expr_of(x), relax.Var)
    expr = relax.Var("cache", relax.AnyType())
    cache = tvm_private.wrap_expr(PagedKVCache, expr, "cache")
    assert isinstance(cache, PagedKVCache) and tvm_private.expr_of(cache).same_as(expr)
    with pytest.raises(CompileError, match="_expr"):
        tvm_private.expr_of(object())


def _private_tvm_uses(path: Path) -> list[str]:
    """`from tvm... import _x`, `import tvm..._x` and `<tvm module>._x` in one source file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules: set[str] = set()  # local names bound to tvm modules
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tvm":
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        found.append(alias.name)
                    modules.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tvm":
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(node.module)
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{node.module}.{alias.name}")
                modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_private_tvm_names_are_used_only_through_tvm_private() -> None:
    uses = {
        str(path.relative_to(APP)): found
        for path in sorted(APP.rglob("*.py"))
        if path.name != "tvm_private.py" and (found := _private_tvm_uses(path))
    }
    assert uses == {}
