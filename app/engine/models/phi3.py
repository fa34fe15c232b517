"""Phi-3, Phi-3.5 and Phi-4-mini (`Phi3ForCausalLM`): the Llama block with the checkpoint's q/k/v
and gate/up already fused (our own layout), partial rotary (`partial_rotary_factor`, 0.75 on
Phi-4-mini) and LongRoPE. LongRoPE switches from its short to its long factors once a sequence
outgrows `original_max_position_embeddings`; the context window is capped there, where the short
factors (and the attention factor on cos and sin) are exact."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from localchat.engine.models import Architecture, llama
from localchat.errors import ModelConfigError, UnsupportedModelError


def config_from_hf(hf: dict[str, Any]) -> llama.LlamaConfig:
    """Read a Phi-3 config.json (old `rope_scaling` or transformers 5's `rope_parameters`)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "longrope"):
        raise UnsupportedModelError(f"Phi-3 rope type {kind!r} is not supported")
    plain = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters")}
    theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
    cfg = llama.LlamaConfig.from_hf({**plain, "rope_theta": theta})
    partial = hf.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
    rotary = int(cfg.head_dim * float(partial))
    if kind == "default":
        return dataclasses.replace(cfg, rotary_dim=rotary if rotary != cfg.head_dim else 0)
    context = int(hf.get("max_position_embeddings") or cfg.context_window_size)
    original = int(hf.get("original_max_position_embeddings")
                   or params.get("original_max_position_embeddings") or context)
    short = [float(f) for f in params.get("short_factor") or []]
    if len(short) != rotary // 2:
        raise ModelConfigError(f"longrope short_factor has {len(short)} entries, the rotary "
                               f"width {rotary} needs {rotary // 2}")
    factor = context / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return dataclasses.replace(
        cfg, rotary_dim=rotary if rotary != cfg.head_dim else 0,
        context_window_size=min(cfg.context_window_size, original),
        rope_ext_factors=short, rope_attention_factor=float(attention))


def hf_params(cfg: llama.LlamaConfig, get: Callable[[str], np.ndarray],
              names: set[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Our parameters: the checkpoint's own names (its projections are fused as ours are)."""
    for name in sorted(names):
        if name.startswith(("model.", "lm_head.")) and not name.endswith("rotary_emb.inv_freq"):
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            yield name, get(name)
    if not cfg.tie_word_embeddings and "lm_head.weight" not in names:
        yield "lm_head.weight", get("model.embed_tokens.weight")


def architecture(name: str) -> Architecture:
    """The registry's view of this module: Llama's build, Phi-3's config and weight names."""
    return dataclasses.replace(llama.architecture(name), config_from_hf=config_from_hf,
                               hf_params=hf_params, gguf=None)
