"""The shared recurrent plumbing (`models.recurrent`) on the CPU: a per-head matrix state and a
vector state kept per sequence by the runtime's RNN-state object (batch order, rollback with
two history slots, fork), and the token shift across sequence boundaries."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.frontend import nn
from tvm.runtime import ShapeTuple

from localchat.engine.device import cpu_target
from localchat.engine.models.recurrent import (
    RnnState,
    StateTensor,
    segment_starts,
    state_bytes,
    token_shift,
)

HEADS, N, VEC = 2, 4, 3
LAYOUT = (StateTensor((HEADS, N, N), "float32", 0.5), StateTensor((VEC,), "float32"))
_NO_PARAMS = {"$": {"param_mode": "none", "effect_mode": "none"}}


class Probe(nn.Module):
    """step: returns each sequence's matrix and vector state, then stores x and vector + 1."""

    def step(self, x: nn.Tensor, rnn_state: RnnState):
        batch = x.shape[0]
        matrix = rnn_state.get(0, 0, batch, (HEADS, N, N), "float32")
        vector = rnn_state.get(0, 1, batch, VEC, "float32")
        state = rnn_state.set(0, 0, x)
        state = state.set(0, 1, vector + 1.0)
        return matrix, vector, state

    def shift(self, x: nn.Tensor, ends: nn.Tensor, prev: nn.Tensor) -> nn.Tensor:
        return token_shift(x, prev, segment_starts(ends, x.shape[0]))

    def create_rnn_state(self, max_batch_size: int, max_history: int) -> RnnState:
        return RnnState.create(max_batch_size, max_history, 1, LAYOUT)


@pytest.fixture(scope="module")
def vm() -> relax.VirtualMachine:
    spec = nn.spec.ModuleSpec.from_raw({
        "step": {"x": nn.spec.Tensor(["batch", HEADS, N, N], "float32"),
                 "rnn_state": nn.spec.Object(object_type=RnnState), **_NO_PARAMS},
        "shift": {"x": nn.spec.Tensor(["n", VEC], "float32"),
                  "ends": nn.spec.Tensor(["b"], "int32"),
                  "prev": nn.spec.Tensor(["b", VEC], "float32"), **_NO_PARAMS},
        "create_rnn_state": {"max_batch_size": int, "max_history": int, **_NO_PARAMS},
    }, Probe())
    mod, _ = Probe().export_tvm(spec=spec)
    return relax.VirtualMachine(tvm.compile(mod, target=cpu_target()), tvm.cpu())


def test_matrix_state_round_trips_per_sequence_with_rollback_and_fork(vm) -> None:
    def builtin(name: str):
        return tvm.get_global_func(f"vm.builtin.kv_state_{name}")

    state = vm["create_rnn_state"](ShapeTuple([3]), ShapeTuple([2]))
    rng = np.random.default_rng(0)

    def step(seq_ids: list[int], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        builtin("begin_forward")(state, ShapeTuple(seq_ids), ShapeTuple([1] * len(seq_ids)))
        matrix, vector, _ = vm["step"](tvm.runtime.tensor(x.astype("float32")), state)
        builtin("end_forward")(state)
        return matrix.numpy(), vector.numpy()

    for seq_id in (0, 1):
        builtin("add_sequence")(state, seq_id)
    x1, x2, x3 = (rng.standard_normal((2, HEADS, N, N)) for _ in range(3))
    matrix, vector = step([0, 1], x1)
    assert np.all(matrix == 0.5) and np.all(vector == 0)  # the layout's initial values
    matrix, vector = step([1, 0], x2)  # the other order: each sequence gets its own state
    assert np.array_equal(matrix, x1[::-1].astype("float32")) and np.all(vector == 1)

    builtin("popn")(state, 0, 1)  # back over sequence 0's last one-token forward
    matrix, vector = step([0], x3[:1])
    assert np.array_equal(matrix[0], x1[0].astype("float32")) and np.all(vector == 1)

    builtin("fork_sequence")(state, 1, 2, -1)  # a copy of sequence 1, which holds x2[0]
    matrix, vector = step([2, 1], x3)
    assert np.array_equal(matrix, np.stack([x2[0], x2[0]]).astype("float32"))
    assert np.all(vector == 2)
    assert state_bytes(LAYOUT, 1, 3, 2) == (HEADS * N * N + VEC) * 4 * 3 * 2


def test_token_shift_takes_the_state_at_each_sequence_start(vm) -> None:
    x = np.arange(5 * VEC, dtype="float32").reshape(5, VEC)
    prev = -np.arange(1, 2 * VEC + 1, dtype="float32").reshape(2, VEC)
    ends = np.array([1, 4], dtype="int32")  # tokens 0-1, then 2-4
    out = vm["shift"](*(tvm.runtime.tensor(a) for a in (x, ends, prev))).numpy()
    assert np.array_equal(out, np.stack([prev[0], x[0], prev[1], x[2], x[3]]))
