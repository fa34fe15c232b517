"""The BERT family of text encoders, for embeddings: BERT itself (all-MiniLM, bge) and its
rotary variant NomicBERT (nomic-embed-text), as two configurations of one encoder block.

BERT: learned absolute positions and token types, post-norm LayerNorm blocks with biases,
GELU (erf) MLP. NomicBERT: rotary positions (theta 1000, rotate-half), no biases in the
projections, a SiLU-gated MLP, the same post-norm LayerNorms. Attention is bidirectional over a
packed batch of texts (`kernels.encoder.packed_attention`): the one exported function `encode`
takes the tokens of several texts one after another and returns every token's last hidden
state; pooling and normalization are the runtime's (`engine.embedding`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.target import Target

from localchat.engine.build.quantization import QuantMode
from localchat.engine.kernels import encoder as kernels
from localchat.engine.models import Architecture
from localchat.engine.models.export import encoder_spec
from localchat.engine.models.layers import BuildContext, Embedding, Linear, silu_mul
from localchat.errors import ModelConfigError, UnsupportedModelError

# the longest text a NomicBERT runs by default: the positions it was trained on
NOMIC_TRAINED_POSITIONS = 2048
_GELU = {"gelu": "gelu", "gelu_python": "gelu"}  # HF names of the erf GELU


@dataclass
class EncoderConfig:
    """The shape and options of a BERT-family encoder."""

    kind: str  # "bert" or "nomic_bert"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    layer_norm_eps: float
    context_window_size: int  # the longest text (positions of the table / rope)
    absolute_positions: bool = True  # BERT's learned position table
    rope_theta: float = 0.0  # rotary positions (NomicBERT); 0: none
    gated: bool = False  # SiLU-gated MLP (NomicBERT) instead of GELU
    bias: bool = True  # biases on the projections
    prefill_chunk_size: int = 0  # the ModelConfig protocol's; an encoder takes whole texts
    # float projection weights stored as the CPU GEMM reads them (no packing per call: at a
    # short text that packing cost as much as the FMAs); False in models converted before
    weight_panels: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EncoderConfig:
        return cls(**data)


def _need(hf: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    raise ModelConfigError(f"config.json has no {keys[0]!r}")


def bert_config(hf: dict[str, Any]) -> EncoderConfig:
    """An HF BERT config.json (BertModel, BertForMaskedLM, ...) as our config."""
    act = hf.get("hidden_act", "gelu")
    if act not in _GELU:
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'gelu')")
    kind = hf.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise UnsupportedModelError(f"position_embedding_type {kind!r} is not supported")
    cfg = EncoderConfig(
        kind="bert",
        hidden_size=int(_need(hf, "hidden_size")),
        intermediate_size=int(_need(hf, "intermediate_size")),
        num_hidden_layers=int(_need(hf, "num_hidden_layers")),
        num_attention_heads=int(_need(hf, "num_attention_heads")),
        vocab_size=int(_need(hf, "vocab_size")),
        layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        context_window_size=int(hf.get("max_position_embeddings") or 512),
    )
    return _checked(cfg)


def nomic_config(hf: dict[str, Any]) -> EncoderConfig:
    """A NomicBERT config.json, in transformers' spelling (hidden_size, rope_parameters) or the
    hub repo's remote-code one (n_embd, rotary_emb_base, ...), as our config."""
    act = hf.get("activation_function") or hf.get("hidden_act") or "swiglu"
    if act not in ("swiglu", "silu"):
        raise UnsupportedModelError(f"NomicBERT activation {act!r} is not supported "
                                    f"(only SwiGLU)")
    for key, ok in (("rotary_emb_fraction", 1.0), ("rotary_emb_interleaved", False),
                    ("prenorm", False), ("qkv_proj_bias", False), ("mlp_fc1_bias", False),
                    ("mlp_fc2_bias", False), ("rotary_scaling_factor", None)):
        if key in hf and hf[key] != ok:
            raise UnsupportedModelError(f"NomicBERT with {key}={hf[key]!r} is not supported")
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"NomicBERT rope_type {rope['rope_type']!r} is not supported")
    theta = rope.get("rope_theta") or hf.get("rope_theta") or hf.get("rotary_emb_base") or 1000.0
    positions = int(hf.get("max_position_embeddings") or hf.get("n_positions") or 2048)
    trained = int(hf.get("max_trained_positions") or NOMIC_TRAINED_POSITIONS)
    cfg = EncoderConfig(
        kind="nomic_bert",
        hidden_size=int(_need(hf, "hidden_size", "n_embd")),
        intermediate_size=int(_need(hf, "intermediate_size", "n_inner")),
        num_hidden_layers=int(_need(hf, "num_hidden_layers", "n_layer")),
        num_attention_heads=int(_need(hf, "num_attention_heads", "n_head")),
        vocab_size=int(_need(hf, "vocab_size")),
        layer_norm_eps=float(hf.get("layer_norm_eps") or hf.get("layer_norm_epsilon") or 1e-12),
        context_window_size=min(positions, trained),
        absolute_positions=False,
        rope_theta=float(theta),
        gated=True,
        bias=False,
    )
    head_dim = hf.get("head_dim")
    if head_dim and int(head_dim) != cfg.head_dim:
        raise UnsupportedModelError(f"head_dim {head_dim} other than hidden_size / heads "
                                    f"({cfg.head_dim}) is not supported")
    return _checked(cfg)


