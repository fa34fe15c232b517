"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) in `tvm.relax.frontend.nn`.

One definition covers the family: grouped-query attention with any head_dim, optional q/k/v
bias (Qwen2), tied or separate LM head, RoPE with optional llama3 scaling, SiLU-gated MLP.
q/k/v and gate/up are fused into one Linear each; attention runs on TVM's paged KV cache (on the
CPU with the kernels of `kernels.attention`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache
from tvm.target import Target

from localchat.engine.build.quantization import QuantMode
from localchat.engine.kernels import elementwise
from localchat.engine.kernels.attention import (
    SINK_PAD,
    create_paged_kv_cache_cpu,
    rotary_qkv_cpu,
    windowed_sm_scale,
)
from localchat.engine.kernels.gpu_attention import sink_attention, soft_cap_attention
from localchat.engine.models import Architecture, GgufMap, GgufSource, probes
from localchat.engine.models.export import model_spec
from localchat.engine.models.layers import (
    GATES,
    BuildContext,
    Embedding,
    Linear,
    RMSNorm,
    gated,
    rotary,
    take_last_token,
    yarn_factors,
)
from localchat.errors import ModelConfigError, UnsupportedModelError

DEFAULT_PREFILL_CHUNK = 256

# (config, ctx, layer_id) -> a layer's MLP module; (config, get, names, layer_id) -> its weights
MlpFactory = Callable[[Any, BuildContext, int], nn.Module]
MlpParams = Callable[[Any, Callable[[str], np.ndarray], set[str], int],
                     Iterator[tuple[str, np.ndarray]]]


# config.json's key under which the GGUF import lists the layers whose attn_v / ffn_down were
# Q6_K (`gguf.gguf_to_hf_folder`; read into `LlamaConfig.q6_k_layers`)
Q6_K_LAYERS_KEY = "localchat_q6_k_layers"


