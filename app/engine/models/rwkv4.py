"""RWKV-4 (the World models among them) in `tvm.relax.frontend.nn`, state in TVM's RNN state.

Per block: LayerNorm -> time-mix -> residual, LayerNorm -> channel-mix -> residual; block 0's
pre-LayerNorm on the embeddings is folded into the embedding table at conversion (it is a
per-row function of the row), then a final LayerNorm and the head.

Every exported function runs one code path on a flat list of tokens from B sequences (see
`kernels_wkv`): prefill is B = 1, batch_prefill takes the sequence ends from `logit_positions`
(the runtime passes the last position of each sequence), decode / batch_decode have one token per
sequence. The recurrent state of each sequence lives in TVM's RNN-state object, five tensors per
layer: 0 = time-mix x_prev, 1 = a, 2 = b, 3 = p (the WKV numerator, denominator and running
max exponent, always float32), 4 = channel-mix x_prev. x_prev is the LayerNorm output of the
sequence's last token, as in transformers' RwkvForCausalLM.

Numerics follow transformers' RwkvForCausalLM in eval mode: `time_decay` is stored as
-exp(time_decay) (float32, like time_first, in every quantization mode); with rescale_every = R > 0
the time-mix output and channel-mix value weights of layer i are divided by 2**(i // R) at
conversion and the hidden state is halved after every R-th layer at run time (both exact in
binary floating point; LayerNorm makes the result scale-free up to its epsilon).

Checkpoints: the HF layout (`rwkv.embeddings`, `rwkv.blocks.N.attention.*`, ...) and the original
BlinkDL `.pth` layout (`emb.weight`, `blocks.N.att.*`, `blocks.N.ffn.*`, `blocks.0.ln0`); the
converter reads either from a folder. A lone `.pth` file becomes such a folder with
`prepare_pth_source` (or `python -m localchat.engine.models.rwkv4 FILE.pth FOLDER`): a config.json
inferred from the tensor shapes, the checkpoint linked in, the World vocabulary copied when it lies
next to the checkpoint; then `localchat convert FOLDER -o OUT` as for an HF folder.

Decode (one token per sequence) runs its Linears in `kernels_gemv` (weights unpacked in
registers); prefill uses the blocked kernels of `kernels_cpu` through `layers.Linear`; GPUs get
dequantize + matmul and the GPU variants of the scan and state kernels.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tvm import relax as rx
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.target import Target

from localchat.engine import kernels_gemv, kernels_wkv
from localchat.engine.models.layers import Embedding, Linear
from localchat.engine.quantization import QuantMode
from localchat.errors import ModelConfigError, UnsupportedModelError, WeightsError

HF_ARCHITECTURES = ("RwkvForCausalLM",)
MODEL_TYPES = ("rwkv",)
DEFAULT_PREFILL_CHUNK = 512
# An RNN has no context limit; this only bounds the runtime's length check.
DEFAULT_CONTEXT = 1 << 20
STATE_INIT_P = -1.0e30  # "minus infinity" for the running max exponent, finite under subtraction
WORLD_VOCAB = "rwkv_vocab_v20230424.txt"

# state ids within a layer
ATT_X, ATT_A, ATT_B, ATT_P, FFN_X = range(5)


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
        for name, size in (
            ("hidden_size", cfg.hidden_size),
            ("attention_hidden_size", cfg.attention_hidden_size),
            ("intermediate_size", cfg.intermediate_size),
        ):
            if size % 32:
                raise UnsupportedModelError(f"{name} {size} is not a multiple of 32")
        return cfg


def state_bytes(cfg: Rwkv4Config, max_batch_size: int, dtype: str = "float32") -> int:
    """Bytes of the recurrent state for `max_batch_size` sequences (one history slot each)."""
    itemsize = np.dtype(dtype).itemsize
    per_layer = 2 * cfg.hidden_size * itemsize + 3 * cfg.attention_hidden_size * 4
    return per_layer * cfg.num_hidden_layers * max_batch_size


# ------------------------------------------------------------------------------------------------
# The RNN state object
# ------------------------------------------------------------------------------------------------


class RnnState(nn.Object):
    """TVM's runtime RNN state (`vm.builtin.rnn_state_*`) seen from the model."""

    @staticmethod
    def create(
        max_batch_size: tirx.Var,
        max_history: tirx.Var,
        num_layers: int,
        init_values: list[np.ndarray],
        gpu: bool = False,
    ) -> RnnState:
        bb = rx.BlockBuilder.current()
        f_gets, f_sets = [], []
        for sid, init in enumerate(init_values):
            size, dtype = int(init.shape[0]), str(init.dtype)
            get = kernels_wkv.state_get(size, dtype, sid, gpu)
            put = kernels_wkv.state_set(size, dtype, sid, gpu)
            f_gets.append(bb.add_func(get, f"rnn_state_get_{sid}"))
            f_sets.append(bb.add_func(put, f"rnn_state_set_{sid}"))
        expr = rx.call_pure_packed(
            "vm.builtin.rnn_state_create",
            rx.prim_value(num_layers),
            rx.prim_value(max_batch_size),
            rx.prim_value(max_history),
            rx.Tuple(f_gets),
            rx.Tuple(f_sets),
            rx.Tuple([rx.const(v) for v in init_values]),
            ty_args=[rx.ObjectType()],
        )
        return RnnState(_expr=expr, _name="rnn_state")

    def get(self, layer_id: int, state_id: int, batch: tirx.PrimExpr, size: int, dtype: str):
        """The state `state_id` of layer `layer_id` for the sequences of this forward, [B, size]."""
        bb = rx.BlockBuilder.current()
        return nn.Tensor(
            _expr=bb.emit(
                rx.call_dps_packed(
                    "vm.builtin.rnn_state_get",
                    [self._expr, rx.prim_value(layer_id), rx.prim_value(state_id)],
                    out_ty=rx.TensorType([batch, size], dtype),
                )
            )
        )

    def set(self, layer_id: int, state_id: int, value: nn.Tensor) -> RnnState:
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
# Graph helpers
# ------------------------------------------------------------------------------------------------


