"""The GPU paths compile: CUDA cross-compiles with nvcc (skipped without it), Metal generates
its shader source. Running them needs the GPU, which tests/test_gpu.py checks where present."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import tvm

from localchat.engine.build.compile import compile_library, export_module
from localchat.engine.build.convert import read_hf_config
from localchat.engine.build.quantization import get_quant_mode
from localchat.engine.device import cuda_target, metal_target
from localchat.engine.models import detect_architecture

from llama_variants import build_variant


@pytest.fixture(autouse=True)
def _no_shared_library_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each store compiles for itself here (these tests compile on purpose): not from the one
    library cache conftest.py gives the other tests."""
    monkeypatch.delenv("LOCALCHAT_SHARED_LIBRARY_CACHE", raising=False)


def _model(quant: str):
    hf = read_hf_config(build_variant("qwen2"))
    arch = detect_architecture(hf)
    return arch, arch.config_from_hf(hf), get_quant_mode(quant)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("quant", ["q4f16_1", "q0f16", "q4f16_asym", "q8f16_0"])
def test_cuda_library_cross_compiles(tmp_path: Path, quant: str) -> None:
    arch, cfg, mode = _model(quant)
    lib = compile_library(arch, cfg, mode, cuda_target("sm_80"), tmp_path)
    assert lib.compiled and lib.path.stat().st_size > 0
    again = compile_library(arch, cfg, mode, cuda_target("sm_80"), tmp_path)
    assert again.compiled is False and again.path == lib.path


def test_metal_codegen() -> None:
    arch, cfg, mode = _model("q4f16_1")
    target = metal_target()
    mod, _ = export_module(arch, cfg, mode, target)
    from localchat.engine.build.compile import relax_pipeline

    ex = tvm.compile(mod, target=target, relax_pipeline=relax_pipeline(target))

    def modules(m):
        yield m
        for child in m.imports:
            yield from modules(child)

    sources = [m.inspect_source() for m in modules(ex.mod) if m.kind == "metal"]
    assert sources and "kernel void" in sources[0]


def test_a_shared_library_cache_compiles_once_for_several_stores(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LOCALCHAT_SHARED_LIBRARY_CACHE: the first store's compile is published there, the
    second store takes a verified copy instead of compiling, and a damaged shared copy is
    never taken."""
    from localchat import model_dir as md
    from localchat.engine.device import cpu_target

    shared = tmp_path / "shared"
    monkeypatch.setenv("LOCALCHAT_SHARED_LIBRARY_CACHE", str(shared))
    arch, cfg, mode = _model("q0f32")
    first = compile_library(arch, cfg, mode, cpu_target(), tmp_path / "a")
    published = shared / first.path.name
    assert first.compiled and md.verified_cache_library(published)
    second = compile_library(arch, cfg, mode, cpu_target(), tmp_path / "b")
    assert second.compiled is False and second.path.parent == tmp_path / "b"
    assert second.path.read_bytes() == first.path.read_bytes()
    assert md.verified_cache_library(second.path)  # its own record beside it
    published.unlink()  # a hard link to the first store's copy: damage a copy of its own
    published.write_bytes(b"\0" * 64 + first.path.read_bytes()[64:])  # record kept: a mismatch
    assert md.library_cache_dirs()[-1] == shared
    third = compile_library(arch, cfg, mode, cpu_target(), tmp_path / "c")
    assert third.compiled and md.verified_cache_library(third.path)


@pytest.mark.parametrize("quant", ["q4f16_1", "q0f16"])
def test_gpu_linears_read_the_weights_in_place(quant: str) -> None:
    """No kernel writes a dequantized or transposed copy of a weight per call (as dequantize ->
    permute_dims -> matmul did: on an H100 those copies held decode at 2% of its bandwidth);
    the KV cache's own transposing append is the one transpose left."""
    import re

    from model_oracle import cuda_sources

    names = re.findall(r"__global__ void[^\n]*?(\w+_kernel)\(", "\n".join(
        cuda_sources(build_variant("llama-odd"), quant)))
    assert any("nt_matmul" in n for n in names)
    copies = [n for n in names if ("transpose" in n and "kv_cache" not in n) or "dequantize" in n]
    assert not copies


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_compiles_q4f32_k_with_its_q6_k_head(tmp_path: Path) -> None:
    """q4f32_k's Q6_K matrices on a GPU (the embedding / LM head, and a Q4_K_M file's attn_v and
    ffn_down, v apart from q and k): the embedding dequantizes inline, the others apart
    (dlight's GEMV rule cannot read two parameters of a row inline)."""
    arch = detect_architecture({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    cfg = arch.config_from_hf({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 128,
        "tie_word_embeddings": True, "localchat_q6_k_layers": {"v": [0], "down": [0]}})
    model = arch.build(cfg, get_quant_mode("q4f32_k"), cuda_target("sm_80"))
    params = {name: str(p.dtype) for name, p in model.named_parameters()}
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.v_proj.weight",
                 "model.layers.0.mlp.down_proj.weight"):
        assert params[name] == "uint8", name
    lib = compile_library(arch, cfg, get_quant_mode("q4f32_k"), cuda_target("sm_80"), tmp_path)
    assert lib.compiled and lib.path.stat().st_size > 0
