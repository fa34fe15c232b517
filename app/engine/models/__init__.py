"""The registry of architectures: adding one is one module plus one entry here."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from localchat.errors import UnsupportedModelError

ParamSource = Callable[[str], np.ndarray]


@dataclass(frozen=True)
class Architecture:
    """How to read, build and convert one architecture."""

    name: str
    state: str  # "kv" (paged KV cache) or "rnn" (recurrent state)
    config_from_hf: Callable[[dict[str, Any]], Any]
    config_from_dict: Callable[[dict[str, Any]], Any]
    build: Callable[..., Any]  # (config, QuantMode, Target) -> nn.Module
    hf_params: Callable[[Any, ParamSource, set[str]], Iterator[tuple[str, np.ndarray]]]
    # rnn only: bytes of the recurrent state of (config, max_batch_size) sequences
    state_bytes: Callable[[Any, int], int] | None = None
    # built-in conversation template for checkpoints that ship no chat template of their own
    default_template: str | None = None


def _llama() -> Architecture:
    from localchat.engine.models import llama

    return Architecture(
        name="llama",
        state="kv",
        config_from_hf=llama.LlamaConfig.from_hf,
        config_from_dict=llama.LlamaConfig.from_dict,
        build=llama.LlamaForCausalLM,
        hf_params=llama.hf_params,
    )


def _rwkv4() -> Architecture:
    from localchat.engine.models import rwkv4

    return Architecture(
        name="rwkv4",
        state="rnn",
        config_from_hf=rwkv4.Rwkv4Config.from_hf,
        config_from_dict=rwkv4.Rwkv4Config.from_dict,
        build=rwkv4.Rwkv4ForCausalLM,
        hf_params=rwkv4.hf_params,
        state_bytes=rwkv4.state_bytes,
        default_template="rwkv_world",
    )


_HF_ARCHITECTURES: dict[str, Callable[[], Architecture]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _llama,
    "Qwen2ForCausalLM": _llama,
    "RwkvForCausalLM": _rwkv4,
}
_MODEL_TYPES: dict[str, Callable[[], Architecture]] = {
    "llama": _llama,
    "mistral": _llama,
    "qwen2": _llama,
    "rwkv": _rwkv4,
}
_BY_NAME: dict[str, Callable[[], Architecture]] = {"llama": _llama, "rwkv4": _rwkv4}


def register(name: str, factory: Callable[[], Architecture], hf_names: tuple[str, ...],
             model_types: tuple[str, ...]) -> None:
    """Add an architecture to the registry (used by the modules that define one)."""
    _BY_NAME[name] = factory
    for hf_name in hf_names:
        _HF_ARCHITECTURES[hf_name] = factory
    for model_type in model_types:
        _MODEL_TYPES[model_type] = factory


def get_architecture(name: str) -> Architecture:
    """The architecture stored in a model directory's localchat-config.json."""
    try:
        return _BY_NAME[name]()
    except KeyError:
        raise UnsupportedModelError(f"unknown architecture {name!r}") from None


def detect_architecture(hf_config: dict[str, Any]) -> Architecture:
    """The architecture of an HF config.json, or UnsupportedModelError naming what it is."""
    names = hf_config.get("architectures") or []
    for hf_name in names:
        if hf_name in _HF_ARCHITECTURES:
            return _HF_ARCHITECTURES[hf_name]()
    model_type = hf_config.get("model_type")
    if not names and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]()
    what = ", ".join(names) if names else f"model_type {model_type!r}"
    known = ", ".join(sorted(_HF_ARCHITECTURES))
    raise UnsupportedModelError(f"unsupported architecture {what} (supported: {known})")
