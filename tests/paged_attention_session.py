"""A paged-attention test harness: a module of attention layers on one TVM KV cache (built by
`create_paged_kv_cache_cpu` or another factory), driven through the cache runtime with batches,
chunked prefill, decode and forks, next to a float64 numpy reference of every layer (rotary
embedding, soft-cap, sliding window per layer, attention sinks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode
from tvm.runtime import ShapeTuple

from localchat.engine.kernels import attention

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
DEV = tvm.cpu()
PAGE_SIZE = 16

# (x [n, heads, d], positions [n], theta, rotary_dim) -> x rotated
Rope = Callable[[np.ndarray, np.ndarray, float, int], np.ndarray]
# ("add", seq) | ("fork", parent, child) | ("prefill", {seq: tokens}) | ("decode", [seqs])
Step = tuple[Any, ...]
# two sequences of different lengths prefilled in one batch, then decoded in batches
TWO_SEQUENCES: tuple[Step, ...] = (
    ("add", 0),
    ("add", 1),
    ("prefill", {0: 13, 1: 21}),
    ("decode", [0, 1]),
    ("decode", [1, 0]),
)

_kv_add = tvm.get_global_func("vm.builtin.kv_state_add_sequence")
_kv_fork = tvm.get_global_func("vm.builtin.kv_state_fork_sequence")
_kv_begin = tvm.get_global_func("vm.builtin.kv_state_begin_forward")
_kv_end = tvm.get_global_func("vm.builtin.kv_state_end_forward")


def tensor(a: np.ndarray) -> tvm.runtime.Tensor:
    """a as a TVM tensor on the CPU."""
    return tvm.runtime.tensor(np.ascontiguousarray(a), DEV)


def _angles(pos: np.ndarray, theta: float, rotary_dim: int) -> np.ndarray:
    """The rotary angles [n, rotary_dim / 2] in float32 as TVM's frequency function (and HF)
    compute them: at a position of thousands their rounding, not the kernel, would decide a
    comparison."""
    f32 = np.float32
    denom = np.power(f32(theta), np.arange(0, rotary_dim, 2, dtype=f32) / f32(rotary_dim))
    return (pos[:, None].astype(f32) / denom[None, :]).astype(f32)


def rope(x: np.ndarray, pos: np.ndarray, theta: float, rotary_dim: int) -> np.ndarray:
    """HF's rotary embedding (rotate half) of x [n, h, d] at positions pos [n] on the first
    rotary_dim features (Phi-3's partial_rotary_factor), the rest passed through."""
    ang = _angles(pos, theta, rotary_dim).astype(np.float64)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def rope_tolerance(x: np.ndarray, pos: np.ndarray, theta: float, rotary_dim: int,
                   atol: float = 2e-5) -> np.ndarray:
    """Per element of `rope(x, ...)`, how far a correct float32 kernel may be from it: `atol`
    plus two ulps of the float32 angle times the two inputs it mixes. Past a few thousand
    positions an angle's last bit (a power or a division rounded the other way: libm and
    LLVM's vector code differ by CPU) moves the result by more than any fixed tolerance."""
    ulp = np.spacing(_angles(pos, theta, rotary_dim)).astype(np.float64)
    half = rotary_dim // 2
    mixed = np.abs(x[..., :half]) + np.abs(x[..., half:rotary_dim])
    slack = 2 * ulp[:, None, :] * mixed
    tol = np.full(x.shape, atol)
    tol[..., :half] += slack
    tol[..., half:rotary_dim] += slack
    return tol


def assert_rotated(actual: np.ndarray, x: np.ndarray, pos: np.ndarray, theta: float,
                   rotary_dim: int) -> None:
    """`actual` is `rope(x, pos, theta, rotary_dim)` within `rope_tolerance`."""
    ref = rope(x, pos, theta, rotary_dim)
    bad = np.abs(actual - ref) > rope_tolerance(x, pos, theta, rotary_dim)
    assert not bad.any(), (
        f"{bad.sum()} of {bad.size} values off: first at {np.argwhere(bad)[0].tolist()}, "
        f"{actual[bad][0]} vs {ref[bad][0]}")


def cache_args(
    layers: int = 2, h_q: int = 2, h_kv: int = 1, head_dim: int = 16, **overrides: Any
) -> dict[str, Any]:
    """`create_paged_kv_cache_cpu`'s keyword arguments for a small float32 cache with its own
    rotary embedding; overrides win."""
    args: dict[str, Any] = dict(
        attn_kind="mha",
        max_batch_size=1,
        max_total_seq_len=64,
        prefill_chunk_size=16,
        page_size=16,
        support_sliding_window=0,
        layer_partition=relax.ShapeExpr([0, layers]),
        num_hidden_layers=layers,
        num_attention_heads=h_q,
        num_key_value_heads=h_kv,
        qk_head_dim=head_dim,
        v_head_dim=head_dim,
        mla_original_qk_head_dim=0,
        mla_original_v_head_dim=0,
        rope_mode=RopeMode.NORMAL,
        rope_scale=1,
        rope_theta=1e4,
        rope_scaling={},
        rope_ext_factors=relax.prim_value(0),
        rotary_dim=head_dim,
        enable_disaggregation=False,
        dtype="float32",
        target=TARGET,
    )
    return args | overrides


def cache_in_function(**overrides: Any) -> None:
    """Build `create_paged_kv_cache_cpu(**cache_args(**overrides))` inside a Relax function."""
    bb = relax.BlockBuilder()
    with bb.function("f", []):
        attention.create_paged_kv_cache_cpu(**cache_args(**overrides))
        bb.emit_func_output(relax.const(0))


@dataclass(frozen=True)
class Layer:
    """One attention layer: its rope (theta, or None for none), window and sinks."""

    theta: float | None
    rotary_dim: int
    windowed: bool = False
    sinks: tuple[float, ...] | None = None  # a natural-log sink logit per query head


@dataclass(frozen=True)
class Spec:
    """A module of attention layers on one cache, and the cache's options."""

    h_q: int
    h_kv: int
    head_dim: int  # the cache's: the real lanes, plus SINK_PAD with sinks
    layers: tuple[Layer, ...]
    sm_scale: float
    # the cache rotates q and k (RopeMode.NORMAL, one rope for every layer); else the module
    # rotates each layer's own (RopeMode.NONE)
    cache_rope: bool = False
    shared_qkv: bool = False  # every layer on the same qkv, else each on its own slice
    soft_cap: float = 0.0
    window: int = 0
    dtype: str = "float32"
    factory: Callable[..., PagedKVCache] = attention.create_paged_kv_cache_cpu

    @property
    def sinks(self) -> bool:
        """Whether the layers have attention sinks."""
        return any(layer.sinks is not None for layer in self.layers)

    @property
    def width(self) -> int:
        """Heads of one layer's qkv."""
        return self.h_q + 2 * self.h_kv


def pack(spec: Spec, chunk: np.ndarray) -> np.ndarray:
    """The module's qkv for a chunk: [n, H, d] as it is with shared_qkv, else [n, layers, H, d]
    -> [n, layers * H, head_dim] with each query head's sink in lane d, the other pad lanes 0."""
    if spec.shared_qkv:
        return chunk
    n, layers = len(chunk), len(spec.layers)
    out = np.zeros((n, layers, spec.width, spec.head_dim), chunk.dtype)
    out[..., : chunk.shape[-1]] = chunk
    if spec.sinks:
        out[:, :, : spec.h_q, chunk.shape[-1]] = [layer.sinks for layer in spec.layers]
    return out.reshape(n, layers * spec.width, spec.head_dim)


@functools.cache
def attention_vm(spec: Spec) -> relax.VirtualMachine:
    """Every layer of spec in one cache, their outputs side by side:
    [b, s, layers * h_q, head_dim]."""
    n_layers = len(spec.layers)
    first = spec.layers[0]
    if spec.cache_rope:
        rope_args = dict(rope_mode=RopeMode.NORMAL, rope_theta=first.theta)
        rope_args["rotary_dim"] = first.rotary_dim
    else:
        rope_args = dict(rope_mode=RopeMode.NONE, rope_theta=1e4, rotary_dim=spec.head_dim)
    options = {"attn_soft_cap": spec.soft_cap, "sliding_window": spec.window}
    options["attn_sinks"] = spec.sinks
    # only those set: another factory (TVM's own cache) takes none of them
    options = {name: value for name, value in options.items() if value}

    class Model(nn.Module):
        def attn(self, qkv: nn.Tensor, cache: PagedKVCache) -> nn.Tensor:
            b, s = qkv.shape[0], qkv.shape[1]
            xs = [qkv] * n_layers if spec.shared_qkv else op.split(qkv, n_layers, axis=2)
            positions = None if spec.cache_rope else cache.get_query_positions(b * s)
            outs = []
            for i, (x, layer) in enumerate(zip(xs, spec.layers)):
                if positions is not None and layer.theta is not None:
                    rotary = attention.rotary_qkv_cpu(
                        layer.theta,
                        1.0,
                        spec.head_dim,
                        spec.h_q,
                        spec.h_kv,
                        spec.dtype,
                        None,
                        layer.rotary_dim,
                    )
                    x = op.tensor_ir_op(
                        rotary,
                        "rotary_qkv",
                        args=[x, positions],
                        out=nn.Tensor.placeholder(x.shape, x.dtype),
                    )
                scale = spec.sm_scale
                if layer.windowed:
                    scale = attention.windowed_sm_scale(scale)
                outs.append(cache.attention_with_fused_qkv(i, x, spec.h_q, sm_scale=scale))
            return outs[0] if n_layers == 1 else op.concat(outs, dim=2)

        def create_paged_kv_cache(
            self, max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, sliding
        ) -> PagedKVCache:
            return spec.factory(
                **cache_args(
                    n_layers,
                    spec.h_q,
                    spec.h_kv,
                    spec.head_dim,
                    max_batch_size=max_batch_size,
                    max_total_seq_len=max_total_seq_len,
                    prefill_chunk_size=prefill_chunk_size,
                    page_size=page_size,
                    support_sliding_window=sliding,
                    dtype=spec.dtype,
                    **rope_args,
                    **options,
                )
            )

    heads = spec.width if spec.shared_qkv else n_layers * spec.width
    none = {"$": {"param_mode": "none", "effect_mode": "none"}}
    module_spec = {
        "attn": {
            "qkv": nn.spec.Tensor(["b", "s", heads, spec.head_dim], spec.dtype),
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
    mod, _ = Model().export_tvm(spec=module_spec)
    return relax.VirtualMachine(tvm.compile(mod, target=TARGET), DEV)


class Session:
    """One cache on spec's module, and a float64 reference of every layer on what each sequence
    holds."""

    def __init__(self, spec: Spec, max_total_seq_len: int = 1024, rotary: Rope = rope) -> None:
        self.spec, self.rotary = spec, rotary
        self.vm = attention_vm(spec)
        self.cache = self.vm["create_paged_kv_cache"](
            ShapeTuple([4]),
            ShapeTuple([max_total_seq_len]),
            ShapeTuple([256]),
            ShapeTuple([PAGE_SIZE]),
            ShapeTuple([0]),
        )
        self.seqs: dict[int, list[np.ndarray]] = {}  # each token's qkv, as given

    def add(self, seq_id: int) -> None:
        """Start an empty sequence."""
        _kv_add(self.cache, seq_id)
        self.seqs[seq_id] = []

    def fork(self, parent: int, child: int) -> None:
        """Start child as a copy of parent (sharing its pages in the cache)."""
        _kv_fork(self.cache, parent, child, -1)
        self.seqs[child] = list(self.seqs[parent])

    def forward(
        self, chunks: dict[int, np.ndarray], decode: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """Append chunks[seq] (qkv as `pack` takes it, cast to the spec's dtype) to each
        sequence: (ours, reference), each [tokens, layers, h_q, head_dim]."""
        spec = self.spec
        chunks = {i: c.astype(spec.dtype) for i, c in chunks.items()}
        ids = list(chunks)
        lens = [len(chunks[i]) for i in ids]
        packed = [pack(spec, chunks[i]) for i in ids]
        if decode:
            assert all(n == 1 for n in lens)
            qkv = np.stack(packed)  # [b, 1, H, head_dim]
        else:
            qkv = np.concatenate(packed)[None]  # [1, n, H, head_dim]
        _kv_begin(self.cache, ShapeTuple(ids), ShapeTuple(lens))
        out = self.vm["attn"](tensor(qkv), self.cache).numpy().astype(np.float64)
        _kv_end(self.cache)
        out = out.reshape(sum(lens), len(spec.layers), spec.h_q, spec.head_dim)
        ref = np.concatenate([self._reference(i, chunks[i]) for i in ids])
        return out, ref

    def _reference(self, seq_id: int, chunk: np.ndarray) -> np.ndarray:
        spec = self.spec
        h_q, h_kv = spec.h_q, spec.h_kv
        group = h_q // h_kv
        tokens = self.seqs[seq_id]
        past = len(tokens)
        tokens.extend(chunk.astype(np.float64))
        every = np.stack(tokens)  # [L, H, d] or [L, layers, H, d]
        pos = np.arange(len(every))
        q_pos = pos[past:]
        out = np.zeros((len(chunk), len(spec.layers), h_q, spec.head_dim))
        for li, layer in enumerate(spec.layers):
            x = every if spec.shared_qkv else every[:, li]
            qk = x[:, : h_q + h_kv]
            if layer.theta is not None:
                qk = self.rotary(qk, pos, layer.theta, layer.rotary_dim)
            q, k, v = qk[past:, :h_q], qk[:, h_q:], x[:, h_q + h_kv :]
            visible = pos[None, :] <= q_pos[:, None]
            if layer.windowed:
                visible &= q_pos[:, None] - pos[None, :] < spec.window
            for h in range(h_q):
                sc = q[:, h] @ k[:, h // group].T * spec.sm_scale
                if spec.soft_cap:
                    sc = spec.soft_cap * np.tanh(sc / spec.soft_cap)
                sc = np.where(visible, sc, -np.inf)
                if layer.sinks is not None:
                    sc = np.concatenate([sc, np.full((len(sc), 1), layer.sinks[h])], axis=1)
                p = np.exp(sc - sc.max(axis=1, keepdims=True))
                p = p / p.sum(axis=1, keepdims=True)
                if layer.sinks is not None:
                    p = p[:, :-1]  # the sink's column dropped
                out[:, li, h, : v.shape[-1]] = p @ v[:, h // group]
        return out


def forward_steps(
    sessions: Sequence[Session], steps: Iterable[Step]
) -> Iterator[tuple[Step, dict[int, int], bool]]:
    """Run the adds and forks of steps on every session; yield each prefill or decode as
    (step, tokens per sequence, decode)."""
    for step in steps:
        if step[0] == "add":
            for session in sessions:
                session.add(step[1])
        elif step[0] == "fork":
            for session in sessions:
                session.fork(step[1], step[2])
        elif step[0] == "decode":
            yield step, {i: 1 for i in step[1]}, True
        else:
            yield step, step[1], False
