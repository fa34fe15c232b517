"""The CPU activations (`models.activations`) against numpy, from tiny to overflowing inputs, in
float32 and float16, and compiled without a libm call."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.frontend import nn

from localchat.engine.device import cpu_target
from localchat.engine.models import activations as act

X = np.concatenate([np.linspace(-100, 100, 1001), [0.0, 1e-8, -1e-8, 3e4, -3e4]])


class Acts(nn.Module):
    def forward(self, x: nn.Tensor):
        return act.sigmoid(x, True), act.tanh(x, True), act.silu(x, True)


def compiled(dtype: str):
    mod, _ = Acts().export_tvm({"forward": {"x": nn.spec.Tensor([len(X)], dtype)}})
    return relax.build(mod, target=cpu_target())


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_equal_numpy(dtype: str) -> None:
    x = X.astype(dtype)
    vm = relax.VirtualMachine(compiled(dtype), tvm.cpu())
    got = [t.numpy().astype(np.float64) for t in vm["forward"](tvm.runtime.tensor(x, tvm.cpu()))]
    xd = x.astype(np.float64)
    with np.errstate(over="ignore"):
        sig = 1 / (1 + np.exp(-xd))
    want = [sig, np.tanh(xd), xd * sig]
    # tanh is 1 - 2 / (e^2x + 1): absolute error ~2e-7 near 0 (kernels.common.tanh)
    rtol, atol = (2e-6, 3e-7) if dtype == "float32" else (2e-3, 1e-4)
    for name, g, w in zip(("sigmoid", "tanh", "silu"), got, want, strict=True):
        w = w.astype(dtype).astype(np.float64)  # rounded to the dtype like ours
        assert np.all(np.isfinite(g)) == np.all(np.isfinite(w)), name
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=name)


def test_no_libm_call() -> None:
    """In vectors: no call to libm's expf or tanhf (one per element)."""
    [llvm] = [m for m in compiled("float32").mod.imports if m.kind == "llvm"]
    source = llvm.inspect_source("ll")
    assert "<16 x float>" in source or "<8 x float>" in source
    assert not any(call in source for call in ("@expf", "@llvm.exp.", "@tanhf", "@llvm.tanh."))
