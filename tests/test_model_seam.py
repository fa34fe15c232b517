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


def _cuda_target():
    """An H100's CUDA target (sm_90a) with this CPU as host: exports for a GPU not present."""
    from tvm.target import Target

    return Target({"kind": "cuda", "arch": "sm_90a", "max_threads_per_block": 1024,
                   "max_shared_memory_per_block": 49152, "thread_warp_size": 32},
                  host=cpu_target())


def test_gemma_builds_for_a_gpu_with_what_tvm_has() -> None:
    """Gemma 3 (per-layer rope, windows) and Gemma 2 export for CUDA; Gemma 2's attention
    soft-cap, which TVM's GPU attention lacks, is written into its kernels' scores (prefill of
    a chunk's own tokens, of earlier pages, decode; windowed and not), and into no others."""
    from tvm import tirx

    cuda = _cuda_target()
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

    from localchat.errors import UnsupportedModelError

    cuda = _cuda_target()
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


def test_gpt_oss_builds_for_a_gpu_with_its_sinks_in_tvms_kernels() -> None:
    """gpt-oss exports for CUDA: the sinks, which TVM's GPU attention lacks, are written into
    the final softmax state of its kernels (prefill of a chunk's own tokens, of earlier pages,
    decode; windowed and not: the output and the LSE of each), and the model applies its YaRN
    rope itself (TVM's would pair the padded head's lanes)."""
    from tvm import tirx

    cuda = _cuda_target()
    arch = get_architecture("gpt_oss")
    cfg = arch.config_from_hf({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64,
        "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": 300, "max_position_embeddings": 256,
        "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096}})
    model = arch.build(cfg, get_quant_mode("q4f16_1"), cuda)
    mod, _ = model.export_tvm(spec=model.get_default_spec())
    scripts = {gv.name_hint: f.script() for gv, f in mod.functions.items()
               if isinstance(f, tirx.PrimFunc)}
    # the sink's lane (32 of 48) of q read where the final state is stored
    sunk = {name for name, text in scripts.items() if "T.float32(120.0)" in text}
    assert sunk == {"batch_prefill_ragged_kv", "batch_prefill_paged_kv", "batch_decode_paged_kv",
                    "batch_prefill_paged_kv_sliding_window",
                    "batch_decode_paged_kv_sliding_window"}
    for name in sunk:
        assert scripts[name].count("T.float32(120.0)") == 2, name  # output and LSE
        assert ", 32]" in scripts[name], name
    # rope in the model: a cos outside the cache's kernels (theirs run only in RopeMode.NORMAL)
    assert any("T.cos" in text for name, text in scripts.items()
               if not name.startswith(("batch_", "tir_", "copy_", "kv_", "merge_")))


def test_yarn_as_rotary_divisors_equals_transformers() -> None:
    """`yarn_factors` turns YaRN into the per-frequency divisors the GPU rope takes: the same
    frequencies as transformers' YaRN (gpt-oss's untruncated range)."""
    import torch  # noqa: F401  (transformers' rope functions need it)
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from localchat.engine.models.layers import yarn_factors

    cfg = GptOssConfig(head_dim=36, hidden_size=144, num_attention_heads=4)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    scaling = getattr(cfg, "rope_scaling", None) or cfg.rope_parameters
    theta = float(scaling.get("rope_theta") or cfg.rope_theta)
    ours = [1.0 / (theta ** (2 * k / 36) * f) for k, f in enumerate(yarn_factors(scaling, theta,
                                                                                 36))]
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6)
    assert max(yarn_factors(scaling, theta, 36)) > 30  # the slow frequencies are interpolated


def test_the_gpu_form_of_mxfp4_experts_equals_numpy() -> None:
    """`layers.expert_linear_gpu` in q4f32_mx (what a GPU runs for MXFP4 experts), built and
    run on the CPU: each token's chosen experts' rows times its input, several tokens choosing
    one expert, some experts chosen by none, every FP4 code and extreme exponents."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend import nn

    from localchat.engine.build.quantization import dequantize_mx, quantize_mx
    from localchat.engine.models.layers import expert_linear_gpu

    mode = get_quant_mode("q4f32_mx")
    experts, n, k, t, topk = 5, 6, 64, 3, 2
    rng = np.random.default_rng(7)
    codes = rng.integers(0, 16, (experts * n, k))
    exps = rng.integers(100, 140, (experts * n, k // 32))
    exps[0, 0], exps[1, 1] = 1, 200  # the smallest normal power, a large one
    from localchat.engine.build.quantization import FP4_VALUES

    w = FP4_VALUES[codes] * np.exp2(np.repeat(exps, 32, axis=1) - 127.0)
    words, e8 = quantize_mx(w.astype(np.float32))
    np.testing.assert_array_equal(dequantize_mx(words, e8, k), w.astype(np.float32))
    ids = np.array([[0, 3], [3, 1], [0, 3]], dtype=np.int32)  # 2 and 4 chosen by none
    x = rng.standard_normal((t, topk, k)).astype(np.float32)

    class Net(nn.Module):
        def forward(self, x: nn.Tensor, words: nn.Tensor, idx: nn.Tensor, e: nn.Tensor):
            return expert_linear_gpu(x, words, e, idx, n, mode)

    mod, _ = Net().export_tvm(spec={"forward": {
        "x": nn.spec.Tensor([t, topk, k], "float32"),
        "words": nn.spec.Tensor(list(words.shape), "uint32"),
        "idx": nn.spec.Tensor([t, topk], "int32"),
        "e": nn.spec.Tensor(list(e8.shape), "uint8"),
        "$": {"param_mode": "none", "effect_mode": "none"}}})
    vm = relax.VirtualMachine(tvm.compile(mod, target=cpu_target()), tvm.cpu())
    got = vm["forward"](*(tvm.runtime.tensor(a, tvm.cpu()) for a in (x, words, ids, e8)))
    ref = np.stack([np.stack([w[ids[i, j] * n:(ids[i, j] + 1) * n] @ x[i, j]
                              for j in range(topk)]) for i in range(t)])
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-30)
