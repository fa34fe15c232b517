"""Tiny random Llama-family models, saved by transformers, for oracle tests.

Each variant exercises one option of the family; the same saved weights are what both
localchat and the transformers oracle load.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from fixtures import cache_dir, one_builder_at_a_time

BASE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
}

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("LlamaConfig", {}),
    "llama-mha": ("LlamaConfig", {"num_key_value_heads": 4}),
    "llama3-rope": (
        "LlamaConfig",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 2, "use_sliding_window": False}),
    "tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "head-dim-32": ("LlamaConfig", {"head_dim": 32}),
}

# Shapes that are not multiples of 32 (tests/test_odd_shapes.py): reductions of 344 or 1000, head
# dims of 48 or 80, odd vocabularies, a hidden size of 72. One layer each, to keep compiles short.
ODD_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-odd": (
        "LlamaConfig",
        {
            "vocab_size": 1001,
            "hidden_size": 72,
            "intermediate_size": 344,
            "num_hidden_layers": 1,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "head_dim": 48,
        },
    ),
    "qwen2-odd": (
        "Qwen2Config",
        {
            "vocab_size": 999,
            "hidden_size": 160,
            "intermediate_size": 1000,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 80,
            "use_sliding_window": False,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3-odd": (  # per-head q/k norm (the block option Qwen3 turns on), head_dim given
        "Qwen3Config",
        {
            "vocab_size": 1001,
            "hidden_size": 72,
            "intermediate_size": 344,
            "num_hidden_layers": 1,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "head_dim": 48,
            "tie_word_embeddings": True,
        },
    ),
    "gemma2-odd": (  # GELU-tanh, sandwich norms (1 + w), scaled embeddings, soft-caps, a
        # window shorter than the test's sequence on the first of two layers
        "Gemma2Config",
        {
            "vocab_size": 1001,
            "hidden_size": 72,
            "intermediate_size": 344,
            "num_hidden_layers": 2,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "head_dim": 48,
            "query_pre_attn_scalar": 40,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 10.0,
            "sliding_window": 8,
            "tie_word_embeddings": True,
        },
    ),
    "gemma3-odd": (  # q/k norm (1 + w), local layers windowed with their own rope theta
        "Gemma3TextConfig",
        {
            "vocab_size": 1001,
            "hidden_size": 72,
            "intermediate_size": 344,
            "num_hidden_layers": 2,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "head_dim": 48,
            "query_pre_attn_scalar": 40,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0,
                                   "rope_theta": 1000000.0},
            },
            "tie_word_embeddings": True,
        },
    ),
    "olmo2-odd": (  # norms after each branch, q/k norm over the whole projection
        "Olmo2Config",
        {
            "vocab_size": 1001,
            "hidden_size": 72,
            "intermediate_size": 344,
            "num_hidden_layers": 1,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "head_dim": 48,
        },
    ),
    "smollm3-odd": (  # the second of two layers without rotary embedding
        "SmolLM3Config",
        {
            "vocab_size": 1001,
            "hidden_size": 72,
            "intermediate_size": 344,
            "num_hidden_layers": 2,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "head_dim": 48,
            "no_rope_layers": [1, 0],
            "tie_word_embeddings": True,
            "pad_token_id": 0,  # its defaults lie outside this vocabulary
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
    "phi3-odd": (  # fused checkpoint projections, partial rotary 0.75, LongRoPE short factors
        "Phi3Config",
        {
            "vocab_size": 1001,
            "hidden_size": 96,
            "intermediate_size": 344,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 512,
            "original_max_position_embeddings": 128,  # the window: short factors hold there
            "rope_parameters": {
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(18)],
                "long_factor": [2.0 + 0.3 * i for i in range(18)],
            },
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
    "mistral-odd": (
        "MistralConfig",
        {
            "vocab_size": 1003,
            "hidden_size": 96,
            "intermediate_size": 1000,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 48,
            "sliding_window": None,
        },
    ),
}


@one_builder_at_a_time
def build_variant(name: str) -> Path:
    """Save a random model of variant `name` (seeded, so stable across runs) and return it."""
    import torch
    import transformers

    cls_name, extra = VARIANTS[name] if name in VARIANTS else ODD_VARIANTS[name]
    kwargs = {**BASE, **extra}
    digest = hashlib.sha256(
        json.dumps(
            [cls_name, kwargs, transformers.__version__, "head=embed"], sort_keys=True
        ).encode()
    ).hexdigest()[:10]
    out = cache_dir() / "variants" / f"{name}-{digest}"
    if (out / "config.json").exists():
        return out
    config = getattr(transformers, cls_name)(**kwargs)
    model_cls = getattr(transformers, cls_name.replace("TextConfig", "Config")
                        .replace("Config", "ForCausalLM"))
    torch.manual_seed(1234)
    model = model_cls(config).eval()
    if not config.tie_word_embeddings:
        # A head aligned with the embeddings gives peaked next-token distributions, as trained
        # models have; with a purely random head the top-1 is decided by noise-level margins.
        with torch.no_grad():
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}-"))
    model.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
