"""SmolLM3 (`SmolLM3ForCausalLM`): the Llama block with rotary embedding left out on the layers
`no_rope_layers` marks 0 (every fourth in the released model)."""

from __future__ import annotations

import dataclasses
from typing import Any

from localchat.engine.models import Architecture, llama
from localchat.errors import ModelConfigError


def config_from_hf(hf: dict[str, Any]) -> llama.LlamaConfig:
    """Read a SmolLM3 config.json (`no_rope_layers`: 1 = rotary, 0 = none)."""
    cfg = llama.LlamaConfig.from_hf(hf)
    layers = [int(v) for v in hf.get("no_rope_layers") or []]
    if layers and len(layers) != cfg.num_hidden_layers:
        raise ModelConfigError(f"no_rope_layers has {len(layers)} entries for "
                               f"{cfg.num_hidden_layers} layers")
    # all layers rotating is the Llama block itself
    return dataclasses.replace(cfg, rope_layers=layers if 0 in layers else [])


def architecture(name: str) -> Architecture:
    """The registry's view of this module: Llama's build and weights, SmolLM3's config."""
    return dataclasses.replace(llama.architecture(name), config_from_hf=config_from_hf,
                               gguf=None)
