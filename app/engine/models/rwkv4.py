"""RWKV-4 (the World models among them) in `tvm.relax.frontend.nn`: its config, its time-mix and
channel-mix, the layout of its recurrent state and its registry entry. What every recurrent
architecture shares (the sequences of a flat batch, token shift, the runtime's RNN-state object)
is in `recurrent`; the checkpoint names in `rwkv4_weights`, BlinkDL `.pth` preparation in
`rwkv4_pth`.

Per block: LayerNorm -> time-mix -> residual, LayerNorm -> channel-mix -> residual; block 0's
pre-LayerNorm on the embeddings is folded into the embedding table at conversion (it is a
per-row function of the row), then a final LayerNorm and the head.

Every exported function runs one code path on a flat list of tokens from B sequences
(`recurrent.Segments`): prefill is B = 1, batch_prefill takes the sequence ends from
`logit_positions` (the runtime passes the last position of each sequence), decode / batch_decode
have one token per sequence. The recurrent state of each sequence lives in TVM's RNN-state
object, five vectors per layer (`state_layout`); x_prev is the LayerNorm output of the
sequence's last token, as in transformers' RwkvForCausalLM.

Numerics follow transformers' RwkvForCausalLM in eval mode: `time_decay` is stored as
-exp(time_decay) (float32, like time_first, in every quantization mode); with rescale_every = R > 0
the time-mix output and channel-mix value weights of layer i are divided by 2**(i // R) at
conversion and the hidden state is halved after every R-th layer at run time (both exact in
binary floating point; LayerNorm makes the result scale-free up to its epsilon).

Decode (one token per sequence) runs its Linears in the decode GEMV of `kernels.gemv` (weights
unpacked in registers); prefill uses the blocked kernels of `kernels.matmul` through
`layers.Linear`; GPUs get dequantize + matmul and the GPU variants of the scan and state kernels.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.target import Target

from localchat.engine.build.quantization import QuantMode
from localchat.engine.kernels import wkv
from localchat.engine.models import Architecture, probes
from localchat.engine.models import activations as act
from localchat.engine.models.layers import BuildContext, Embedding, Linear
from localchat.engine.models.recurrent import (
    RecurrentLM,
    RnnState,
    RwkvBlock,
    Segments,
    StateTensor,
)
from localchat.engine.models.recurrent import state_bytes as layout_bytes
from localchat.engine.models.rwkv4_weights import hf_params
from localchat.errors import ModelConfigError

DEFAULT_PREFILL_CHUNK = 512
# An RNN has no context limit; this only bounds the runtime's length check.
DEFAULT_CONTEXT = 1 << 20


@dataclass
class Rwkv4Config:
    """The shape and options of an RWKV-4 model, as read from an HF config.json."""

    hidden_size: int
    attention_hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    vocab_size: int
    layer_norm_epsilon: float
    rescale_every: int
    context_window_size: int = DEFAULT_CONTEXT
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Rwkv4Config:
        return cls(**data)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Rwkv4Config:
        """Read an HF RWKV config.json. Its `context_length` is the training length, not a limit
        of the recurrence, so the context window is left unbounded (DEFAULT_CONTEXT)."""

        def need(key: str) -> Any:
            if key not in hf:
                raise ModelConfigError(f"config.json has no {key!r}")
            return hf[key]

        hidden = int(need("hidden_size"))
        cfg = cls(
            hidden_size=hidden,
            attention_hidden_size=int(hf.get("attention_hidden_size") or hidden),
            intermediate_size=int(hf.get("intermediate_size") or 4 * hidden),
            num_hidden_layers=int(need("num_hidden_layers")),
            vocab_size=int(need("vocab_size")),
            layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
            rescale_every=int(hf.get("rescale_every") or 0),
        )
        return cfg


# ------------------------------------------------------------------------------------------------
# The recurrent state
# ------------------------------------------------------------------------------------------------

STATE_INIT_P = -1.0e30  # "minus infinity" for the running max exponent, finite under subtraction

# State ids within a layer: time-mix x_prev, the WKV numerator a, denominator b and running max
# exponent p (always float32), channel-mix x_prev.
ATT_X, ATT_A, ATT_B, ATT_P, FFN_X = range(5)


def state_layout(cfg: Rwkv4Config, dtype: str) -> tuple[StateTensor, ...]:
    """The state of one layer of a sequence, by state id (the same in every layer)."""
    h, a = cfg.hidden_size, cfg.attention_hidden_size
    return (
        StateTensor((h,), dtype),
        StateTensor((a,), "float32"),
        StateTensor((a,), "float32"),
        StateTensor((a,), "float32", STATE_INIT_P),
        StateTensor((h,), dtype),
    )


def state_bytes(cfg: Rwkv4Config, max_batch_size: int, dtype: str = "float32") -> int:
    """Bytes of the recurrent state for `max_batch_size` sequences (one history slot each)."""
    return layout_bytes(state_layout(cfg, dtype), cfg.num_hidden_layers, max_batch_size)


# ------------------------------------------------------------------------------------------------
# Modules
# ------------------------------------------------------------------------------------------------


class TimeMix(nn.Module):
    def __init__(self, cfg: Rwkv4Config, ctx: BuildContext) -> None:
        h, a, dt = cfg.hidden_size, cfg.attention_hidden_size, ctx.dtype
        self.gpu = not ctx.cpu
        self.attention_size = a
        self.dtype = dt
        self.time_decay = nn.Parameter((a,), "float32")  # -exp(time_decay)
        self.time_first = nn.Parameter((a,), "float32")
        self.time_mix_k = nn.Parameter((h,), dt)
        self.time_mix_v = nn.Parameter((h,), dt)
        self.time_mix_r = nn.Parameter((h,), dt)
        self.key = Linear(h, a, False, ctx)
        self.value = Linear(h, a, False, ctx)
        self.receptance = Linear(h, a, False, ctx)
        self.output = Linear(a, h, False, ctx)

    def forward(self, xx: nn.Tensor, seg: Segments, state: RnnState, layer_id: int):
        a, dt, batch = self.attention_size, self.dtype, seg.batch
        prev = state.get(layer_id, ATT_X, batch, xx.shape[-1], dt)
        aa = state.get(layer_id, ATT_A, batch, a, "float32")
        bb = state.get(layer_id, ATT_B, batch, a, "float32")
        pp = state.get(layer_id, ATT_P, batch, a, "float32")
        xk, xv, xr = seg.token_mix(xx, prev, self.time_mix_k, self.time_mix_v, self.time_mix_r)
        k = probes.probe("attention.key", seg.project(self.key, xk))
        v = probes.probe("attention.value", seg.project(self.value, xv))
        r = act.sigmoid(probes.probe("attention.receptance", seg.project(self.receptance, xr)),
                        not self.gpu)
        n = xx.shape[0]
        y, aa, bb, pp = op.tensor_ir_op(
            wkv.wkv_scan(a, dt, self.gpu),
            "wkv_scan",
            args=[k, v, self.time_decay, self.time_first, aa, bb, pp, seg.ends],
            out=[
                nn.Tensor.placeholder((n, a), dt),
                nn.Tensor.placeholder((batch, a), "float32"),
                nn.Tensor.placeholder((batch, a), "float32"),
                nn.Tensor.placeholder((batch, a), "float32"),
            ],
        )
        last = seg.last_rows(xx)
        state = state.set(layer_id, ATT_X, probes.probe("state.att_x", last))
        state = state.set(layer_id, ATT_A, probes.probe("state.att_num", aa))
        state = state.set(layer_id, ATT_B, probes.probe("state.att_den", bb))
        state = state.set(layer_id, ATT_P, probes.probe("state.att_max", pp))
        out = seg.project(self.output, probes.probe("attention.output:in", r * y))
        return probes.probe("attention.output", out), state


class ChannelMix(nn.Module):
    def __init__(self, cfg: Rwkv4Config, ctx: BuildContext) -> None:
        h, f, dt = cfg.hidden_size, cfg.intermediate_size, ctx.dtype
        self.dtype, self.cpu = dt, ctx.cpu
        self.time_mix_k = nn.Parameter((h,), dt)
        self.time_mix_r = nn.Parameter((h,), dt)
        self.key = Linear(h, f, False, ctx)
        self.receptance = Linear(h, h, False, ctx)
        self.value = Linear(f, h, False, ctx)

    def forward(self, xx: nn.Tensor, seg: Segments, state: RnnState, layer_id: int):
        prev = state.get(layer_id, FFN_X, seg.batch, xx.shape[-1], self.dtype)
        xk, xr = seg.token_mix(xx, prev, self.time_mix_k, self.time_mix_r)
        k = op.square(op.relu(probes.probe("feed_forward.key", seg.project(self.key, xk))))
        r = act.sigmoid(probes.probe("feed_forward.receptance", seg.project(self.receptance, xr)),
                        self.cpu)
        state = state.set(layer_id, FFN_X, probes.probe("state.ffn_x", seg.last_rows(xx)))
        return r * probes.probe("feed_forward.value", seg.project(self.value, k)), state


class Rwkv4ForCausalLM(RecurrentLM):
    """The exported model (`recurrent.RecurrentLM`: embed, (batch_)prefill, (batch_)decode, the
    RNN-state constructor, the debug prefill) over these blocks."""

    def __init__(self, cfg: Rwkv4Config, mode: QuantMode, target: Target) -> None:
        ctx = BuildContext(mode, target)
        self.cfg = cfg
        self.mode = mode
        self.target = target
        h = cfg.hidden_size
        self.embeddings = Embedding(cfg.vocab_size, h, ctx)  # pre-LayerNorm folded in
        self.blocks = nn.ModuleList([
            RwkvBlock(TimeMix(cfg, ctx), ChannelMix(cfg, ctx), cfg.hidden_size,
                      cfg.layer_norm_epsilon, ctx.dtype)
            for _ in range(cfg.num_hidden_layers)])
        self.ln_out = nn.LayerNorm(h, cfg.layer_norm_epsilon, dtype=mode.dtype)
        self.head = Linear(h, cfg.vocab_size, False, ctx, head=True)

    def _blocks(self, x: nn.Tensor, seg: Segments, state: RnnState):
        every = self.cfg.rescale_every
        for i, block in enumerate(self.blocks):
            with probes.layer(i):
                x, state = block(x, seg, state, i)
                probes.probe_layer(x)  # before the rescale, as HF's block returns it
            if every > 0 and (i + 1) % every == 0:
                x = x / 2.0
        return x, state

    def state_layout(self) -> tuple[StateTensor, ...]:
        return state_layout(self.cfg, self.mode.dtype)


def architecture(name: str) -> Architecture:
    """The registry's view of this module (see `localchat.engine.models.REGISTRY`)."""
    return Architecture(
        name=name,
        state="rnn",
        config_from_hf=Rwkv4Config.from_hf,
        config_from_dict=Rwkv4Config.from_dict,
        build=Rwkv4ForCausalLM,
        hf_params=hf_params,
        cache_bytes=lambda cfg, dtype, batch, _tokens: state_bytes(cfg, batch, dtype),
        default_template="rwkv_world",
    )