def _checked(cfg: EncoderConfig) -> EncoderConfig:
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ModelConfigError(f"hidden_size {cfg.hidden_size} is not a multiple of "
                               f"num_attention_heads {cfg.num_attention_heads}")
    if cfg.rope_theta and cfg.head_dim % 2:
        raise UnsupportedModelError(f"rotary positions need an even head_dim, not {cfg.head_dim}")
    cfg.prefill_chunk_size = cfg.context_window_size
    cfg.weight_panels = True
    return cfg


class LayerNorm(nn.Module):
    """LayerNorm with bias over the last axis of [b, s, n], of the sum x (+ residual) (+ a
    constant row): the CPU kernel `kernels.encoder.layer_norm`."""

    def __init__(self, hidden_size: int, eps: float, ctx: BuildContext) -> None:
        self.weight = nn.Parameter((hidden_size,), ctx.dtype)
        self.bias = nn.Parameter((hidden_size,), ctx.dtype)
        self.eps = eps

    def forward(self, x: nn.Tensor, residual: nn.Tensor | None = None,
                shift: nn.Tensor | None = None) -> nn.Tensor:
        n = int(x.shape[-1])
        func = kernels.layer_norm(n, float(self.eps), str(x.dtype), residual is not None,
                                  shift is not None)
        args = [x] + [t for t in (residual, shift) if t is not None] + [self.weight, self.bias]
        return op.tensor_ir_op(func, "layer_norm", args=args,
                               out=nn.Tensor.placeholder(x.shape, x.dtype))


class EncoderAttention(nn.Module):
    def __init__(self, cfg: EncoderConfig, ctx: BuildContext) -> None:
        h = cfg.hidden_size
        self.cfg = cfg
        self.qkv = Linear(h, 3 * h, cfg.bias, ctx, panels=cfg.weight_panels)
        self.out = Linear(h, h, cfg.bias, ctx, panels=cfg.weight_panels)

    def forward(self, x: nn.Tensor, starts: nn.Tensor, rope: list[nn.Tensor]) -> nn.Tensor:
        cfg = self.cfg
        qkv = self.qkv(x)
        func = kernels.packed_attention(cfg.num_attention_heads, cfg.head_dim,
                                        cfg.context_window_size, str(x.dtype), bool(rope))
        out = op.tensor_ir_op(func, "packed_attention", args=[qkv, starts, *rope],
                              out=nn.Tensor.placeholder(x.shape, x.dtype))
        return self.out(out)


class EncoderMLP(nn.Module):
    def __init__(self, cfg: EncoderConfig, ctx: BuildContext) -> None:
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.gated = cfg.gated
        self.target_kind = ctx.target_kind
        # gated: [gate | up]
        self.up = Linear(h, 2 * f if cfg.gated else f, cfg.bias, ctx, panels=cfg.weight_panels)
        self.down = Linear(f, h, cfg.bias, ctx, panels=cfg.weight_panels)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        up = self.up(x)
        if self.gated:
            return self.down(silu_mul(up, self.target_kind))
        f = int(up.shape[-1])
        act = op.tensor_ir_op(kernels.gelu_erf(f, str(up.dtype)), "gelu_erf", args=[up],
                              out=nn.Tensor.placeholder(up.shape, up.dtype))
        return self.down(act)


class EncoderLayer(nn.Module):
    """Post-norm: x = LN(x + attention(x)); x = LN(x + mlp(x))."""

    def __init__(self, cfg: EncoderConfig, ctx: BuildContext) -> None:
        self.attn = EncoderAttention(cfg, ctx)
        self.attn_norm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, ctx)
        self.mlp = EncoderMLP(cfg, ctx)
        self.mlp_norm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, ctx)

    def forward(self, x: nn.Tensor, starts: nn.Tensor, rope: list[nn.Tensor]) -> nn.Tensor:
        x = self.attn_norm(self.attn(x, starts, rope), x)
        return self.mlp_norm(self.mlp(x), x)