@dataclass
class LlamaConfig:
    """The shape and options of a Llama-family model, as read from an HF config.json."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any]
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    context_window_size: int
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK
    # The decoder block's options, as data: the Llama family uses none of them; other dense
    # architectures are this block with some turned on (docs/architecture.md, "Adding an
    # architecture"). Defaults leave the block exactly the Llama one.
    hidden_act: str = "silu"  # the MLP gate's activation: "silu" or "gelu_tanh"
    mlp_bias: bool = False
    qk_norm: str = ""  # RMSNorm of q and k: "" none, "head" (each head), "projection" (whole)
    norm_offset: float = 0.0  # RMSNorm weights act as (offset + w): Gemma's 1 (folded at convert)
    norms: str = "pre"  # "pre" (Llama), "sandwich" (pre and post, Gemma), "post" (OLMo 2)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden_size))
    attn_scale: float = 0.0  # attention's score scale; 0: head_dim ** -0.5
    final_softcap: float = 0.0  # logits become c * tanh(logits / c); 0: off
    attn_softcap: float = 0.0  # the same on attention scores (see `attention_options`)
    sliding_window: int = 0  # the window of the layers `sliding_layers` marks
    sliding_layers: list[int] = dataclasses.field(default_factory=list)  # 1: windowed layer
    rotary_dim: int = 0  # rotated width of each head; 0: all of it
    layer_rope_theta: list[float] = dataclasses.field(default_factory=list)  # per layer
    layer_rope_scale: list[float] = dataclasses.field(default_factory=list)  # positions x this
    rope_layers: list[int] = dataclasses.field(default_factory=list)  # 0: no rotary there
    # LongRoPE (Phi-3/4): each frequency divided by its factor, cos and sin times the
    # attention factor; phi3.py picks the short or the long factors from the compiled window
    rope_ext_factors: list[float] = dataclasses.field(default_factory=list)
    rope_attention_factor: float = 1.0
    # gpt-oss: a learned logit per layer and query head in each softmax's denominator (its
    # column dropped); carried to the CPU kernels in a padded lane of q (kernels.attention)
    attn_sinks: bool = False
    # The layers whose v projection ("v") or MLP down projection ("down") came in llama.cpp's
    # Q6_K (a Q4_K_M file's attn_v / ffn_down, as the GGUF import records them): held in Q6_K
    # apart from the layer's other projections. The converter keeps it only for the modes
    # holding their LM head in Q6_K (q4f32_k); empty otherwise.
    q6_k_layers: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LlamaConfig:
        return cls(**data)

    @property
    def rope_per_layer(self) -> bool:
        """Whether the model applies rope itself (the cache's cannot): layers differ in it
        (theta or none), or it has LongRoPE's factors."""
        return (bool(self.layer_rope_theta) or bool(self.rope_layers)
                or bool(self.rope_ext_factors) or self.rope_attention_factor != 1.0)

    def applies_rope(self, cpu: bool) -> bool:
        """Whether the model applies rope itself on this target: `rope_per_layer`, or sinks on
        a GPU (TVM's GPU rope would pair the lanes of the cache's padded head dim)."""
        return self.rope_per_layer or (self.attn_sinks and not cpu)

    def q6_k(self, part: str, layer_id: int) -> bool:
        """Whether layer `layer_id`'s `part` ("v" or "down") is held in Q6_K (`q6_k_layers`)."""
        return layer_id in self.q6_k_layers.get(part, ())

    def layer_options(self, layer_id: int) -> dict[str, Any]:
        """What differs between layers: the sliding window (0: full), the rope theta, and
        whether the layer has rotary embedding at all."""
        windowed = bool(self.sliding_layers) and bool(self.sliding_layers[layer_id])
        return {
            "window": self.sliding_window if windowed else 0,
            "rope_theta": (self.layer_rope_theta[layer_id] if self.layer_rope_theta
                           else self.rope_theta),
            "rope_scale": self.layer_rope_scale[layer_id] if self.layer_rope_scale else 1.0,
            "rope": not self.rope_layers or bool(self.rope_layers[layer_id]),
        }

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        """Read an HF config.json (old `rope_theta`/`rope_scaling` or new `rope_parameters`)."""

        def need(key: str) -> Any:
            if key not in hf:
                raise ModelConfigError(f"config.json has no {key!r}")
            return hf[key]

        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu')")
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true is not supported")
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = int(hf.get("head_dim") or hidden // heads)
        rope_theta, rope_scaling, rope_factor = _rope_from_hf(hf)
        model_type = hf.get("model_type", "llama")
        qkv_bias = bool(hf.get("attention_bias", False)) or model_type == "qwen2"
        context = int(hf.get("max_position_embeddings") or 4096)
        window = hf.get("sliding_window")
        if window and hf.get("use_sliding_window", model_type == "mistral") and window < context:
            # Exact for sequences within the window, which is then our whole context.
            context = int(window)
        return cls(
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            vocab_size=int(need("vocab_size")),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=bool(hf.get("attention_bias", False)) and model_type != "qwen2",
            context_window_size=context,
            # YaRN scales cos and sin (so q and k) by its attention factor: the scores by its
            # square, folded into the attention scale
            attn_scale=head_dim**-0.5 * rope_factor**2 if rope_factor != 1.0 else 0.0,
            q6_k_layers={part: [int(i) for i in layers] for part, layers in
                         (hf.get(Q6_K_LAYERS_KEY) or {}).items() if part in ("v", "down")},
        )


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict[str, Any], float]:
    """(theta, our rope_scaling, YaRN's attention factor or 1) of an HF config.json."""
    params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return float(theta), {}, 1.0
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in scaling]
        if missing:
            raise ModelConfigError(f"llama3 rope scaling lacks {', '.join(missing)}")
        return float(theta), {"rope_type": "llama3", **{k: scaling[k] for k in keys}}, 1.0
    if kind == "yarn":
        return float(theta), *_yarn_from_hf(scaling)
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported")


