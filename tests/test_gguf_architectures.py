"""GGUF import of the architectures beyond Llama (Qwen3, Gemma 2, Gemma 3, OLMo 2, SmolLM3,
Phi-3): each tiny odd-shaped model of `llama_variants` is written as llama.cpp's converter lays
it out (its tensor names from the `gguf` package's own name map, its metadata keys, Gemma's norms
stored as 1 + w, SmolLM3's q/k rows permuted as Llama's, Phi-3's LongRoPE factors as tensors),
imported, and must give back the HF weights and config, then, compiled at q0f32, transformers'
greedy tokens on the original folder.

llama.cpp does not store a few things it fixes per architecture (Gemma's window pattern and
attention scale, Gemma 3's local rope theta, SmolLM3's every-fourth layer without rope): where the
odd variant departs from those, the variant used here is the odd one with just that changed, so
that the file means the same model in llama.cpp.
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

from localchat.engine.build import gguf as lg
from localchat.errors import UnsupportedModelError

import llama_variants
from fixtures import cache_dir, converted, one_builder_at_a_time

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "app" / "engine" / "models"
PROMPT = [int(t) for t in np.random.RandomState(11).randint(0, 999, 20)]
STEPS = 6

# name: (llama.cpp's general.architecture, the odd variant, what changes for llama.cpp's rules)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("qwen3", "qwen3-odd", {}),
    "olmo2": ("olmo2", "olmo2-odd", {}),
    "phi3": ("phi3", "phi3-odd", {}),
    # llama.cpp scales Gemma's attention by head_dim ** -0.5 (but on the 27B models)
    "gemma2": ("gemma2", "gemma2-odd", {"query_pre_attn_scalar": 48}),
    # five local layers then a global one, as llama.cpp assumes
    "gemma3": ("gemma3", "gemma3-odd", {
        "query_pre_attn_scalar": 48, "num_hidden_layers": 6,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}),
    # no rope on every fourth layer, as llama.cpp assumes
    "smollm3": ("smollm3", "smollm3-odd", {"num_hidden_layers": 4,
                                           "no_rope_layers": [1, 1, 1, 0]}),
}
MODULES = {"qwen3": "qwen3", "olmo2": "olmo2", "phi3": "phi3", "gemma2": "gemma",
           "gemma3": "gemma", "smollm3": "smollm3"}


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()[:10]


@cache
@one_builder_at_a_time
def source(name: str) -> Path:
    """The HF folder of case `name`: the odd variant itself, or it with the case's changes
    (saved once in the test cache, seeded as the variants are)."""
    _, base, changes = CASES[name]
    if not changes:
        return llama_variants.build_variant(base)
    import torch
    import transformers

    cls_name, extra = llama_variants.ODD_VARIANTS[base]
    kwargs = {**llama_variants.BASE, **extra, **changes}
    digest = _digest(json.dumps([cls_name, kwargs, transformers.__version__],
                                sort_keys=True).encode())
    out = cache_dir() / "variants" / f"{base}-gguf-{digest}"
    if (out / "config.json").exists():
        return out
    config = getattr(transformers, cls_name)(**kwargs)
    model_cls = getattr(transformers, cls_name.replace("TextConfig", "Config")
                        .replace("Config", "ForCausalLM"))
    torch.manual_seed(1234)
    model = model_cls(config).eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{base}-gguf-"))
    model.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


# -- writing a GGUF as llama.cpp's convert_hf_to_gguf.py does ---------------------------------
def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for its interleaved rotary (Llama-arch converters only)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def _metadata(w: Any, arch: str, cfg: dict[str, Any], n_layers: int) -> None:
    """The hyperparameter keys llama.cpp's converter writes for `arch`."""
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    w.add_block_count(n_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    if arch == "phi3":
        rotary = int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads
        original = cfg.get("original_max_position_embeddings") or \
            rope["original_max_position_embeddings"]
        w.add_rope_dimension_count(rotary)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(
            float(np.sqrt(1 + np.log(scale) / np.log(original))) if scale > 1 else 1.0)
        return
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg["sliding_window"])
        if arch == "gemma2":
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
            return
        full = rope["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            import gguf

            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        return
    w.add_rope_freq_base(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0))
    if arch == "smollm3":  # LlamaModel's keys
        w.add_rope_dimension_count(head_dim)


