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

import numpy as np
import pytest
import tvm
from paged_attention_session import (
    TARGET,
    TWO_SEQUENCES,
    Layer,
    Session,
    Spec,
    cache_in_function,
    forward_steps,
    pack,
    tensor,
)
from tvm.relax.frontend.nn.llm.kv_cache import RopeMode, llama_rope_with_position_map

from localchat.engine.kernels import attention, tvm_private
from localchat.engine.kernels.attention import SINK_PAD

H_Q, H_KV, D_REAL = 4, 2, 16
D = D_REAL + SINK_PAD
H = H_Q + 2 * H_KV
THETA = 1e4
WINDOW = 8
WINDOWED = (False, True)  # layer 0 sees every key, layer 1 the last WINDOW positions
# natural-log sink logits per (layer, query head); scores are about +-3, so 6 and 9 dominate
SINKS = np.array([[0.5, -2.0, 6.0, 1.0], [9.0, -1.0, 0.0, 3.0]])
# every layer on its own slice of qkv [b, s, layers * H, D], one cache (the cache's rotary);
# the reference is HF's eager gpt-oss attention
SPEC = Spec(
    H_Q,
    H_KV,
    D,
    tuple(Layer(THETA, D_REAL, w, tuple(sinks)) for w, sinks in zip(WINDOWED, SINKS)),
    D_REAL**-0.5,
    cache_rope=True,
    window=WINDOW,
)


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
    for step, lens, decode in forward_steps([session], steps):
        ours, ref = session.forward(_chunks(rng, lens), decode)
        _check(step, ours, ref)


def test_batch_of_two_prefill_then_decode() -> None:
    """Two sequences longer than the window, prefilled together, decoded in batches (the sink in
    the decode depth that holds the new key), then a chunk after cached pages (the sink in the
    ragged call only, not in the paged one)."""
    steps = [
        *TWO_SEQUENCES,
        ("decode", [0, 1]),
        ("prefill", {1: 5, 0: 11}),
        ("decode", [0, 1]),
    ]
    _run(Session(SPEC), steps, seed=1)


def test_prompt_in_two_chunks_equals_one_chunk() -> None:
    """The same prompt in one chunk (sequence 0) and in two (sequence 1): the same outputs."""
    session = Session(SPEC)
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


def test_forked_sequences_count_the_sink_once() -> None:
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
    _run(Session(SPEC), steps, seed=3)


def test_long_decode_uses_several_splits() -> None:
    """Decode over more than DECODE_MIN_SPLIT * 2 keys (the full layer splits them; the sink is
    added once after the splits merge), also after a fork of the long prefix."""
    n = attention.DECODE_MIN_SPLIT * 2 + 30
    steps = [("add", 0), ("prefill", {0: n}), ("decode", [0]), ("decode", [0])]
    steps += [("fork", 0, 1), ("decode", [1, 0]), ("decode", [1])]
    _run(Session(SPEC), steps, seed=2)


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
    qkv = pack(SPEC, rng.uniform(-2, 2, (n, len(WINDOWED), H, D_REAL)).astype(np.float32))[:, :H]
    pos = (np.arange(n) * 1000).astype(np.int32)
    q, k, v = (tensor(np.full((n, h, D), np.nan, np.float32)) for h in (H_Q, H_KV, H_KV))
    split(tensor(qkv), tensor(pos), q, k, v, 1)
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
    cache_in_function(
        **(dict(layers=1, head_dim=D, rotary_dim=D_REAL, attn_sinks=True) | overrides)
    )


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
