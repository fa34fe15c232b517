"""RWKV-6 "Finch" (the World models) in `tvm.relax.frontend.nn`: its config, its time-mix (a
matrix-valued linear attention with data-dependent decay) and channel-mix, the layout of its
recurrent state, the BlinkDL checkpoint names and its registry entry. What every recurrent
architecture shares is in `recurrent`; BlinkDL `.pth` preparation in `rwkv6_pth`.

Per block: LayerNorm -> time-mix -> residual, LayerNorm -> channel-mix -> residual; block 0's
pre-LayerNorm (`blocks.0.ln0`) is folded into the embedding table at conversion, then a final
LayerNorm and the head. The numerics follow the `rwkv` package's `att_seq_v6_0` /
`ffn_seq_v6` (cpu fp32):

    sx       = shifted(x) - x                     (token shift; x_prev: last LayerNorm output)
    m_w..m_g = M2_i tanh(M1 (x + sx * maa_x))     (the mix LoRA: five outputs of one input)
    x_i      = x + sx * (maa_i + m_i)             for i in w, k, v, r, g
    r, k, v  = R x_r, K x_k, V x_v;   g = silu(G x_g)
    w_raw    = time_decay + D2 tanh(D1 x_w)       (decay exp(-exp(w_raw)), in the scan)
    y        = GroupNorm_heads(scan(r, w_raw, k, v, u = time_faaaa))
    out      = O (y * g);   channel mix: sigmoid(Rf x_r) * Vf relu(Kf x_k)^2

The state of a sequence per layer (`state_layout`): the time-mix x_prev [C], the per-head
matrix state [heads, N, N] in float32 (the reference's layout: row = key channel), the
channel-mix x_prev [C]. The LoRA matrices are `layers.Linear`s like every projection (4-bit in
the 4-bit modes); time_decay, time_faaaa and the decay's pre-activation stay float32 in every
mode (see `kernels.wkv6`).
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
from localchat.engine.kernels import wkv6
from localchat.engine.models import Architecture, probes
from localchat.engine.models import activations as act
from localchat.engine.models.layers import BuildContext, Embedding, Linear
from localchat.engine.models.recurrent import (
    ATT_KV,
    ATT_X,
    FFN_X,
    RecurrentLM,
    RnnState,
    RwkvBlock,
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
MIXES = ("w", "k", "v", "r", "g")  # the order of time_maa_w2's five slices


@dataclass
class Rwkv6Config:
    """The shape of an RWKV-6 model (from the config.json `rwkv6_pth` infers from a `.pth`)."""

    hidden_size: int
    head_size: int
    intermediate_size: int
    num_hidden_layers: int
    vocab_size: int
    mix_low_rank_dim: int  # time_maa_w1: [C, 5 * this]
    decay_low_rank_dim: int  # time_decay_w1: [C, this]
    layer_norm_epsilon: float = 1e-5
    context_window_size: int = DEFAULT_CONTEXT
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK

    @property
    def num_heads(self) -> int:
        return self.hidden_size // self.head_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Rwkv6Config:
        return cls(**data)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Rwkv6Config:
        """Read the config.json `rwkv6_pth` writes for a BlinkDL `.pth` (the LoRA ranks are in
        it; an HF-format RWKV-6 folder has none and is refused naming what is read)."""

        def need(key: str) -> int:
            if key not in hf:
                raise ModelConfigError(
                    f"config.json has no {key!r} (localchat reads RWKV-6 from BlinkDL .pth "
                    f"checkpoints: `localchat convert FILE.pth`)")
            return int(hf[key])

        cfg = cls(
            hidden_size=need("hidden_size"),
            head_size=need("head_size"),
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            vocab_size=need("vocab_size"),
            mix_low_rank_dim=need("mix_low_rank_dim"),
            decay_low_rank_dim=need("decay_low_rank_dim"),
            layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
        )
        if cfg.hidden_size % cfg.head_size:
            raise ModelConfigError(f"hidden_size {cfg.hidden_size} is not a multiple of "
                                   f"head_size {cfg.head_size}")
        return cfg


# ------------------------------------------------------------------------------------------------
# The recurrent state (ids ATT_X, ATT_KV, FFN_X: recurrent.matrix_state_layout)
# ------------------------------------------------------------------------------------------------


def state_layout(cfg: Rwkv6Config, dtype: str) -> tuple[StateTensor, ...]:
    """The state of one layer of a sequence, by state id (the same in every layer)."""
    return matrix_state_layout(cfg.hidden_size, cfg.head_size, dtype)


def state_bytes(cfg: Rwkv6Config, max_batch_size: int, dtype: str = "float32") -> int:
    """Bytes of the recurrent state for `max_batch_size` sequences (one history slot each)."""
    return layout_bytes(state_layout(cfg, dtype), cfg.num_hidden_layers, max_batch_size)


# ------------------------------------------------------------------------------------------------
# Modules
# ------------------------------------------------------------------------------------------------




class TimeMix(nn.Module):
    def __init__(self, cfg: Rwkv6Config, ctx: BuildContext) -> None:
        c, dt = cfg.hidden_size, ctx.dtype
        d_mix, d_decay = cfg.mix_low_rank_dim, cfg.decay_low_rank_dim
        self.heads, self.head_size, self.dtype = cfg.num_heads, cfg.head_size, dt
        self.gpu = not ctx.cpu
        self.maa_x = nn.Parameter((c,), dt)
        for m in MIXES:
            setattr(self, f"maa_{m}", nn.Parameter((c,), dt))
        self.maa_w1 = Linear(c, 5 * d_mix, False, ctx)
        self.maa_w2 = nn.ModuleList([Linear(d_mix, c, False, ctx) for _ in MIXES])
        self.decay = nn.Parameter((c,), "float32")
        self.decay_w1 = Linear(c, d_decay, False, ctx)
        self.decay_w2 = Linear(d_decay, c, False, ctx)
        self.faaaa = nn.Parameter((c,), "float32")
        self.receptance = Linear(c, c, False, ctx)
        self.key = Linear(c, c, False, ctx)
        self.value = Linear(c, c, False, ctx)
        self.gate = Linear(c, c, False, ctx)
        self.output = Linear(c, c, False, ctx)
        self.ln_x_weight = nn.Parameter((c,), "float32")
        self.ln_x_bias = nn.Parameter((c,), "float32")

    def forward(self, xx: nn.Tensor, seg: Segments, state: RnnState, layer_id: int):
        h, n_, dt, batch = self.heads, self.head_size, self.dtype, seg.batch
        c, n = h * n_, xx.shape[0]
        prev = state.get(layer_id, ATT_X, batch, c, dt)
        kv = state.get(layer_id, ATT_KV, batch, (h, n_, n_), "float32")
        sx = seg.token_shift(xx, prev) - xx
        cpu = not self.gpu
        lora = act.tanh(seg.project(self.maa_w1, xx + sx * self.maa_x), cpu)
        parts = op.split(lora, len(MIXES), axis=1)
        mixed = {m: xx + sx * (getattr(self, f"maa_{m}") + seg.project(lin, part))
                 for m, lin, part in zip(MIXES, self.maa_w2, parts)}
        r = probes.probe("att.receptance", seg.project(self.receptance, mixed["r"]))
        k = probes.probe("att.key", seg.project(self.key, mixed["k"]))
        v = probes.probe("att.value", seg.project(self.value, mixed["v"]))
        g = probes.probe("att.gate", act.silu(seg.project(self.gate, mixed["g"]), cpu))
        lora = seg.project(self.decay_w2, act.tanh(seg.project(self.decay_w1, mixed["w"]), cpu))
        w_raw = probes.probe("att.w", self.decay + (lora if dt == "float32" else
                                                     lora.astype("float32")))
        y, kv = op.tensor_ir_op(
            wkv6.wkv6_scan(h, n_, dt, self.gpu),
            "wkv6_scan",
            args=[r, w_raw, k, v, self.faaaa, kv, seg.ends],
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
        y = probes.probe("att.output:in", y * g)
        state = state.set(layer_id, ATT_X, probes.probe("state.att_x", seg.last_rows(xx)))
        state = state.set(layer_id, ATT_KV, probes.probe("state.att_kv", kv))
        return probes.probe("att.output", seg.project(self.output, y)), state


class ChannelMix(nn.Module):
    def __init__(self, cfg: Rwkv6Config, ctx: BuildContext) -> None:
        c, f, dt = cfg.hidden_size, cfg.intermediate_size, ctx.dtype
        self.dtype, self.cpu = dt, ctx.cpu
        self.maa_k = nn.Parameter((c,), dt)
        self.maa_r = nn.Parameter((c,), dt)
        self.key = Linear(c, f, False, ctx)
        self.receptance = Linear(c, c, False, ctx)
        self.value = Linear(f, c, False, ctx)

    def forward(self, xx: nn.Tensor, seg: Segments, state: RnnState, layer_id: int):
        prev = state.get(layer_id, FFN_X, seg.batch, xx.shape[-1], self.dtype)
        xk, xr = token_lerp(seg, xx, prev, self.maa_k, self.maa_r)
        r = act.sigmoid(probes.probe("ffn.receptance", seg.project(self.receptance, xr)), self.cpu)
        k = op.square(op.relu(probes.probe("ffn.key", seg.project(self.key, xk))))
        state = state.set(layer_id, FFN_X, probes.probe("state.ffn_x", seg.last_rows(xx)))
        return probes.probe("ffn.output", r * seg.project(self.value, k)), state


class Rwkv6ForCausalLM(RecurrentLM):
    """The exported model (`recurrent.RecurrentLM`: embed, (batch_)prefill, (batch_)decode, the
    RNN-state constructor, the debug prefill) over these blocks."""

    def __init__(self, cfg: Rwkv6Config, mode: QuantMode, target: Target) -> None:
        ctx = BuildContext(mode, target)
        self.cfg = cfg
        self.mode = mode
        self.target = target
        c = cfg.hidden_size
        self.embeddings = Embedding(cfg.vocab_size, c, ctx)  # blocks.0.ln0 folded in
        self.blocks = nn.ModuleList([
            RwkvBlock(TimeMix(cfg, ctx), ChannelMix(cfg, ctx), cfg.hidden_size,
                      cfg.layer_norm_epsilon, ctx.dtype)
            for _ in range(cfg.num_hidden_layers)])
        self.ln_out = nn.LayerNorm(c, cfg.layer_norm_epsilon, dtype=mode.dtype)
        self.head = Linear(c, cfg.vocab_size, False, ctx, head=True)

    def _blocks(self, x: nn.Tensor, seg: Segments, state: RnnState):
        for i, block in enumerate(self.blocks):
            with probes.layer(i):
                x, state = block(x, seg, state, i)
                probes.probe_layer(x)
        return x, state

    def state_layout(self) -> tuple[StateTensor, ...]:
        return state_layout(self.cfg, self.mode.dtype)


# ------------------------------------------------------------------------------------------------
# Checkpoint names
# ------------------------------------------------------------------------------------------------

# vectors of a block (stored as [1, 1, C], time_faaaa as [heads, N]): ours -> BlinkDL, flattened
_VECTORS = {f"att.maa_{m}": f"att.time_maa_{m}" for m in ("x", *MIXES)}
_VECTORS.update({"att.decay": "att.time_decay", "att.faaaa": "att.time_faaaa",
                 "att.ln_x_weight": "att.ln_x.weight", "att.ln_x_bias": "att.ln_x.bias",
                 "ffn.maa_k": "ffn.time_maa_k", "ffn.maa_r": "ffn.time_maa_r",
                 "ln1.weight": "ln1.weight", "ln1.bias": "ln1.bias",
                 "ln2.weight": "ln2.weight", "ln2.bias": "ln2.bias"})
# torch Linear weights ([out, in], as ours)
_MATRICES = ("att.receptance.weight", "att.key.weight", "att.value.weight", "att.gate.weight",
             "att.output.weight", "ffn.key.weight", "ffn.receptance.weight",
             "ffn.value.weight")


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    out = (x - mu) / np.sqrt(var + eps) * w.astype(np.float64) + b.astype(np.float64)
    return out.astype(np.float32)


def hf_params(cfg: Rwkv6Config, get: Callable[[str], np.ndarray],
              names: set[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Our float parameters, by our names, from a BlinkDL RWKV-6 checkpoint (`blocks.N.att.*`).
    The reference uses its LoRA factors as x @ M ([in, out]): our Linears hold M^T."""

    def f32(name: str) -> np.ndarray:
        return np.asarray(get(name), dtype=np.float32)

    emb = f32("emb.weight")
    yield "embeddings.weight", _layer_norm(emb, f32("blocks.0.ln0.weight"),
                                           f32("blocks.0.ln0.bias"), cfg.layer_norm_epsilon)
    for i in range(cfg.num_hidden_layers):
        p = f"blocks.{i}."
        for name, blink in _VECTORS.items():
            yield p + name, f32(p + blink).reshape(-1)
        yield f"{p}att.maa_w1.weight", np.ascontiguousarray(f32(f"{p}att.time_maa_w1").T)
        w2 = f32(f"{p}att.time_maa_w2")  # [5, D, C]
        for j in range(len(MIXES)):
            yield f"{p}att.maa_w2.{j}.weight", np.ascontiguousarray(w2[j].T)
        for lora in ("w1", "w2"):
            yield (f"{p}att.decay_{lora}.weight",
                   np.ascontiguousarray(f32(f"{p}att.time_decay_{lora}").T))
        for name in _MATRICES:
            yield p + name, f32(p + name)
    yield "ln_out.weight", f32("ln_out.weight")
    yield "ln_out.bias", f32("ln_out.bias")
    yield "head.weight", f32("head.weight")


def architecture(name: str) -> Architecture:
    """The registry's view of this module (see `localchat.engine.models.REGISTRY`)."""
    return Architecture(
        name=name,
        state="rnn",
        config_from_hf=Rwkv6Config.from_hf,
        config_from_dict=Rwkv6Config.from_dict,
        build=Rwkv6ForCausalLM,
        hf_params=hf_params,
        cache_bytes=lambda cfg, dtype, batch, _tokens: state_bytes(cfg, batch, dtype),
        default_template="rwkv_world",
    )
