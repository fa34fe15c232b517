"""Reading Llama-family configs as older and newer transformers write them."""

from __future__ import annotations

import pytest

from localchat.engine.models import detect_architecture
from localchat.engine.models.llama import LlamaConfig
from localchat.errors import ModelConfigError, UnsupportedModelError

# As the hub's Llama-3.2-1B-Instruct config.json has it (transformers 4.x layout).
LLAMA32_OLD = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": True,
}


def test_old_and_new_rope_layouts_give_the_same_config() -> None:
    new = dict(LLAMA32_OLD)
    scaling = new.pop("rope_scaling")
    new["rope_parameters"] = {**scaling, "rope_theta": new.pop("rope_theta")}
    assert LlamaConfig.from_hf(LLAMA32_OLD) == LlamaConfig.from_hf(new)
    cfg = LlamaConfig.from_hf(new)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rope_scaling["factor"] == 32.0
    assert cfg.tie_word_embeddings and cfg.head_dim == 64


def test_legacy_type_key_and_default_rope() -> None:
    cfg = LlamaConfig.from_hf({**LLAMA32_OLD, "rope_scaling": None, "rope_theta": 10000.0})
    assert cfg.rope_scaling == {} and cfg.rope_theta == 10000.0
    with pytest.raises(UnsupportedModelError, match="linear"):
        LlamaConfig.from_hf({**LLAMA32_OLD, "rope_scaling": {"type": "linear", "factor": 2.0}})


def test_qwen2_has_qkv_bias_only() -> None:
    qwen = {**LLAMA32_OLD, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    qwen.pop("rope_scaling")
    cfg = LlamaConfig.from_hf(qwen)
    assert cfg.qkv_bias and not cfg.o_bias
    assert detect_architecture(qwen).name == "llama"


def test_mistral_sliding_window_caps_context() -> None:
    mistral = {
        **LLAMA32_OLD,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
    }
    mistral.pop("rope_scaling")
    assert LlamaConfig.from_hf(mistral).context_window_size == 4096
    assert LlamaConfig.from_hf({**mistral, "sliding_window": None}).context_window_size == 32768


def test_missing_and_unsupported_fields_are_named() -> None:
    broken = dict(LLAMA32_OLD)
    del broken["hidden_size"]
    with pytest.raises(ModelConfigError, match="hidden_size"):
        LlamaConfig.from_hf(broken)
    with pytest.raises(UnsupportedModelError, match="gelu"):
        LlamaConfig.from_hf({**LLAMA32_OLD, "hidden_act": "gelu"})
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        detect_architecture({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
