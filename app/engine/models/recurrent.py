"""What every recurrent (RWKV-style) architecture shares: the sequences of a forward's flat token
batch (`Segments`), the token shift, and the per-sequence state kept in TVM's RNN-state object
(`RnnState`, of vectors or per-head matrices, laid out by `StateTensor`s).

A forward runs on a flat list of tokens `x [n, channels]` holding B sequences back to back:
`ends[b]` (int32) is the position of the last token of sequence b (see `kernels.wkv`). A prefill
is B = 1, ends = [n - 1] (`prefill_ends`); a batched prefill takes the ends from its
`logit_positions`; a decode has one token per sequence, ends = [0, ..., B - 1] (`decode_ends`).

The state is one set of tensors per layer, the same set in every layer, each stored per sequence
as a flat vector by `vm.builtin.rnn_state_*`; a matrix state ([heads, N, N]) is stored as its
heads * N * N values and reshaped on the way in and out. The runtime object also does what the
engine needs of a state: a fork copies a sequence's state (at its end only), and with
`max_history` > 1 it keeps that many states per sequence, so `popn` can step back over up to
max_history - 1 single-token forwards (a prefill of several tokens cannot be undone).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tvm import relax as rx
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from localchat.engine.kernels import wkv, wkv7
from localchat.engine.models import probes
from localchat.engine.models.export import model_spec
from localchat.engine.models.layers import Linear

# ------------------------------------------------------------------------------------------------
# The sequences of a flat batch
# ------------------------------------------------------------------------------------------------


def segment_starts(ends: nn.Tensor, n: tirx.PrimExpr) -> nn.Tensor:
    """Per token, the sequence it opens (int32 [n]), or -1 when it continues one."""
    return op.tensor_expr_op(lambda e: wkv.segment_starts(e, n), "segment_starts", args=[ends])


def _const_ends(x: nn.Tensor, kind: str) -> nn.Tensor:
    def compute(t: te.Tensor) -> te.Tensor:
        n = t.shape[0]
        if kind == "prefill":
            return te.compute((1,), lambda i: (n - 1 + i).astype("int32"), name="ends")
        return te.compute((n,), lambda i: i.astype("int32"), name="ends")

    return op.tensor_expr_op(compute, f"{kind}_ends", args=[x])


def prefill_ends(x: nn.Tensor) -> nn.Tensor:
    """The ends of a single prefill of x [n, h]: [n - 1]."""
    return _const_ends(x, "prefill")


def decode_ends(x: nn.Tensor) -> nn.Tensor:
    """The ends of a batched decode of x [B, h] (one token per sequence): [0, ..., B - 1]."""
    return _const_ends(x, "decode")


def take_rows(x: nn.Tensor, rows: nn.Tensor) -> nn.Tensor:
    """x[rows] for int32 row ids that are in range by construction (the sequence ends)."""

    def compute(t: te.Tensor, r: te.Tensor) -> te.Tensor:
        return te.compute((r.shape[0], t.shape[1]), lambda i, j: t[r[i], j], name="take_rows")

    return op.tensor_expr_op(compute, "take_rows", args=[x, rows])


def token_mix(x: nn.Tensor, prev: nn.Tensor, start_of: nn.Tensor,
              *mixes: nn.Tensor) -> list[nn.Tensor]:
    """For each mix m: x * m + shifted(x) * (1 - m), one fused kernel (`wkv.token_mix`);
    shifted(x) is `token_shift`."""
    out = op.tensor_expr_op(wkv.token_mix, "token_mix", args=[x, prev, start_of, *mixes])
    return list(out) if isinstance(out, (list, tuple)) else [out]


def token_shift(x: nn.Tensor, prev: nn.Tensor, start_of: nn.Tensor) -> nn.Tensor:
    """The previous token of every token, [n, h]: x[t - 1] within a sequence, and for the first
    token of sequence b the state `prev[b]` (the last token its previous forward saw)."""

    def compute(t: te.Tensor, p: te.Tensor, s: te.Tensor) -> te.Tensor:
        def shifted(i, c):
            b = s[i]
            return tirx.if_then_else(b >= 0, p[tirx.max(b, 0), c], t[tirx.max(i - 1, 0), c])

        return te.compute(t.shape, shifted, name="token_shift")

    return op.tensor_expr_op(compute, "token_shift", args=[x, prev, start_of])


def project(lin: Linear, x: nn.Tensor, gemv: bool) -> nn.Tensor:
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


@dataclass(frozen=True)
class Segments:
    """Where the B sequences of one forward lie in its flat tokens x [n, channels], and the
    kind of step; a layer takes this instead of (ends, start_of, batch, gemv)."""

    ends: nn.Tensor  # int32 [B]: the position of each sequence's last token
    start_of: nn.Tensor  # int32 [n]: b for the token that opens sequence b, else -1
    gemv: bool  # one token per sequence (decode): Linears run as matrix-vector products

    @staticmethod
    def of(x: nn.Tensor, ends: nn.Tensor, gemv: bool = False) -> Segments:
        return Segments(ends, segment_starts(ends, x.shape[0]), gemv)

    @property
    def batch(self) -> tirx.PrimExpr:
        """B, the number of sequences."""
        return self.ends.shape[0]

    def last_rows(self, x: nn.Tensor) -> nn.Tensor:
        """Each sequence's last row of x [n, c]: [B, c] (what a token-shift state keeps)."""
        return take_rows(x, self.ends)

    def token_mix(self, x: nn.Tensor, prev: nn.Tensor, *mixes: nn.Tensor) -> list[nn.Tensor]:
        """`token_mix` of x with the state `prev` [B, c]."""
        return token_mix(x, prev, self.start_of, *mixes)

    def token_shift(self, x: nn.Tensor, prev: nn.Tensor) -> nn.Tensor:
        """`token_shift` of x with the state `prev` [B, c]."""
        return token_shift(x, prev, self.start_of)

    def project(self, lin: Linear, x: nn.Tensor) -> nn.Tensor:
        """`project` in this step's kind (GEMV for a decode)."""
        return project(lin, x, self.gemv)


