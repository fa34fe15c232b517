"""SmolLM3 (`SmolLM3ForCausalLM`): the Llama block with rotary embedding left out on the layers
`no_rope_layers` marks 0 (every fourth in the released model)."""

from __future__ import annotations

import dataclasses
from typing import Any

from localchat.engine.models import Architecture, GgufSource, llama
from localchat.errors import ModelConfigError

# llama.cpp's files carry no key for the layers without rotary: it skips rope on every fourth
# layer (1-based) of every `smollm3` model, as the released model does
GGUF_NO_ROPE_STEP = 4


def config_from_hf(hf: dict[str, Any]) -> llama.LlamaConfig:
    """Read a SmolLM3 config.json (`no_rope_layers`: 1 = rotary, 0 = none)."""
    cfg = llama.LlamaConfig.from_hf(hf)
    layers = [int(v) for v in hf.get("no_rope_layers") or []]
    if layers and len(layers) != cfg.num_hidden_layers:
        raise ModelConfigError(f"no_rope_layers has {len(layers)} entries for "
                               f"{cfg.num_hidden_layers} layers")
    # all layers rotating is the Llama block itself
    return dataclasses.replace(cfg, rope_layers=layers if 0 in layers else [])


def gguf_config(gf: GgufSource, read: dict[str, Any]) -> dict[str, Any]:
    """A SmolLM3 config.json from llama.cpp's `smollm3` metadata: Llama's keys, and the layers
    without rotary that llama.cpp assumes (every fourth)."""
    n = read["num_hidden_layers"]
    return {**llama.gguf_config(gf, read), "architectures": ["SmolLM3ForCausalLM"],
            "model_type": "smollm3", "no_rope_layer_interval": GGUF_NO_ROPE_STEP,
            "no_rope_layers": [int((i + 1) % GGUF_NO_ROPE_STEP != 0) for i in range(n)]}


# llama.cpp converts SmolLM3 as Llama: the same names, q/k rows interleaved for its rotary
GGUF = dataclasses.replace(llama.GGUF, config=gguf_config)


def architecture(name: str) -> Architecture:
    """The registry's view of this module: Llama's build and weights, SmolLM3's config."""
    return dataclasses.replace(llama.architecture(name), config_from_hf=config_from_hf,
                               gguf=GGUF)