def _yarn_from_hf(scaling: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """YaRN's parameters (as TVM's rope reads them) and its attention factor, as transformers
    computes them; only the untruncated correction range (gpt-oss's `truncate: false`) is
    supported: TVM's YaRN frequencies do not round it."""
    import math

    if scaling.get("truncate", True):
        raise UnsupportedModelError("YaRN rope scaling with a truncated correction range is not "
                                    "supported (only truncate=false, as gpt-oss has)")
    if "factor" not in scaling or "original_max_position_embeddings" not in scaling:
        raise ModelConfigError("yarn rope scaling lacks factor or original_max_position_embeddings")
    factor = float(scaling["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    ours = {"rope_type": "yarn", "factor": factor,
            "beta_fast": float(scaling.get("beta_fast") or 32),
            "beta_slow": float(scaling.get("beta_slow") or 1),
            "original_max_position_embeddings": int(scaling["original_max_position_embeddings"])}
    return ours, float(attention)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, ctx: BuildContext, layer_id: int = 0) -> None:
        self.num_q = cfg.num_attention_heads
        self.num_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.attn_scale or self.head_dim**-0.5
        self.qk_norm = cfg.qk_norm
        layer = cfg.layer_options(layer_id)
        # a windowed layer tells the CPU kernels by the sign of its scale (kernels.attention)
        self.call_scale = windowed_sm_scale(self.scale) if layer["window"] and ctx.cpu \
            else self.scale
        # rope the cache cannot apply (per-layer theta, layers without it): applied here
        self.own_rope = cfg.applies_rope(ctx.cpu) and layer["rope"]
        self.rope_theta, self.rope_scaling = layer["rope_theta"], cfg.rope_scaling
        self.rope_scale = layer["rope_scale"]
        self.cpu = ctx.cpu
        self.kv_dtype = ctx.mode.kv_dtype
        self.ext_factors, self.mscale = cfg.rope_ext_factors, cfg.rope_attention_factor
        self.rotary_dim = cfg.rotary_dim or None
        kv_out = self.num_kv * self.head_dim
        self.split_v = cfg.q6_k("v", layer_id)
        if self.split_v:  # v in Q6_K, q and k in the mode's 4 bits: two products, joined
            self.qk_proj = Linear(cfg.hidden_size, (self.num_q + self.num_kv) * self.head_dim,
                                  cfg.qkv_bias, ctx)
            self.v_proj = Linear(cfg.hidden_size, kv_out, cfg.qkv_bias, ctx, head=True)
        else:
            self.qkv_proj = Linear(cfg.hidden_size, (self.num_q + self.num_kv) * self.head_dim
                                   + kv_out, cfg.qkv_bias, ctx)
        self.o_proj = Linear(self.num_q * self.head_dim, cfg.hidden_size, cfg.o_bias, ctx)
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ctx)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ctx)
        elif cfg.qk_norm == "projection":
            self.q_norm = RMSNorm(self.num_q * self.head_dim, cfg.rms_norm_eps, ctx)
            self.k_norm = RMSNorm(self.num_kv * self.head_dim, cfg.rms_norm_eps, ctx)
        elif cfg.qk_norm:
            raise UnsupportedModelError(f"qk_norm {cfg.qk_norm!r} is not supported")
        self.with_sinks = cfg.attn_sinks
        if cfg.attn_sinks:
            self.sinks = nn.Parameter((self.num_q,), ctx.dtype)

    def _sink_lanes(self, qkv: nn.Tensor) -> nn.Tensor:
        """[b, s, heads, d] -> [b, s, heads, d + SINK_PAD]: each query head's sink logit in the
        first pad lane, zeros elsewhere (keys and values), as the sink kernels read them."""
        b, s, heads, _ = qkv.shape
        dtype = str(qkv.dtype)
        first = op.concat([op.reshape(self.sinks, (self.num_q, 1)),
                           op.zeros((heads - self.num_q, 1), dtype)], dim=0)
        lanes = op.concat([first, op.zeros((heads, SINK_PAD - 1), dtype)], dim=1)
        lanes = op.broadcast_to(op.reshape(lanes, (1, 1, heads, SINK_PAD)),
                                (b, s, heads, SINK_PAD))
        return op.concat([qkv, lanes], dim=-1)

    def _normed_qkv(self, qkv: nn.Tensor) -> nn.Tensor:
        """[b, s, (q + 2 kv) * d] with q and k normalized (per head or over the projection)."""
        b, s, _ = qkv.shape
        d, nq, nkv = self.head_dim, self.num_q, self.num_kv
        q, k, v = op.split(qkv, [nq * d, (nq + nkv) * d], axis=-1)
        if self.qk_norm == "head":  # each head's d values: rows of a [b, s * heads, d] tensor
            q = op.reshape(self.q_norm(op.reshape(q, (b, s * nq, d))), (b, s, nq * d))
            k = op.reshape(self.k_norm(op.reshape(k, (b, s * nkv, d))), (b, s, nkv * d))
        else:
            q, k = self.q_norm(q), self.k_norm(k)
        probes.probe("self_attn.q_norm", q)
        probes.probe("self_attn.k_norm", k)
        return op.concat([q, k, v], dim=-1)

    def _rotated(self, qkv: nn.Tensor, cache: PagedKVCache) -> nn.Tensor:
        """q and k rotated by this layer's own rope (a cache without rope: per-layer theta)."""
        b, s = qkv.shape[0], qkv.shape[1]
        positions = cache.get_query_positions(b * s)
        if not self.cpu or self.ext_factors or self.mscale != 1.0:
            factors = self.ext_factors
            if (self.rope_scaling or {}).get("rope_type") == "yarn" and not factors:
                # YaRN changes only the frequencies (its attention factor is in the scale)
                factors = yarn_factors(self.rope_scaling, self.rope_theta,
                                       self.rotary_dim or self.head_dim)
            elif self.rope_scaling:
                raise UnsupportedModelError("per-layer rope with rope_scaling runs on the CPU "
                                            "kernels only")
            return rotary(qkv, positions, self.rope_theta, self.rope_scale, self.num_q,
                          self.num_kv, self.rotary_dim or self.head_dim,
                          factors=factors, mscale=self.mscale)
        func = rotary_qkv_cpu(self.rope_theta, self.rope_scale, self.head_dim, self.num_q,
                              self.num_kv, str(qkv.dtype), self.rope_scaling or None,
                              self.rotary_dim)
        return op.tensor_ir_op(func, "rotary_qkv", args=[qkv, positions],
                               out=nn.Tensor.placeholder(qkv.shape, qkv.dtype))

    def forward(self, x: nn.Tensor, cache: PagedKVCache, layer_id: int, gemv: bool) -> nn.Tensor:
        b, s, _ = x.shape
        qkv = (op.concat([self.qk_proj(x, gemv), self.v_proj(x, gemv)], dim=-1)
               if self.split_v else self.qkv_proj(x, gemv))
        q_size, kv_size = self.num_q * self.head_dim, self.num_kv * self.head_dim
        probes.probe_split(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), qkv,
                           (q_size, kv_size, kv_size))
        if self.qk_norm:
            qkv = self._normed_qkv(qkv)
        qkv = op.reshape(qkv, (b, s, self.num_q + 2 * self.num_kv, self.head_dim))
        if self.own_rope:
            qkv = self._rotated(qkv, cache)
            # no reference module computes this: shown, checked for NaN/Inf, not compared
            probes.probe("rotary", qkv)
        if self.with_sinks:
            qkv = self._sink_lanes(qkv)
        if self.kv_dtype != qkv.dtype:  # the cache's type (float16 in quantized modes)
            qkv = op.astype(qkv, self.kv_dtype)
        out = cache.attention_with_fused_qkv(layer_id, qkv, self.num_q, sm_scale=self.call_scale)
        if self.kv_dtype != x.dtype:
            out = op.astype(out, x.dtype)
        if self.with_sinks:
            out = op.split(out, [self.head_dim], axis=-1)[0]
        out = probes.probe("self_attn.o_proj:in", op.reshape(out, (b, s, q_size)))
        return probes.probe("self_attn.o_proj", self.o_proj(out, gemv))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, ctx: BuildContext, layer_id: int = 0) -> None:
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = Linear(h, 2 * f, cfg.mlp_bias, ctx)
        # (in Q6_K where the GGUF had it so: held as the mode holds its head)
        self.down_proj = Linear(f, h, cfg.mlp_bias, ctx, head=cfg.q6_k("down", layer_id))
        self.target_kind = ctx.target_kind
        self.act = cfg.hidden_act
        if self.act not in GATES:
            raise UnsupportedModelError(f"hidden_act {self.act!r} is not supported "
                                        f"(supported: {', '.join(GATES)})")

    def forward(self, x: nn.Tensor, gemv: bool) -> nn.Tensor:
        gate_up = self.gate_up_proj(x, gemv)
        f = self.down_proj.in_features
        probes.probe_split(("mlp.gate_proj", "mlp.up_proj"), gate_up, (f, f))
        act = probes.probe("mlp.down_proj:in", gated(gate_up, self.act, self.target_kind))
        return probes.probe("mlp.down_proj", self.down_proj(act, gemv))


