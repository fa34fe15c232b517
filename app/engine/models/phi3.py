"""Phi-3, Phi-3.5 and Phi-4-mini (`Phi3ForCausalLM`): the Llama block with the checkpoint's q/k/v
and gate/up already fused (our own layout), partial rotary (`partial_rotary_factor`, 0.75 on
Phi-4-mini) and LongRoPE.

LongRoPE has two sets of per-frequency factors. transformers picks them per forward pass: the
long ones once the sequence outgrows `original_max_position_embeddings`, the short ones below;
the attention factor (sqrt(1 + ln(max / original) / ln(original)) unless given) scales cos and
sin either way. A compiled model has one rotary table, so it chooses once, by the context window
it is built for, as llama.cpp and Ollama do (long factors when the context exceeds the original
one): a window within `original_max_position_embeddings` (the default, 4K on the published
models) runs the short factors and equals transformers at every length; a larger window
(`convert --context-window`, a recipe's `context_window`) runs the long factors from the first
token, which equals transformers for sequences longer than the original context and differs
from it (long factors where transformers uses short ones) on shorter ones.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from localchat.engine.models import Architecture, GgufMap, GgufSource, llama
from localchat.errors import ModelConfigError, UnsupportedModelError


@dataclasses.dataclass
class Phi3Config(llama.LlamaConfig):
    """The Llama block's config plus LongRoPE's two factor sets; `rope_ext_factors`, what the
    block rotates with, follows the context window whenever the config is built or stored."""

    longrope_short: list[float] = dataclasses.field(default_factory=list)
    longrope_long: list[float] = dataclasses.field(default_factory=list)
    longrope_original: int = 0  # original_max_position_embeddings; 0: no LongRoPE

    def for_window(self) -> Phi3Config:
        """This config with the factors its context window calls for (long past the original
        context, short within it)."""
        if not self.longrope_original:
            return self
        long = self.context_window_size > self.longrope_original
        return dataclasses.replace(
            self, rope_ext_factors=list(self.longrope_long if long else self.longrope_short))

    def to_dict(self) -> dict[str, Any]:
        # a window set after reading (convert's context override) is stored with its factors
        return dataclasses.asdict(self.for_window())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Phi3Config:
        return cls(**data)


def build(cfg: llama.LlamaConfig, mode: Any, target: Any) -> Any:
    """Llama's block, rotating with the LongRoPE factors of the window it is compiled for."""
    if isinstance(cfg, Phi3Config):
        cfg = cfg.for_window()
    return llama.LlamaForCausalLM(cfg, mode, target)


def config_from_hf(hf: dict[str, Any]) -> llama.LlamaConfig:
    """Read a Phi-3 config.json (old `rope_scaling` or transformers 5's `rope_parameters`)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "longrope"):
        raise UnsupportedModelError(f"Phi-3 rope type {kind!r} is not supported")
    plain = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters")}
    theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
    cfg = llama.LlamaConfig.from_hf({**plain, "rope_theta": theta})
    partial = hf.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
    rotary = int(cfg.head_dim * float(partial))
    if kind == "default":
        return dataclasses.replace(cfg, rotary_dim=rotary if rotary != cfg.head_dim else 0)
    context = int(hf.get("max_position_embeddings") or cfg.context_window_size)
    original = int(hf.get("original_max_position_embeddings")
                   or params.get("original_max_position_embeddings") or context)
    short = [float(f) for f in params.get("short_factor") or []]
    if len(short) != rotary // 2:
        raise ModelConfigError(f"longrope short_factor has {len(short)} entries, the rotary "
                               f"width {rotary} needs {rotary // 2}")
    long = [float(f) for f in params.get("long_factor") or short]
    if len(long) != len(short):
        raise ModelConfigError(f"longrope long_factor has {len(long)} entries, the rotary "
                               f"width {rotary} needs {rotary // 2}")
    attention = params.get("attention_factor")
    if attention is None:
        attention = _longrope_attention(context, original)
    # the default window is the original context (short factors, exact at every length)
    return Phi3Config(**{
        **dataclasses.asdict(cfg), "rotary_dim": rotary if rotary != cfg.head_dim else 0,
        "context_window_size": min(cfg.context_window_size, original),
        "rope_ext_factors": short, "rope_attention_factor": float(attention),
        "longrope_short": short, "longrope_long": long, "longrope_original": original})


def hf_params(cfg: llama.LlamaConfig, get: Callable[[str], np.ndarray],
              names: set[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Our parameters: the checkpoint's own names (its projections are fused as ours are)."""
    for name in sorted(names):
        if name.startswith(("model.", "lm_head.")) and not name.endswith("rotary_emb.inv_freq"):
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            yield name, get(name)
    if not cfg.tie_word_embeddings and "lm_head.weight" not in names:
        yield "lm_head.weight", get("model.embed_tokens.weight")


