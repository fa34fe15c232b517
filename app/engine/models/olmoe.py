"""OLMoE (`OlmoeForCausalLM`): the Llama block with q/k RMSNorm over the whole projection (as
OLMo 2, but with the usual pre-norms) and mixture-of-experts MLPs in every layer (`models.moe`),
the top-k probabilities not renormalized unless `norm_topk_prob`."""

from __future__ import annotations

import dataclasses
from typing import Any

from localchat.engine.models import Architecture, GgufMap, GgufSource, llama, moe
from localchat.errors import UnsupportedModelError


def config_from_hf(hf: dict[str, Any]) -> moe.MoeConfig:
    """Read an OLMoE config.json."""
    if hf.get("clip_qkv") is not None:
        raise UnsupportedModelError("OLMoE with clip_qkv is not supported")
    base = dataclasses.replace(llama.LlamaConfig.from_hf(hf), qk_norm="projection")
    return moe.moe_config(base, moe.experts_of(hf),
                          int(hf.get("num_experts_per_tok") or 0),
                          int(hf.get("moe_intermediate_size") or hf.get("intermediate_size")
                              or 0),
                          bool(hf.get("norm_topk_prob", False)))


def gguf_config(gf: GgufSource, read: dict[str, Any]) -> dict[str, Any]:
    """An OLMoE config.json from llama.cpp's `olmoe` metadata (llama.cpp keeps the softmax's
    top-k weights as they are, as OLMoE's default)."""
    return {**llama.gguf_config(gf, read), "architectures": ["OlmoeForCausalLM"],
            "model_type": "olmoe", **moe.gguf_moe_config(gf, False)}


# llama.cpp's `olmoe` files: Llama's names, the q/k norms, the merged experts; q/k rows in HF's
# order (NeoX rotary in llama.cpp too)
GGUF = GgufMap(
    tensors=llama.GGUF_TENSORS,
    layer_tensors={**{k: v for k, v in llama.GGUF_LAYER_TENSORS.items()
                      if not k.startswith(("ffn_gate", "ffn_up", "ffn_down"))},
                   "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                   **moe.GGUF_MOE_TENSORS},
    config=gguf_config,
    config_keys=llama.GGUF_CONFIG_KEYS,
)


def architecture(name: str) -> Architecture:
    """The registry's view of this module."""
    return moe.architecture(name, config_from_hf, GGUF)
