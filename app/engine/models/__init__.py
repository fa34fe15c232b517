"""The registry of architectures: adding one is one module of this package (with a function
`architecture(name) -> Architecture`) plus one `Entry` in `REGISTRY`, the only list of them.
An architecture that llama.cpp's GGUF files hold also declares a `GgufMap` (its tensor names and
config) and names the files' `general.architecture` values in its `Entry`."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
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


class GgufSource(Protocol):
    """What an architecture's GGUF config reads of a file (`build.gguf.GGUFFile` is one)."""

    path: Path

    def arch_key(self, key: str, default: Any = None) -> Any:
        """The metadata value `<general.architecture>.<key>` (e.g. `llama.block_count`)."""
        ...

    def tensor_shape(self, name: str) -> tuple[int, ...] | None:
        """A tensor's shape, rows first (None: the file has no such tensor)."""
        ...

    def tensor_values(self, name: str) -> np.ndarray:
        """A tensor's values, dequantized to float32."""
        ...


# A metadata key's HF config key, its type, and its default (None: the key is required); a
# missing, zero or empty value takes the default.
GgufKey = tuple[str, Callable[[Any], Any], Any]


@dataclass(frozen=True, eq=False)  # eq=False: hashable by identity, as Architecture needs
class GgufMap:
    """How an architecture reads llama.cpp's GGUF files, as data for `build.gguf`, which does
    the reading: which tensor is which HF tensor, and the HF config.json the metadata makes.

    `tensors` maps whole-model names (`output_norm.weight`); `layer_tensors` maps block tensors
    by their name inside `blk.N.` without `.weight`/`.bias` (`attn_q` -> `self_attn.q_proj`),
    placed under `layer_prefix` (formatted with N). `config_keys` maps metadata keys (after
    `<general.architecture>.`) to HF keys; `config(file, read)` returns the rest of config.json
    given what `config_keys` read. `permuted` names the layer tensors whose rows llama.cpp's
    converter reordered for its rotary layout, with the HF config key of their head count.
    `ignored` tensors have no HF tensor (their content is in the config, e.g. `rope_freqs`).
    `shifted` names tensors (whole-model names or layer parts) that llama.cpp stored as HF's
    values plus a constant, which the reader subtracts (Gemma's norms, stored as 1 + w).
    """

    tensors: Mapping[str, str]
    layer_tensors: Mapping[str, str]
    config: Callable[[GgufSource, dict[str, Any]], dict[str, Any]]
    config_keys: Mapping[str, GgufKey] = field(default_factory=dict)
    layer_prefix: str = "model.layers.{}."
    permuted: Mapping[str, str] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    shifted: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Architecture:
    """How to read, build and convert one architecture."""

    name: str
    state: str  # "kv" (paged KV cache), "rnn" (recurrent state) or "encoder" (embeddings)
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]
    config_from_dict: Callable[[dict[str, Any]], ModelConfig]
    build: Callable[..., Any]  # (config, QuantMode, Target) -> nn.Module
    hf_params: Callable[[Any, ParamSource, set[str]], Iterator[tuple[str, np.ndarray]]]
    cache_bytes: CacheBytes
    # built-in conversation template for checkpoints that ship no chat template of their own
    default_template: str | None = None
    # how to read llama.cpp's GGUF files of it (None: they are not read)
    gguf: GgufMap | None = None


