"""Mixture-of-experts MLPs for the shared decoder block of `llama` (Qwen3-MoE, OLMoE, Mixtral).

A MoE layer routes each token to `num_experts_per_tok` of `num_experts` SwiGLU experts: router
logits (a float Linear, never quantized: which experts run must not move with the weights'
rounding), softmax over all experts, the top k, renormalized to sum 1 with `norm_topk_prob`
(Mixtral's softmax over its two chosen logits is the same thing), and the weighted sum of the
chosen experts' outputs (HF's `*TopKRouter` and `*Experts`, transformers 5).

Storage: each projection's experts are one 2-D parameter, expert e's rows at [e * out, (e + 1) *
out): `experts.gate_up_proj` [E * 2F, H] (per expert its gate rows, then its up rows, as the
dense block's fused gate/up) and `experts.down_proj` [E * H, F]; held by `Linear`s (whose
forward is not used), so the converter quantizes them as any other Linear weight. On the CPU
the layer runs `kernels.moe` (router top-k, the grouped GEMV over the selected experts, the
weighted sum); on a GPU `kernels.moe.router_topk_gpu` and `layers.expert_linear_gpu` (one
gathered reduction over the selected experts per projection).

The decoder block picks this MLP per layer through `LlamaForCausalLM.make_mlp` (`MoeConfig.
moe_layers`: 1 for a MoE layer, 0 for a dense one, as Qwen3-MoE's `mlp_only_layers` and
`decoder_sparse_step` say), so llama.py does not import this module.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from tvm import te
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from localchat.engine.build.quantization import K_SCALE_DTYPE, get_quant_mode
from localchat.engine.kernels import moe as moe_kernels
from localchat.engine.models import Architecture, GgufMap, GgufSource, llama, probes
from localchat.engine.models.layers import (
    BuildContext,
    Linear,
    expert_linear_gpu,
    linear,
    silu_mul,
)
from localchat.errors import ModelConfigError, UnsupportedModelError


@dataclass
class MoeConfig(llama.LlamaConfig):
    """The shared block's config plus its experts: how many, how many per token, their width,
    whether the chosen weights are renormalized, and which layers are MoE (1) or dense (0)."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: list[int] = dataclasses.field(default_factory=list)
    # gpt-oss: biases on the router and on each expert's projections, and its clamped SwiGLU
    # ("swiglu_clamp": gate clamped above, up both sides at `swiglu_limit`, then
    # gate * sigmoid(swiglu_alpha * gate) * (up + 1)); the others: plain SwiGLU, no biases
    router_bias: bool = False
    expert_bias: bool = False
    expert_act: str = "silu"
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0

    def is_moe(self, layer_id: int) -> bool:
        """Whether layer `layer_id`'s MLP is the mixture of experts."""
        return self.num_experts > 0 and bool(self.moe_layers[layer_id])


def experts_of(hf: dict[str, Any]) -> int:
    """The number of experts of an HF config.json: `num_experts` (Qwen3-MoE, OLMoE) or
    `num_local_experts` (Mixtral, and what transformers 5 writes for all three)."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def moe_config(base: llama.LlamaConfig, experts: int, per_token: int, intermediate: int,
               norm_topk_prob: bool, moe_layers: list[int] | None = None) -> MoeConfig:
    """A MoeConfig from the block's config (`LlamaConfig.from_hf` and the architecture's
    options) and the experts' settings read from config.json; checks them."""
    if experts <= 0 or not 0 < per_token <= experts:
        raise ModelConfigError(f"config.json: {per_token} experts per token of {experts}")
    if intermediate <= 0:
        raise ModelConfigError("config.json: the experts' intermediate size is missing")
    layers = moe_layers if moe_layers is not None else [1] * base.num_hidden_layers
    return MoeConfig(**dataclasses.asdict(base), num_experts=experts,
                     num_experts_per_tok=per_token, moe_intermediate_size=intermediate,
                     norm_topk_prob=norm_topk_prob, moe_layers=layers)


