"""The seam between the engine and the architectures: the config contract every stage reads, the
cache size each architecture reports, and a library key that only the modules an architecture's
build uses can change."""

from __future__ import annotations

from pathlib import Path

import numpy as np
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


def _rope_reference(x: np.ndarray, pos: np.ndarray, theta: float, scale: float, nqk: int,
                    rd: int) -> np.ndarray:
    """HF's rotate-half on the first `rd` of each of the first `nqk` heads, in float64."""
    out = x.astype(np.float64).copy()
    half = rd // 2
    inv = theta ** (-np.arange(half) * 2.0 / rd)
    ang = (pos.reshape(x.shape[0], x.shape[1]) * scale)[..., None] * inv  # [b, s, half]
    cos, sin = np.cos(ang)[:, :, None, :], np.sin(ang)[:, :, None, :]
    a, b = x[:, :, :nqk, :half], x[:, :, :nqk, half:rd]
    out[:, :, :nqk, :half] = a * cos - b * sin
    out[:, :, :nqk, half:rd] = b * cos + a * sin
    return out


def test_the_gpu_form_of_per_layer_rope_equals_hf_rotate_half() -> None:
    """`layers.rotary` (the tensor expression GPUs run for a layer with its own theta), built
    and run on the CPU, against numpy: partial width, a position scale, v untouched."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend import nn

    from localchat.engine.models.layers import rotary

    b, s, nq, nkv, d, rd = 2, 5, 3, 1, 16, 12

    class Net(nn.Module):
        def forward(self, qkv: nn.Tensor, pos: nn.Tensor):
            return rotary(qkv, pos, 10000.0, 0.25, nq, nkv, rd)

    mod, _ = Net().export_tvm(spec={"forward": {
        "qkv": nn.spec.Tensor([b, s, nq + 2 * nkv, d], "float32"),
        "pos": nn.spec.Tensor([b * s], "int32"),
        "$": {"param_mode": "none", "effect_mode": "none"}}})
    vm = relax.VirtualMachine(tvm.compile(mod, target=cpu_target()), tvm.cpu())
    rng = np.random.default_rng(3)
    x = rng.standard_normal((b, s, nq + 2 * nkv, d)).astype(np.float32)
    pos = np.concatenate([np.arange(7, 7 + s), np.arange(s)]).astype(np.int32)
    got = vm["forward"](tvm.runtime.tensor(x, tvm.cpu()), tvm.runtime.tensor(pos, tvm.cpu()))
    ref = _rope_reference(x, pos, 10000.0, 0.25, nq + nkv, rd)
    np.testing.assert_allclose(got.numpy(), ref, atol=2e-5)


def test_gemma_builds_for_a_gpu_with_what_tvm_has() -> None:
    """Gemma 3 (per-layer rope, windows) and Gemma 2 export for CUDA; Gemma 2's attention
    soft-cap, which TVM's GPU attention lacks, is written into its kernels' scores (prefill of
    a chunk's own tokens, of earlier pages, decode; windowed and not), and into no others."""
    from tvm import tirx
    from tvm.target import Target

    cuda = Target({"kind": "cuda", "arch": "sm_90a", "max_threads_per_block": 1024,
                   "max_shared_memory_per_block": 49152, "thread_warp_size": 32},
                  host=cpu_target())
    hf = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "vocab_size": 300, "max_position_embeddings": 128, "sliding_window": 8,
          "layer_types": ["sliding_attention", "full_attention"]}
    for name, extra in (("gemma3", {}), ("gemma2", {"attn_logit_softcapping": 50.0})):
        arch = get_architecture(name)
        model = arch.build(arch.config_from_hf({**hf, **extra}), get_quant_mode("q4f16_1"),
                           cuda)
        mod, _ = model.export_tvm(spec=model.get_default_spec())
        capped = {gv.name_hint for gv, f in mod.functions.items()
                  if isinstance(f, tirx.PrimFunc) and "tanh" in f.script()}
        assert capped == (set() if name == "gemma3" else {
            "batch_prefill_ragged_kv", "batch_prefill_paged_kv", "batch_decode_paged_kv",
            "batch_prefill_paged_kv_sliding_window", "batch_decode_paged_kv_sliding_window"})


def test_the_registry_knows_each_architectures_state_without_importing_it() -> None:
    """`architecture_state` (what a runtime-only TVM reads) says what the module's
    Architecture says."""
    from localchat.engine.models import architecture_state

    for entry in REGISTRY:
        assert architecture_state(entry.name) == entry.load().state, entry.name


def test_moe_builds_for_a_gpu() -> None:
    """Qwen3-MoE exports for CUDA (the router one thread per token, the experts one gathered
    reduction each: no CPU kernel); the asymmetric modes, whose reads dlight cannot inline,
    are refused by name."""
    from tvm import tirx
    from tvm.target import Target

    from localchat.errors import UnsupportedModelError

    cuda = Target({"kind": "cuda", "arch": "sm_90a", "max_threads_per_block": 1024,
                   "max_shared_memory_per_block": 49152, "thread_warp_size": 32},
                  host=cpu_target())
    arch = get_architecture("qwen3_moe")
    cfg = arch.config_from_hf({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 48, "num_experts": 6,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 300,
        "max_position_embeddings": 128})
    model = arch.build(cfg, get_quant_mode("q4f16_1"), cuda)
    mod, _ = model.export_tvm(spec=model.get_default_spec())
    funcs = {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}
    assert any("threadIdx.x" in f.script() for n, f in funcs.items() if "router" in n)
    assert any(n.startswith("expert_matmul") for n in funcs)
    assert not any(n.startswith(("moe_gemv", "moe_combine")) and "parallel" in f.script()
                   for n, f in funcs.items())
    with pytest.raises(UnsupportedModelError, match="q4f16_asym"):
        arch.build(cfg, get_quant_mode("q4f16_asym"), cuda)
