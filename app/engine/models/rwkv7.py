"""RWKV-7 "Goose" (the World and G1 models) in `tvm.relax.frontend.nn`: its config, its time-mix
(the generalized delta rule) and channel-mix, the layout of its recurrent state, the BlinkDL
checkpoint names and its registry entry. What every recurrent architecture shares (the
sequences of a flat batch, projections, the runtime's RNN-state object) is in `recurrent`;
BlinkDL `.pth` preparation in `rwkv7_pth`.

Per block: LayerNorm -> time-mix -> residual, LayerNorm -> channel-mix -> residual; block 0's
pre-LayerNorm (`blocks.0.ln0`) is folded into the embedding table at conversion, then a final
LayerNorm and the head. The numerics follow the `rwkv` package's `RWKV_x070` (cpu fp32):

    x_r..x_g = x + (x_prev - x) * mix           (token shift; x_prev: last LayerNorm output)
    r, k, v  = R x_r, K x_k, V x_v
    w_raw    = w0 + W2 tanh(W1 x_w)             (decay exp(-e^-0.5 sigmoid(w_raw)), in the scan)
    a        = sigmoid(a0 + A2 A1 x_a)           (in-context learning rate)
    g        = G2 sigmoid(G1 x_g)
    kk       = normalize(k * k_k) per head;  k = k * (1 + (a - 1) * k_a)
    v        = v + (v_first - v) * sigmoid(v0 + V2 V1 x_v)   (layers > 0; layer 0's v is v_first)
    y        = GroupNorm_heads(scan(r, w_raw, k, v, kk, a)) + (sum_head r * k * r_k) * v
    out      = O (y * g);          channel mix: Vf relu(Kf x_k)^2

The state of a sequence per layer (`state_layout`): the time-mix x_prev [C], the per-head
matrix state [heads, N, N] in float32 (the reference's layout: row = value channel), the
channel-mix x_prev [C]. The LoRA matrices are `layers.Linear`s like every projection (4-bit in
the 4-bit modes; their odd ranks are padded to whole quantization groups by the layer);
w0 and the decay's pre-activation stay float32 in every mode (see `kernels.wkv7`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.target import Target

from localchat.engine.build.quantization import QuantMode
from localchat.engine.kernels import wkv7
from localchat.engine.models import Architecture, probes
from localchat.engine.models import activations as act
from localchat.engine.models.layers import BuildContext, Embedding, Linear
from localchat.engine.models.recurrent import (
    ATT_KV,
    ATT_X,
    FFN_X,
    RecurrentLM,
    RnnState,
    Segments,
    StateTensor,
    matrix_state_layout,
    token_lerp,
)
from localchat.engine.models.recurrent import state_bytes as layout_bytes
from localchat.errors import ModelConfigError

DEFAULT_PREFILL_CHUNK = 512
DEFAULT_CONTEXT = 1 << 20  # an RNN has no context limit; this only bounds the length check
GROUP_NORM_EPS = 64e-5  # ln_x: the reference's eps (1e-5 * head_size_divisor 8 squared)
KK_EPS = 1e-12  # torch.nn.functional.normalize's floor on the norm


@dataclass
class Rwkv7Config:
    """The shape of an RWKV-7 model (from the config.json `rwkv7_pth` infers from a `.pth`)."""

    hidden_size: int
    head_size: int
    intermediate_size: int
    num_hidden_layers: int
    vocab_size: int
    decay_low_rank_dim: int
    a_low_rank_dim: int
    v_low_rank_dim: int
    gate_low_rank_dim: int
    layer_norm_epsilon: float = 1e-5
    context_window_size: int = DEFAULT_CONTEXT
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK

    @property
    def num_heads(self) -> int:
        return self.hidden_size // self.head_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Rwkv7Config:
        return cls(**data)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Rwkv7Config:
        """Read the config.json of an RWKV-7 source folder; its training context is not a limit
        of the recurrence, so the window is left unbounded (DEFAULT_CONTEXT)."""

        def need(key: str) -> int:
            if key not in hf:
                raise ModelConfigError(f"config.json has no {key!r}")
            return int(hf[key])

        cfg = cls(
            hidden_size=need("hidden_size"),
            head_size=need("head_size"),
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            vocab_size=need("vocab_size"),
            decay_low_rank_dim=need("decay_low_rank_dim"),
            a_low_rank_dim=need("a_low_rank_dim"),
            v_low_rank_dim=need("v_low_rank_dim"),
            gate_low_rank_dim=need("gate_low_rank_dim"),
            layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
        )
        if cfg.hidden_size % cfg.head_size:
            raise ModelConfigError(f"hidden_size {cfg.hidden_size} is not a multiple of "
                                   f"head_size {cfg.head_size}")
        return cfg


# ------------------------------------------------------------------------------------------------
# The recurrent state (ids ATT_X, ATT_KV, FFN_X: recurrent.matrix_state_layout)
# ------------------------------------------------------------------------------------------------


def state_layout(cfg: Rwkv7Config, dtype: str) -> tuple[StateTensor, ...]:
    """The state of one layer of a sequence, by state id (the same in every layer)."""
    return matrix_state_layout(cfg.hidden_size, cfg.head_size, dtype)


def state_bytes(cfg: Rwkv7Config, max_batch_size: int, dtype: str = "float32") -> int:
    """Bytes of the recurrent state for `max_batch_size` sequences (one history slot each)."""
    return layout_bytes(state_layout(cfg, dtype), cfg.num_hidden_layers, max_batch_size)


# ------------------------------------------------------------------------------------------------
# Modules
# ------------------------------------------------------------------------------------------------




def _per_head_sum(x: nn.Tensor, heads: int, size: int) -> nn.Tensor:
    """[n, heads * size] -> [n, heads, 1]: the sum over each head's channels."""
    return op.sum(op.reshape(x, (x.shape[0], heads, size)), axis=-1, keepdims=True)