def _longrope_attention(context: int, original: int) -> float:
    """LongRoPE's default attention factor (HF's and llama.cpp's converter's formula)."""
    factor = context / original
    return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0


def gguf_config(gf: GgufSource, read: dict[str, Any]) -> dict[str, Any]:
    """A Phi-3 config.json from llama.cpp's `phi3` metadata: the rotated width from
    `rope.dimension_count`, LongRoPE from the `rope_factors_short/long` tensors, the original
    context and the attention factor from the `rope.scaling.*` keys."""
    heads, hidden = read["num_attention_heads"], read["hidden_size"]
    head_dim = int(gf.arch_key("attention.key_length") or hidden // heads)
    rotary = int(gf.arch_key("rope.dimension_count") or head_dim)
    config: dict[str, Any] = {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_act": "silu",
        "num_key_value_heads": int(gf.arch_key("attention.head_count_kv", heads)),
        "tie_word_embeddings": gf.tensor_shape("output.weight") is None,
        "torch_dtype": "float32",
    }
    if head_dim != hidden // heads:
        config["head_dim"] = head_dim
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": read["rope_theta"]}
    if rotary != head_dim:
        rope["partial_rotary_factor"] = rotary / head_dim
        config["partial_rotary_factor"] = rotary / head_dim
    has_short = gf.tensor_shape("rope_factors_short.weight") is not None
    if has_short != (gf.tensor_shape("rope_factors_long.weight") is not None):
        raise ModelConfigError(f"{gf.path.name}: only one of rope_factors_short and "
                               f"rope_factors_long is in the file")
    if has_short:
        context = read["max_position_embeddings"]
        original = int(gf.arch_key("rope.scaling.original_context_length") or context)
        rope.update(
            rope_type="longrope",
            short_factor=[float(f) for f in gf.tensor_values("rope_factors_short.weight")],
            long_factor=[float(f) for f in gf.tensor_values("rope_factors_long.weight")],
            original_max_position_embeddings=original,
        )
        config["original_max_position_embeddings"] = original
        attention = gf.arch_key("rope.scaling.attn_factor")
        # stored as float32: kept only where it is not the default the config would compute
        if attention is not None and not math.isclose(
                float(attention), _longrope_attention(context, original), rel_tol=1e-6):
            rope["attention_factor"] = float(attention)
    config["rope_parameters"] = rope
    return config


# llama.cpp's `phi3` files keep the checkpoint's fused q/k/v (`attn_qkv`) and gate/up (under
# `ffn_up`), in HF's row order; LongRoPE's factors are tensors of their own
GGUF = GgufMap(
    tensors=llama.GGUF_TENSORS,
    layer_tensors={
        "attn_norm": "input_layernorm",
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_up": "mlp.gate_up_proj",
        "ffn_down": "mlp.down_proj",
    },
    config=gguf_config,
    config_keys=llama.GGUF_CONFIG_KEYS,
    ignored=("rope_factors_short.weight", "rope_factors_long.weight"),
)


def architecture(name: str) -> Architecture:
    """The registry's view of this module: Llama's build, Phi-3's config and weight names."""
    return dataclasses.replace(llama.architecture(name), config_from_hf=config_from_hf,
                               config_from_dict=Phi3Config.from_dict, build=build,
                               hf_params=hf_params, gguf=GGUF)
