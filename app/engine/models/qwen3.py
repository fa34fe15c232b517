"""Qwen3 (`Qwen3ForCausalLM`): the shared decoder block of `llama` with each head's q and k
RMSNorm-ed (`q_norm`, `k_norm`, before rotary) and no q/k/v bias. The smallest example of an
architecture that is a configuration of the block: docs/architecture.md, "Adding an
architecture"."""

from __future__ import annotations

import dataclasses
from typing import Any

from localchat.engine.models import Architecture, GgufMap, GgufSource, llama


def config_from_hf(hf: dict[str, Any]) -> llama.LlamaConfig:
    """Read a Qwen3 config.json: Llama's fields plus per-head q/k norm."""
    return dataclasses.replace(llama.LlamaConfig.from_hf(hf), qk_norm="head")


def gguf_config(gf: GgufSource, read: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3 config.json from llama.cpp's `qwen3` metadata: Llama's reading, Qwen3's class."""
    return {**llama.gguf_config(gf, read), "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3"}


# llama.cpp's `qwen3` files: Llama's names plus the per-head norms; its converter leaves q/k
# rows in HF's order (llama.cpp rotates Qwen's heads by halves, as HF does)
GGUF = GgufMap(
    tensors=llama.GGUF_TENSORS,
    layer_tensors={**llama.GGUF_LAYER_TENSORS, "attn_q_norm": "self_attn.q_norm",
                   "attn_k_norm": "self_attn.k_norm"},
    config=gguf_config,
    config_keys=llama.GGUF_CONFIG_KEYS,
    ignored=("rope_freqs.weight",),
)


def architecture(name: str) -> Architecture:
    """The registry's view of this module: Llama's build and weights, Qwen3's config."""
    return dataclasses.replace(llama.architecture(name), config_from_hf=config_from_hf,
                               gguf=GGUF)