class TimeMix(nn.Module):
    def __init__(self, cfg: Rwkv7Config, ctx: BuildContext, layer_id: int) -> None:
        c, dt = cfg.hidden_size, ctx.dtype
        self.heads, self.head_size, self.dtype = cfg.num_heads, cfg.head_size, dt
        self.first = layer_id == 0
        self.gpu = not ctx.cpu
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            setattr(self, name, nn.Parameter((c,), dt))
        self.w0 = nn.Parameter((c,), "float32")
        self.w1 = Linear(c, cfg.decay_low_rank_dim, False, ctx)
        self.w2 = Linear(cfg.decay_low_rank_dim, c, False, ctx)
        self.a0 = nn.Parameter((c,), dt)
        self.a1 = Linear(c, cfg.a_low_rank_dim, False, ctx)
        self.a2 = Linear(cfg.a_low_rank_dim, c, False, ctx)
        if not self.first:  # layer 0's value is v_first itself
            self.v0 = nn.Parameter((c,), dt)
            self.v1 = Linear(c, cfg.v_low_rank_dim, False, ctx)
            self.v2 = Linear(cfg.v_low_rank_dim, c, False, ctx)
        self.g1 = Linear(c, cfg.gate_low_rank_dim, False, ctx)
        self.g2 = Linear(cfg.gate_low_rank_dim, c, False, ctx)
        self.k_k = nn.Parameter((c,), dt)
        self.k_a = nn.Parameter((c,), dt)
        self.r_k = nn.Parameter((c,), dt)
        self.receptance = Linear(c, c, False, ctx)
        self.key = Linear(c, c, False, ctx)
        self.value = Linear(c, c, False, ctx)
        self.output = Linear(c, c, False, ctx)
        self.ln_x_weight = nn.Parameter((c,), "float32")
        self.ln_x_bias = nn.Parameter((c,), "float32")

    def forward(self, xx: nn.Tensor, seg: Segments, state: RnnState, layer_id: int,
                v_first: nn.Tensor | None):
        h, n_, dt, batch = self.heads, self.head_size, self.dtype, seg.batch
        c, n = h * n_, xx.shape[0]
        prev = state.get(layer_id, ATT_X, batch, c, dt)
        kv = state.get(layer_id, ATT_KV, batch, (h, n_, n_), "float32")
        xr, xw, xk, xv, xa, xg = token_lerp(seg, xx, prev, self.x_r, self.x_w, self.x_k, self.x_v,
                                       self.x_a, self.x_g)
        r = probes.probe("att.receptance", seg.project(self.receptance, xr))
        k = probes.probe("att.key", seg.project(self.key, xk))
        v = probes.probe("att.value", seg.project(self.value, xv))
        cpu = not self.gpu
        lora = seg.project(self.w2, act.tanh(seg.project(self.w1, xw), cpu))
        w_raw = probes.probe("att.w", self.w0 + (lora if dt == "float32" else
                                                 lora.astype("float32")))
        a = probes.probe("att.a", act.sigmoid(
            self.a0 + seg.project(self.a2, seg.project(self.a1, xa)), cpu))
        g = probes.probe("att.g", seg.project(self.g2,
                                              act.sigmoid(seg.project(self.g1, xg), cpu)))
        kk = op.reshape(k * self.k_k, (n, h, n_))
        norm = op.sqrt(op.sum(op.square(kk), axis=-1, keepdims=True))
        kk = op.reshape(kk / op.maximum(norm, op.full((1,), KK_EPS, dt)), (n, c))
        k = k * (1.0 + (a - 1.0) * self.k_a)
        if self.first:
            v_first = v
        else:
            mix = act.sigmoid(self.v0 + seg.project(self.v2, seg.project(self.v1, xv)), cpu)
            v = v + (v_first - v) * mix
        y, kv = op.tensor_ir_op(
            wkv7.wkv7_scan(h, n_, dt, self.gpu),
            "wkv7_scan",
            args=[r, w_raw, k, v, kk, a, kv, seg.ends],
            out=[nn.Tensor.placeholder((n, c), dt),
                 nn.Tensor.placeholder((batch, h, n_, n_), "float32")],
        )
        y = probes.probe("att.scan", y)
        # GroupNorm per head (ln_x), in float32
        y3 = op.reshape(y if dt == "float32" else y.astype("float32"), (n, h, n_))
        mean = op.sum(y3, axis=-1, keepdims=True) / float(n_)
        centered = y3 - mean
        var = op.sum(op.square(centered), axis=-1, keepdims=True) / float(n_)
        normed = centered / op.sqrt(var + GROUP_NORM_EPS)
        y = op.reshape(normed, (n, c)) * self.ln_x_weight + self.ln_x_bias
        if dt != "float32":
            y = y.astype(dt)
        bonus = op.reshape(_per_head_sum(r * k * self.r_k, h, n_) * op.reshape(v, (n, h, n_)),
                           (n, c))
        y = probes.probe("att.output:in", (y + bonus) * g)
        state = state.set(layer_id, ATT_X, probes.probe("state.att_x", seg.last_rows(xx)))
        state = state.set(layer_id, ATT_KV, probes.probe("state.att_kv", kv))
        out = seg.project(self.output, y)
        return probes.probe("att.output", out), state, v_first