def _segment_starts(ends: nn.Tensor, n: tirx.PrimExpr) -> nn.Tensor:
    return op.tensor_expr_op(
        lambda e: kernels_wkv.segment_starts(e, n), "segment_starts", args=[ends]
    )


def _token_mix(x: nn.Tensor, prev: nn.Tensor, start_of: nn.Tensor, *mixes: nn.Tensor):
    out = op.tensor_expr_op(kernels_wkv.token_mix, "token_mix", args=[x, prev, start_of, *mixes])
    return out if isinstance(out, (list, tuple)) else [out]


def _const_ends(x: nn.Tensor, kind: str) -> nn.Tensor:
    """ends for a single prefill ([n - 1]) or a batched decode ([0, ..., B - 1])."""

    def compute(t: te.Tensor) -> te.Tensor:
        n = t.shape[0]
        if kind == "prefill":
            return te.compute((1,), lambda i: (n - 1 + i).astype("int32"), name="ends")
        return te.compute((n,), lambda i: i.astype("int32"), name="ends")

    return op.tensor_expr_op(compute, f"{kind}_ends", args=[x])


def _has_avx512(target: Target) -> bool:
    if target.kind.name != "llvm":
        return False
    from tvm.target import codegen

    try:
        return bool(codegen.llvm_cpu_has_features(["avx512f"], target))
    except Exception:  # an LLVM without x86, or a CPU it does not know
        return False


