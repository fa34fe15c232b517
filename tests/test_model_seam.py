"""The seam between the engine and the architectures: the config contract every stage reads, the
cache size each architecture reports, and a library key that only the modules an architecture's
build uses can change."""

from __future__ import annotations

from pathlib import Path

import pytest

from localchat.engine.build.compile import build_sources, library_key
from localchat.engine.build.quantization import get_quant_mode
from localchat.engine.device import cpu_target
from localchat.engine.models import REGISTRY, Entry, ModelConfig, get_architecture
from localchat.engine.models.llama import LlamaConfig
from localchat.engine.models.rwkv4 import Rwkv4Config

LLAMA = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                    rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling={},
                    tie_word_embeddings=True, qkv_bias=False, o_bias=False,
                    context_window_size=128)


def test_every_config_meets_the_model_config_contract() -> None:
    rwkv = get_architecture("rwkv4").config_from_hf(
        {"architectures": ["RwkvForCausalLM"], "hidden_size": 32, "num_hidden_layers": 2,
         "vocab_size": 100, "context_length": 64, "attention_hidden_size": 32,
         "intermediate_size": 64, "layer_norm_epsilon": 1e-5})
    for config in (LLAMA, rwkv):
        assert isinstance(config, ModelConfig)
        assert type(config).from_dict(config.to_dict()) == config
    assert isinstance(rwkv, Rwkv4Config)


def test_cache_bytes_for_kv_and_recurrent_state() -> None:
    llama = get_architecture("llama")
    # keys and values, 3 layers x 2 KV heads x 16 per token, float32
    assert llama.cache_bytes(LLAMA, "float32", 4, 100) == 2 * 3 * 2 * 16 * 4 * 100
    assert llama.cache_bytes(LLAMA, "float16", 4, 100) == 2 * 3 * 2 * 16 * 2 * 100
    rwkv = get_architecture("rwkv4")
    cfg = rwkv.config_from_hf({"architectures": ["RwkvForCausalLM"], "hidden_size": 32,
                               "num_hidden_layers": 2, "vocab_size": 100,
                               "context_length": 64, "attention_hidden_size": 32,
                               "intermediate_size": 64, "layer_norm_epsilon": 1e-5})
    one = rwkv.cache_bytes(cfg, "float32", 1, 0)
    assert one > 0 and rwkv.cache_bytes(cfg, "float32", 3, 10_000) == 3 * one


def test_a_new_architecture_module_leaves_the_other_library_keys_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    mode, target = get_quant_mode("q4f32_1"), cpu_target()
    llama = get_architecture("llama")
    before = library_key(llama, LLAMA, mode, target)
    models = Path(build_sources("llama")[0]).parents[1] / "models"
    probe = models / "zz_probe_arch.py"
    probe.write_text("from localchat.engine.kernels import wkv  # noqa: F401\n"
                     "from localchat.engine.models import layers  # noqa: F401\n")
    try:
        monkeypatch.setattr("localchat.engine.models.REGISTRY",
                            (*REGISTRY, Entry("probe", "zz_probe_arch", ("Probe",), ("probe",))))
        assert library_key(llama, LLAMA, mode, target) == before
        sources = {p.name for p in build_sources("probe")}
        assert {"zz_probe_arch.py", "wkv.py", "layers.py"} <= sources
        assert "llama.py" not in sources and "attention.py" not in sources
        assert "rwkv4.py" not in {p.name for p in build_sources("llama")}
    finally:
        probe.unlink()
