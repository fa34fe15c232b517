"""Mixtral (`MixtralForCausalLM`): Mistral's block with mixture-of-experts MLPs in every layer
(`models.moe`): top `num_experts_per_tok` of `num_local_experts`, softmax over the chosen
logits (the softmax's top k renormalized), experts `w1` (gate), `w3` (up), `w2` (down). A
sliding window shorter than the context caps the context at it (exact within the window)."""

from __future__ import annotations

import dataclasses
from typing import Any

from localchat.engine.models import Architecture, llama, moe


def config_from_hf(hf: dict[str, Any]) -> moe.MoeConfig:
    """Read a Mixtral config.json."""
    base = llama.LlamaConfig.from_hf(hf)
    window = hf.get("sliding_window")
    if window and int(window) < base.context_window_size:
        base = dataclasses.replace(base, context_window_size=int(window))
    return moe.moe_config(base, moe.experts_of(hf),
                          int(hf.get("num_experts_per_tok") or 0),
                          int(hf.get("intermediate_size") or 0), True)


def architecture(name: str) -> Architecture:
    """The registry's view of this module."""
    return moe.architecture(name, config_from_hf)
