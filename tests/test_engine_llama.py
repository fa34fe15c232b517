"""The compiled Llama-family engine against transformers on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from localchat.engine.runtime import Model

from fixtures import converted
from llama_variants import VARIANTS, build_variant
from model_oracle import rel_err, run_teacher_forced

PROMPT = [int(t) for t in np.random.RandomState(7).randint(0, 512, 24)]
STEPS = 20


def hf_greedy(src, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """transformers' greedy continuation and the logits before each generated token."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), [lg[0].numpy() for lg in out.logits]




@pytest.mark.parametrize("variant", list(VARIANTS))
def test_q0f32_matches_transformers(variant: str) -> None:
    src = build_variant(variant)
    ref_tokens, ref_logits = hf_greedy(src, PROMPT, STEPS)
    model = Model(converted(src, "q0f32"), "cpu")
    ours = run_teacher_forced(model, PROMPT, ref_tokens)
    worst = max(rel_err(o, r) for o, r in zip(ours, ref_logits))
    assert worst <= 1e-4, f"max relative error {worst:.2e}"
    # Free-running greedy generation gives the very same tokens.
    seq = model.new_sequence()
    tok = int(np.argmax(model.prefill(seq, PROMPT)))
    greedy = [tok]
    for _ in range(STEPS - 1):
        tok = int(np.argmax(model.decode([seq], [tok])[0]))
        greedy.append(tok)
    assert greedy == ref_tokens


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_q4f32_top1_agreement(variant: str) -> None:
    src = build_variant(variant)
    ref_tokens, ref_logits = hf_greedy(src, PROMPT, STEPS)
    model = Model(converted(src, "q4f32_1"), "cpu")
    ours = run_teacher_forced(model, PROMPT, ref_tokens)
    agree = np.mean([int(o.argmax() == r.argmax()) for o, r in zip(ours, ref_logits)])
    assert agree >= 0.9, f"top-1 agreement {agree:.0%}"


@pytest.fixture(scope="module")
def gqa_model() -> Model:
    return Model(converted(build_variant("llama-gqa"), "q0f32"), "cpu", prefill_chunk_size=16)


def test_chunked_prefill_equals_single_prefill(gqa_model: Model) -> None:
    prompt = [int(t) for t in np.random.RandomState(3).randint(0, 512, 48)]  # 3 chunks of 16
    chunked = gqa_model.prefill(seq := gqa_model.new_sequence(), prompt)
    gqa_model.remove(seq)
    whole = Model(gqa_model.model_dir, "cpu", prefill_chunk_size=64)
    single = whole.prefill(whole.new_sequence(), prompt)
    assert rel_err(chunked, single) <= 1e-5


def test_batched_decode_equals_each_alone(gqa_model: Model) -> None:
    a_prompt, b_prompt = PROMPT[:10], PROMPT[5:]

    def alone(prompt: list[int]) -> list[int]:
        seq = gqa_model.new_sequence()
        tok = int(np.argmax(gqa_model.prefill(seq, prompt)))
        out = [tok]
        for _ in range(8):
            tok = int(np.argmax(gqa_model.decode([seq], [tok])[0]))
            out.append(tok)
        gqa_model.remove(seq)
        return out

    a, b = gqa_model.new_sequence(), gqa_model.new_sequence()
    first = gqa_model.batch_prefill([a, b], [a_prompt, b_prompt])
    toks = [int(np.argmax(first[0])), int(np.argmax(first[1]))]
    together = [[toks[0]], [toks[1]]]
    for _ in range(8):
        logits = gqa_model.decode([a, b], toks)
        toks = [int(np.argmax(logits[0])), int(np.argmax(logits[1]))]
        together[0].append(toks[0])
        together[1].append(toks[1])
    gqa_model.remove(a)
    gqa_model.remove(b)
    assert together == [alone(a_prompt), alone(b_prompt)]