@dataclass(frozen=True)
class Entry:
    """One architecture of the registry: its name (stored in converted models), the module of
    this package that defines it (with a function `architecture(name) -> Architecture`), the
    HF `architectures` / `model_type` values that select it, and the GGUF `general.architecture`
    values it reads (its `Architecture.gguf` says how). `embedding_of` names the chat
    architecture whose sentence-transformers checkpoints are this embedding architecture (the
    same config.json: only the repo's modules.json tells them apart)."""

    name: str
    module: str
    hf_architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...] = ()
    embedding_of: str = ""
    # its Architecture.state, known without importing the module (which imports TVM's
    # compiler): what a runtime-only TVM needs to run a library compiled elsewhere
    state: str = "kv"

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
        gguf_architectures=("llama",),
    ),
    Entry("qwen3", "qwen3", ("Qwen3ForCausalLM",), ("qwen3",), gguf_architectures=("qwen3",)),
    Entry("gemma2", "gemma", ("Gemma2ForCausalLM",), ("gemma2",),
          gguf_architectures=("gemma2",)),
    # the multimodal checkpoints (4B and up): their language model, the vision tower left out
    Entry("gemma3", "gemma", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
          ("gemma3_text", "gemma3"),
          gguf_architectures=("gemma3",)),
    Entry("olmo2", "olmo2", ("Olmo2ForCausalLM",), ("olmo2",), gguf_architectures=("olmo2",)),
    Entry("smollm3", "smollm3", ("SmolLM3ForCausalLM",), ("smollm3",),
          gguf_architectures=("smollm3",)),
    Entry("phi3", "phi3", ("Phi3ForCausalLM",), ("phi3",), gguf_architectures=("phi3",)),
    # mixture-of-experts configurations of the same block (models/moe.py)
    Entry("qwen3_moe", "qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",),
          gguf_architectures=("qwen3moe",)),
    Entry("olmoe", "olmoe", ("OlmoeForCausalLM",), ("olmoe",), gguf_architectures=("olmoe",)),
    Entry("mixtral", "mixtral", ("MixtralForCausalLM",), ("mixtral",)),
    Entry("gpt_oss", "gpt_oss", ("GptOssForCausalLM",), ("gpt_oss",),
          gguf_architectures=("gpt-oss",)),
    Entry("rwkv4", "rwkv4", ("RwkvForCausalLM",), ("rwkv",), state="rnn"),
    Entry("rwkv6", "rwkv6", ("Rwkv6ForCausalLM",), ("rwkv6",), state="rnn"),
    Entry("rwkv7", "rwkv7", ("Rwkv7ForCausalLM",), ("rwkv7",), state="rnn"),
    # text encoders for embeddings (state "encoder": no KV cache, one `encode` function)
    Entry("bert", "bert", ("BertModel", "BertForMaskedLM", "BertForPreTraining"), ("bert",),
          state="encoder"),
    Entry("nomic_bert", "bert", ("NomicBertModel", "NomicBertForMaskedLM",
                                 "NomicBertForPreTraining"), ("nomic_bert",), state="encoder"),
    # a Qwen3 with sentence-transformers files (Qwen3-Embedding), or a bare Qwen3Model
    Entry("qwen3_embedding", "qwen3_embedding", ("Qwen3Model",), (), embedding_of="qwen3",
          state="encoder"),
)


def _entry(name: str) -> Entry:
    for entry in REGISTRY:
        if entry.name == name:
            return entry
    raise UnsupportedModelError(f"unknown architecture {name!r}")


def get_architecture(name: str) -> Architecture:
    """The architecture stored in a model directory's localchat-config.json."""
    return _entry(name).load()


def architecture_state(name: str) -> str:
    """The state an architecture keeps ("kv", "rnn" or "encoder"), without importing it."""
    return _entry(name).state


def detect_architecture(hf_config: dict[str, Any],
                        sentence_transformers: bool = False) -> Architecture:
    """The architecture of an HF config.json, or UnsupportedModelError naming what it is; with
    `sentence_transformers` (the folder is a sentence-transformers model: it pools), the
    embedding architecture of a chat one where the registry has it (`Entry.embedding_of`)."""
    names = hf_config.get("architectures") or []
    model_type = hf_config.get("model_type")
    found = next((entry for hf_name in names for entry in REGISTRY
                  if hf_name in entry.hf_architectures), None)
    if found is None and not names:
        found = next((entry for entry in REGISTRY if model_type in entry.model_types), None)
    if found is not None:
        if sentence_transformers:
            found = next((e for e in REGISTRY if e.embedding_of == found.name), found)
        return found.load()
    what = ", ".join(names) if names else f"model_type {model_type!r}"
    known = ", ".join(sorted(n for entry in REGISTRY for n in entry.hf_architectures))
    raise UnsupportedModelError(f"unsupported architecture {what} (supported: {known})")


def gguf_architectures() -> tuple[str, ...]:
    """The GGUF `general.architecture` values some architecture reads."""
    return tuple(name for entry in REGISTRY for name in entry.gguf_architectures)


def gguf_map(gguf_architecture: str) -> GgufMap | None:
    """How to read a GGUF file of this `general.architecture`; None when no architecture does."""
    for entry in REGISTRY:
        if gguf_architecture in entry.gguf_architectures:
            arch = entry.load()
            if arch.gguf is None:
                raise TypeError(f"architecture {entry.name!r} lists GGUF architecture "
                                f"{gguf_architecture!r} but declares no GgufMap")
            return arch.gguf
    return None