class ChannelMix(nn.Module):
    def __init__(self, cfg: Rwkv7Config, ctx: BuildContext) -> None:
        c, f, dt = cfg.hidden_size, cfg.intermediate_size, ctx.dtype
        self.dtype = dt
        self.x_k = nn.Parameter((c,), dt)
        self.key = Linear(c, f, False, ctx)
        self.value = Linear(f, c, False, ctx)

    def forward(self, xx: nn.Tensor, seg: Segments, state: RnnState, layer_id: int):
        prev = state.get(layer_id, FFN_X, seg.batch, xx.shape[-1], self.dtype)
        (xk,) = token_lerp(seg, xx, prev, self.x_k)
        k = op.square(op.relu(probes.probe("ffn.key", seg.project(self.key, xk))))
        state = state.set(layer_id, FFN_X, probes.probe("state.ffn_x", seg.last_rows(xx)))
        return probes.probe("ffn.value", seg.project(self.value, k)), state


class Block(nn.Module):
    def __init__(self, cfg: Rwkv7Config, ctx: BuildContext, layer_id: int) -> None:
        eps, c, dt = cfg.layer_norm_epsilon, cfg.hidden_size, ctx.dtype
        self.ln1 = nn.LayerNorm(c, eps, dtype=dt)
        self.ln2 = nn.LayerNorm(c, eps, dtype=dt)
        self.att = TimeMix(cfg, ctx, layer_id)
        self.ffn = ChannelMix(cfg, ctx)

    def forward(self, x: nn.Tensor, seg: Segments, state: RnnState, layer_id: int,
                v_first: nn.Tensor | None):
        out, state, v_first = self.att(probes.probe("ln1", self.ln1(x)), seg, state, layer_id,
                                       v_first)
        x = x + out
        out, state = self.ffn(probes.probe("ln2", self.ln2(x)), seg, state, layer_id)
        return x + out, state, v_first


