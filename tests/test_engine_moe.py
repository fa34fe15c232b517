"""Mixture-of-experts models (Qwen3-MoE, OLMoE, Mixtral) against transformers, and the expert
kernels against numpy.

The models are tiny random ones from transformers' config classes (tests/moe_variants.py: hidden
144, experts 88 wide, 6 experts, top 2, 2 layers), each converted and compiled once. At q0f32
our greedy tokens equal transformers' for 24 steps and the teacher-forced logits match to float
rounding; at q4f32_1 the oracle is transformers with every weight our conversion quantizes
replaced by its round trip (experts included; the router stays float in both), as in
tests/test_odd_shapes.py. A sequence gets the same bits batched with others as alone.
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

from localchat.engine.build import gguf as lg
from localchat.engine.build.q6_k import dequantize_q6_k, holds, quantize_q6_k
from localchat.engine.build.quantization import (
    dequantize_mx,
    dequantize_q4,
    dequantize_q8,
    get_quant_mode,
    quantize_mx,
    quantize_q4,
    quantize_q4_0,
    quantize_q4_asym,
    quantize_q4_k,
    quantize_q8,
)
from localchat.engine.runtime import Model

import moe_variants
from fixtures import converted
from model_oracle import batched_and_alone, rel_err, run_greedy, run_teacher_forced

ARCHS = ["qwen3-moe", "olmoe", "mixtral"]
PROMPT = [int(t) for t in np.random.RandomState(5).randint(3, 300, 12)]
STEPS = 24


@cache
def model(arch: str, quant: str) -> Model:
    """Our compiled model of `arch` in `quant` (one per test session)."""
    return Model(converted(moe_variants.build_variant(arch), quant), "cpu")


def _round_trip(w: torch.Tensor, quant: str) -> torch.Tensor:
    """A [N, K] weight as our `quant` conversion stores it (4-bit, or 8-bit), dequantized
    back."""
    a = w.detach().float().numpy()
    k = a.shape[1]
    if quant == "Q6_K":
        return torch.from_numpy(dequantize_q6_k(*quantize_q6_k(a)))
    if quant == "q8f32_0":
        return torch.from_numpy(dequantize_q8(*quantize_q8(a), k))
    if quant == "q4f32_asym":
        return torch.from_numpy(dequantize_q4(*quantize_q4_asym(a), k, asymmetric=True))
    if quant == "q4f32_k":
        return torch.from_numpy(dequantize_q4(*quantize_q4_k(a), k))
    if quant == "q4f32_0":
        return torch.from_numpy(dequantize_q4(*quantize_q4_0(a), k))
    return torch.from_numpy(dequantize_q4(*quantize_q4(a, "float32"), k))


def _quantize_like_convert(hf, quant: str) -> None:
    """Every weight our 4-bit conversion quantizes replaced, in place, by its round trip: the
    Linears, the embedding and the experts' stacked projections (quantized row by row, so
    stacking the experts changes nothing); the routers stay float, as ours."""
    # the modes holding a llama.cpp type keep the embedding and the LM head in 8 bits (q4f32_k
    # in Q6_K where their rows are whole super-blocks)
    mode = get_quant_mode(quant)
    head = "q8f32_0" if mode.head_bits == 8 else quant
    if mode.head_format and holds(hf.model.embed_tokens.weight.shape[1]):
        head = mode.head_format
    with torch.no_grad():
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(_round_trip(module.weight,
                                                head if module is hf.lm_head else quant))
        for name, param in hf.named_parameters():
            if ".experts." in name and param.dim() == 3:  # transformers 5: [E, out, in]
                e, n, k = param.shape
                param.copy_(_round_trip(param.reshape(e * n, k), quant).reshape(e, n, k))
        emb = hf.model.embed_tokens.weight
        emb.copy_(_round_trip(emb, head))


@cache
def reference(arch: str, quant: str) -> tuple[list[int], list[np.ndarray]]:
    """transformers' greedy continuation of PROMPT and the logits before each token."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(moe_variants.build_variant(arch),
                                              dtype=torch.float32,
                                              attn_implementation="eager").eval()
    if quant != "q0f32":
        _quantize_like_convert(hf, quant)
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=STEPS, min_new_tokens=STEPS,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(PROMPT):].tolist(), [lg[0].numpy() for lg in out.logits]