def test_fork_continues_independently(gqa_model: Model) -> None:
    parent = gqa_model.new_sequence()
    gqa_model.prefill(parent, PROMPT[:12])
    child = gqa_model.fork(parent)
    from_parent = gqa_model.decode([parent], [PROMPT[12]])[0]
    from_child = gqa_model.decode([child], [PROMPT[13]])[0]
    fresh = gqa_model.new_sequence()
    expect_child = gqa_model.prefill(fresh, PROMPT[:12] + [PROMPT[13]])
    expect_parent = gqa_model.prefill(gqa_model.new_sequence(), PROMPT[:13])
    assert rel_err(from_child, expect_child) <= 1e-5
    assert rel_err(from_parent, expect_parent) <= 1e-5


def test_second_load_does_not_compile() -> None:
    path = converted(build_variant("llama-gqa"), "q0f32")
    Model(path, "cpu")
    again = Model(path, "cpu")
    assert again.library.compiled is False
    assert again.compile_seconds == 0.0


@pytest.mark.parametrize("k,n,bias", [(576, 40, True), (64, 24, False), (2048, 36, True)])
def test_linear_kernels_give_a_row_the_same_bits_whatever_the_batch(
    k: int, n: int, bias: bool
) -> None:
    """The decode GEMV (generic and AVX-512; reductions that are not a multiple of 128 end in a
    narrower vector) and the blocked `linear_q4` against numpy on the dequantized weights, and
    each gives row 0 the same bits with 1, 3 or 6 rows: a sequence's tokens must not depend on
    what it is batched with (the server's N concurrent requests equal their solo runs)."""
    import tvm

    from localchat.engine.build.quantization import dequantize_q4, quantize_q4
    from localchat.engine.device import cpu_target
    from localchat.engine.kernels import gemv, matmul
    from localchat.engine.kernels.common import has_avx512

    rng = np.random.default_rng(k + n)
    words, scale = quantize_q4(rng.standard_normal((n, k), dtype=np.float32) * 0.05, "float32")
    b = rng.standard_normal(n).astype(np.float32)
    target, dev = cpu_target(), tvm.cpu()
    kernels = {"linear_q4": matmul.linear_q4(k, n, "float32", bias)}
    for avx512 in [False] + ([True] if has_avx512(target) else []):
        kernels[f"gemv avx512={avx512}"] = gemv.gemv_q4(k, n, "float32", avx512, bias)
    x = rng.standard_normal((6, k), dtype=np.float32)
    ref = x.astype(np.float64) @ dequantize_q4(words, scale).T.astype(np.float64)
    for name, func in kernels.items():
        f = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
        first_rows = []
        for m in (1, 3, 6):
            y = tvm.runtime.tensor(np.zeros((m, n), np.float32), dev)
            args = (x[:m], words, scale, *([b] if bias else []))
            f["main"](*[tvm.runtime.tensor(a, dev) for a in args], y)
            assert rel_err(y.numpy(), ref[:m] + (b if bias else 0)) <= 1e-5, f"{name} m={m}"
            first_rows.append(y.numpy()[0])
        for m, row in zip((3, 6), first_rows[1:]):
            assert np.array_equal(row, first_rows[0]), f"{name}: row 0 differs with {m} rows"


def test_quantized_modes_keep_the_kv_cache_in_float16() -> None:
    """A 4-bit model's KV cache is float16 (`QuantMode.kv_dtype`), half the bytes q0f32's
    float32 cache takes for the same tokens (what the memory check and the benchmark count);
    the q4 agreement with transformers above runs through it."""
    src = build_variant("llama-gqa")
    f32 = Model(converted(src, "q0f32"), "cpu")
    f16 = Model(converted(src, "q4f32_1"), "cpu")
    assert f32.mode.kv_dtype == "float32" and f16.mode.kv_dtype == "float16"
    assert f16.kv_cache_bytes() * 2 == f32.kv_cache_bytes() > 0