class LlamaDecoderLayer(nn.Module):
    """Attention then MLP, each a residual branch, with the norms `cfg.norms` places: before
    each branch ("pre", Llama), before and after ("sandwich", Gemma), after only ("post",
    OLMo 2). Parameter names follow HF's for each placement."""

    def __init__(self, cfg: LlamaConfig, ctx: BuildContext, layer_id: int = 0,
                 make_mlp: MlpFactory | None = None) -> None:
        """`make_mlp(cfg, ctx, layer_id)`: the layer's MLP (default LlamaMLP; the MoE
        architectures give `models.moe`'s)."""
        eps, h = cfg.rms_norm_eps, cfg.hidden_size
        self.norms = cfg.norms
        if cfg.norms not in ("pre", "sandwich", "post"):
            raise UnsupportedModelError(f"norms {cfg.norms!r} is not supported")
        if cfg.norms in ("pre", "sandwich"):
            self.input_layernorm = RMSNorm(h, eps, ctx)
        self.self_attn = LlamaAttention(cfg, ctx, layer_id)
        # Llama's post_attention_layernorm is the MLP's pre-norm; in Gemma and OLMo 2 it
        # normalizes the attention's output
        self.post_attention_layernorm = RMSNorm(h, eps, ctx)
        if cfg.norms == "sandwich":
            self.pre_feedforward_layernorm = RMSNorm(h, eps, ctx)
        if cfg.norms in ("sandwich", "post"):
            self.post_feedforward_layernorm = RMSNorm(h, eps, ctx)
        self.mlp = make_mlp(cfg, ctx, layer_id) if make_mlp else LlamaMLP(cfg, ctx, layer_id)

    def forward(self, x: nn.Tensor, cache: PagedKVCache, layer_id: int, gemv: bool) -> nn.Tensor:
        # probes (models/probes.py) name each step by the HF module whose output it equals
        norm = probes.probe
        if self.norms == "pre":
            h = norm("input_layernorm", self.input_layernorm(x))
            x = x + self.self_attn(h, cache, layer_id, gemv)
            return x + self.mlp(norm("post_attention_layernorm", self.post_attention_layernorm(x)),
                                gemv)
        attn_in = norm("input_layernorm", self.input_layernorm(x)) \
            if self.norms == "sandwich" else x
        x = x + norm("post_attention_layernorm",
                     self.post_attention_layernorm(self.self_attn(attn_in, cache, layer_id, gemv)))
        mlp_in = norm("pre_feedforward_layernorm", self.pre_feedforward_layernorm(x)) \
            if self.norms == "sandwich" else x
        return x + norm("post_feedforward_layernorm",
                        self.post_feedforward_layernorm(self.mlp(mlp_in, gemv)))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, ctx: BuildContext,
                 make_mlp: MlpFactory | None = None) -> None:
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, ctx)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(cfg, ctx, i, make_mlp) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)

    def forward(self, x: nn.Tensor, cache: PagedKVCache, gemv: bool = False) -> nn.Tensor:
        """The decoder stack; `gemv`: a decode step (one token per sequence), whose Linears run
        in the decode GEMV on the CPU whatever the batch size, so a sequence's bits do not
        depend on what it is batched with."""
        for layer_id, layer in enumerate(self.layers):
            with probes.layer(layer_id):
                x = probes.probe_layer(layer(x, cache, layer_id, gemv))
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """The exported model: embed, (batch_)prefill, (batch_)decode and the KV-cache constructor.
    A subclass may set `make_mlp` (see LlamaDecoderLayer)."""

    make_mlp: MlpFactory | None = None

    def __init__(self, cfg: LlamaConfig, mode: QuantMode, target: Target) -> None:
        ctx = BuildContext(mode, target)
        self.cfg = cfg
        self.mode = mode
        self.target = target
        self.model = LlamaModel(cfg, ctx, type(self).make_mlp)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, ctx, head=True)

    def _logits(self, h: nn.Tensor) -> nn.Tensor:
        if self.cfg.tie_word_embeddings:
            logits = self.model.embed_tokens.lm_head(h)
        else:
            logits = self.lm_head(h, gemv=True)  # logits: a few rows, always the same kernel
        logits = logits.astype("float32") if logits.dtype != "float32" else logits
        cap = self.cfg.final_softcap
        if not cap:
            return logits
        if self.target.kind.name != "llvm":
            return op.tanh(logits / cap) * cap
        func = elementwise.soft_cap(self.cfg.vocab_size, cap, "float32", ndim=len(logits.shape))
        return op.tensor_ir_op(func, "soft_cap", args=[logits],
                               out=nn.Tensor.placeholder(logits.shape, "float32"))

    def embed(self, input_ids: nn.Tensor) -> nn.Tensor:
        x = self.model.embed_tokens(input_ids)
        scale = self.cfg.embed_scale
        # in the activation dtype, as HF multiplies by a normalizer of the hidden states' dtype
        return x * nn.Tensor.from_const(np.array(scale, dtype=self.mode.dtype)) \
            if scale != 1.0 else x

    def prefill(self, input_embed: nn.Tensor, paged_kv_cache: PagedKVCache):
        n, h = input_embed.shape
        hidden = self.model(op.reshape(input_embed, (1, n, h)), paged_kv_cache)
        return self._logits(take_last_token(hidden)), paged_kv_cache

    def decode(self, input_embed: nn.Tensor, paged_kv_cache: PagedKVCache):
        hidden = self.model(
            op.reshape(input_embed, (1, 1, input_embed.shape[-1])), paged_kv_cache, gemv=True
        )
        return self._logits(hidden), paged_kv_cache

    def batch_prefill(
        self, input_embeds: nn.Tensor, logit_positions: nn.Tensor, paged_kv_cache: PagedKVCache
    ):
        n, h = input_embeds.shape
        hidden = self.model(op.reshape(input_embeds, (1, n, h)), paged_kv_cache)
        last = op.take(op.reshape(hidden, (n, h)), logit_positions, axis=0)
        return self._logits(last), paged_kv_cache

    def batch_decode(self, input_embeds: nn.Tensor, paged_kv_cache: PagedKVCache):
        b, h = input_embeds.shape
        hidden = self.model(op.reshape(input_embeds, (b, 1, h)), paged_kv_cache, gemv=True)
        return self._logits(op.reshape(hidden, (b, h))), paged_kv_cache

    def debug_prefill(self, input_embed: nn.Tensor, paged_kv_cache: PagedKVCache):
        """A debug build's prefill: logits at every position, then every probe (`probes`)."""
        n, h = input_embed.shape
        with probes.recording() as rec:
            hidden = self.model(op.reshape(input_embed, (1, n, h)), paged_kv_cache)
        self.debug_probes = rec.names()
        return (self._logits(op.reshape(hidden, (n, h))), *rec.outputs()), paged_kv_cache

    def get_debug_spec(self) -> nn.spec.ModuleSpec:
        return probes.debug_spec(self, hidden_size=self.cfg.hidden_size, dtype=self.mode.dtype,
                                 state="kv", state_type=PagedKVCache)

    def create_paged_kv_cache(
        self,
        max_batch_size: int,
        max_total_seq_len: int,
        prefill_chunk_size: int,
        page_size: int,
        support_sliding_window: int,
    ) -> PagedKVCache:
        cfg = self.cfg
        cpu = self.target.kind.name == "llvm"
        # On the CPU, TVM's attention kernels are serial loop nests; ours are scheduled.
        make = create_paged_kv_cache_cpu if cpu else TIRPagedKVCache
        options: dict[str, Any] = {}
        attn_kind: Any = "mha"
        if cfg.sliding_window and cpu:
            options["sliding_window"] = cfg.sliding_window
        elif cfg.sliding_window:  # TVM's kernels: a window per layer kind
            attn_kind = ["mha_sliding" if cfg.layer_options(i)["window"] else "mha"
                         for i in range(cfg.num_hidden_layers)]
            options["layer_sliding_window_size"] = cfg.sliding_window
        if cfg.attn_softcap and cpu:
            options["attn_soft_cap"] = cfg.attn_softcap
        if cfg.attn_sinks and cpu:  # GPU: TVM's kernels, rewritten below
            options["attn_sinks"] = True
        cache = make(
            attn_kind=attn_kind,
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=relax.ShapeExpr([0, cfg.num_hidden_layers]),
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            qk_head_dim=cache_head_dim(cfg),
            v_head_dim=cache_head_dim(cfg),
            mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0,
            rope_mode=RopeMode.NONE if cfg.applies_rope(cpu) else RopeMode.NORMAL,
            rope_scale=1,
            rope_theta=cfg.rope_theta,
            rope_scaling=cfg.rope_scaling,
            rope_ext_factors=relax.prim_value(0),
            rotary_dim=cfg.rotary_dim or cfg.head_dim,
            enable_disaggregation=False,
            dtype=self.mode.kv_dtype,
            target=self.target,
            **options,
        )
        if cfg.attn_softcap and not cpu:  # TVM's GPU kernels, rewritten to cap their scores
            soft_cap_attention(cfg.attn_softcap)
        if cfg.attn_sinks and not cpu:  # ... and to count the sinks
            sink_attention(cfg.head_dim)
        return cache

    def get_default_spec(self) -> nn.spec.ModuleSpec:
        return model_spec(self, hidden_size=self.cfg.hidden_size, dtype=self.mode.dtype,
                          state="kv", state_type=PagedKVCache)


