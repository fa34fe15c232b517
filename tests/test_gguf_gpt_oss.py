"""GGUF import of gpt-oss: the tiny MXFP4-shaped gpt-oss (tests/moe_variants.py "gpt-oss-mxfp4")
written as llama.cpp's converter lays it out (`general.architecture` "gpt-oss", its metadata
keys, the `gguf` package's tensor names, `attn_sinks.weight`, the experts [E, out, in] with
gate and up split out of transformers' interleaved rows, in ggml's MXFP4 quantized by the `gguf`
package, their biases F32, the rest F32), imported, and checked against transformers running
the HF model whose experts hold the same dequantized MXFP4 values.

llama.cpp does not store gpt-oss's clamp (it fixes 7): the variant's 0.5 is written as
`swiglu_clamp_exp`, which the import reads where a file has it, so that the imported config is
the HF folder's and the compiled library the one tests/test_engine_gpt_oss.py builds.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_engine_gpt_oss import PROMPT, STEPS, _generate, _hf

from localchat.engine.build import gguf as lg
from localchat.engine.models import detect_architecture
from localchat.engine.runtime import Model

import moe_variants
from fixtures import cache_dir, converted, one_builder_at_a_time
from model_oracle import rel_err, run_greedy, run_teacher_forced

ROOT = Path(__file__).resolve().parent.parent
VARIANT = "gpt-oss-mxfp4"


def _mxfp4(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., K] float -> (ggml MXFP4 bytes, as the `gguf` package quantizes them; the values they
    dequantize to)."""
    import gguf
    from gguf import quants

    q = quants.quantize(np.ascontiguousarray(a, dtype=np.float32), gguf.GGMLQuantizationType.MXFP4)
    return q, quants.dequantize(q, gguf.GGMLQuantizationType.MXFP4).astype(np.float32)