def _project(lin: Linear, x: nn.Tensor, gemv: bool, avx512: bool = False) -> nn.Tensor:
    """lin(x) for x [rows, in]; with `gemv` (decode: a few rows) on the CPU, in the
    matrix-vector kernels of `kernels_gemv` that unpack weights in registers."""
    k, n, mode = lin.in_features, lin.out_features, lin.mode
    if lin.target_kind != "llvm":
        # GPUs: dequantize + matmul scheduled by dlight, in the shapes the Llama family uses:
        # [1, rows, k] for prefill, [rows, 1, k] for decode (dlight's Matmul rule segfaults in
        # TVM 0.27 on a decode-sized dynamic row count in the middle axis)
        rows = x.shape[0]
        shape = (rows, 1, k) if gemv else (1, rows, k)
        return op.reshape(lin(op.reshape(x, shape)), (rows, n))
    if not gemv or lin.bias is not None:
        return lin(x)
    if mode.quantized and k % kernels_gemv.Q4_K_MULTIPLE == 0:
        func = kernels_gemv.gemv_q4(k, n, mode.dtype, avx512)
        args = [x, lin.weight, lin.scale]
    elif not mode.quantized and k % kernels_gemv.LANES == 0:
        func, args = kernels_gemv.gemv_f(k, n, mode.dtype), [x, lin.weight]
    else:
        return lin(x)
    out = nn.Tensor.placeholder((x.shape[0], n), mode.dtype)
    return op.tensor_ir_op(func, "gemv", args=args, out=out)


def _take_rows(x: nn.Tensor, rows: nn.Tensor) -> nn.Tensor:
    """x[rows] for int32 row ids that are in range by construction (the sequence ends)."""

    def compute(t: te.Tensor, r: te.Tensor) -> te.Tensor:
        return te.compute((r.shape[0], t.shape[1]), lambda i, j: t[r[i], j], name="take_rows")

    return op.tensor_expr_op(compute, "take_rows", args=[x, rows])


# ------------------------------------------------------------------------------------------------
# Modules
# ------------------------------------------------------------------------------------------------


