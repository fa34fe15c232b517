"""The function attributes of our hand-scheduled kernels take effect in TVM 0.27.

TVM silently accepts attributes it does not know (0.27 reads `tirx.noalias` / `tirx.is_scheduled`
and ignores the older `tir.*` spellings), so these tests check the effects, not the dictionary:
a no-alias kernel's pointers are `noalias` in the LLVM IR, and dlight leaves a kernel marked as
scheduled alone. Each test has a control without the attributes, so the observation is known to
tell the two apart.
"""

from __future__ import annotations

import pytest
import tvm
from tvm import te

from localchat.engine.kernels import attention, gemv, matmul, wkv
from localchat.engine.kernels.common import SCHEDULED_ATTRS, scheduled

CPU = tvm.target.Target({"kind": "llvm", "num-cores": 2})
CUDA = tvm.target.Target(
    {
        "kind": "cuda",
        "arch": "sm_90a",
        "max_threads_per_block": 1024,
        "max_shared_memory_per_block": 49152,
        "thread_warp_size": 32,
    }
)


def _llvm_ir(func) -> str:
    ex = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), CPU)
    return ex.mod.inspect_source("ll")


def _row_sums():
    """An unscheduled TE reduction (one block), the kind dlight's rules do schedule."""
    a = te.placeholder((256, 128), "float32", name="a")
    r = te.reduce_axis((0, 128), name="r")
    b = te.compute((256,), lambda i: te.sum(a[i, r], axis=r), name="b")
    return te.create_prim_func([a, b])


def test_noalias_reaches_the_llvm_ir() -> None:
    plain = gemv.gemv_f(64, 8, "float32").without_attr("tirx.noalias")
    assert "noalias" not in _llvm_ir(plain)  # control: the attribute is what adds it
    assert "noalias" in _llvm_ir(scheduled(plain))
    assert "noalias" in _llvm_ir(gemv.gemv_q4(128, 8, "float32"))


def test_is_scheduled_keeps_dlight_away() -> None:
    from tvm.s_tir import dlight as dl

    def after_dlight(func) -> str:
        mod = tvm.IRModule({"main": func})
        with CUDA:
            return dl.ApplyDefaultSchedule(dl.gpu.Fallback())(mod)["main"].script()

    assert "threadIdx" in after_dlight(_row_sums())  # control: dlight schedules it
    assert "threadIdx" not in after_dlight(scheduled(_row_sums()))


KERNELS = {
    "linear_f": lambda: matmul.linear_f(64, 16, "float32", True),
    "linear_q4": lambda: matmul.linear_q4(64, 16, "float32", False),
    "gemv_q4": lambda: gemv.gemv_q4(128, 8, "float16", bias=True),
    "gemv_f": lambda: gemv.gemv_f(64, 8, "float32"),
    "prefill_ragged": lambda: attention.attention_prefill_ragged_cpu(1, 2, 16, 16, "float32"),
    "prefill_paged": lambda: attention.attention_prefill_paged_cpu(1, 2, 16, "float32"),
    "decode_paged": lambda: attention.attention_decode_paged_cpu(1, 2, 16, "float32"),
    "merge_state": lambda: attention.merge_state_inplace_cpu(2, 16, "float32"),
    "wkv_scan": lambda: wkv.wkv_scan(32, "float32"),
    "wkv_scan_gpu": lambda: wkv.wkv_scan(32, "float32", gpu=True),
    "state_get": lambda: wkv.state_get(32, "float32", 0),
    "state_set_gpu": lambda: wkv.state_set(32, "float32", 1, gpu=True),
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_kernel_carries_the_honoured_attributes(name: str) -> None:
    attrs = KERNELS[name]().attrs
    for key in SCHEDULED_ATTRS:
        assert bool(attrs[key]), key
    assert not [key for key in attrs.keys() if key.startswith("tir.")]