def write_gguf(path: Path, fused: bool = False) -> tuple[Path, dict[str, np.ndarray]]:
    """The variant as llama.cpp's `gpt-oss` GGUF (`fused`: gate and up as one
    `ffn_gate_up_exps`, the converter's other option), and the HF tensors of the model it
    holds (the experts' dequantized MXFP4 values in transformers' layout)."""
    import gguf
    from safetensors.numpy import load_file

    folder = moe_variants.build_variant(VARIANT)
    cfg = json.loads((folder / "config.json").read_text())
    layers, rope = cfg["num_hidden_layers"], cfg["rope_parameters"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, layers)
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    moe_variants.write_gguf_header(w, cfg)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_swiglu_clamp_exp([cfg["swiglu_limit"]] * layers)
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    tensors = load_file(folder / "model.safetensors")
    held = dict(tensors)
    for hf_name, value in tensors.items():
        blk = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else ""
        if hf_name.endswith("experts.gate_up_proj"):  # [E, H, 2F], gate at even columns
            rows = value.transpose(0, 2, 1)
            (gq, gate), (uq, up) = _mxfp4(rows[:, 0::2]), _mxfp4(rows[:, 1::2])
            if fused:
                w.add_tensor(f"blk.{blk}.ffn_gate_up_exps.weight", np.concatenate([gq, uq], 1),
                             raw_dtype=mxfp4)
            else:
                w.add_tensor(f"blk.{blk}.ffn_gate_exps.weight", gq, raw_dtype=mxfp4)
                w.add_tensor(f"blk.{blk}.ffn_up_exps.weight", uq, raw_dtype=mxfp4)
            both = np.empty_like(rows)
            both[:, 0::2], both[:, 1::2] = gate, up
            held[hf_name] = np.ascontiguousarray(both.transpose(0, 2, 1))
        elif hf_name.endswith("experts.gate_up_proj_bias"):
            if fused:
                w.add_tensor(f"blk.{blk}.ffn_gate_up_exps.bias",
                             np.concatenate([value[:, 0::2], value[:, 1::2]], 1))
            else:
                w.add_tensor(f"blk.{blk}.ffn_gate_exps.bias", np.ascontiguousarray(value[:, 0::2]))
                w.add_tensor(f"blk.{blk}.ffn_up_exps.bias", np.ascontiguousarray(value[:, 1::2]))
        elif hf_name.endswith("experts.down_proj"):  # [E, F, H]
            q, down = _mxfp4(value.transpose(0, 2, 1))
            w.add_tensor(f"blk.{blk}.ffn_down_exps.weight", q, raw_dtype=mxfp4)
            held[hf_name] = np.ascontiguousarray(down.transpose(0, 2, 1))
        elif hf_name.endswith("experts.down_proj_bias"):
            w.add_tensor(f"blk.{blk}.ffn_down_exps.bias", value)
        else:
            gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            assert gname is not None, hf_name
            if hf_name.endswith("sinks"):  # the converter names it `attn_sinks.weight`
                gname += ".weight"
            w.add_tensor(gname, np.ascontiguousarray(value, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, held


@cache
@one_builder_at_a_time
def imported() -> Path:
    """The HF folder imported from the GGUF, cached by the sources that shape it (so that its
    converted model is too)."""
    sources = [ROOT / "app/engine/build/gguf.py", ROOT / "app/engine/models/gpt_oss.py",
               ROOT / "app/engine/models/llama.py", ROOT / "app/engine/models/__init__.py",
               Path(__file__)]
    h = hashlib.sha256(moe_variants.build_variant(VARIANT).name.encode())
    for p in sources:
        h.update(p.read_bytes())
    out = cache_dir() / "gguf-import" / f"{VARIANT}-{h.hexdigest()[:10]}"
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{VARIANT}-"))
        lg.gguf_to_hf_folder(write_gguf(tmp / "m.gguf")[0], tmp / "hf")
        if out.exists():
            shutil.rmtree(out)
        (tmp / "hf").rename(out)
        shutil.rmtree(tmp)
    return out


def _params(folder: Path, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    hf = json.loads((folder / "config.json").read_text())
    arch = detect_architecture(hf)
    return dict(arch.hf_params(arch.config_from_hf(hf), tensors.__getitem__, set(tensors)))


@pytest.mark.parametrize("fused", [False, True])
def test_import_gives_the_hf_config_and_the_mxfp4_weights(fused: bool, tmp_path: Path) -> None:
    """No compile: the imported config is the HF folder's, exactly (so the library is the one
    already built), and our parameters from the import are those from the HF tensors with the
    experts' dequantized MXFP4 values: gate and up put back, sinks and biases found."""
    from safetensors.numpy import load_file

    folder = moe_variants.build_variant(VARIANT)
    path, held = write_gguf(tmp_path / "m.gguf", fused=fused)
    hf_dir = lg.gguf_to_hf_folder(path, tmp_path / "hf")
    got_hf = json.loads((hf_dir / "config.json").read_text())
    want_hf = json.loads((folder / "config.json").read_text())
    arch = detect_architecture(got_hf)
    assert arch.name == "gpt_oss"
    assert arch.config_from_hf(got_hf).to_dict() == arch.config_from_hf(want_hf).to_dict()
    mine = _params(hf_dir, load_file(hf_dir / "model.safetensors"))
    ref = _params(folder, held)
    assert mine.keys() == ref.keys()
    for name, value in ref.items():
        assert np.array_equal(mine[name], value), name
    # the MXFP4 rounding is real: the experts differ from the float folder's
    floats = _params(folder, load_file(folder / "model.safetensors"))
    assert not np.array_equal(floats["model.layers.0.mlp.experts.down_proj.weight"],
                              ref["model.layers.0.mlp.experts.down_proj.weight"])


def _header(path: Path, extra: dict[str, Any]) -> Path:
    """A metadata-only gpt-oss-20b GGUF as llama.cpp's converter writes it (tiny tensors where
    the import reads a shape)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_block_count(24)
    w.add_context_length(131072)
    w.add_embedding_length(2880)
    w.add_feed_forward_length(2880)
    w.add_head_count(64)
    w.add_head_count_kv(8)
    w.add_rope_freq_base(150000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_key_length(64)
    w.add_value_length(64)
    w.add_expert_count(32)
    w.add_expert_used_count(4)
    w.add_sliding_window(128)
    w.add_expert_feed_forward_length(2880)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    for key, value in extra.items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.add_tensor("output.weight", np.zeros((4, 8), np.float32))
    w.add_tensor("blk.0.attn_q.bias", np.zeros(8, np.float32))
    w.add_tensor("blk.0.ffn_gate_inp.bias", np.zeros(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_llama_cpp_fixed_rules_for_the_real_sizes(tmp_path: Path) -> None:
    """What llama.cpp fixes for gpt-oss rather than storing it: every other layer windowed from
    layer 0, the clamp at 7 and alpha 1.702, YaRN untruncated (beta 32 / 1); a pattern or clamp
    the file does store wins."""
    hf = lg.inspect_gguf(_header(tmp_path / "a.gguf", {}))
    cfg = detect_architecture(hf).config_from_hf(hf)
    assert hf["layer_types"][:3] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert cfg.sliding_layers == [1, 0] * 12 and cfg.sliding_window == 128
    assert (cfg.swiglu_limit, cfg.swiglu_alpha) == (7.0, 1.702)
    assert hf["rope_parameters"] == {
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
        "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False}
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (32, 4, 2880)
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.rms_norm_eps) == (64, 8, 1e-5)
    assert cfg.qkv_bias and cfg.o_bias and cfg.router_bias and cfg.attn_sinks
    assert not cfg.tie_word_embeddings
    hf = lg.inspect_gguf(_header(tmp_path / "b.gguf", {
        "sliding_window_pattern": [False, True] * 12, "swiglu_clamp_exp": [5.0] * 24}))
    assert hf["layer_types"][:2] == ["full_attention", "sliding_attention"]
    assert hf["swiglu_limit"] == 5.0


@pytest.mark.slow
def test_imported_model_matches_transformers(tmp_path: Path) -> None:
    """The imported model at q0f32 (the HF folder's config, so the library of
    tests/test_engine_gpt_oss.py's MXFP4 test) gives transformers' teacher-forced logits and
    greedy tokens on the HF model whose experts hold the GGUF's dequantized MXFP4 values."""
    folder = imported()
    held = write_gguf(tmp_path / "m.gguf")[1]  # the same (deterministic) MXFP4 values
    hf = _hf(moe_variants.build_variant(VARIANT))
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                param.copy_(torch.from_numpy(held[name]))
    ref_tokens, ref_logits = _generate(hf)
    assert len(set(ref_tokens)) > STEPS // 3
    ours = Model(converted(folder, "q0f32"), "cpu")
    got = run_teacher_forced(ours, PROMPT, ref_tokens)
    worst = max(rel_err(o, r) for o, r in zip(got, ref_logits))
    assert worst <= 1e-4, f"max relative error {worst:.2e}"
    assert run_greedy(ours, PROMPT, STEPS) == ref_tokens


def test_gpt4o_pre_tokenizer_splits_as_o200k() -> None:
    """gpt-oss GGUFs name their pre-tokenizer "gpt-4o": case-aware words keeping English
    contractions, digits in threes, punctuation runs with their line breaks (o200k's split),
    not GPT-2's."""
    from tokenizers import Regex, pre_tokenizers

    from localchat.engine.build import gguf as lg

    split = pre_tokenizers.Split(Regex(lg._PRE_SPLITS["gpt-4o"]), behavior="isolated")
    pieces = [p for p, _ in split.pre_tokenize_str("HelloWorld it's 1234567 éAB CDe!!!\n\n  x")]
    assert pieces == ["Hello", "World", " it's", " ", "123", "456", "7", " é", "AB", " CDe",
                      "!!!\n\n", " ", " x"]


def test_mxfp4_gguf_defaults_to_q4f32_mx_which_holds_its_experts(tmp_path: Path) -> None:
    """A GGUF with MXFP4 experts (llama.cpp's MXFP4_MOE files) converts by default, for the CPU
    and for a GPU alike, to q4f32_mx, whose quantizer gives back the very MXFP4 values of its
    experts."""
    from localchat.engine import build
    from localchat.engine.build.quantization import dequantize_mx, quantize_mx

    path, held = write_gguf(tmp_path / "m.gguf")
    assert "MXFP4" in lg.matrix_types(lg.read_gguf(path))
    assert lg.exact_quantization(path) == "q4f32_mx"
    assert build.gguf_default_quantization(path, "cpu") == "q4f32_mx"
    assert build.gguf_default_quantization(path, "gpu") == "q4f32_mx"
    for name, value in held.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = np.ascontiguousarray(value.transpose(0, 2, 1)).reshape(-1, value.shape[1])
            assert np.array_equal(dequantize_mx(*quantize_mx(rows), rows.shape[1]), rows), name
