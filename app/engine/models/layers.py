"""Building blocks shared by the architectures: quantization-aware Linear and Embedding.

A Linear holds its weight as float [out, in] or, in a 4-bit mode, as packed words and scales
(see `localchat.engine.build.quantization`). On the CPU its product runs in the hand-scheduled
kernels of `kernels.matmul`, or with `gemv` (decode and logits: a few rows) in the decode GEMV of
`kernels.gemv` (`avx512`, from `kernels.common.gemv_isa`: "vnni" for the int8 VNNI form, "avx2"
for the same int8 form with AVX2's pmaddubsw, True for the AVX-512 table-lookup form, False for
the generic one). With either int8 form a 4-bit Linear runs that GEMV for every step, prefill
included (it is the faster kernel at any row count). The caller
chooses by the kind of step, never by the row count: the two kernels sum in different orders,
and a sequence must get the same bits alone as batched with others. On GPUs it is expressed as
dequantize + matmul, which FuseOps/FuseTIR merge into one kernel that dlight then schedules.

A 4-bit weight whose reduction size is not a multiple of the group size is stored padded to whole
groups (`quantization.padded_k`); every kernel and the GPU dequantize read only the real columns,
so the padding is invisible outside the stored layout.

In the asymmetric modes a 4-bit weight's `scale` holds each group's scale and min side by side
(float16), or in q4f32_k Q4_K's super-blocks as uint8 bytes (`quantization`), and in every mode
that holds a llama.cpp type (`QuantMode.gguf_type`:
the asymmetric ones, q4f32_0 / q4f16_0) the token embedding and the LM head are 8-bit (int8
values, a float16 scale per group: `quantization.quantize_q8`), run by `gemv.gemv_q8`; an int8
weight is the 8-bit layout, so `linear` needs no flag beyond the mode. q4f32_k keeps them in
llama.cpp's Q6_K instead where their rows are whole super-blocks (uint8 codes and parameters,
`build.q6_k`), run by `gemv_q6.gemv_q6_k`. In the 8-bit modes
(llama.cpp's Q8_0) every weight matrix has that layout and runs `gemv_q8` at every step. The
kernels get the group parameters' type from the mode (`QuantMode.group_dtype`: q4f32_0's
scales are float16 under float32 activations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.target import Target

from localchat.engine.build import q6_k
from localchat.engine.build.quantization import (
    GROUP_SIZE,
    NIBBLES_PER_WORD,
    QuantMode,
    padded_k,
)
from localchat.engine.kernels import elementwise, gemm_amx, gemv_q6, matmul
from localchat.engine.kernels import gemv as gemv_kernels
from localchat.engine.kernels.common import (
    FP4_DOUBLED,
    asym_layout,
    f16_bytes,
    gemv_isa,
    group_param,
    has_amx,
    wide_registers,
)
from localchat.engine.kernels.gemm import NR as PANEL_WIDTH

Q8_DTYPE = "int8"  # the 8-bit layout's weight dtype (the 4-bit one's is uint32 words)
Q6_DTYPE = "uint8"  # Q6_K's codes (`build.q6_k`): q4f32_k's embedding / LM head (and Q6_K
# attn_v / ffn_down of a Q4_K_M file)


@dataclass(frozen=True)
class BuildContext:
    """What one build is for, decided once and passed to every module: the quantization mode
    and the target. The device specifics a layer needs (is this the CPU, which decode GEMV the
    CPU's ISA takes) are read from here, so constructors take (shape, ctx) and nothing else."""

    mode: QuantMode
    target: Target
    target_kind: str = field(init=False)
    isa: bool | str = field(init=False)  # `kernels.common.gemv_isa`: "vnni", True, "avx2", False
    amx: bool = field(init=False)  # Intel AMX (`kernels.common.has_amx`): prefill's 4-bit matmul

    def __post_init__(self) -> None:
        kind = self.target.kind.name
        object.__setattr__(self, "target_kind", kind)
        object.__setattr__(self, "isa", gemv_isa(self.target) if kind == "llvm" else False)
        object.__setattr__(self, "amx", kind == "llvm" and has_amx(self.target))

    @property
    def dtype(self) -> str:
        """The activation dtype."""
        return self.mode.dtype

    @property
    def cpu(self) -> bool:
        """Whether the build is for the CPU (our scheduled kernels) rather than a GPU."""
        return self.target_kind == "llvm"


def _nibble(words: te.Tensor, row, col) -> tirx.PrimExpr:
    """The 4-bit code of weight [row, col] in its packed uint32 word (8 a word, low first)."""
    word = words[row, col // NIBBLES_PER_WORD]
    shift = ((col % NIBBLES_PER_WORD) * 4).astype("uint32")
    return tirx.bitwise_and(tirx.shift_right(word, shift), tirx.const(15, "uint32"))


def _dequant_value(
    words: te.Tensor, scale: te.Tensor, row, col, dtype: str, asym: bool = False
) -> tirx.PrimExpr:
    """Weight [row, col] of a 4-bit ((q - 8) * scale, or with `asym` q * scale + min, both in
    `scale`) or 8-bit (int8 `words`: q * scale) matrix, as `dtype`; the asymmetric and 8-bit
    forms compute in float32 (q * scale is exact there) and round once."""
    group = col // GROUP_SIZE
    if words.dtype == Q6_DTYPE:
        return _q6_value(words, scale, row, col).astype(dtype)
    if words.dtype == Q8_DTYPE:
        value = words[row, col].astype("float32") * scale[row, group].astype("float32")
        return value.astype(dtype)
    nibble = _nibble(words, row, col)
    if asym:
        layout = asym_layout(scale.dtype)
        value = nibble.astype("float32") * group_param(scale, row, group, 0, layout) + \
            group_param(scale, row, group, 1, layout)
        return value.astype(dtype)
    # the scale may be float16 under float32 activations (the modes holding llama.cpp's Q4_0)
    return (nibble.astype("int32") - 8).astype(dtype) * scale[row, group].astype(dtype)


def _q6_value(codes: te.Tensor, params: te.Tensor, row, col) -> tirx.PrimExpr:
    """Weight [row, col] of a Q6_K matrix (`build.q6_k`'s layout) in float32: (d * sc) *
    (q - 32), as llama.cpp computes it (exact)."""
    k = int(codes.shape[1]) // q6_k.CODE_BYTES * q6_k.SUPER
    sb, j = col // q6_k.SUPER, col % q6_k.SUPER
    e, t = j // q6_k.SUB, j % q6_k.SUB
    v, b = t // 4, t % 4
    base = sb * q6_k.CODE_BYTES + 4 * e + b
    low = tirx.bitwise_and(tirx.shift_right(
        codes[row, base + (v // 2) * 64].astype("uint32"), ((v % 2) * 4).astype("uint32")),
        tirx.const(15, "uint32"))
    high = tirx.bitwise_and(tirx.shift_right(
        codes[row, base + 128].astype("uint32"), (v * 2).astype("uint32")),
        tirx.const(3, "uint32"))
    q = tirx.bitwise_or(low, tirx.shift_left(high, tirx.const(4, "uint32"))).astype("int32")
    sc = tirx.reinterpret("int8", params[row, sb * q6_k.SUBS + e]).astype("float32")
    d = f16_bytes(params, row, k // q6_k.SUB + 2 * sb)
    return (d * sc) * (q - 32).astype("float32")


def _mx_value(words: te.Tensor, exponents: te.Tensor, row, col, dtype: str) -> tirx.PrimExpr:
    """Weight [row, col] of an MXFP4 matrix (FP4 E2M1 codes in 4-bit words, uint8 E8M0
    exponents per group of 32: FP4(code) * 2^(e - 127)), as `dtype`: exact in float32."""
    code = _nibble(words, row, col)
    # twice the 8 magnitudes (0, 1, 2, 3, 4, 6, 8, 12), a nibble each of one constant: a shift
    # picks one with no branch (a select chain became nested branches on a GPU, each loading
    # the word again: the MXFP4 expert GEMV ran at a fifth of the 4-bit one's speed)
    twice = tirx.bitwise_and(
        tirx.shift_right(tirx.const(_FP4_TWICE, "uint32"),
                         tirx.shift_left(tirx.bitwise_and(code, tirx.const(7, "uint32")),
                                         tirx.const(2, "uint32"))),
        tirx.const(15, "uint32"))
    magnitude = twice.astype("float32") * tirx.const(0.5, "float32")
    sign = tirx.const(1.0, "float32") - (code >> 3).astype("float32") * \
        tirx.const(2.0, "float32")
    # 2^(e - 127) is the float32 whose exponent bits are e (e = 0, 2^-127, reads as 0)
    power = tirx.reinterpret("float32", tirx.shift_left(
        exponents[row, col // GROUP_SIZE].astype("uint32"), tirx.const(23, "uint32")))
    return (magnitude * sign * power).astype(dtype)


# the doubled FP4 magnitude of code c in nibble c: 0xC8643210
_FP4_TWICE = sum(v << (4 * c) for c, v in enumerate(FP4_DOUBLED[:8]))


def _quantized_params(
    rows: int, cols: int, mode: QuantMode, head: bool, experts: bool = False
) -> tuple[nn.Parameter, nn.Parameter]:
    """(weight, scale) of a quantized [rows, cols] matrix in `mode`: MXFP4 for MoE `experts` in
    the mode that keeps them so (FP4 codes as 4-bit words, uint8 E8M0 exponents per group), the
    8-bit layout in the 8-bit modes and for the embedding / LM head (`head`) where the mode has
    one, else 4-bit (asymmetric: scale and min of each group side by side)."""
    kp = padded_k(cols)
    groups = kp // GROUP_SIZE
    if experts and mode.experts == "MXFP4":
        return (nn.Parameter((rows, kp // NIBBLES_PER_WORD), "uint32"),
                nn.Parameter((rows, groups), "uint8"))
    if head and mode.head_format == "Q6_K" and q6_k.holds(cols):
        return (nn.Parameter((rows, q6_k.code_width(cols)), Q6_DTYPE),
                nn.Parameter((rows, q6_k.param_width(cols)), "uint8"))
    if mode.bits == 8 or (head and mode.head_bits == 8):
        # the 8-bit layout's scales are float16 in every mode (`quantization.quantize_q8`)
        return nn.Parameter((rows, kp), Q8_DTYPE), nn.Parameter((rows, groups), "float16")
    return (
        nn.Parameter((rows, kp // NIBBLES_PER_WORD), "uint32"),
        nn.Parameter((rows, mode.group_width(groups)), mode.group_dtype),
    )


class Linear(nn.Module):
    """y = x W^T (+ b), with W float or 4-bit packed according to the quantization mode."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, ctx: BuildContext,
        head: bool = False, panels: bool = False, experts: bool = False,
    ) -> None:
        """`head`: held as the mode holds its LM head (8-bit in the asymmetric modes, Q6_K in
        q4f32_k: the head, or a Q4_K_M file's Q6_K attn_v / ffn_down); `panels`: a float
        weight is stored as the CPU GEMM reads it (`kernels.gemm.weight_panels`), for layers
        that only ever run the GEMM (the encoders': no decode GEMV reads rows of it);
        `experts`: a MoE model's stacked expert projections (MXFP4 in q4f32_mx)."""
        self.in_features = in_features
        self.out_features = out_features
        mode = self.mode = ctx.mode
        self.target_kind = ctx.target_kind
        self.avx512 = ctx.isa
        self.amx = ctx.amx
        self.panels = panels and ctx.cpu and not mode.quantized
        if mode.quantized:
            self.weight, self.scale = _quantized_params(out_features, in_features, mode, head,
                                                        experts)
        elif self.panels:
            self.weight = nn.Parameter(
                (-(-out_features // PANEL_WIDTH), in_features, PANEL_WIDTH), mode.dtype)
            self.scale = None
        else:
            self.weight = nn.Parameter((out_features, in_features), mode.dtype)
            self.scale = None
        self.bias = nn.Parameter((out_features,), mode.dtype) if bias else None

    def forward(self, x: nn.Tensor, gemv: bool = False) -> nn.Tensor:
        if self.panels:
            return _linear_panels(x, self.weight, self.bias, self.out_features,
                                  wide_registers(self.avx512))
        return linear(
            x, self.weight, self.scale, self.bias, self.mode, self.target_kind, self.avx512, gemv,
            self.amx,
        )


def _linear_panels(x: nn.Tensor, weight: nn.Tensor, bias: nn.Tensor | None, n: int,
                   wide: bool) -> nn.Tensor:
    """x [..., K] times a float weight stored as panels [ceil(n / 16), K, 16], on the CPU
    (`wide`: AVX-512's micro-kernel, `gemm.gemm_f`)."""
    k = x.shape[-1]
    lead = list(x.shape[:-1])
    rows = 1
    for d in lead:
        rows = rows * d
    func = matmul.linear_f_panels(int(k), n, str(x.dtype), bias is not None, wide)
    out = op.tensor_ir_op(
        func, "linear", args=[op.reshape(x, (rows, k)), weight] + ([bias] if bias else []),
        out=nn.Tensor.placeholder((rows, n), x.dtype))
    return op.reshape(out, lead + [n])


def linear(
    x: nn.Tensor,
    weight: nn.Tensor,
    scale: nn.Tensor | None,
    bias: nn.Tensor | None,
    mode: QuantMode,
    target_kind: str,
    avx512: bool | str = False,
    gemv: bool = False,
    amx: bool = False,
) -> nn.Tensor:
    """x [..., K] times weight [N, K]^T, dispatching on target and quantization; on the CPU
    with `gemv` in the decode GEMV (`avx512`: `kernels.common.gemv_isa` of the llvm target), else
    (prefill) a symmetric 4-bit weight on Intel AMX where the target has it (`amx`). An int8
    weight is 8-bit (the asymmetric modes' head); other 4-bit weights follow the mode."""
    n = weight.shape[0]
    k = x.shape[-1]
    lead = list(x.shape[:-1])
    q8 = mode.quantized and weight.dtype == Q8_DTYPE
    q6 = mode.quantized and weight.dtype == Q6_DTYPE
    asym = mode.asymmetric and not q8 and not q6
    sdt = mode.group_dtype if mode.quantized else None  # the 4-bit scales' type
    if target_kind == "llvm":
        rows = 1
        for d in lead:
            rows = rows * d
        x2 = op.reshape(x, (rows, k))
        func_is_gemv = gemv and (mode.quantized or bias is None)
        if q8 or q6:
            # the LM head (a few rows) or a Q6_K matrix: one kernel for every step, prefill too
            # (its tiles and chunks), as the int8 4-bit GEMV
            func_is_gemv = True
            func = (gemv_q6.gemv_q6_k if q6 else gemv_kernels.gemv_q8)(
                int(k), int(n), mode.dtype, avx512, bias is not None)
        elif gemv and mode.quantized:
            func = gemv_kernels.gemv_q4(int(k), int(n), mode.dtype, avx512, bias is not None, asym,
                                        sdt)
        elif gemv and bias is None:
            func = gemv_kernels.gemv_f(int(k), int(n), mode.dtype)
        elif amx and mode.quantized and not gemv:
            # prefill on AMX tiles, every 4-bit layout (1.1-2.8x the VNNI GEMV's rows at
            # 128-451 rows, Sapphire Rapids, 2 threads); a row's bits differ from decode's
            # GEMV, never with the batch
            func = gemm_amx.gemm_q4_amx(int(k), int(n), mode.dtype, bias is not None, asym, sdt)
        elif mode.quantized and avx512 in gemv_kernels.INT8_ISAS:
            # prefill too: with int8 x the GEMV's row blocks beat the float blocked kernel at
            # 128 rows (VNNI 2-2.5x; AVX2 1.1-1.6x, Zen 4), and a row's bits still do not
            # depend on the others
            func_is_gemv = True
            func = gemv_kernels.gemv_q4(int(k), int(n), mode.dtype, avx512, bias is not None, asym,
                                        sdt)
        elif mode.quantized:
            func = matmul.linear_q4(int(k), int(n), mode.dtype, bias is not None, asym, sdt,
                                    wide_registers(avx512))
        else:
            func = matmul.linear_f(int(k), int(n), mode.dtype, bias is not None,
                                   wide_registers(avx512))
        args = (
            [x2, weight]
            + ([scale] if scale is not None else [])
            + ([bias] if bias is not None else [])
        )
        out = op.tensor_ir_op(
            func,
            "gemv" if func_is_gemv else "linear_q4" if mode.quantized else "linear",
            args=args,
            out=nn.Tensor.placeholder((rows, n), mode.dtype),
        )
        return op.reshape(out, lead + [n])
    # GPUs: one x times W^T with the dequantization inline, accumulated in float32. As
    # dequantize -> permute_dims -> matmul, each call wrote a dequantized, transposed copy of
    # the weight (decode on an H100 at 2% of its bandwidth: those copies were the time).
    if asym or q6:
        # the scale and min of a group (Q6_K: a sub-block's sc and its super-block's d), two
        # reads of one row, fail dlight's one-element access analysis when inlined: dequantized
        # apart (the modes holding GGUF types are meant for the CPU)
        w = op.tensor_expr_op(
            lambda words, sc: te.compute(
                (n, k), lambda i, j: _dequant_value(words, sc, i, j, mode.dtype, asym),
                name="dequantize"),
            "dequantize", args=[weight, scale])
        out = op.matmul(x, op.permute_dims(w))
        return out + bias if bias is not None else out

    def nt_matmul(xt: te.Tensor, words: te.Tensor, *sc: te.Tensor) -> te.Tensor:
        return _reduce_in_f32(
            (*lead, n), k, mode, "nt_matmul", "nt_cast",
            lambda idx, r: xt[(*idx[:-1], r)], lambda idx, r: (words, sc, idx[-1], r))

    out = op.tensor_expr_op(nt_matmul, "nt_matmul",
                            args=[x, weight] + ([scale] if mode.quantized else []))
    if bias is not None:
        out = out + bias
    return out


def _reduce_in_f32(shape, k: int, mode: QuantMode, name: str, cast_name: str, x_at, w_at,
                   mx: bool = False):
    """out[idx] = sum over r < k of x_at(idx, r) * W[row, r], accumulated in float32 and cast
    to the mode's type, W's element read where `w_at(idx, r)` = (words, (scale,) or (), row,
    r) points (dequantized inline in a quantized mode; `mx`: W is MXFP4): the GPU linears' one
    reduction."""
    r = te.reduce_axis((0, k), name="k")

    def w_value(words, sc, row, col):
        if mx:
            return _mx_value(words, sc[0], row, col, mode.dtype)
        return _dequant_value(words, sc[0], row, col, mode.dtype) if sc else words[row, col]

    acc = te.compute(
        shape,
        lambda *idx: te.sum(x_at(idx, r).astype("float32")
                            * w_value(*w_at(idx, r)).astype("float32"), axis=r),
        name=name,
    )
    return te.compute(shape, lambda *idx: acc[idx].astype(mode.dtype), name=cast_name)


def expert_linear_gpu(x: nn.Tensor, weight: nn.Tensor, scale: nn.Tensor | None,
                      idx: nn.Tensor, n: int, mode: QuantMode) -> nn.Tensor:
    """y [t, topk, n] = x[t, j or 0] times expert idx[t, j]'s rows of weight [experts * n, K]
    transposed, on a GPU: one reduction with the dequantization inline (as `linear`'s GPU
    form; MXFP4 in q4f32_mx), accumulated in float32. x [t, 1, K] serves every slot (the
    gate/up projection), x [t, topk, K] one per slot (the down projection)."""
    k = int(x.shape[-1])
    topk = int(idx.shape[1])
    shared = int(x.shape[1]) == 1

    def gathered(xt: te.Tensor, words: te.Tensor, ids: te.Tensor, *sc: te.Tensor) -> te.Tensor:
        return _reduce_in_f32(
            (xt.shape[0], topk, n), k, mode, "expert_matmul", "expert_cast",
            lambda i, r: xt[i[0], 0 if shared else i[1], r],
            lambda i, r: (words, sc, ids[i[0], i[1]].astype("int64") * n + i[2], r),
            mx=mode.experts == "MXFP4")

    return op.tensor_expr_op(gathered, "expert_matmul",
                             args=[x, weight, idx] + ([scale] if mode.quantized else []))


def _rowwise(func, name: str, x: nn.Tensor, extra: list[nn.Tensor], n_out: int) -> nn.Tensor:
    """A row-wise CPU kernel on x [b, s, K] (no reshapes: each would be a copy kernel)."""
    b, s = x.shape[0], x.shape[1]
    return op.tensor_ir_op(
        func, name, args=[x, *extra], out=nn.Tensor.placeholder((b, s, n_out), x.dtype)
    )


class RMSNorm(nn.RMSNorm):
    """RMSNorm over the last axis, without bias; on the CPU the scheduled row kernel
    (`kernels.elementwise.rms_norm`), elsewhere TVM's operator."""

    def __init__(self, hidden_size: int, eps: float, ctx: BuildContext) -> None:
        super().__init__(hidden_size, -1, eps, bias=False, dtype=ctx.dtype)
        self.target_kind = ctx.target_kind

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        if self.target_kind != "llvm":
            return super().forward(x)
        n = int(x.shape[-1])
        func = elementwise.rms_norm(n, float(self.epsilon), str(x.dtype))
        return _rowwise(func, "rms_norm", x, [self.weight], n)


GATES = ("silu", "gelu_tanh")  # the MLP gate activations `gated` knows


def gated(gate_up: nn.Tensor, act: str, target_kind: str) -> nn.Tensor:
    """act(gate) * up for gate_up [..., 2F] = [gate | up], `act` one of GATES."""
    if act == "silu":
        return silu_mul(gate_up, target_kind)
    if target_kind != "llvm":
        gate, up = op.split(gate_up, 2, axis=-1)
        return op.gelu(gate, approximate="tanh") * up
    f = int(gate_up.shape[-1]) // 2
    func = elementwise.gated_mul(f, str(gate_up.dtype), act)
    return _rowwise(func, "gated_mul", gate_up, [], f)


def silu_mul(gate_up: nn.Tensor, target_kind: str) -> nn.Tensor:
    """silu(gate) * up for gate_up [..., 2F] = [gate | up]; on the CPU one scheduled kernel
    (`kernels.elementwise.silu_mul`)."""
    if target_kind != "llvm":
        gate, up = op.split(gate_up, 2, axis=-1)
        return op.silu(gate) * up
    f = int(gate_up.shape[-1]) // 2
    return _rowwise(elementwise.silu_mul(f, str(gate_up.dtype)), "silu_mul", gate_up, [], f)


class Embedding(nn.Module):
    """Token embedding table, float or 4-bit packed; can double as a tied LM head."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: BuildContext):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        mode = self.mode = ctx.mode
        self.target_kind = ctx.target_kind
        self.avx512 = ctx.isa
        if mode.quantized:
            # the table doubles as the LM head when tied: 8-bit in the asymmetric modes
            self.weight, self.scale = _quantized_params(vocab_size, hidden_size, mode, head=True)
        else:
            self.weight = nn.Parameter((vocab_size, hidden_size), mode.dtype)
            self.scale = None

    def forward(self, ids: nn.Tensor) -> nn.Tensor:
        """ids [n] int32 -> [n, hidden]."""
        if not self.mode.quantized:
            return op.take(self.weight, ids, axis=0)
        hidden, dtype = self.hidden_size, self.mode.dtype
        # 4-bit symmetric or 8-bit (the asymmetric modes), which `_dequant_value` tells by the
        # weight dtype
        return op.tensor_expr_op(
            lambda words, sc, idx: te.compute(
                (idx.shape[0], hidden),
                lambda i, j: _dequant_value(words, sc, idx[i], j, dtype),
                name="embed",
            ),
            "embed",
            args=[self.weight, self.scale, ids],
        )

    def lm_head(self, x: nn.Tensor) -> nn.Tensor:
        """Logits from hidden states with the embedding matrix as the output projection (in the
        decode GEMV: logits are a few rows, and always the same kernel)."""
        return linear(
            x, self.weight, self.scale, None, self.mode, self.target_kind, self.avx512, gemv=True
        )


def yarn_factors(scaling: dict[str, Any], theta: float, rotary_dim: int) -> list[float]:
    """YaRN's frequencies as `rotary`'s per-frequency divisors: frequency k blends its
    interpolated (/ factor) and extrapolated (as is) values by a linear ramp between the
    correction dims of beta_fast and beta_slow rotations, as transformers computes it with an
    untruncated range (gpt-oss)."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(correction_dim(float(scaling.get("beta_fast") or 32)), 0.0)
    high = min(correction_dim(float(scaling.get("beta_slow") or 1)), rotary_dim - 1.0)
    if low == high:
        high += 0.001
    divisors = []
    for k in range(rotary_dim // 2):
        ramp = min(max((k - low) / (high - low), 0.0), 1.0)  # 0: extrapolated, 1: interpolated
        divisors.append(1.0 / (ramp / factor + 1.0 - ramp))
    return divisors


def rotary(qkv: nn.Tensor, positions: nn.Tensor, theta: float, scale: float, num_q: int,
           num_kv: int, rotary_dim: int, factors: list[float] | None = None,
           mscale: float = 1.0) -> nn.Tensor:
    """Rotary embedding (HF's rotate-half) of the q and k heads of qkv [b, s, heads, d] at the
    tokens' `positions` [b * s] times `scale`, on the first `rotary_dim` of each head; v and the
    rest pass through. `factors` (LongRoPE) divide each frequency, `mscale` multiplies cos and
    sin. A plain tensor expression: the GPU path of a layer with its own theta and LongRoPE's
    path on every target (the CPU's per-layer theta runs `kernels.attention.rotary_qkv_cpu`)."""
    half = rotary_dim // 2
    if factors and len(factors) != half:
        raise ValueError(f"{len(factors)} rope factors for {half} frequencies")

    def compute(x: te.Tensor, pos: te.Tensor) -> te.Tensor:
        seq = x.shape[1]

        def factor(k):
            if not factors:
                return tirx.const(1.0, "float32")
            value = tirx.const(float(factors[-1]), "float32")
            for i in range(half - 2, -1, -1):  # a select chain: the table is small
                value = tirx.Select(k == i, tirx.const(float(factors[i]), "float32"), value)
            return value

        def value(bi, si, h, j):
            p = pos[bi * seq + si].astype("float32") * tirx.const(scale, "float32")
            k = tirx.floormod(j, half)
            freq = p / (tirx.power(tirx.const(theta, "float32"),
                                   k.astype("float32") * tirx.const(2.0 / rotary_dim, "float32"))
                        * factor(k))
            m = tirx.const(mscale, "float32")
            cos, sin = tirx.cos(freq) * m, tirx.sin(freq) * m
            xv = x[bi, si, h, j].astype("float32")
            partner = tirx.if_then_else(j < half, -x[bi, si, h, j + half].astype("float32"),
                                        x[bi, si, h, j - half].astype("float32"))
            rotated = xv * cos + partner * sin
            keep = tirx.any(h >= num_q + num_kv, j >= rotary_dim)
            return tirx.if_then_else(keep, x[bi, si, h, j], rotated.astype(x.dtype))

        return te.compute(x.shape, value, name="rotary")

    return op.tensor_expr_op(compute, "rotary", args=[qkv, positions])


def take_last_token(x: nn.Tensor) -> nn.Tensor:
    """[b, s, h] -> [b, 1, h]: the last position, so only it goes through the LM head."""

    def compute(t: te.Tensor) -> te.Tensor:
        b, s, h = t.shape
        return te.compute((b, 1, h), lambda i, _, j: t[i, s - 1, j], name="take_last")

    return op.tensor_expr_op(compute, "take_last", args=[x])
