"""Elementwise activations (sigmoid, tanh, SiLU) of a model's tensors that stay in vectors on
the CPU.

Relax's own `op.sigmoid`/`op.tanh`/`op.silu` lower to one libm call per element, which keeps
LLVM from vectorizing the fused kernel around them: on the RWKV-7 2.9B shape a decode step's
two sigmoids over 2,560 channels took 13-18 us a layer, and a prefill chunk pays that per
token. Here each is a tensor expression over `kernels.common` (`exp2`: ~2e-7 relative error),
which fuses with its neighbours like any elementwise op and vectorizes. On a GPU the Relax ops
stay (their exp is an instruction there).
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from localchat.engine.kernels import common

F32 = "float32"


def _elementwise(x: nn.Tensor, name: str, f: Callable[[tirx.PrimExpr], tirx.PrimExpr]
                 ) -> nn.Tensor:
    """f over every element of x, in float32, returned in x's dtype."""
    dtype = x.dtype

    def compute(t: te.Tensor) -> te.Tensor:
        return te.compute(t.shape, lambda *i: f(t(*i).astype(F32)).astype(dtype), name=name)

    return op.tensor_expr_op(compute, name, [x])


def sigmoid(x: nn.Tensor, cpu: bool) -> nn.Tensor:
    """1 / (1 + e^-x), elementwise."""
    return _elementwise(x, "sigmoid_vec", common.sigmoid) if cpu else op.sigmoid(x)


def tanh(x: nn.Tensor, cpu: bool) -> nn.Tensor:
    """tanh(x), elementwise (exactly +-1 for large |x|)."""
    return _elementwise(x, "tanh_vec", common.tanh) if cpu else op.tanh(x)


def silu(x: nn.Tensor, cpu: bool) -> nn.Tensor:
    """x / (1 + e^-x), elementwise."""
    return _elementwise(x, "silu_vec", lambda v: v * common.sigmoid(v)) if cpu else op.silu(x)