class EncoderEmbeddings(nn.Module):
    def __init__(self, cfg: EncoderConfig, ctx: BuildContext) -> None:
        h = cfg.hidden_size
        self.word_embeddings = Embedding(cfg.vocab_size, h, ctx)
        if cfg.absolute_positions:
            self.position_embeddings = nn.Parameter((cfg.context_window_size, h), ctx.dtype)
        self.token_type = nn.Parameter((h,), ctx.dtype)  # type 0's row: every text is one
        self.norm = LayerNorm(h, cfg.layer_norm_eps, ctx)
        self.absolute = cfg.absolute_positions

    def forward(self, input_ids: nn.Tensor, positions: nn.Tensor) -> nn.Tensor:
        n = input_ids.shape[0]
        x = op.reshape(self.word_embeddings(input_ids), (1, n, -1))
        pos = None
        if self.absolute:
            pos = op.reshape(op.take(self.position_embeddings, positions, axis=0), (1, n, -1))
        return self.norm(x, pos, self.token_type)


class Encoder(nn.Module):
    """The exported encoder: `encode(input_ids [n], positions [n], starts [texts + 1])` ->
    the last hidden state of every token, float32 [n, hidden]."""

    def __init__(self, cfg: EncoderConfig, mode: QuantMode, target: Target) -> None:
        ctx = BuildContext(mode, target)
        if not ctx.cpu:
            raise UnsupportedModelError("the BERT-family encoders run on the CPU only for now")
        self.cfg = cfg
        self.mode = mode
        self.embeddings = EncoderEmbeddings(cfg, ctx)
        self.layers = nn.ModuleList([EncoderLayer(cfg, ctx) for _ in range(cfg.num_hidden_layers)])
        if cfg.rope_theta:
            half = cfg.head_dim // 2
            self.rope_cos = nn.Parameter((cfg.context_window_size, half), "float32")
            self.rope_sin = nn.Parameter((cfg.context_window_size, half), "float32")

    def encode(self, input_ids: nn.Tensor, positions: nn.Tensor, starts: nn.Tensor) -> nn.Tensor:
        x = self.embeddings(input_ids, positions)
        rope = [self.rope_cos, self.rope_sin] if self.cfg.rope_theta else []
        for layer in self.layers:
            x = layer(x, starts, rope)
        x = op.reshape(x, (input_ids.shape[0], self.cfg.hidden_size))
        return x.astype("float32") if x.dtype != "float32" else x

    def get_default_spec(self) -> nn.spec.ModuleSpec:
        return encoder_spec(self)


