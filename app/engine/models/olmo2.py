"""OLMo 2 (`Olmo2ForCausalLM`): the shared decoder block of `llama` with norms after the
attention and the MLP instead of before, and q/k RMSNorm over the whole projection."""

from __future__ import annotations

import dataclasses
from typing import Any

from localchat.engine.models import Architecture, llama


def config_from_hf(hf: dict[str, Any]) -> llama.LlamaConfig:
    """Read an OLMo 2 config.json."""
    return dataclasses.replace(llama.LlamaConfig.from_hf(hf), norms="post",
                               qk_norm="projection")


def architecture(name: str) -> Architecture:
    """The registry's view of this module: Llama's build and weights, OLMo 2's config."""
    return dataclasses.replace(llama.architecture(name), config_from_hf=config_from_hf,
                               gguf=None)
