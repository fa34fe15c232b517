"""RWKV-4's recurrent state: its layout (five tensors per layer), its size, and `RnnState`, the
model's view of TVM's runtime RNN-state object (`vm.builtin.rnn_state_*`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from tvm import relax as rx
from tvm import tirx
from tvm.relax.frontend import nn

from localchat.engine.kernels import wkv

if TYPE_CHECKING:
    from localchat.engine.models.rwkv4 import Rwkv4Config

STATE_INIT_P = -1.0e30  # "minus infinity" for the running max exponent, finite under subtraction

# state ids within a layer: time-mix x_prev, the WKV numerator a, denominator b and running max
# exponent p (always float32), channel-mix x_prev
ATT_X, ATT_A, ATT_B, ATT_P, FFN_X = range(5)


def initial_values(cfg: Rwkv4Config, dtype: str) -> list[np.ndarray]:
    """The state of a new sequence, one vector per state id (the same for every layer)."""
    h, a = cfg.hidden_size, cfg.attention_hidden_size
    return [
        np.zeros(h, dtype),
        np.zeros(a, "float32"),
        np.zeros(a, "float32"),
        np.full(a, STATE_INIT_P, "float32"),
        np.zeros(h, dtype),
    ]


def state_bytes(cfg: Rwkv4Config, max_batch_size: int, dtype: str = "float32") -> int:
    """Bytes of the recurrent state for `max_batch_size` sequences (one history slot each)."""
    itemsize = np.dtype(dtype).itemsize
    per_layer = 2 * cfg.hidden_size * itemsize + 3 * cfg.attention_hidden_size * 4
    return per_layer * cfg.num_hidden_layers * max_batch_size


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
            get = wkv.state_get(size, dtype, sid, gpu)
            put = wkv.state_set(size, dtype, sid, gpu)
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
