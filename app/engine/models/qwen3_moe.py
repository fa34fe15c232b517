"""Qwen3-MoE (`Qwen3MoeForCausalLM`, e.g. Qwen3-30B-A3B): Qwen3's block (per-head q/k norm)
with mixture-of-experts MLPs (`models.moe`): softmax over `num_experts`, top
`num_experts_per_tok`, renormalized with `norm_topk_prob`; a layer is dense where
`mlp_only_layers` names it or `decoder_sparse_step` skips it."""

from __future__ import annotations

import dataclasses
from typing import Any

from localchat.engine.models import Architecture, GgufMap, GgufSource, llama, moe


def config_from_hf(hf: dict[str, Any]) -> moe.MoeConfig:
    """Read a Qwen3-MoE config.json."""
    base = dataclasses.replace(llama.LlamaConfig.from_hf(hf), qk_norm="head")
    experts = moe.experts_of(hf)
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    layers = [int(i not in dense and experts > 0 and (i + 1) % step == 0)
              for i in range(base.num_hidden_layers)]
    return moe.moe_config(base, experts, int(hf.get("num_experts_per_tok") or 0),
                          int(hf.get("moe_intermediate_size") or 0),
                          bool(hf.get("norm_topk_prob", False)), layers)


def gguf_config(gf: GgufSource, read: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3-MoE config.json from llama.cpp's `qwen3moe` metadata: every layer MoE, the
    top-k weights renormalized (as llama.cpp runs it)."""
    return {**llama.gguf_config(gf, read), "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe", **moe.gguf_moe_config(gf, True)}


# llama.cpp's `qwen3moe` files: Qwen3's names with the merged experts (no dense MLP, so the
# dense width may be absent)
GGUF = GgufMap(
    tensors=llama.GGUF_TENSORS,
    layer_tensors={**{k: v for k, v in llama.GGUF_LAYER_TENSORS.items()
                      if not k.startswith(("ffn_gate", "ffn_up", "ffn_down"))},
                   "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                   **moe.GGUF_MOE_TENSORS},
    config=gguf_config,
    config_keys={**llama.GGUF_CONFIG_KEYS,
                 "feed_forward_length": ("intermediate_size", int, 1)},
)


def architecture(name: str) -> Architecture:
    """The registry's view of this module."""
    return moe.architecture(name, config_from_hf, GGUF)