def _tolerance(quant: str) -> float:
    """Float rounding; with AVX-512 VNNI or AVX2 the 4-bit kernels round activations to int8
    per group (as in tests/test_odd_shapes.py)."""
    from localchat.engine.device import cpu_target
    from localchat.engine.kernels.common import int8_activations

    return 2e-2 if quant != "q0f32" and int8_activations(cpu_target()) else 1e-4


@pytest.mark.parametrize("arch,quant", [(a, "q0f32") for a in ARCHS]
                         + [("qwen3-moe", "q4f32_1"), ("qwen3-moe", "q8f32_0"),
                            ("qwen3-moe", "q4f32_k"), ("qwen3-moe", "q4f32_0")])
def test_matches_transformers(arch: str, quant: str) -> None:
    ref_tokens, ref_logits = reference(arch, quant)
    assert len(set(ref_tokens)) > STEPS // 2  # the oracle walks through the vocabulary
    ours = model(arch, quant)
    got = run_teacher_forced(ours, PROMPT, ref_tokens)
    worst = max(rel_err(o, r) for o, r in zip(got, ref_logits))
    assert worst <= _tolerance(quant), f"max relative error {worst:.2e}"
    if quant == "q0f32" or _tolerance(quant) < 1e-3:
        assert run_greedy(ours, PROMPT, STEPS) == ref_tokens


@pytest.mark.parametrize("quant", ["q0f32", "q4f32_1", "q8f32_0"])
def test_batched_equals_alone(quant: str) -> None:
    """Three prompts prefilled together and decoded together give each the bits it gets
    alone: the experts' grouping never mixes sequences' arithmetic."""
    ours = model("qwen3-moe", quant)
    prompts = [PROMPT, PROMPT[:5], [7, 9, 11, 13, 200, 17, 19]]
    for together, alone in batched_and_alone(ours, prompts, steps=4):
        for a, b in zip(together, alone):
            assert np.array_equal(a, b)


def _gemv_cases():
    """Token t's slot j routed to idx[t, j]: expert 1 chosen by 10 of 11 tokens (a block of 8
    rows plus single rows), expert 4 by one, experts 3 and 5 by none."""
    idx = np.array([[1, 0]] * 6 + [[2, 1]] * 3 + [[1, 4]] + [[0, 2]], dtype=np.int32)
    return idx


