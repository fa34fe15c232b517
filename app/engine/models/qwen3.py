"""Qwen3 (`Qwen3ForCausalLM`): the shared decoder block of `llama` with each head's q and k
RMSNorm-ed (`q_norm`, `k_norm`, before rotary) and no q/k/v bias. The smallest example of an
architecture that is a configuration of the block: docs/architecture.md, "Adding an
architecture"."""

from __future__ import annotations

import dataclasses
from typing import Any

from localchat.engine.models import Architecture, llama


def config_from_hf(hf: dict[str, Any]) -> llama.LlamaConfig:
    """Read a Qwen3 config.json: Llama's fields plus per-head q/k norm."""
    return dataclasses.replace(llama.LlamaConfig.from_hf(hf), qk_norm="head")


def architecture(name: str) -> Architecture:
    """The registry's view of this module: Llama's build and weights, Qwen3's config."""
    return dataclasses.replace(llama.architecture(name), config_from_hf=config_from_hf,
                               gguf=None)