class Rwkv7ForCausalLM(RecurrentLM):
    """The exported model (`recurrent.RecurrentLM`: embed, (batch_)prefill, (batch_)decode, the
    RNN-state constructor, the debug prefill) over these blocks."""

    def __init__(self, cfg: Rwkv7Config, mode: QuantMode, target: Target) -> None:
        ctx = BuildContext(mode, target)
        self.cfg = cfg
        self.mode = mode
        self.target = target
        c = cfg.hidden_size
        self.embeddings = Embedding(cfg.vocab_size, c, ctx)  # blocks.0.ln0 folded in
        self.blocks = nn.ModuleList([Block(cfg, ctx, i) for i in range(cfg.num_hidden_layers)])
        self.ln_out = nn.LayerNorm(c, cfg.layer_norm_epsilon, dtype=mode.dtype)
        self.head = Linear(c, cfg.vocab_size, False, ctx, head=True)

    def _blocks(self, x: nn.Tensor, seg: Segments, state: RnnState):
        v_first = None
        for i, block in enumerate(self.blocks):
            with probes.layer(i):
                x, state, v_first = block(x, seg, state, i, v_first)
                probes.probe_layer(x)
        return x, state

    def state_layout(self) -> tuple[StateTensor, ...]:
        return state_layout(self.cfg, self.mode.dtype)


# ------------------------------------------------------------------------------------------------
# Checkpoint names
# ------------------------------------------------------------------------------------------------

# vectors of a block, stored as [1, 1, C] (r_k as [heads, N]): ours -> BlinkDL, flattened
_VECTORS = {f"att.{m}": f"att.{m}" for m in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0",
                                            "a0", "v0", "k_k", "k_a", "r_k")}
_VECTORS.update({"att.ln_x_weight": "att.ln_x.weight", "att.ln_x_bias": "att.ln_x.bias",
                 "ffn.x_k": "ffn.x_k", "ln1.weight": "ln1.weight", "ln1.bias": "ln1.bias",
                 "ln2.weight": "ln2.weight", "ln2.bias": "ln2.bias"})
# LoRA factors, used as x @ M ([in, out]) by the reference: our Linear holds M^T
_LORAS = ("w1", "w2", "a1", "a2", "v1", "v2", "g1", "g2")
# torch Linear weights ([out, in], as ours)
_MATRICES = ("att.receptance.weight", "att.key.weight", "att.value.weight", "att.output.weight",
             "ffn.key.weight", "ffn.value.weight")


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    out = (x - mu) / np.sqrt(var + eps) * w.astype(np.float64) + b.astype(np.float64)
    return out.astype(np.float32)


def hf_params(cfg: Rwkv7Config, get: Callable[[str], np.ndarray],
              names: set[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Our float parameters, by our names, from a BlinkDL RWKV-7 checkpoint (`blocks.N.att.*`)."""

    def f32(name: str) -> np.ndarray:
        return np.asarray(get(name), dtype=np.float32)

    emb = f32("emb.weight")
    yield "embeddings.weight", _layer_norm(emb, f32("blocks.0.ln0.weight"),
                                           f32("blocks.0.ln0.bias"), cfg.layer_norm_epsilon)
    for i in range(cfg.num_hidden_layers):
        src, ours = f"blocks.{i}.", f"blocks.{i}."
        for name, blink in _VECTORS.items():
            if i == 0 and name == "att.v0":
                continue
            yield ours + name, f32(src + blink).reshape(-1)
        for lora in _LORAS:
            if i == 0 and lora.startswith("v"):
                continue
            yield f"{ours}att.{lora}.weight", np.ascontiguousarray(f32(f"{src}att.{lora}").T)
        for name in _MATRICES:
            yield ours + name, f32(src + name)
    yield "ln_out.weight", f32("ln_out.weight")
    yield "ln_out.bias", f32("ln_out.bias")
    yield "head.weight", f32("head.weight")


def architecture(name: str) -> Architecture:
    """The registry's view of this module (see `localchat.engine.models.REGISTRY`)."""
    return Architecture(
        name=name,
        state="rnn",
        config_from_hf=Rwkv7Config.from_hf,
        config_from_dict=Rwkv7Config.from_dict,
        build=Rwkv7ForCausalLM,
        hf_params=hf_params,
        cache_bytes=lambda cfg, dtype, batch, _tokens: state_bytes(cfg, batch, dtype),
        default_template="rwkv_world",
    )