def hf_params(
    cfg: LlamaConfig, get: Callable[[str], np.ndarray], names: set[str],
    mlp_params: MlpParams | None = None,
) -> Iterator[tuple[str, np.ndarray]]:
    """Our float parameters, by our names, from HF tensors fetched by `get(hf_name)` (HF's
    names for every block option: q_norm/k_norm, the norms of each placement, MLP biases);
    `mlp_params(cfg, get, names, layer_id)` yields a layer's MLP instead of `dense_mlp_params`
    (the MoE architectures)."""

    def norm(name: str) -> np.ndarray:  # (offset + w) folded into the stored weight
        w = get(name)
        return w + np.asarray(cfg.norm_offset, dtype=w.dtype) if cfg.norm_offset else w

    yield "model.embed_tokens.weight", get("model.embed_tokens.weight")
    for i in range(cfg.num_hidden_layers):
        hf = f"model.layers.{i}."
        ours = f"model.layers.{i}."
        # q, k and v as one matrix, or q and k apart from a Q6_K v (`q6_k_layers`)
        groups = ([("qk_proj", "qk"), ("v_proj", "v")] if cfg.q6_k("v", i)
                  else [("qkv_proj", "qkv")])
        for mine, parts in groups:
            proj = [hf + f"self_attn.{p}_proj" for p in parts]
            yield ours + f"self_attn.{mine}.weight", np.concatenate(
                [get(p + ".weight") for p in proj])
            if cfg.qkv_bias:
                yield ours + f"self_attn.{mine}.bias", np.concatenate(
                    [get(p + ".bias") for p in proj])
        yield ours + "self_attn.o_proj.weight", get(hf + "self_attn.o_proj.weight")
        if cfg.o_bias:
            yield ours + "self_attn.o_proj.bias", get(hf + "self_attn.o_proj.bias")
        if cfg.attn_sinks:
            yield ours + "self_attn.sinks", get(hf + "self_attn.sinks")
        if cfg.qk_norm:
            for qk in ("q_norm", "k_norm"):
                yield ours + f"self_attn.{qk}.weight", norm(hf + f"self_attn.{qk}.weight")
        yield from (mlp_params or dense_mlp_params)(cfg, get, names, i)
        layer_norms = {"pre": ("input_layernorm", "post_attention_layernorm"),
                       "sandwich": ("input_layernorm", "post_attention_layernorm",
                                    "pre_feedforward_layernorm", "post_feedforward_layernorm"),
                       "post": ("post_attention_layernorm", "post_feedforward_layernorm")}
        for name in layer_norms[cfg.norms]:
            yield ours + f"{name}.weight", norm(hf + f"{name}.weight")
    yield "model.norm.weight", norm("model.norm.weight")
    if not cfg.tie_word_embeddings:
        if "lm_head.weight" in names:
            yield "lm_head.weight", get("lm_head.weight")
        else:  # some checkpoints omit a head that equals the embedding
            yield "lm_head.weight", get("model.embed_tokens.weight")


