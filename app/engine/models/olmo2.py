"""OLMo 2 (`Olmo2ForCausalLM`): the shared decoder block of `llama` with norms after the
attention and the MLP instead of before, and q/k RMSNorm over the whole projection."""

from __future__ import annotations

import dataclasses
from typing import Any

from localchat.engine.models import Architecture, GgufMap, GgufSource, llama
from localchat.errors import UnsupportedModelError


def config_from_hf(hf: dict[str, Any]) -> llama.LlamaConfig:
    """Read an OLMo 2 config.json."""
    return dataclasses.replace(llama.LlamaConfig.from_hf(hf), norms="post",
                               qk_norm="projection")


def gguf_config(gf: GgufSource, read: dict[str, Any]) -> dict[str, Any]:
    """An OLMo 2 config.json from llama.cpp's `olmo2` metadata (Llama's keys)."""
    if gf.arch_key("attention.sliding_window"):
        # llama.cpp files OLMo 3 under `olmo2` too, with windowed layers this module lacks
        raise UnsupportedModelError(f"{gf.path.name}: an `olmo2` GGUF with sliding-window "
                                    f"layers (OLMo 3) is not supported")
    return {**llama.gguf_config(gf, read), "architectures": ["Olmo2ForCausalLM"],
            "model_type": "olmo2"}


# llama.cpp's `olmo2` files: no pre-norms, the post norms under their own names, q/k norms over
# the whole projection; q/k rows in HF's order (rotated by halves in llama.cpp too)
GGUF = GgufMap(
    tensors=llama.GGUF_TENSORS,
    layer_tensors={
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    config=gguf_config,
    config_keys=llama.GGUF_CONFIG_KEYS,
)


def architecture(name: str) -> Architecture:
    """The registry's view of this module: Llama's build and weights, OLMo 2's config."""
    return dataclasses.replace(llama.architecture(name), config_from_hf=config_from_hf,
                               gguf=GGUF)