class Router(nn.Module):
    """The router's weight [experts, hidden] (and bias), float in every mode (HF's `mlp.gate`,
    gpt-oss's `mlp.router`)."""

    def __init__(self, experts: int, hidden: int, dtype: str, bias: bool = False) -> None:
        self.weight = nn.Parameter((experts, hidden), dtype)
        self.bias = nn.Parameter((experts,), dtype) if bias else None


class Experts(nn.Module):
    """The experts' stacked projections (HF's `mlp.experts`), as 2-D Linear weights, and
    their biases [experts, out] (gpt-oss), float in every mode."""

    def __init__(self, cfg: MoeConfig, ctx: BuildContext) -> None:
        e, h, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = Linear(h, e * 2 * f, False, ctx, experts=True)
        self.down_proj = Linear(f, e * h, False, ctx, experts=True)
        self.gate_up_bias = nn.Parameter((e, 2 * f), ctx.dtype) if cfg.expert_bias else None
        self.down_bias = nn.Parameter((e, h), ctx.dtype) if cfg.expert_bias else None


class MoeMLP(nn.Module):
    """A mixture-of-experts MLP: the router picks k experts per token, their SwiGLU outputs are
    summed weighted by the router's probabilities."""

    def __init__(self, cfg: MoeConfig, ctx: BuildContext) -> None:
        if cfg.hidden_act != "silu" or cfg.mlp_bias:
            raise UnsupportedModelError("MoE experts are SwiGLU without biases")
        if cfg.expert_act not in ("silu", "swiglu_clamp"):
            raise UnsupportedModelError(f"MoE expert activation {cfg.expert_act!r} is not "
                                        f"supported (silu, swiglu_clamp)")
        if ctx.mode.quantized and ctx.mode.bits not in (4, 8):
            raise UnsupportedModelError(f"MoE experts in {ctx.mode.name} are not supported "
                                        f"(float, 4-bit or 8-bit modes)")
        if not ctx.cpu and ctx.mode.asymmetric:
            raise UnsupportedModelError(
                f"mixture-of-experts models in {ctx.mode.name} run on the CPU only (on a GPU: "
                f"q0f16, q4f16_1, q8f16_0, q4f32_mx)")
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.hidden, self.inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.norm = cfg.norm_topk_prob
        self.act, self.alpha, self.limit = cfg.expert_act, cfg.swiglu_alpha, cfg.swiglu_limit
        self.mode, self.ctx = ctx.mode, ctx
        self.float_mode = get_quant_mode("q0f16" if ctx.dtype == "float16" else "q0f32")
        self.gate = Router(cfg.num_experts, cfg.hidden_size, ctx.dtype, cfg.router_bias)
        self.experts = Experts(cfg, ctx)

    def _quant(self) -> str:
        if not self.mode.quantized:
            return "f"
        if self.mode.experts == "MXFP4":
            return "mxfp4"
        if self.mode.bits == 8:
            return "q8"
        if self.mode.group_dtype == K_SCALE_DTYPE:
            return "q4_k"
        return "q4_asym" if self.mode.asymmetric else "q4"

    def _grouped(self, x: nn.Tensor, proj: Linear, idx: nn.Tensor, k: int, n: int,
                 shared: bool) -> nn.Tensor:
        """x [t, 1 or top_k, k] through the selected experts of `proj` -> [t, top_k, n]."""
        if not self.ctx.cpu:
            return expert_linear_gpu(x, proj.weight, proj.scale, idx, n, self.mode)
        func = moe_kernels.moe_gemv(k, n, self.num_experts, self.top_k, self.ctx.dtype,
                                    self._quant(), self.ctx.isa, shared, self.mode.group_dtype)
        weights = [proj.weight] + ([proj.scale] if proj.scale is not None else [])
        return op.tensor_ir_op(
            func, "moe_gemv", args=[x, *weights, idx],
            out=nn.Tensor.placeholder((x.shape[0], self.top_k, n), self.ctx.dtype))

    def _swiglu_clamp(self, gate_up: nn.Tensor) -> nn.Tensor:
        """gpt-oss's activation of [..., 2F] = [gate | up]: gate clamped above at the limit, up
        on both sides, gate * sigmoid(alpha * gate) * (up + 1)."""
        gate, up = op.split(gate_up, 2, axis=-1)
        dtype = str(gate_up.dtype)

        def const(v: float) -> nn.Tensor:
            return nn.Tensor.from_const(np.array(v, dtype=dtype))

        gate = op.minimum(gate, const(self.limit))
        up = op.maximum(op.minimum(up, const(self.limit)), const(-self.limit))
        return gate * op.sigmoid(gate * const(self.alpha)) * (up + const(1.0))

    def forward(self, x: nn.Tensor, gemv: bool) -> nn.Tensor:
        b, s, h = x.shape
        x2 = op.reshape(x, (b * s, h))
        logits = linear(x2, self.gate.weight, None, self.gate.bias, self.float_mode,
                        self.ctx.target_kind, False, gemv)
        t, k, f = b * s, self.top_k, self.inter
        router = moe_kernels.router_topk if self.ctx.cpu else moe_kernels.router_topk_gpu
        func = router(self.num_experts, k, self.norm, self.ctx.dtype)
        idx, weight = op.tensor_ir_op(
            func, "router_topk", args=[logits],
            out=[nn.Tensor.placeholder((t, k), "int32"),
                 nn.Tensor.placeholder((t, k), "float32")])
        gate_up = self._grouped(op.reshape(x2, (t, 1, h)), self.experts.gate_up_proj, idx, h,
                                2 * f, shared=True)
        if self.experts.gate_up_bias is not None:
            gate_up = gate_up + op.take(self.experts.gate_up_bias, idx, axis=0)
        act = silu_mul(gate_up, self.ctx.target_kind) if self.act == "silu" else \
            self._swiglu_clamp(gate_up)
        down = self._grouped(act, self.experts.down_proj, idx, f, h, shared=False)
        if self.experts.down_bias is not None:
            down = down + op.take(self.experts.down_bias, idx, axis=0)
        if self.ctx.cpu:
            out = op.tensor_ir_op(moe_kernels.moe_combine(h, k, self.ctx.dtype), "moe_combine",
                                  args=[down, weight],
                                  out=nn.Tensor.placeholder((t, h), self.ctx.dtype))
        else:  # the slots summed in order in float32, as moe_combine does
            out = op.tensor_expr_op(_combine_te(k, self.ctx.dtype), "moe_combine",
                                    args=[down, weight])
        return probes.probe("mlp", op.reshape(out, (b, s, h)))


