"""The registry of architectures: adding one is one module of this package (with a function
`architecture(name) -> Architecture`) plus one `Entry` in `REGISTRY`, the only list of them."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from localchat.errors import UnsupportedModelError

ParamSource = Callable[[str], np.ndarray]


@runtime_checkable
class ModelConfig(Protocol):
    """What every stage outside an architecture's own module reads of its config: convert sets
    the window and prefill chunk and records the vocabulary; the runtime sizes its buffers from
    them. Anything else (heads, head_dim, state sizes) stays behind `Architecture.cache_bytes`
    and `build`."""

    vocab_size: int
    num_hidden_layers: int
    context_window_size: int
    prefill_chunk_size: int

    def to_dict(self) -> dict[str, Any]:
        """The config as stored in localchat-config.json (`config_from_dict` reads it back)."""
        ...


# (config, activation dtype, max sequences, KV token capacity) -> bytes of the KV cache or the
# recurrent state; a recurrent architecture ignores the token capacity.
CacheBytes = Callable[[Any, str, int, int], int]


@dataclass(frozen=True)
class Architecture:
    """How to read, build and convert one architecture."""

    name: str
    state: str  # "kv" (paged KV cache) or "rnn" (recurrent state)
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]
    config_from_dict: Callable[[dict[str, Any]], ModelConfig]
    build: Callable[..., Any]  # (config, QuantMode, Target) -> nn.Module
    hf_params: Callable[[Any, ParamSource, set[str]], Iterator[tuple[str, np.ndarray]]]
    cache_bytes: CacheBytes
    # built-in conversation template for checkpoints that ship no chat template of their own
    default_template: str | None = None


@dataclass(frozen=True)
class Entry:
    """One architecture of the registry: its name (stored in converted models), the module of
    this package that defines it (with a function `architecture(name) -> Architecture`), and the
    HF `architectures` / `model_type` values that select it."""

    name: str
    module: str
    hf_architectures: tuple[str, ...]
    model_types: tuple[str, ...]

    def load(self) -> Architecture:
        # imported on use: the model modules import TVM, the registry's users often do not need it
        module = importlib.import_module(f"{__name__}.{self.module}")
        return module.architecture(self.name)


REGISTRY: tuple[Entry, ...] = (
    Entry(
        "llama",
        "llama",
        ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
        ("llama", "mistral", "qwen2"),
    ),
    Entry("qwen3", "qwen3", ("Qwen3ForCausalLM",), ("qwen3",)),
    Entry("rwkv4", "rwkv4", ("RwkvForCausalLM",), ("rwkv",)),
)


def get_architecture(name: str) -> Architecture:
    """The architecture stored in a model directory's localchat-config.json."""
    for entry in REGISTRY:
        if entry.name == name:
            return entry.load()
    raise UnsupportedModelError(f"unknown architecture {name!r}")


def detect_architecture(hf_config: dict[str, Any]) -> Architecture:
    """The architecture of an HF config.json, or UnsupportedModelError naming what it is."""
    names = hf_config.get("architectures") or []
    for hf_name in names:
        for entry in REGISTRY:
            if hf_name in entry.hf_architectures:
                return entry.load()
    model_type = hf_config.get("model_type")
    if not names:
        for entry in REGISTRY:
            if model_type in entry.model_types:
                return entry.load()
    what = ", ".join(names) if names else f"model_type {model_type!r}"
    known = ", ".join(sorted(n for entry in REGISTRY for n in entry.hf_architectures))
    raise UnsupportedModelError(f"unsupported architecture {what} (supported: {known})")