def _vocabulary(w: Any, cfg: dict[str, Any]) -> None:
    """A byte-level vocabulary of exactly the embedding's rows (the test feeds token ids)."""
    alphabet = list(lg.bytes_to_unicode().values())
    n = cfg["vocab_size"]
    tokens = alphabet + [f"t{i}" for i in range(n - len(alphabet))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * n)
    w.add_token_merges([])
    w.add_bos_token_id(int(cfg.get("bos_token_id") or 1))
    w.add_eos_token_id(int(cfg.get("eos_token_id") or 2))


def write_gguf(name: str, path: Path) -> Path:
    """Case `name`'s model as an F32 GGUF in llama.cpp's layout."""
    import gguf
    from safetensors.numpy import load_file

    arch = CASES[name][0]
    folder = source(name)
    cfg = json.loads((folder / "config.json").read_text())
    n_layers = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), n_layers)
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, arch, cfg, n_layers)
    _vocabulary(w, cfg)
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    for hf_name, value in load_file(folder / "model.safetensors").items():
        if hf_name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, hf_name  # with its .weight / .bias
        if arch == "smollm3" and gname.endswith("attn_q.weight"):  # a LlamaModel converter
            value = _permute(value, heads)
        elif arch == "smollm3" and gname.endswith("attn_k.weight"):
            value = _permute(value, kv)
        if arch.startswith("gemma") and gname.endswith("norm.weight"):
            value = value + 1  # Gemma's RMSNorm scales by (1 + w): stored that way
        w.add_tensor(gname, np.ascontiguousarray(value, dtype=np.float32))
    if arch == "phi3":
        rope = cfg["rope_parameters"]
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight",
                         np.asarray(rope[f"{kind}_factor"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@cache
@one_builder_at_a_time
def imported(name: str) -> Path:
    """The HF folder imported from case `name`'s GGUF, cached by the sources that shape it."""
    sources = [ROOT / "app/engine/build/gguf.py", MODELS / "llama.py", MODELS / "__init__.py",
               MODELS / f"{MODULES[name]}.py", Path(__file__)]
    out = cache_dir() / "gguf-import" / \
        f"{source(name).name}-{_digest(*(p.read_bytes() for p in sources))}"
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}-"))
        lg.gguf_to_hf_folder(write_gguf(name, tmp / f"{name}.gguf"), tmp / "hf")
        (tmp / "hf").rename(out)
        shutil.rmtree(tmp)
    return out


def _close(a: Any, b: Any) -> bool:
    """Equal, floats to float32 precision (GGUF stores its float keys in 32 bits)."""
    if isinstance(a, float) or isinstance(b, float):
        return bool(np.isclose(float(a), float(b), rtol=1e-6, atol=0))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return bool(a == b)


# -- the tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_import_gives_back_the_hf_weights_and_config(name: str) -> None:
    """No compile: every HF tensor comes back exactly (Gemma's 1 + w taken away, SmolLM3's rows
    put back), and the config our architecture reads equals the one of the original folder."""
    from safetensors.numpy import load_file

    from localchat.engine.models import detect_architecture

    ours = load_file(imported(name) / "model.safetensors")
    original = load_file(source(name) / "model.safetensors")
    cfg = json.loads((source(name) / "config.json").read_text())
    if cfg.get("tie_word_embeddings"):
        original.pop("lm_head.weight", None)
    assert set(ours) == set(original)
    for tensor, value in original.items():
        assert np.array_equal(ours[tensor], value), tensor
    got_hf = json.loads((imported(name) / "config.json").read_text())
    arch = detect_architecture(got_hf)
    assert arch.name == name and arch is not None
    want = detect_architecture(cfg).config_from_hf(cfg).to_dict()
    got = arch.config_from_hf(got_hf).to_dict()
    assert got.keys() == want.keys()
    differ = [k for k in want if not _close(got[k], want[k])]
    assert differ == [], {k: (got[k], want[k]) for k in differ}


# One compile end to end: the test above proves every architecture's import gives back the HF
# folder's weights exactly and a config our architecture reads identically, and
# tests/test_odd_shapes.py runs each architecture from such a folder against transformers; this
# one follows Phi-3 (fused tensors, LongRoPE factors from the file) through convert and run.
COMPILED_CASES = ["phi3"]


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPILED_CASES)
def test_imported_model_greedy_tokens_equal_transformers(name: str) -> None:
    """The imported model, converted at q0f32 and compiled, continues PROMPT greedily with
    transformers' tokens on the original HF folder (its first logits within float rounding)."""
    import torch
    from transformers import AutoModelForCausalLM

    from localchat.engine.runtime import Model

    hf = AutoModelForCausalLM.from_pretrained(source(name), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=STEPS, min_new_tokens=STEPS,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
    want = out.sequences[0, len(PROMPT):].tolist()
    first = out.logits[0][0].numpy()
    model = Model(converted(imported(name), "q0f32"), "cpu")
    seq = model.new_sequence()
    try:
        logits = model.prefill(seq, PROMPT)
        assert np.abs(logits - first).max() / np.abs(first).max() <= 1e-4
        tokens = [int(np.argmax(logits))]
        while len(tokens) < STEPS:
            tokens.append(int(np.argmax(model.decode([seq], [tokens[-1]])[0])))
    finally:
        model.remove(seq)
    assert tokens == want


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError) as err:
        lg.inspect_gguf(path)
    message = str(err.value)
    assert "'falcon'" in message
    for arch in ("llama", *(arch for arch, _, _ in CASES.values())):
        assert f" {arch}," in message or f" {arch};" in message, (arch, message)