def dense_mlp_params(
    cfg: LlamaConfig, get: Callable[[str], np.ndarray], names: set[str], layer_id: int
) -> Iterator[tuple[str, np.ndarray]]:
    """Layer `layer_id`'s LlamaMLP parameters from HF's gate/up/down projections."""
    hf = ours = f"model.layers.{layer_id}."
    gate_up = [hf + "mlp.gate_proj", hf + "mlp.up_proj"]
    yield ours + "mlp.gate_up_proj.weight", np.concatenate([get(p + ".weight") for p in gate_up])
    yield ours + "mlp.down_proj.weight", get(hf + "mlp.down_proj.weight")
    if cfg.mlp_bias:
        yield ours + "mlp.gate_up_proj.bias", np.concatenate([get(p + ".bias") for p in gate_up])
        yield ours + "mlp.down_proj.bias", get(hf + "mlp.down_proj.bias")


def cache_head_dim(cfg: LlamaConfig) -> int:
    """The head width the KV cache stores: head_dim, plus the sink lanes (attn_sinks)."""
    return cfg.head_dim + (SINK_PAD if cfg.attn_sinks else 0)


def kv_cache_bytes(cfg: LlamaConfig, dtype: str, max_batch_size: int, tokens: int) -> int:
    """Bytes of a KV cache holding `tokens` positions (keys and values of every layer)."""
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cache_head_dim(cfg)
    return per_token * np.dtype(dtype).itemsize * tokens


