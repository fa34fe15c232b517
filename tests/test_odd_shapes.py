"""Shapes that are not multiples of 32: reduction sizes such as 344 or 1000, head dims of 48 or
80, odd vocabularies and hidden sizes. Unquantized modes take any size; 4-bit modes store the
reduction padded to whole groups with zero weights, which must not show in any result.

The oracle is transformers on the same weights: as they are for q0f32, and with every weight our
4-bit conversion quantizes replaced by its quantize-dequantize round trip for q4f32_1 and
q4f32_asym (asymmetric 4-bit Linears, 8-bit embedding and LM head; the padding then has to be
exactly invisible, not merely close) and q8f32_0 (every matrix 8-bit). One compiled model per
architecture and mode, each with one layer, to keep compile time (which dominates) short.
"""

from __future__ import annotations

import shutil
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

from localchat.engine.build.quantization import (
    dequantize_q4,
    dequantize_q8,
    quantize_q4,
    quantize_q4_asym,
    quantize_q8,
)
from localchat.engine.runtime import Model
from localchat.errors import CompileError

import llama_variants
import rwkv_variants
from fixtures import converted
from model_oracle import rel_err, run_teacher_forced

ARCHS = ["llama-odd", "qwen2-odd", "mistral-odd", "qwen3-odd", "gemma2-odd", "gemma3-odd",
         "olmo2-odd", "smollm3-odd", "phi3-odd", "rwkv4-odd"]
QUANTS = ["q0f32", "q4f32_1", "q4f32_asym", "q8f32_0"]
# q4f32_asym and q8f32_0 on an untied and a tied Llama and on RWKV (Mistral's layers are Llama's:
# no new path);
# the block's options (q/k norm, Gemma's, OLMo 2's, SmolLM3's) are float paths whatever the
# mode: Qwen3 at q0f32 and q4f32_1, the others at q0f32
SKIP = {("mistral-odd", "q4f32_asym"), ("qwen3-odd", "q4f32_asym"),
        ("mistral-odd", "q8f32_0"), ("qwen3-odd", "q8f32_0"),
        *((a, q) for a in ("gemma2-odd", "gemma3-odd", "olmo2-odd", "smollm3-odd", "phi3-odd")
          for q in QUANTS[1:])}
CASES = [(a, q) for q in QUANTS for a in ARCHS if (a, q) not in SKIP]
PROMPT = [int(t) for t in np.random.RandomState(11).randint(0, 999, 20)]
STEPS = 8


def source(arch: str) -> Path:
    """The saved random model (HF layout) of an odd-shaped variant."""
    if arch.startswith("rwkv"):
        return rwkv_variants.build_variant(arch)
    return llama_variants.build_variant(arch)


def _round_trip(weight: torch.Tensor, quant: str = "q4f32_1", head: bool = False) -> torch.Tensor:
    """`weight` [N, K] as our `quant` conversion stores it, dequantized back to [N, K]; `head`:
    the embedding or LM head (8-bit in the asymmetric modes; everything is in q8f32_0)."""
    w = weight.detach().float().numpy()
    k = w.shape[1]
    if quant == "q8f32_0" or (quant == "q4f32_asym" and head):
        return torch.from_numpy(dequantize_q8(*quantize_q8(w), k))
    if quant == "q4f32_asym":
        return torch.from_numpy(dequantize_q4(*quantize_q4_asym(w), k, asymmetric=True))
    words, scale = quantize_q4(w, "float32")
    return torch.from_numpy(dequantize_q4(words, scale, k))


def _quantize_like_convert(hf, arch: str, quant: str) -> None:
    """Replace, in place, every weight our `quant` conversion quantizes by its round trip: all
    Linear weights and the embedding (rows are quantized independently, so our fusing of q/k/v
    and gate/up along rows does not change what each row becomes)."""
    heads = (hf.get_output_embeddings(),)
    with torch.no_grad():
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(_round_trip(module.weight, quant, module in heads))
        if arch.startswith("rwkv"):
            # ours stores the embedding with block 0's pre-LayerNorm folded in, quantized after
            # the fold: give the oracle that very table and take its pre-LayerNorm away
            from localchat.engine.models.rwkv4 import Rwkv4Config
            from localchat.engine.models.rwkv4_weights import hf_params

            state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
            cfg = Rwkv4Config.from_hf(hf.config.to_dict())
            folded = dict(hf_params(cfg, state.__getitem__, set(state)))["embeddings.weight"]
            hf.rwkv.embeddings.weight.copy_(_round_trip(torch.from_numpy(folded), quant, True))
            hf.rwkv.blocks[0].pre_ln = torch.nn.Identity()
        else:
            emb = hf.model.embed_tokens.weight
            if not hf.config.tie_word_embeddings:
                emb.copy_(_round_trip(emb, quant, True))
            elif hf.lm_head.weight.data_ptr() != emb.data_ptr():  # tied: quantized once
                emb.copy_(hf.lm_head.weight)