# ------------------------------------------------------------------------------------------------
# The state
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StateTensor:
    """One tensor of each layer's state, per sequence: its shape ((size,) for a vector,
    (heads, N, N) for per-head matrices), dtype and the value every element starts at."""

    shape: tuple[int, ...]
    dtype: str
    init: float = 0.0

    @property
    def size(self) -> int:
        """Elements per sequence (as stored: flat)."""
        return math.prod(self.shape)

    def initial(self) -> np.ndarray:
        """The flat value of a new sequence."""
        return np.full(self.size, self.init, self.dtype)


def state_bytes(layout: Sequence[StateTensor], num_layers: int, max_batch_size: int,
                max_history: int = 1) -> int:
    """Bytes of the state of `max_batch_size` sequences, `max_history` slots each."""
    per_layer = sum(t.size * np.dtype(t.dtype).itemsize for t in layout)
    return per_layer * num_layers * max_batch_size * max_history


# The per-layer state of the matrix-state RWKVs (6 and 7), by state id, in the `rwkv` package's
# order: time-mix x_prev [C], the per-head matrix state [heads, N, N] float32, channel-mix x_prev.
ATT_X, ATT_KV, FFN_X = range(3)


def matrix_state_layout(hidden: int, head_size: int, dtype: str) -> tuple[StateTensor, ...]:
    """One layer's state of a matrix-state RWKV, by state id (ATT_X, ATT_KV, FFN_X)."""
    h = hidden // head_size
    return (StateTensor((hidden,), dtype), StateTensor((h, head_size, head_size), "float32"),
            StateTensor((hidden,), dtype))