def architecture(name: str) -> Architecture:
    """The registry's view of this module (see `localchat.engine.models.REGISTRY`)."""
    return Architecture(
        name=name,
        state="kv",
        config_from_hf=LlamaConfig.from_hf,
        config_from_dict=LlamaConfig.from_dict,
        build=LlamaForCausalLM,
        hf_params=hf_params,
        cache_bytes=kv_cache_bytes,
        gguf=GGUF,
    )


# ------------------------------------------------------------------------------------------------
# llama.cpp's GGUF files of the family (general.architecture "llama"), read by `build.gguf`
# ------------------------------------------------------------------------------------------------

GGUF_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixtral (filed under `llama`): the router and the experts merged per layer, [E, out, in]
    # (`models.moe` reads these names)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
GGUF_CONFIG_KEYS = {
    "embedding_length": ("hidden_size", int, None),
    "feed_forward_length": ("intermediate_size", int, None),
    "block_count": ("num_hidden_layers", int, None),
    "attention.head_count": ("num_attention_heads", int, None),
    "context_length": ("max_position_embeddings", int, 4096),
    "attention.layer_norm_rms_epsilon": ("rms_norm_eps", float, 1e-5),
    "rope.freq_base": ("rope_theta", float, 10000.0),
}


def llama3_rope_from_freqs(factors: np.ndarray, head_dim: int, theta: float,
                           context: int) -> dict[str, Any] | None:
    """Llama 3.1-style rope scaling from the `rope_freqs` tensor llama.cpp stores: it keeps only
    the per-frequency divisors, so the standard parameters that reproduce them are returned
    ({} for no scaling), or None when none do."""
    factors = np.asarray(factors, dtype=np.float64)
    if np.allclose(factors, 1.0):
        return {}
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    factor = float(factors.max())
    for low, high, original in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 4.0, context)):
        low_wl, high_wl = original / low, original / high
        smooth = (original / wavelen - low) / (high - low)
        expect = np.where(wavelen < high_wl, 1.0,
                          np.where(wavelen > low_wl, factor,
                                   1.0 / ((1 - smooth) / factor + smooth)))
        if expect.shape == factors.shape and np.allclose(expect, factors, rtol=1e-3):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": original}
    return None


