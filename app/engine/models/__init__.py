"""The registry of architectures: adding one is one module of this package (with a function
`architecture(name) -> Architecture`) plus one `Entry` in `REGISTRY`, the only list of them."""

from __future__ import annotations

import importlib
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