@cache
def reference(arch: str, quant: str) -> tuple[list[int], list[np.ndarray]]:
    """transformers' greedy continuation of PROMPT and the logits before each token."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(source(arch), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    if quant != "q0f32":
        _quantize_like_convert(hf, arch, quant)
    with torch.no_grad():
        if arch.startswith("rwkv"):
            out = hf(torch.tensor([PROMPT]), use_cache=True)
            logits = [out.logits[0, -1].numpy()]
            for _ in range(STEPS - 1):
                tok = int(logits[-1].argmax())
                out = hf(torch.tensor([[tok]]), state=out.state, use_cache=True)
                logits.append(out.logits[0, -1].numpy())
            return [int(lg.argmax()) for lg in logits], logits
        out = hf.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=STEPS,
            min_new_tokens=STEPS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(PROMPT) :].tolist(), [lg[0].numpy() for lg in out.logits]


@cache
def model(arch: str, quant: str) -> Model:
    """Our compiled model of `arch` in `quant` (one per test session)."""
    return Model(converted(source(arch), quant), "cpu")


def _tolerance(quant: str) -> float:
    """Float activations match the oracle (same quantized weights) to float rounding; on a CPU
    with AVX-512 VNNI or AVX2 the 4-bit kernels quantize activations to int8 per group of 32, as
    llama.cpp does, which moves logits by ~4e-3 of their largest (the kernel itself is checked
    exactly against that int8 rounding in test_gemv_vnni)."""
    from localchat.engine.device import cpu_target
    from localchat.engine.kernels.common import int8_activations

    if quant != "q0f32" and int8_activations(cpu_target()):
        return 2e-2
    return 1e-4


@pytest.mark.parametrize("arch,quant", CASES)
def test_matches_transformers(arch: str, quant: str) -> None:
    ref_tokens, ref_logits = reference(arch, quant)
    ours = model(arch, quant)
    tol = _tolerance(quant)
    # prefill (the blocked kernels) and one-row decode (the GEMV), teacher-forced
    got = run_teacher_forced(ours, PROMPT, ref_tokens)
    worst = max(rel_err(o, r) for o, r in zip(got, ref_logits))
    assert worst <= tol, f"max relative error {worst:.2e}"
    # two sequences decoded together (several rows per call)
    seqs = [ours.new_sequence(), ours.new_sequence()]
    try:
        for seq in seqs:
            ours.prefill(seq, PROMPT)
        both = ours.decode(seqs, [ref_tokens[0]] * 2)
    finally:
        for seq in seqs:
            ours.remove(seq)
    assert max(rel_err(row, ref_logits[1]) for row in both) <= tol
    # free-running greedy generation gives the very same tokens
    seq = ours.new_sequence()
    try:
        tok = int(np.argmax(ours.prefill(seq, PROMPT)))
        greedy = [tok]
        for _ in range(STEPS - 1):
            tok = int(np.argmax(ours.decode([seq], [tok])[0]))
            greedy.append(tok)
    finally:
        ours.remove(seq)
    assert greedy == ref_tokens


@pytest.mark.parametrize("k,n", [(344, 24), (9, 7)])
def test_kernels_take_any_reduction_size(k: int, n: int) -> None:
    """Every CPU linear kernel (4-bit GEMV generic and AVX-512, the blocked 4-bit and float
    kernels, the float GEMV) on one and several rows against numpy, with k not a multiple of 32
    (344: a padded last group and a tail of 8; 9: less than one vector)."""
    import tvm

    from localchat.engine.device import cpu_target
    from localchat.engine.kernels import gemv, matmul
    from localchat.engine.kernels.common import has_avx512

    rng = np.random.default_rng(k)
    w = rng.standard_normal((n, k), dtype=np.float32) * 0.05
    words, scale = quantize_q4(w, "float32")
    target, dev = cpu_target(), tvm.cpu()
    q4 = [gemv.gemv_q4(k, n, "float32"), matmul.linear_q4(k, n, "float32", False)]
    if has_avx512(target):
        q4 += [gemv.gemv_q4(k, n, "float32", True)]
    kernels = [(f, (words, scale), dequantize_q4(words, scale, k)) for f in q4]
    for func in (gemv.gemv_f(k, n, "float32"), matmul.linear_f(k, n, "float32", False)):
        kernels.append((func, (w,), w))
    # one module, so LLVM runs once
    funcs = {f"f{i}": f.with_attr("global_symbol", f"f{i}") for i, (f, _, _) in enumerate(kernels)}
    lib = tvm.compile(tvm.IRModule(funcs), target)
    for i, (_, weights, dense) in enumerate(kernels):
        for m in (1, 5):
            x = rng.standard_normal((m, k), dtype=np.float32)
            y = tvm.runtime.tensor(np.zeros((m, n), np.float32), dev)
            lib[f"f{i}"](*[tvm.runtime.tensor(a, dev) for a in (x, *weights)], y)
            ref = x.astype(np.float64) @ dense.T.astype(np.float64)
            assert rel_err(y.numpy(), ref) <= 1e-5, f"kernel {i} m={m}"


def test_padding_is_zero_weights() -> None:
    """The stored layout holds whole groups; the columns past k dequantize to exactly 0 and the
    real ones are what they would be without padding."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 344), dtype=np.float32)
    words, scale = quantize_q4(w, "float32")
    assert words.shape == (5, 352 // 8) and scale.shape == (5, 352 // 32)
    full = dequantize_q4(words, scale)
    assert np.all(full[:, 344:] == 0)
    head_words, head_scale = quantize_q4(w[:, :320], "float32")  # the whole groups alone
    assert np.array_equal(words[:, :40], head_words) and np.array_equal(scale[:, :10], head_scale)


def test_gpu_dequantize_path_reads_only_real_columns() -> None:
    """The GPU formulation (dequantize + matmul, dequantized embedding rows) on padded 4-bit
    weights, built as for a GPU but run on the CPU, equals numpy on the unpadded matrix."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend import nn

    from localchat.engine.build.quantization import get_quant_mode
    from localchat.engine.device import cpu_target
    from localchat.engine.models.layers import BuildContext, Embedding, Linear

    k, n, vocab = 344, 24, 11
    mode = get_quant_mode("q4f32_1")
    # built as for a GPU (dequantize + matmul), compiled and run on the CPU
    gpu = BuildContext(mode, tvm.target.Target({"kind": "cuda", "arch": "sm_80"}))

    class Net(nn.Module):
        def __init__(self) -> None:
            self.proj = Linear(k, n, False, gpu)
            self.emb = Embedding(vocab, k, gpu)

        def forward(self, x: nn.Tensor, ids: nn.Tensor):
            return self.proj(x), self.emb(ids)

    net = Net()
    spec = {
        "forward": {
            "x": nn.spec.Tensor([3, k], "float32"),
            "ids": nn.spec.Tensor([4], "int32"),
            "$": {"param_mode": "packed", "effect_mode": "none"},
        }
    }
    mod, params = net.export_tvm(spec=spec)
    ex = tvm.compile(mod, target=cpu_target())
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(1)
    w = rng.standard_normal((n, k), dtype=np.float32)
    e = rng.standard_normal((vocab, k), dtype=np.float32)
    (ww, ws), (ew, es) = quantize_q4(w, "float32"), quantize_q4(e, "float32")
    values = {"proj.weight": ww, "proj.scale": ws, "emb.weight": ew, "emb.scale": es}
    packed = [tvm.runtime.tensor(values[name], tvm.cpu()) for name, _ in params]
    x = rng.standard_normal((3, k), dtype=np.float32)
    ids = np.array([0, 10, 3, 3], np.int32)
    y, rows = vm["forward"](tvm.runtime.tensor(x, tvm.cpu()), tvm.runtime.tensor(ids, tvm.cpu()),
                            packed)
    ref = x.astype(np.float64) @ dequantize_q4(ww, ws, k).T
    assert rel_err(y.numpy(), ref) <= 1e-5
    assert np.array_equal(rows.numpy(), dequantize_q4(ew, es, k)[ids])


def test_failed_compile_leaves_nothing_behind(tmp_path: Path, monkeypatch) -> None:
    """convert_model compiling for a device: when the compile fails, neither the output
    directory nor a temporary sibling remains."""
    from localchat.engine.build import compile as lc_compile
    from localchat.engine.build.convert import convert_model

    def broken(*_args, **_kwargs):
        raise RuntimeError("reduction size 344 is not a multiple of 32")

    # the compile fails as it did before odd shapes were supported (and at once)
    monkeypatch.setattr(lc_compile, "export_module", broken)
    out = tmp_path / "models" / "odd"
    src = source("llama-odd")
    with pytest.raises(CompileError, match="not a multiple of 32"):
        # a context window of its own: a library no other test has compiled, so none is cached
        convert_model(src, out, "q0f32", context_window_size=77, compile_for="cpu")
    assert not out.exists()
    assert list(out.parent.iterdir()) == [], "temporary files left behind"


def test_compile_for_puts_the_library_in_place(tmp_path: Path) -> None:
    """convert_model with `compile_for` leaves a directory whose library is already in lib/
    (shared with the library cache, so this reuses the compile of the oracle test)."""
    from localchat.engine.build.convert import convert_model

    model("llama-odd", "q0f32")  # the library, compiled once per session
    out = convert_model(source("llama-odd"), tmp_path / "odd", "q0f32", compile_for="cpu")
    libs = list((out / "lib").glob("*.so"))
    assert len(libs) == 1
    loaded = Model(out, "cpu")
    assert loaded.library.compiled is False and loaded.library.path == libs[0]
    shutil.rmtree(out)