def gguf_config(gf: GgufSource, read: dict[str, Any]) -> dict[str, Any]:
    """The rest of a Llama config.json from a GGUF file, given what GGUF_CONFIG_KEYS read: KV
    heads, head_dim, tied head, q/k/v bias and rope scaling (from `rope_freqs` or the
    `rope.scaling.*` keys)."""
    heads, hidden = read["num_attention_heads"], read["hidden_size"]
    kv_heads = gf.arch_key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts
        if len(set(kv_heads)) != 1:
            raise UnsupportedModelError(f"{gf.path.name}: per-layer KV head counts differ")
        kv_heads = kv_heads[0]
    head_dim = int(gf.arch_key("attention.key_length") or hidden // heads)
    rotary = int(gf.arch_key("rope.dimension_count") or head_dim)
    if rotary != head_dim:
        raise UnsupportedModelError(
            f"{gf.path.name}: partial rotary embedding ({rotary} of {head_dim} dims) is not "
            f"supported"
        )
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "tie_word_embeddings": gf.tensor_shape("output.weight") is None,
        "attention_bias": gf.tensor_shape("blk.0.attn_q.bias") is not None,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    experts = gf.arch_key("expert_count")
    if experts:  # llama.cpp files Mixtral under `llama`
        config.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                      num_local_experts=int(experts),
                      num_experts_per_tok=int(gf.arch_key("expert_used_count") or 0))
    scaling_type = gf.arch_key("rope.scaling.type")
    if gf.tensor_shape("rope_freqs.weight") is not None:
        scaling = llama3_rope_from_freqs(gf.tensor_values("rope_freqs.weight"), head_dim,
                                         read["rope_theta"], read["max_position_embeddings"])
        if scaling is None:
            raise UnsupportedModelError(
                f"{gf.path.name}: its rope_freqs tensor matches no rope scaling localchat knows"
            )
        if scaling:
            config["rope_scaling"] = scaling
    elif scaling_type and scaling_type != "none":
        factor = gf.arch_key("rope.scaling.factor")
        scaling = {"rope_type": str(scaling_type), "factor": float(factor or 1.0)}
        original = gf.arch_key("rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        config["rope_scaling"] = scaling
    return config


GGUF = GgufMap(
    tensors=GGUF_TENSORS,
    layer_tensors=GGUF_LAYER_TENSORS,
    config=gguf_config,
    config_keys=GGUF_CONFIG_KEYS,
    # llama.cpp's converter interleaves each head's q/k rows for its rotary layout
    permuted={"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"},
    ignored=("rope_freqs.weight",),  # folded into config.json's rope_scaling
)