def test_expert_kernels_match_numpy() -> None:
    import tvm

    from localchat.engine.device import cpu_target
    from localchat.engine.kernels import moe

    experts, top, k, n, m = 6, 2, 144, 88, 11
    rng = np.random.default_rng(7)
    w = rng.standard_normal((experts * n, k), dtype=np.float32) * 0.1
    wq = quantize_q4(w, "float32")
    wa = quantize_q4_asym(w)
    wm = quantize_mx(w)
    # down-projection shaped: reduction 88 (a padded group), 144 outputs
    wd = rng.standard_normal((experts * k, n), dtype=np.float32) * 0.1
    wdq = quantize_q4(wd, "float32")
    funcs = {
        "router": moe.router_topk(experts, top, True, "float32"),
        "router_raw": moe.router_topk(experts, top, False, "float32"),
        "f": moe.moe_gemv(k, n, experts, top, "float32", "f"),
        "q4": moe.moe_gemv(k, n, experts, top, "float32", "q4"),
        "q4_asym": moe.moe_gemv(k, n, experts, top, "float32", "q4_asym"),
        "q8": moe.moe_gemv(k, n, experts, top, "float32", "q8"),
        "mxfp4": moe.moe_gemv(k, n, experts, top, "float32", "mxfp4"),
        "down_q4": moe.moe_gemv(n, k, experts, top, "float32", "q4", shared=False),
        "combine": moe.moe_combine(n, top, "float32"),
    }
    from localchat.engine.kernels.common import has_avx512

    if has_avx512(cpu_target()):  # the AVX-512 table-lookup GEMV (a CPU without VNNI)
        funcs["mxfp4_table"] = moe.moe_gemv(k, n, experts, top, "float32", "mxfp4", True)
    lib = tvm.compile(tvm.IRModule({name: f.with_attr("global_symbol", name)
                                    for name, f in funcs.items()}), cpu_target())
    dev = tvm.cpu()

    def run(name: str, *args: np.ndarray, out: list[tuple[tuple[int, ...], str]]):
        outs = [tvm.runtime.tensor(np.zeros(shape, dtype), dev) for shape, dtype in out]
        lib[name](*[tvm.runtime.tensor(a, dev) for a in args], *outs)
        return [o.numpy() for o in outs]

    # router: softmax, top 2 in order, renormalized or not
    logits = rng.standard_normal((m, experts), dtype=np.float32) * 3
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    want = np.argsort(-p, axis=1, kind="stable")[:, :top]
    chosen = np.take_along_axis(p, want, 1)
    for name, expect in (("router", chosen / chosen.sum(1, keepdims=True)),
                         ("router_raw", chosen)):
        idx_out, w_out = run(name, logits, out=[((m, top), "int32"), ((m, top), "float32")])
        assert np.array_equal(idx_out, want)
        np.testing.assert_allclose(w_out, expect, rtol=1e-5)

    idx = _gemv_cases()
    x = rng.standard_normal((m, 1, k), dtype=np.float32)
    w8 = quantize_q8(w)
    dense = {"f": w, "q4": dequantize_q4(*wq, k), "q4_asym": dequantize_q4(*wa, k, asymmetric=True),
             "q8": dequantize_q8(*w8, k), "mxfp4": dequantize_mx(*wm, k)}
    dense["mxfp4_table"] = dense["mxfp4"]
    weights = {"f": (w,), "q4": wq, "q4_asym": wa, "q8": w8, "mxfp4": wm, "mxfp4_table": wm}
    for name in ("f", "q4", "q4_asym", "q8", "mxfp4") + (("mxfp4_table",) if "mxfp4_table" in funcs
                                                          else ()):
        (y,) = run(name, x, *weights[name], idx, out=[((m, top, n), "float32")])
        ref = np.stack([[x[t, 0].astype(np.float64) @ dense[name][e * n:(e + 1) * n].T
                         for e in idx[t]] for t in range(m)])
        assert rel_err(y, ref) <= 1e-5, name
        # a token's rows do not depend on the others: the first token alone gives its bits
        (y1,) = run(name, x[:1], *weights[name], idx[:1], out=[((1, top, n), "float32")])
        assert np.array_equal(y1[0], y[0]), name
    # the down projection: each slot its own input
    xs = rng.standard_normal((m, top, n), dtype=np.float32)
    (y,) = run("down_q4", xs, *wdq, idx, out=[((m, top, k), "float32")])
    dd = dequantize_q4(*wdq, n)
    ref = np.stack([[xs[t, j].astype(np.float64) @ dd[e * k:(e + 1) * k].T
                     for j, e in enumerate(idx[t])] for t in range(m)])
    assert rel_err(y, ref) <= 1e-5
    # the weighted sum of the slots
    ys = rng.standard_normal((m, top, n), dtype=np.float32)
    wt = rng.random((m, top), dtype=np.float32)
    (out,) = run("combine", ys, wt, out=[((m, n), "float32")])
    np.testing.assert_allclose(out, (ys * wt[:, :, None]).sum(1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("isa", ["vnni", "avx2"])
def test_int8_expert_gemv_matches_numpy_and_one_token_equals_batched(isa: str) -> None:
    """The expert GEMV with int8 activations (what the models run on VNNI / AVX2 CPUs): the
    dequantized experts times x rounded to int8 as the kernels do, for gate/up (shared x) and
    down (x per slot) shapes; one token alone (decode) gives the same bits as inside a batch
    (where an expert's tokens run as one block)."""
    import tvm
    from test_gemv_vnni import _quantize_x, _target

    from localchat.engine.build.quantization import padded_k
    from localchat.engine.kernels import moe

    target = _target(isa)
    experts, top, k, n, m = 6, 2, 144, 88, 11
    rng = np.random.default_rng(11)
    wq = quantize_q4(rng.standard_normal((experts * n, k), dtype=np.float32) * 0.1, "float32")
    wa = quantize_q4_asym(rng.standard_normal((experts * n, k), dtype=np.float32) * 0.1)
    wd = quantize_q4(rng.standard_normal((experts * k, n), dtype=np.float32) * 0.1, "float32")
    w8 = quantize_q8(rng.standard_normal((experts * k, n), dtype=np.float32) * 0.1)
    wm = quantize_mx(rng.standard_normal((experts * n, k), dtype=np.float32) * 0.1)
    wmd = quantize_mx(rng.standard_normal((experts * k, n), dtype=np.float32) * 0.1)
    funcs = {
        "mxfp4": moe.moe_gemv(k, n, experts, top, "float32", "mxfp4", isa),
        "down_mxfp4": moe.moe_gemv(n, k, experts, top, "float32", "mxfp4", isa, shared=False),
        "q4": moe.moe_gemv(k, n, experts, top, "float32", "q4", isa),
        "down_q8": moe.moe_gemv(n, k, experts, top, "float32", "q8", isa, shared=False),
        "q4_asym": moe.moe_gemv(k, n, experts, top, "float32", "q4_asym", isa),
        "down": moe.moe_gemv(n, k, experts, top, "float32", "q4", isa, shared=False),
    }
    lib = tvm.compile(tvm.IRModule({name: f.with_attr("global_symbol", name)
                                    for name, f in funcs.items()}), target)
    dev = tvm.cpu()

    def run(name, x, weights, idx, shape):
        out = tvm.runtime.tensor(np.zeros(shape, np.float32), dev)
        lib[name](*[tvm.runtime.tensor(a, dev) for a in (x, *weights, idx)], out)
        return out.numpy()

    idx = _gemv_cases()
    x = rng.standard_normal((m, 1, k), dtype=np.float32)
    xd = rng.standard_normal((m, top, n), dtype=np.float32)
    cases = {
        "q4": (x, wq, dequantize_q4(*wq, k), k, n),
        "q4_asym": (x, wa, dequantize_q4(*wa, k, asymmetric=True), k, n),
        "down": (xd, wd, dequantize_q4(*wd, n), n, k),
        "down_q8": (xd, w8, dequantize_q8(*w8, n), n, k),
        "mxfp4": (x, wm, dequantize_mx(*wm, k), k, n),
        "down_mxfp4": (xd, wmd, dequantize_mx(*wmd, n), n, k),
    }
    for name, (xin, weights, dense, kk, nn) in cases.items():
        y = run(name, xin, weights, idx, (m, top, nn))
        xq = _quantize_x(xin.reshape(-1, kk), padded_k(kk)).reshape(xin.shape)
        ref = np.stack([[xq[t, 0 if not name.startswith("down") else j].astype(np.float64)
                         @ dense[e * nn:(e + 1) * nn].T for j, e in enumerate(idx[t])]
                        for t in range(m)])
        assert rel_err(y, ref) <= 2e-6, name
        for t in (0, 5):
            alone = run(name, xin[t:t + 1], weights, idx[t:t + 1], (1, top, nn))
            assert np.array_equal(alone[0], y[t]), f"{name}: token {t} alone differs"


def test_configs() -> None:
    """Dense layers where Qwen3-MoE's config says; OLMoE's clip_qkv, and the asymmetric modes
    on a GPU, refused with a clear error before any compile (test_model_seam builds the GPU
    form)."""
    import tvm

    from localchat.engine.build.convert import read_hf_config
    from localchat.engine.models import detect_architecture
    from localchat.errors import UnsupportedModelError

    hf = read_hf_config(moe_variants.build_variant("qwen3-moe"))
    arch = detect_architecture(hf)
    assert arch.name == "qwen3_moe"
    assert arch.config_from_hf(hf).moe_layers == [1, 0]
    step = arch.config_from_hf({**hf, "mlp_only_layers": [], "decoder_sparse_step": 2})
    assert step.moe_layers == [0, 1]
    assert arch.config_from_dict(step.to_dict()) == step
    olmoe = read_hf_config(moe_variants.build_variant("olmoe"))
    with pytest.raises(UnsupportedModelError, match="clip_qkv"):
        detect_architecture(olmoe).config_from_hf({**olmoe, "clip_qkv": 8.0})
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    with pytest.raises(UnsupportedModelError, match="CPU only"):
        arch.build(arch.config_from_hf(hf), get_quant_mode("q4f16_asym"), cuda)


# -- GGUF: llama.cpp's layout, experts merged per layer ------------------------------------------
# variant: (llama.cpp's general.architecture, our architecture); Mixtral is filed under `llama`
GGUF_CASES = {"olmoe": ("olmoe", "olmoe"), "qwen3-moe-all": ("qwen3moe", "qwen3_moe"),
              "mixtral": ("llama", "mixtral")}


def _write_gguf(variant: str, path: Path) -> Path:
    """The variant as an F32 GGUF as llama.cpp's converter writes it: its metadata keys
    (`expert_count`, `expert_used_count`, `expert_feed_forward_length`), the router as
    `ffn_gate_inp`, each projection's experts merged into one [E, out, in] tensor."""
    import gguf
    from safetensors.numpy import load_file

    arch = GGUF_CASES[variant][0]
    folder = moe_variants.build_variant(variant)
    cfg = json.loads((folder / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), layers)
    w = gguf.GGUFWriter(str(path), arch)
    moe_variants.write_gguf_header(w, cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if "moe_intermediate_size" in cfg:
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    tensors = load_file(folder / "model.safetensors")
    for hf_name, value in tensors.items():
        if ".experts." in hf_name:
            continue
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, hf_name
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            # the Llama converter's q/k row order for its interleaved rotary
            heads = cfg["num_attention_heads" if "attn_q" in gname else "num_key_value_heads"]
            value = value.reshape(heads, 2, value.shape[0] // heads // 2, -1).swapaxes(1, 2) \
                .reshape(value.shape)
        w.add_tensor(gname, np.ascontiguousarray(value, dtype=np.float32))
    mixtral = "model.layers.0.block_sparse_moe.gate.weight" in tensors
    projections = (("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj"))
    for i in range(layers):
        base = f"model.layers.{i}." + ("block_sparse_moe." if mixtral else "mlp.")
        for proj, part in zip(projections, ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
            stacked = np.stack([tensors[f"{base}experts.{e}.{proj}.weight"]
                                for e in range(experts)])
            w.add_tensor(f"blk.{i}.{part}.weight", np.ascontiguousarray(stacked, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("variant", list(GGUF_CASES))
def test_gguf_import_gives_the_same_model(variant: str, tmp_path: Path) -> None:
    """A `.gguf` in llama.cpp's layout imports to the config our architecture reads from the HF
    folder and to exactly the HF folder's parameters (experts stacked alike, Mixtral's q/k rows
    put back); OLMoE's then runs to transformers' tokens (its library is the HF folder's,
    already compiled above)."""
    from safetensors.numpy import load_file

    from localchat.engine.models import detect_architecture

    folder = moe_variants.build_variant(variant)
    hf_dir = lg.gguf_to_hf_folder(_write_gguf(variant, tmp_path / "m.gguf"), tmp_path / "hf")
    got_hf = json.loads((hf_dir / "config.json").read_text())
    want_hf = json.loads((folder / "config.json").read_text())
    arch = detect_architecture(got_hf)
    assert arch.name == GGUF_CASES[variant][1]
    got, want = arch.config_from_hf(got_hf), arch.config_from_hf(want_hf)
    if variant == "qwen3-moe-all":  # the dense width: llama.cpp has no dense layer to use it
        got = dataclasses.replace(got, intermediate_size=want.intermediate_size)
    # GGUF stores its float keys in 32 bits
    assert np.isclose(got.rms_norm_eps, want.rms_norm_eps, rtol=1e-6)
    got = dataclasses.replace(got, rms_norm_eps=want.rms_norm_eps)
    assert got.to_dict() == want.to_dict()
    ours, theirs = load_file(hf_dir / "model.safetensors"), load_file(folder / "model.safetensors")
    mine = dict(arch.hf_params(got, ours.__getitem__, set(ours)))
    ref = dict(arch.hf_params(want, theirs.__getitem__, set(theirs)))
    assert mine.keys() == ref.keys()
    for name, value in ref.items():
        assert np.array_equal(mine[name], value), name
    if variant == "olmoe":
        # the epsilon as the HF folder's, so that the compiled library is the one already built
        (hf_dir / "config.json").write_text(json.dumps({**got_hf, "rms_norm_eps": 1e-6}))
        imported = Model(converted(hf_dir, "q0f32"), "cpu")
        assert run_greedy(imported, PROMPT, 8) == reference("olmoe", "q0f32")[0][:8]