def rope_tables(cfg: EncoderConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [positions, head_dim / 2] of the encoder's rotary angles."""
    return rope_angles(cfg.head_dim, cfg.rope_theta, cfg.context_window_size)


def rope_angles(head_dim: int, theta: float, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [positions, head_dim / 2] of rotary angles, as transformers computes them
    (float32 inverse frequencies times the position); the table of every packed encoder."""
    d = head_dim
    inv = (1.0 / (theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d)))
    angles = np.arange(positions, dtype=np.float32)[:, None] * inv.astype(np.float32)[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


# Prefixes a checkpoint may put before the encoder's names (BertForMaskedLM's `bert.`, ...).
_PREFIXES = ("", "bert.", "model.", "nomic_bert.", "encoder.")


def _getter(get: Callable[[str], np.ndarray], names: set[str]) -> tuple[Callable, Callable]:
    """(get by name with the checkpoint's prefix, has) where the prefix is found from the word
    embeddings; old checkpoints' LayerNorm gamma/beta are read as weight/bias."""
    prefix = next((p for p in _PREFIXES if f"{p}embeddings.word_embeddings.weight" in names), None)
    if prefix is None:
        raise ModelConfigError("the checkpoint has no embeddings.word_embeddings.weight")

    def has(name: str) -> bool:
        return prefix + name in names

    def fetch(name: str) -> np.ndarray:
        if not has(name):
            old = name.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
                "LayerNorm.bias", "LayerNorm.beta")
            if has(old):
                return get(prefix + old)
        return get(prefix + name)

    return fetch, has


def hf_params(cfg: EncoderConfig, get: Callable[[str], np.ndarray],
              names: set[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Our parameters from an HF BERT or NomicBERT checkpoint (transformers' names or the
    nomic hub repo's own)."""
    fetch, has = _getter(get, names)
    h = cfg.hidden_size
    yield "embeddings.word_embeddings.weight", fetch("embeddings.word_embeddings.weight")
    if cfg.absolute_positions:
        table = fetch("embeddings.position_embeddings.weight")
        if table.shape[0] < cfg.context_window_size:
            raise ModelConfigError(f"the position table has {table.shape[0]} rows, the "
                                   f"context is {cfg.context_window_size}")
        yield "embeddings.position_embeddings", table[: cfg.context_window_size]
    types = "embeddings.token_type_embeddings.weight"
    yield "embeddings.token_type", fetch(types)[0] if has(types) else np.zeros(h, np.float32)
    if cfg.kind == "bert":
        yield from _bert_layers(cfg, fetch)
    elif has("layers.0.self_attn.q_proj.weight"):
        yield from _nomic_layers(cfg, fetch, "layers.{}.", _NOMIC_HF, "embeddings.LayerNorm")
    else:
        yield from _nomic_layers(cfg, fetch, "encoder.layers.{}.", _NOMIC_HUB, "emb_ln")
    if cfg.rope_theta:
        cos, sin = rope_tables(cfg)
        yield "rope_cos", cos
        yield "rope_sin", sin


def _bert_layers(cfg: EncoderConfig, fetch: Callable) -> Iterator[tuple[str, np.ndarray]]:
    yield "embeddings.norm.weight", fetch("embeddings.LayerNorm.weight")
    yield "embeddings.norm.bias", fetch("embeddings.LayerNorm.bias")
    for i in range(cfg.num_hidden_layers):
        hf, ours = f"encoder.layer.{i}.", f"layers.{i}."
        qkv = [hf + f"attention.self.{p}" for p in ("query", "key", "value")]
        for part in ("weight", "bias"):
            yield ours + f"attn.qkv.{part}", np.concatenate([fetch(f"{p}.{part}") for p in qkv])
        for ours_name, hf_name in (("attn.out", "attention.output.dense"),
                                   ("attn_norm", "attention.output.LayerNorm"),
                                   ("mlp.up", "intermediate.dense"),
                                   ("mlp.down", "output.dense"),
                                   ("mlp_norm", "output.LayerNorm")):
            for part in ("weight", "bias"):
                yield ours + f"{ours_name}.{part}", fetch(f"{hf}{hf_name}.{part}")


# NomicBERT's names: (qkv as [q, k, v] or fused, out, gate, up, down, attn_norm, mlp_norm)
_NOMIC_HF = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "out": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
             "down": "mlp.down_proj", "attn_norm": "post_attention_layernorm",
             "mlp_norm": "post_mlp_layernorm"}
_NOMIC_HUB = {"qkv": ("attn.Wqkv",), "out": "attn.out_proj", "gate": "mlp.fc12",
              "up": "mlp.fc11", "down": "mlp.fc2", "attn_norm": "norm1", "mlp_norm": "norm2"}


def _nomic_layers(cfg: EncoderConfig, fetch: Callable, layer: str, names: dict[str, Any],
                  emb_norm: str) -> Iterator[tuple[str, np.ndarray]]:
    yield "embeddings.norm.weight", fetch(f"{emb_norm}.weight")
    yield "embeddings.norm.bias", fetch(f"{emb_norm}.bias")
    for i in range(cfg.num_hidden_layers):
        hf, ours = layer.format(i), f"layers.{i}."
        yield ours + "attn.qkv.weight", np.concatenate(
            [fetch(f"{hf}{p}.weight") for p in names["qkv"]])
        yield ours + "attn.out.weight", fetch(f"{hf}{names['out']}.weight")
        yield ours + "mlp.up.weight", np.concatenate(
            [fetch(f"{hf}{names['gate']}.weight"), fetch(f"{hf}{names['up']}.weight")])
        yield ours + "mlp.down.weight", fetch(f"{hf}{names['down']}.weight")
        for norm in ("attn_norm", "mlp_norm"):
            for part in ("weight", "bias"):
                yield ours + f"{norm}.{part}", fetch(f"{hf}{names[norm]}.{part}")


def _no_cache(cfg: Any, dtype: str, batch: int, tokens: int) -> int:
    return 0  # an encoder keeps no state between calls


def architecture(name: str) -> Architecture:
    """The registry's view of this module: "bert" or "nomic_bert"."""
    return Architecture(
        name=name,
        state="encoder",
        config_from_hf=nomic_config if name == "nomic_bert" else bert_config,
        config_from_dict=EncoderConfig.from_dict,
        build=Encoder,
        hf_params=hf_params,
        cache_bytes=_no_cache,
    )