def test_llama_cpp_fixed_rules_for_the_real_sizes(tmp_path: Path) -> None:
    """What llama.cpp does not store, as it assumes it: Gemma 2 27B's attention scale from
    hidden / heads and every other layer windowed, Gemma 3's 5:1 pattern with a local theta of
    10k, SmolLM3's every fourth layer without rope; an OLMo 3 file (`olmo2` with a window) is
    refused."""
    import gguf

    def header(arch: str, layers: int, extra: dict[str, Any]) -> Path:
        path = tmp_path / f"{arch}-{layers}.gguf"
        w = gguf.GGUFWriter(str(path), arch)
        w.add_block_count(layers)
        w.add_embedding_length(4608)
        w.add_feed_forward_length(36864)
        w.add_head_count(32)
        w.add_head_count_kv(16)
        w.add_key_length(128)
        for key, value in extra.items():
            getattr(w, f"add_{key}")(value)
        w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    g2 = lg.inspect_gguf(header("gemma2", 46, {"sliding_window": 4096}))
    assert g2["query_pre_attn_scalar"] == 4608 // 32
    assert g2["layer_types"][:3] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert lg.inspect_gguf(header("gemma2", 26, {"sliding_window": 4096}))[
        "query_pre_attn_scalar"] == 128
    g3 = lg.inspect_gguf(header("gemma3", 12, {"sliding_window": 512, "rope_freq_base": 1e6}))
    assert g3["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 2
    assert g3["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert g3["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
    s3 = lg.inspect_gguf(header("smollm3", 8, {}))
    assert s3["no_rope_layers"] == [1, 1, 1, 0, 1, 1, 1, 0]
    with pytest.raises(UnsupportedModelError, match="OLMo 3"):
        lg.inspect_gguf(header("olmo2", 4, {"sliding_window": 4096}))