def _combine_te(topk: int, dtype: str) -> Callable[..., Any]:
    """out [t, n] = sum_j weight[t, j] * y[t, j] in TE (a GPU's form of moe_combine)."""

    def combine(y: Any, weight: Any) -> Any:
        def total(t, c):
            acc = weight[t, 0] * y[t, 0, c].astype("float32")
            for j in range(1, topk):
                acc = acc + weight[t, j] * y[t, j, c].astype("float32")
            return acc.astype(dtype)

        return te.compute((y.shape[0], y.shape[2]), total, name="moe_combine")

    return combine


def make_mlp(cfg: MoeConfig, ctx: BuildContext, layer_id: int) -> nn.Module:
    """Layer `layer_id`'s MLP: the experts, or the dense MLP where the config says so."""
    return MoeMLP(cfg, ctx) if cfg.is_moe(layer_id) else llama.LlamaMLP(cfg, ctx, layer_id)


class MoeForCausalLM(llama.LlamaForCausalLM):
    """The Llama block's model with MoE MLPs (`make_mlp`)."""

    make_mlp = staticmethod(make_mlp)


def moe_mlp_params(cfg: MoeConfig, get: Callable[[str], np.ndarray], names: set[str],
                   layer_id: int) -> Iterator[tuple[str, np.ndarray]]:
    """Layer `layer_id`'s MLP parameters from HF tensors: the router and the experts stacked
    (HF's per-expert `mlp.experts.N.{gate,up,down}_proj`, Mixtral's `block_sparse_moe.experts.N.
    w1/w3/w2`, transformers 5's fused `mlp.experts.gate_up_proj` [E, 2F, H] and `down_proj`
    [E, H, F], or a GGUF's merged `mlp.experts.{gate,up,down}_proj.weight` [E, out, in])."""
    if not cfg.is_moe(layer_id):
        yield from llama.dense_mlp_params(cfg, get, names, layer_id)
        return
    layer = f"model.layers.{layer_id}."
    ours = layer + "mlp."
    e, h, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    if layer + "block_sparse_moe.gate.weight" in names:
        base, gate, up, down = layer + "block_sparse_moe.", "w1", "w3", "w2"
    else:
        base, gate, up, down = layer + "mlp.", "gate_proj", "up_proj", "down_proj"
    yield ours + "gate.weight", get(base + "gate.weight")
    if base + "experts.gate_proj.weight" in names:  # llama.cpp's merged [E, out, in] (GGUF)
        yield ours + "experts.gate_up_proj.weight", np.concatenate(
            [get(base + "experts.gate_proj.weight"), get(base + "experts.up_proj.weight")],
            axis=1).reshape(e * 2 * f, h)
        yield ours + "experts.down_proj.weight", np.reshape(
            get(base + "experts.down_proj.weight"), (e * h, f))
        return
    if base + "experts.gate_up_proj" in names:
        yield ours + "experts.gate_up_proj.weight", np.reshape(
            get(base + "experts.gate_up_proj"), (e * 2 * f, h))
        yield ours + "experts.down_proj.weight", np.reshape(
            get(base + "experts.down_proj"), (e * h, f))
        return
    gate_up = np.empty((e * 2 * f, h), dtype=np.float32)
    downs = np.empty((e * h, f), dtype=np.float32)
    for i in range(e):
        expert = f"{base}experts.{i}."
        gate_up[i * 2 * f:i * 2 * f + f] = get(expert + f"{gate}.weight")
        gate_up[i * 2 * f + f:(i + 1) * 2 * f] = get(expert + f"{up}.weight")
        downs[i * h:(i + 1) * h] = get(expert + f"{down}.weight")
    yield ours + "experts.gate_up_proj.weight", gate_up
    yield ours + "experts.down_proj.weight", downs


