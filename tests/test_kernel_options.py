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
from pathlib import Path

import numpy as np
import pytest
import tvm
from paged_attention_session import (
    TWO_SEQUENCES,
    Layer,
    Session,
    Spec,
    assert_rotated,
    forward_steps,
)
from paged_attention_session import cache_in_function as _cache_in_function
from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode

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
    got = out.numpy().reshape(b * s, -1, d)
    assert_rotated(got[:, : h_q + h_kv], flat[:, : h_q + h_kv], pos, theta, rotary_dim)
    np.testing.assert_array_equal(got[:, h_q + h_kv :], qkv.reshape(b * s, -1, d)[:, h_q + h_kv :])


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
    assert_rotated(q.numpy(), x[:, :h_q], pos, 1e4, rd)
    assert_rotated(k.numpy(), x[:, h_q : h_q + h_kv], pos, 1e4, rd)
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

LAYERS = (
    Layer(1e4, D),  # Llama
    Layer(1e6, D, windowed=True),  # Gemma 3: local and global layers differ in theta and window
    Layer(None, D, windowed=True),  # SmolLM3: a layer without rope
    Layer(1e4, 24),  # Phi-4-mini: partial rotary
)


def _session(soft_cap: float) -> Session:
    """All LAYERS on the same qkv in one cache (RopeMode.NONE: the model applies rope itself)."""
    spec = Spec(
        H_Q, H_KV, D, LAYERS, SM_SCALE, shared_qkv=True, soft_cap=soft_cap, window=WINDOW
    )
    return Session(spec, max_total_seq_len=2048)


def _run(session: Session, steps, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for step, lens, decode in forward_steps([session], steps):
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
    steps = [*TWO_SEQUENCES, ("prefill", {1: 5, 0: 11}), ("decode", [0, 1])]
    _run(_session(soft_cap), steps, seed=1)


@pytest.mark.parametrize("soft_cap", SOFT_CAPS, ids=["no-cap", "cap"])
def test_long_sequence_skips_keys_outside_the_window(soft_cap: float) -> None:
    """Chunks longer than a key block (64) and decode past several splits: windowed layers skip
    whole blocks and splits, the others read every key."""
    steps = [("add", 0), ("prefill", {0: 150}), ("prefill", {0: 70})] + [("decode", [0])] * 3
    _run(_session(soft_cap), steps, seed=2)


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
    _run(_session(2.0), steps, seed=3)


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


def test_macros_expand_through_the_frame_walk_lookup() -> None:
    """Importing the kernels replaces TVM's macro lookup (getouterframes, ~0.1 s a call under
    pytest); nested macros, expanded many frames deep, still find their parser and parse."""
    from tvm.script import tirx as T
    from tvm.script.parser.core.parser import ScriptMacro

    assert ScriptMacro._find_parser_def is tvm_private._find_parser_by_frames

    @T.macro
    def inner(y, i):
        y[i] = y[i] + T.float32(1)

    @T.macro
    def outer(y, i):
        inner(y, i)
        inner(y, i)

    def build(depth: int):
        if depth:
            return build(depth - 1)

        @T.prim_func(private=True)
        def func(y: T.Buffer((4,), "float32")):
            for i in range(4):
                outer(y, i)

        return func

    func = build(60)
    target = tvm.target.Target("llvm")
    y = tvm.runtime.tensor(np.zeros(4, "float32"))
    tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)["main"](y)
    np.testing.assert_array_equal(y.numpy(), np.full(4, 2, "float32"))


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