def token_lerp(seg: Segments, x: nn.Tensor, prev: nn.Tensor, *mixes: nn.Tensor
               ) -> list[nn.Tensor]:
    """`kernels.wkv7.token_lerp` (x + (shifted(x) - x) * m) of x with the state `prev` [B, c],
    one output per mix (RWKV-6 and 7)."""
    out = op.tensor_expr_op(wkv7.token_lerp, "token_lerp", args=[x, prev, seg.start_of, *mixes])
    return list(out) if isinstance(out, (list, tuple)) else [out]


class RwkvBlock(nn.Module):
    """An RWKV layer: LayerNorm then time mix, LayerNorm then channel mix, each a residual
    branch that reads and writes the layer's state (RWKV-4 and 6; RWKV-7 also threads
    v_first). `att` and `ffn` are called as (x, seg, state, layer_id) -> (out, state)."""

    def __init__(self, att: nn.Module, ffn: nn.Module, hidden: int, eps: float,
                 dtype: str) -> None:
        self.ln1 = nn.LayerNorm(hidden, eps, dtype=dtype)
        self.ln2 = nn.LayerNorm(hidden, eps, dtype=dtype)
        self.att = att
        self.ffn = ffn

    def forward(self, x: nn.Tensor, seg: Segments, state: RnnState, layer_id: int):
        out, state = self.att(probes.probe("ln1", self.ln1(x)), seg, state, layer_id)
        x = x + out
        out, state = self.ffn(probes.probe("ln2", self.ln2(x)), seg, state, layer_id)
        return x + out, state


class RnnState(nn.Object):
    """TVM's runtime RNN state (`vm.builtin.rnn_state_*`) seen from the model: the state ids of
    a layer are the positions of its `StateTensor`s in the layout given to `create`."""

    @staticmethod
    def create(
        max_batch_size: tirx.Var,
        max_history: tirx.Var,
        num_layers: int,
        layout: Sequence[StateTensor],
        gpu: bool = False,
    ) -> RnnState:
        bb = rx.BlockBuilder.current()
        f_gets, f_sets = [], []
        for sid, tensor in enumerate(layout):
            get = wkv.state_get(tensor.size, tensor.dtype, sid, gpu)
            put = wkv.state_set(tensor.size, tensor.dtype, sid, gpu)
            f_gets.append(bb.add_func(get, f"rnn_state_get_{sid}"))
            f_sets.append(bb.add_func(put, f"rnn_state_set_{sid}"))
        expr = rx.call_pure_packed(
            "vm.builtin.rnn_state_create",
            rx.prim_value(num_layers),
            rx.prim_value(max_batch_size),
            rx.prim_value(max_history),
            rx.Tuple(f_gets),
            rx.Tuple(f_sets),
            rx.Tuple([rx.const(t.initial()) for t in layout]),
            ty_args=[rx.ObjectType()],
        )
        return RnnState(_expr=expr, _name="rnn_state")

    def get(self, layer_id: int, state_id: int, batch: tirx.PrimExpr,
            shape: int | tuple[int, ...], dtype: str) -> nn.Tensor:
        """State `state_id` of layer `layer_id` for the sequences of this forward: [B, size] for
        a vector (`shape` = size), [B, *shape] for a matrix state such as (heads, N, N)."""
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        size = math.prod(dims)
        bb = rx.BlockBuilder.current()
        flat = nn.Tensor(
            _expr=bb.emit(
                rx.call_dps_packed(
                    "vm.builtin.rnn_state_get",
                    [self._expr, rx.prim_value(layer_id), rx.prim_value(state_id)],
                    out_ty=rx.TensorType([batch, size], dtype),
                )
            )
        )
        return flat if len(dims) == 1 else op.reshape(flat, (batch, *dims))

    def set(self, layer_id: int, state_id: int, value: nn.Tensor) -> RnnState:
        """Store `value` ([B, size] or [B, *shape]) as the new state `state_id` of layer
        `layer_id`; it becomes current when the runtime ends the forward."""
        if value.ndim > 2:
            batch, *dims = value.shape
            value = op.reshape(value, (batch, math.prod(dims)))
        bb = rx.BlockBuilder.current()
        expr = bb.emit(
            rx.call_pure_packed(
                "vm.builtin.rnn_state_set",
                self._expr,
                rx.prim_value(layer_id),
                rx.prim_value(state_id),
                value._expr,
                ty_args=[rx.ObjectType()],
            )
        )
        return RnnState(_expr=expr, _name="rnn_state")