def architecture(name: str, config_from_hf: Callable[[dict[str, Any]], MoeConfig],
                 gguf: GgufMap | None = None) -> Architecture:
    """A MoE architecture of the shared block: Llama's cache and exports, `config_from_hf`'s
    config, the MoE MLPs and their weights, `gguf`'s reading of llama.cpp's files."""
    return dataclasses.replace(
        llama.architecture(name), config_from_hf=config_from_hf,
        config_from_dict=MoeConfig.from_dict, build=MoeForCausalLM,
        hf_params=functools.partial(llama.hf_params, mlp_params=moe_mlp_params), gguf=gguf)


# llama.cpp's names for a MoE layer's MLP: the router and the experts merged per layer, 3-D
# [E, out, in] (read under names of their own; `moe_mlp_params` stacks them)
GGUF_MOE_TENSORS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}


def gguf_moe_config(gf: GgufSource, norm_topk_prob: bool) -> dict[str, Any]:
    """The experts' part of config.json from llama.cpp's `expert_*` metadata (the width from
    the merged tensors when the file does not say it)."""
    experts = int(gf.arch_key("expert_count") or 0)
    used = int(gf.arch_key("expert_used_count") or 0)
    shape = gf.tensor_shape("blk.0.ffn_gate_exps.weight")
    if not experts or not used or shape is None:
        raise UnsupportedModelError(f"{gf.path.name}: a MoE GGUF without experts")
    width = int(gf.arch_key("expert_feed_forward_length") or shape[1])
    return {"num_experts": experts, "num_experts_per_tok": used,
            "moe_intermediate_size": width, "norm_topk_prob": norm_topk_prob}