class TimeMix(nn.Module):
    def __init__(self, cfg: Rwkv4Config, mode: QuantMode, tk: str, avx512: bool) -> None:
        h, a, dt = cfg.hidden_size, cfg.attention_hidden_size, mode.dtype
        self.avx512 = avx512
        self.gpu = tk != "llvm"
        self.attention_size = a
        self.dtype = dt
        self.time_decay = nn.Parameter((a,), "float32")  # -exp(time_decay)
        self.time_first = nn.Parameter((a,), "float32")
        self.time_mix_k = nn.Parameter((h,), dt)
        self.time_mix_v = nn.Parameter((h,), dt)
        self.time_mix_r = nn.Parameter((h,), dt)
        self.key = Linear(h, a, False, mode, tk)
        self.value = Linear(h, a, False, mode, tk)
        self.receptance = Linear(h, a, False, mode, tk)
        self.output = Linear(a, h, False, mode, tk)

    def forward(self, xx, ends, start_of, state: RnnState, layer_id: int, batch, gemv: bool):
        a, dt = self.attention_size, self.dtype
        prev = state.get(layer_id, ATT_X, batch, xx.shape[-1], dt)
        aa = state.get(layer_id, ATT_A, batch, a, "float32")
        bb = state.get(layer_id, ATT_B, batch, a, "float32")
        pp = state.get(layer_id, ATT_P, batch, a, "float32")
        xk, xv, xr = _token_mix(
            xx, prev, start_of, self.time_mix_k, self.time_mix_v, self.time_mix_r
        )
        k = _project(self.key, xk, gemv, self.avx512)
        v = _project(self.value, xv, gemv, self.avx512)
        r = op.sigmoid(_project(self.receptance, xr, gemv, self.avx512))
        n = xx.shape[0]
        y, aa, bb, pp = op.tensor_ir_op(
            kernels_wkv.wkv_scan(a, dt, self.gpu),
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
        return _project(self.output, r * y, gemv, self.avx512), state


class ChannelMix(nn.Module):
    def __init__(self, cfg: Rwkv4Config, mode: QuantMode, tk: str, avx512: bool) -> None:
        h, f, dt = cfg.hidden_size, cfg.intermediate_size, mode.dtype
        self.avx512 = avx512
        self.dtype = dt
        self.time_mix_k = nn.Parameter((h,), dt)
        self.time_mix_r = nn.Parameter((h,), dt)
        self.key = Linear(h, f, False, mode, tk)
        self.receptance = Linear(h, h, False, mode, tk)
        self.value = Linear(f, h, False, mode, tk)

    def forward(self, xx, ends, start_of, state: RnnState, layer_id: int, batch, gemv: bool):
        prev = state.get(layer_id, FFN_X, batch, xx.shape[-1], self.dtype)
        xk, xr = _token_mix(xx, prev, start_of, self.time_mix_k, self.time_mix_r)
        k = op.square(op.relu(_project(self.key, xk, gemv, self.avx512)))
        r = op.sigmoid(_project(self.receptance, xr, gemv, self.avx512))
        state = state.set(layer_id, FFN_X, _take_rows(xx, ends))
        return r * _project(self.value, k, gemv, self.avx512), state


class Block(nn.Module):
    def __init__(self, cfg: Rwkv4Config, mode: QuantMode, tk: str, avx512: bool) -> None:
        eps, h, dt = cfg.layer_norm_epsilon, cfg.hidden_size, mode.dtype
        self.ln1 = nn.LayerNorm(h, eps, dtype=dt)
        self.ln2 = nn.LayerNorm(h, eps, dtype=dt)
        self.att = TimeMix(cfg, mode, tk, avx512)
        self.ffn = ChannelMix(cfg, mode, tk, avx512)

    def forward(self, x, ends, start_of, state: RnnState, layer_id: int, batch, gemv: bool):
        out, state = self.att(self.ln1(x), ends, start_of, state, layer_id, batch, gemv)
        x = x + out
        out, state = self.ffn(self.ln2(x), ends, start_of, state, layer_id, batch, gemv)
        return x + out, state


class Rwkv4ForCausalLM(nn.Module):
    """The exported model: embed, (batch_)prefill, (batch_)decode and the RNN-state constructor."""

    def __init__(self, cfg: Rwkv4Config, mode: QuantMode, target: Target) -> None:
        tk = target.kind.name
        self.cfg = cfg
        self.mode = mode
        self.target = target
        h = cfg.hidden_size
        self.avx512 = _has_avx512(target)
        self.embeddings = Embedding(cfg.vocab_size, h, mode, tk)  # pre-LayerNorm folded in
        self.blocks = nn.ModuleList(
            [Block(cfg, mode, tk, self.avx512) for _ in range(cfg.num_hidden_layers)]
        )
        self.ln_out = nn.LayerNorm(h, cfg.layer_norm_epsilon, dtype=mode.dtype)
        self.head = Linear(h, cfg.vocab_size, False, mode, tk)

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
        logits = _project(self.head, self.ln_out(_take_rows(x, ends)), True, self.avx512)
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
        cfg, dt = self.cfg, self.mode.dtype
        h, a = cfg.hidden_size, cfg.attention_hidden_size
        init = [
            np.zeros(h, dt),
            np.zeros(a, "float32"),
            np.zeros(a, "float32"),
            np.full(a, STATE_INIT_P, "float32"),
            np.zeros(h, dt),
        ]
        gpu = self.target.kind.name != "llvm"
        return RnnState.create(max_batch_size, max_history, cfg.num_hidden_layers, init, gpu)

    def get_default_spec(self) -> nn.spec.ModuleSpec:
        h, dt = self.cfg.hidden_size, self.mode.dtype
        packed = {"$": {"param_mode": "packed", "effect_mode": "none"}}
        state = nn.spec.Object(object_type=RnnState)
        spec = {
            "embed": {"input_ids": nn.spec.Tensor(["seq_len"], "int32"), **packed},
            "prefill": {
                "input_embed": nn.spec.Tensor(["seq_len", h], dt),
                "rnn_state": state,
                **packed,
            },
            "decode": {"input_embed": nn.spec.Tensor([1, h], dt), "rnn_state": state, **packed},
            "batch_prefill": {
                "input_embeds": nn.spec.Tensor(["seq_len", h], dt),
                "logit_positions": nn.spec.Tensor(["batch_size"], "int32"),
                "rnn_state": state,
                **packed,
            },
            "batch_decode": {
                "input_embeds": nn.spec.Tensor(["batch_size", h], dt),
                "rnn_state": state,
                **packed,
            },
            "create_rnn_state": {
                "max_batch_size": int,
                "max_history": int,
                "$": {"param_mode": "none", "effect_mode": "none"},
            },
        }
        return nn.spec.ModuleSpec.from_raw(spec, self)


# ------------------------------------------------------------------------------------------------
# Weights
# ------------------------------------------------------------------------------------------------

# our name within a block -> (HF name, BlinkDL name) within a block
_BLOCK_NAMES = {
    "ln1.weight": ("ln1.weight", "ln1.weight"),
    "ln1.bias": ("ln1.bias", "ln1.bias"),
    "ln2.weight": ("ln2.weight", "ln2.weight"),
    "ln2.bias": ("ln2.bias", "ln2.bias"),
    "att.time_decay": ("attention.time_decay", "att.time_decay"),
    "att.time_first": ("attention.time_first", "att.time_first"),
    "att.time_mix_k": ("attention.time_mix_key", "att.time_mix_k"),
    "att.time_mix_v": ("attention.time_mix_value", "att.time_mix_v"),
    "att.time_mix_r": ("attention.time_mix_receptance", "att.time_mix_r"),
    "att.key.weight": ("attention.key.weight", "att.key.weight"),
    "att.value.weight": ("attention.value.weight", "att.value.weight"),
    "att.receptance.weight": ("attention.receptance.weight", "att.receptance.weight"),
    "att.output.weight": ("attention.output.weight", "att.output.weight"),
    "ffn.time_mix_k": ("feed_forward.time_mix_key", "ffn.time_mix_k"),
    "ffn.time_mix_r": ("feed_forward.time_mix_receptance", "ffn.time_mix_r"),
    "ffn.key.weight": ("feed_forward.key.weight", "ffn.key.weight"),
    "ffn.receptance.weight": ("feed_forward.receptance.weight", "ffn.receptance.weight"),
    "ffn.value.weight": ("feed_forward.value.weight", "ffn.value.weight"),
}
_TOP_NAMES = {
    "emb": ("rwkv.embeddings.weight", "emb.weight"),
    "pre_ln.weight": ("rwkv.blocks.0.pre_ln.weight", "blocks.0.ln0.weight"),
    "pre_ln.bias": ("rwkv.blocks.0.pre_ln.bias", "blocks.0.ln0.bias"),
    "ln_out.weight": ("rwkv.ln_out.weight", "ln_out.weight"),
    "ln_out.bias": ("rwkv.ln_out.bias", "ln_out.bias"),
    "head.weight": ("head.weight", "head.weight"),
}


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return ((x - mu) / np.sqrt(var + eps) * w.astype(np.float64) + b.astype(np.float64)).astype(
        np.float32
    )


def hf_params(
    cfg: Rwkv4Config, get: Callable[[str], np.ndarray], names: set[str]
) -> Iterator[tuple[str, np.ndarray]]:
    """Our float parameters, by our names, from an HF or a BlinkDL checkpoint."""
    blink = "emb.weight" in names
    col = 1 if blink else 0

    def top(key: str) -> np.ndarray:
        return np.asarray(get(_TOP_NAMES[key][col]), dtype=np.float32)

    emb = top("emb")
    eps = cfg.layer_norm_epsilon
    yield "embeddings.weight", _layer_norm(emb, top("pre_ln.weight"), top("pre_ln.bias"), eps)
    every = cfg.rescale_every
    for i in range(cfg.num_hidden_layers):
        prefix = f"blocks.{i}." if blink else f"rwkv.blocks.{i}."
        for ours, pair in _BLOCK_NAMES.items():
            value = np.asarray(get(prefix + pair[col]), dtype=np.float32)
            if ours.startswith("att.time_") or ours.startswith("ffn.time_"):
                value = value.reshape(-1)
            if ours == "att.time_decay":
                value = -np.exp(value)
            if every > 0 and ours in ("att.output.weight", "ffn.value.weight"):
                value = value / np.float32(2 ** (i // every))
            yield f"blocks.{i}.{ours}", value
    yield "ln_out.weight", top("ln_out.weight")
    yield "ln_out.bias", top("ln_out.bias")
    if _TOP_NAMES["head.weight"][col] in names:
        yield "head.weight", top("head.weight")
    else:  # a tied head is the raw embedding (ours has the pre-LayerNorm folded in)
        yield "head.weight", emb


# ------------------------------------------------------------------------------------------------
# BlinkDL .pth files
# ------------------------------------------------------------------------------------------------


def config_from_checkpoint(path: Path, rescale_every: int = 6) -> dict[str, Any]:
    """An HF-style config.json for a BlinkDL RWKV-4 `.pth`, inferred from its tensor shapes."""
    from localchat.engine.weights import open_checkpoint_file

    src = open_checkpoint_file(Path(path))
    names = src.names
    if "emb.weight" not in names or "blocks.0.att.time_first" not in names:
        raise WeightsError(f"{Path(path).name}: not an RWKV-4 checkpoint (no emb / att.time_first)")
    if any(".ln_x." in n or ".time_faaaa" in n or ".att.gate." in n for n in names):
        raise UnsupportedModelError(
            f"{Path(path).name}: an RWKV-5/6 checkpoint (only RWKV-4 is supported)"
        )
    layers = 1 + max(int(m.group(1)) for n in names if (m := re.match(r"blocks\.(\d+)\.", n)))
    vocab, hidden = src.get("emb.weight").shape
    return {
        "architectures": ["RwkvForCausalLM"],
        "model_type": "rwkv",
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "attention_hidden_size": int(src.get("blocks.0.att.key.weight").shape[0]),
        "intermediate_size": int(src.get("blocks.0.ffn.key.weight").shape[0]),
        "num_hidden_layers": int(layers),
        "layer_norm_epsilon": 1e-5,
        "rescale_every": int(rescale_every),
        "bos_token_id": 0,
        "eos_token_id": 0,
        "tie_word_embeddings": False,
    }


def prepare_pth_source(pth: Path, dest: Path, *, rescale_every: int = 6) -> Path:
    """Make `dest` a folder the converter reads: config.json inferred from `pth`, the checkpoint
    (linked, or copied where links are not possible) and the World vocabulary when it lies next
    to the checkpoint. Returns `dest`."""
    pth, dest = Path(pth), Path(dest)
    config = config_from_checkpoint(pth, rescale_every)
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / pth.name
    if not target.exists():
        try:
            os.symlink(pth.resolve(), target)
        except OSError:
            shutil.copy2(pth, target)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    vocab = pth.parent / WORLD_VOCAB
    if vocab.exists() and not (dest / WORLD_VOCAB).exists():
        shutil.copy2(vocab, dest / WORLD_VOCAB)
    return dest


if __name__ == "__main__":  # python -m localchat.engine.models.rwkv4 FILE.pth FOLDER
    import argparse

    parser = argparse.ArgumentParser(
        description="Make a converter-ready folder from a BlinkDL RWKV-4 .pth "
        "(then: localchat convert FOLDER -o OUT)"
    )
    parser.add_argument("pth", type=Path)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--rescale-every", type=int, default=6)
    ns = parser.parse_args()
    print(prepare_pth_source(ns.pth, ns.folder, rescale_every=ns.rescale_every))