# ------------------------------------------------------------------------------------------------
# The exported model
# ------------------------------------------------------------------------------------------------


class RecurrentLM(nn.Module):
    """What every recurrent language model exports, over its own blocks: embed, (batch_)prefill,
    (batch_)decode, the RNN-state constructor and the debug build's prefill. A subclass sets
    `cfg`, `mode`, `target`, `embeddings`, `ln_out` and `head` and defines `_blocks` (the block
    stack over a flat batch, probing each block's output) and `state_layout` (one layer's
    state)."""

    cfg: Any
    mode: Any
    target: Any

    def _blocks(self, x: nn.Tensor, seg: Segments, state: RnnState) -> tuple[nn.Tensor, RnnState]:
        raise NotImplementedError

    def state_layout(self) -> Sequence[StateTensor]:
        """The state of one layer of a sequence, by state id."""
        raise NotImplementedError

    def _logits(self, x: nn.Tensor, gemv: bool) -> nn.Tensor:
        logits = project(self.head, self.ln_out(x), gemv)
        return logits.astype("float32") if logits.dtype != "float32" else logits

    def _forward(self, x: nn.Tensor, ends: nn.Tensor, state: RnnState, gemv: bool = False):
        """x [n, h] holding B sequences ending at `ends` -> logits [B, vocab] (float32).
        `gemv`: one token per sequence (decode), so Linears run as matrix-vector products."""
        seg = Segments.of(x, ends, gemv)
        x, state = self._blocks(x, seg, state)
        # the head always sees one row per sequence
        return self._logits(seg.last_rows(x), True), state

    def embed(self, input_ids: nn.Tensor) -> nn.Tensor:
        return self.embeddings(input_ids)

    def prefill(self, input_embed: nn.Tensor, rnn_state: RnnState):
        logits, state = self._forward(input_embed, prefill_ends(input_embed), rnn_state)
        return op.reshape(logits, (1, 1, self.cfg.vocab_size)), state

    def decode(self, input_embed: nn.Tensor, rnn_state: RnnState):
        logits, state = self._forward(input_embed, decode_ends(input_embed), rnn_state, True)
        return op.reshape(logits, (1, 1, self.cfg.vocab_size)), state

    def batch_prefill(self, input_embeds: nn.Tensor, logit_positions: nn.Tensor, rnn_state):
        return self._forward(input_embeds, logit_positions, rnn_state)

    def batch_decode(self, input_embeds: nn.Tensor, rnn_state: RnnState):
        return self._forward(input_embeds, decode_ends(input_embeds), rnn_state, True)

    def debug_prefill(self, input_embed: nn.Tensor, rnn_state: RnnState):
        """A debug build's prefill: logits at every position, then every probe (`probes`)."""
        with probes.recording() as rec:
            seg = Segments.of(input_embed, prefill_ends(input_embed))
            x, state = self._blocks(input_embed, seg, rnn_state)
        self.debug_probes = rec.names()
        return (self._logits(x, False), *rec.outputs()), state

    def create_rnn_state(self, max_batch_size: tirx.Var, max_history: tirx.Var) -> RnnState:
        gpu = self.target.kind.name != "llvm"
        return RnnState.create(max_batch_size, max_history, self.cfg.num_hidden_layers,
                               self.state_layout(), gpu)

    def get_default_spec(self) -> nn.spec.ModuleSpec:
        return model_spec(self, hidden_size=self.cfg.hidden_size, dtype=self.mode.dtype,
                          state="rnn", state_type=RnnState)

    def get_debug_spec(self) -> nn.spec.ModuleSpec:
        return probes.debug_spec(self, hidden_size=self.cfg.hidden_size, dtype=self.mode.dtype,
                                 state="rnn", state_type=RnnState)
