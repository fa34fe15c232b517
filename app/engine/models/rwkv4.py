"""RWKV-4 (the World models among them) in `tvm.relax.frontend.nn`: its config, the model and
its registry entry; the recurrent state lives in `rwkv4_state`, the checkpoint names in
`rwkv4_weights`, BlinkDL `.pth` preparation in `rwkv4_pth`.

Per block: LayerNorm -> time-mix -> residual, LayerNorm -> channel-mix -> residual; block 0's
pre-LayerNorm on the embeddings is folded into the embedding table at conversion (it is a
per-row function of the row), then a final LayerNorm and the head.

Every exported function runs one code path on a flat list of tokens from B sequences (see
`kernels.wkv`): prefill is B = 1, batch_prefill takes the sequence ends from `logit_positions`
(the runtime passes the last position of each sequence), decode / batch_decode have one token per
sequence. The recurrent state of each sequence lives in TVM's RNN-state object, five tensors per
layer (`rwkv4_state`); x_prev is the LayerNorm output of the sequence's last token, as in
transformers' RwkvForCausalLM.

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

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.target import Target

from localchat.engine.build.quantization import QuantMode
from localchat.engine.kernels import wkv
from localchat.engine.models import Architecture
from localchat.engine.models.export import model_spec
from localchat.engine.models.layers import BuildContext, Embedding, Linear
from localchat.engine.models.rwkv4_state import (
    ATT_A,
    ATT_B,
    ATT_P,
    ATT_X,
    FFN_X,
    RnnState,
    initial_values,
    state_bytes,
)
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
# Graph helpers
# ------------------------------------------------------------------------------------------------


def _segment_starts(ends: nn.Tensor, n: tirx.PrimExpr) -> nn.Tensor:
    return op.tensor_expr_op(lambda e: wkv.segment_starts(e, n), "segment_starts", args=[ends])


def _token_mix(x: nn.Tensor, prev: nn.Tensor, start_of: nn.Tensor, *mixes: nn.Tensor):
    out = op.tensor_expr_op(wkv.token_mix, "token_mix", args=[x, prev, start_of, *mixes])
    return out if isinstance(out, (list, tuple)) else [out]


def _const_ends(x: nn.Tensor, kind: str) -> nn.Tensor:
    """ends for a single prefill ([n - 1]) or a batched decode ([0, ..., B - 1])."""

    def compute(t: te.Tensor) -> te.Tensor:
        n = t.shape[0]
        if kind == "prefill":
            return te.compute((1,), lambda i: (n - 1 + i).astype("int32"), name="ends")
        return te.compute((n,), lambda i: i.astype("int32"), name="ends")

    return op.tensor_expr_op(compute, f"{kind}_ends", args=[x])


def _project(lin: Linear, x: nn.Tensor, gemv: bool) -> nn.Tensor:
    """lin(x) for x [rows, in]; with `gemv` (decode: a few rows) on the CPU, in the
    matrix-vector kernels of `kernels.gemv` that unpack weights in registers."""
    k, n = lin.in_features, lin.out_features
    if lin.target_kind != "llvm":
        # GPUs: dequantize + matmul scheduled by dlight, in the shapes the Llama family uses:
        # [1, rows, k] for prefill, [rows, 1, k] for decode (dlight's Matmul rule segfaults in
        # TVM 0.27 on a decode-sized dynamic row count in the middle axis)
        rows = x.shape[0]
        shape = (rows, 1, k) if gemv else (1, rows, k)
        return op.reshape(lin(op.reshape(x, shape)), (rows, n))
    return lin(x, gemv=gemv)


def _take_rows(x: nn.Tensor, rows: nn.Tensor) -> nn.Tensor:
    """x[rows] for int32 row ids that are in range by construction (the sequence ends)."""

    def compute(t: te.Tensor, r: te.Tensor) -> te.Tensor:
        return te.compute((r.shape[0], t.shape[1]), lambda i, j: t[r[i], j], name="take_rows")

    return op.tensor_expr_op(compute, "take_rows", args=[x, rows])


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

    def forward(self, xx, ends, start_of, state: RnnState, layer_id: int, batch, gemv: bool):
        a, dt = self.attention_size, self.dtype
        prev = state.get(layer_id, ATT_X, batch, xx.shape[-1], dt)
        aa = state.get(layer_id, ATT_A, batch, a, "float32")
        bb = state.get(layer_id, ATT_B, batch, a, "float32")
        pp = state.get(layer_id, ATT_P, batch, a, "float32")
        xk, xv, xr = _token_mix(
            xx, prev, start_of, self.time_mix_k, self.time_mix_v, self.time_mix_r
        )
        k = _project(self.key, xk, gemv)
        v = _project(self.value, xv, gemv)
        r = op.sigmoid(_project(self.receptance, xr, gemv))
        n = xx.shape[0]
        y, aa, bb, pp = op.tensor_ir_op(
            wkv.wkv_scan(a, dt, self.gpu),
            "wkv_scan",
            args=[k, v, self.time_decay, self.time_first, aa, bb, pp, ends],
            out=[
                nn.Tensor.placeholder((n, a), dt),
                nn.Tensor.placeholder((batch, a), "float32"),
                nn.Tensor.placeholder((batch, a), "float32"),
                nn.Tensor.placeholder((batch, a), "float32"),
            ],
        )
        state = state.set(layer_id, ATT_X, _take_rows(xx, ends))
        state = state.set(layer_id, ATT_A, aa)
        state = state.set(layer_id, ATT_B, bb)
        state = state.set(layer_id, ATT_P, pp)
        return _project(self.output, r * y, gemv), state


class ChannelMix(nn.Module):
    def __init__(self, cfg: Rwkv4Config, ctx: BuildContext) -> None:
        h, f, dt = cfg.hidden_size, cfg.intermediate_size, ctx.dtype
        self.dtype = dt
        self.time_mix_k = nn.Parameter((h,), dt)
        self.time_mix_r = nn.Parameter((h,), dt)
        self.key = Linear(h, f, False, ctx)
        self.receptance = Linear(h, h, False, ctx)
        self.value = Linear(f, h, False, ctx)

    def forward(self, xx, ends, start_of, state: RnnState, layer_id: int, batch, gemv: bool):
        prev = state.get(layer_id, FFN_X, batch, xx.shape[-1], self.dtype)
        xk, xr = _token_mix(xx, prev, start_of, self.time_mix_k, self.time_mix_r)
        k = op.square(op.relu(_project(self.key, xk, gemv)))
        r = op.sigmoid(_project(self.receptance, xr, gemv))
        state = state.set(layer_id, FFN_X, _take_rows(xx, ends))
        return r * _project(self.value, k, gemv), state


class Block(nn.Module):
    def __init__(self, cfg: Rwkv4Config, ctx: BuildContext) -> None:
        eps, h, dt = cfg.layer_norm_epsilon, cfg.hidden_size, ctx.dtype
        self.ln1 = nn.LayerNorm(h, eps, dtype=dt)
        self.ln2 = nn.LayerNorm(h, eps, dtype=dt)
        self.att = TimeMix(cfg, ctx)
        self.ffn = ChannelMix(cfg, ctx)

    def forward(self, x, ends, start_of, state: RnnState, layer_id: int, batch, gemv: bool):
        out, state = self.att(self.ln1(x), ends, start_of, state, layer_id, batch, gemv)
        x = x + out
        out, state = self.ffn(self.ln2(x), ends, start_of, state, layer_id, batch, gemv)
        return x + out, state


class Rwkv4ForCausalLM(nn.Module):
    """The exported model: embed, (batch_)prefill, (batch_)decode and the RNN-state constructor."""

    def __init__(self, cfg: Rwkv4Config, mode: QuantMode, target: Target) -> None:
        ctx = BuildContext(mode, target)
        self.cfg = cfg
        self.mode = mode
        self.target = target
        h = cfg.hidden_size
        self.embeddings = Embedding(cfg.vocab_size, h, ctx)  # pre-LayerNorm folded in
        self.blocks = nn.ModuleList([Block(cfg, ctx) for _ in range(cfg.num_hidden_layers)])
        self.ln_out = nn.LayerNorm(h, cfg.layer_norm_epsilon, dtype=mode.dtype)
        self.head = Linear(h, cfg.vocab_size, False, ctx, head=True)

    def _forward(self, x: nn.Tensor, ends: nn.Tensor, state: RnnState, gemv: bool = False):
        """x [n, h] holding B sequences ending at `ends` -> logits [B, vocab] (float32).
        `gemv`: one token per sequence (decode), so Linears run as matrix-vector products."""
        batch = ends.shape[0]
        start_of = _segment_starts(ends, x.shape[0])
        every = self.cfg.rescale_every
        for i, block in enumerate(self.blocks):
            x, state = block(x, ends, start_of, state, i, batch, gemv)
            if every > 0 and (i + 1) % every == 0:
                x = x / 2.0
        # the head always sees one row per sequence
        logits = _project(self.head, self.ln_out(_take_rows(x, ends)), True)
        if logits.dtype != "float32":
            logits = logits.astype("float32")
        return logits, state

    def embed(self, input_ids: nn.Tensor) -> nn.Tensor:
        return self.embeddings(input_ids)

    def prefill(self, input_embed: nn.Tensor, rnn_state: RnnState):
        logits, state = self._forward(input_embed, _const_ends(input_embed, "prefill"), rnn_state)
        return op.reshape(logits, (1, 1, self.cfg.vocab_size)), state

    def decode(self, input_embed: nn.Tensor, rnn_state: RnnState):
        ends = _const_ends(input_embed, "decode")
        logits, state = self._forward(input_embed, ends, rnn_state, gemv=True)
        return op.reshape(logits, (1, 1, self.cfg.vocab_size)), state

    def batch_prefill(self, input_embeds: nn.Tensor, logit_positions: nn.Tensor, rnn_state):
        return self._forward(input_embeds, logit_positions, rnn_state)

    def batch_decode(self, input_embeds: nn.Tensor, rnn_state: RnnState):
        ends = _const_ends(input_embeds, "decode")
        return self._forward(input_embeds, ends, rnn_state, gemv=True)

    def create_rnn_state(self, max_batch_size: tirx.Var, max_history: tirx.Var) -> RnnState:
        cfg = self.cfg
        init = initial_values(cfg, self.mode.dtype)
        gpu = self.target.kind.name != "llvm"
        return RnnState.create(max_batch_size, max_history, cfg.num_hidden_layers, init, gpu)

    def get_default_spec(self) -> nn.spec.ModuleSpec:
        return model_spec(self, hidden_size=self.cfg.hidden_size, dtype=self.mode.dtype,
                          state="rnn", state_type=RnnState)


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
