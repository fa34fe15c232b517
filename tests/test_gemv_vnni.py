"""The int8-activation 4-bit decode GEMV: AVX-512 VNNI (`gemv.gemv_q4(..., avx512="vnni")`) and
AVX2's pmaddubsw route (`avx512="avx2"`), each where the CPU has it.

x is quantized per row and group of 32 to int8 (scale max|x| / 127, round half to even), so the
kernel's exact reference is the dequantized weights times that quantized x: a tight tolerance
against it (float32 summation only), a loose one against the float x. A row's result must not
depend on the other rows of the call (the server batches up to 16 sequences and each must equal
its solo run), and every reduction size must work: units of 16 groups, then of 4, then a
zero-padded partial unit; k not a multiple of 32 is stored padded to whole groups.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from model_oracle import rel_err

AGREE_STEPS = 128


ISAS = ["vnni", "avx2"]


def _target(isa: str = "vnni"):
    from localchat.engine.device import cpu_target
    from localchat.engine.kernels.common import has_avx2, has_avx512_vnni

    target = cpu_target()
    if isa == "vnni" and not has_avx512_vnni(target):
        pytest.skip("this CPU has no AVX-512 VNNI (avx512_vnni): the int8 GEMV is not built")
    if isa == "avx2" and not has_avx2(target):
        pytest.skip("this CPU has no AVX2: the pmaddubsw GEMV is not built")
    return target


def _quantize_x(x: np.ndarray, kp: int) -> np.ndarray:
    """x as the kernel sees it: per group of 32, int8 at scale max|x| / 127, back to float."""
    m, k = x.shape
    padded = np.zeros((m, kp), np.float32)
    padded[:, :k] = x
    groups = padded.reshape(m, kp // 32, 32)
    amax = np.abs(groups).max(axis=-1)
    scale = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(groups * inv[..., None])
    assert np.abs(q).max() <= 127
    return (q * scale[..., None]).reshape(m, kp)[:, :k]


def _build(target, func):
    import tvm

    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)


def _run(lib, args, m: int, n: int) -> np.ndarray:
    import tvm

    y = tvm.runtime.tensor(np.zeros((m, n), np.float32), tvm.cpu())
    lib["main"](*[tvm.runtime.tensor(a, tvm.cpu()) for a in args], y)
    return y.numpy()


@pytest.mark.parametrize(
    "k,n,bias",
    [
        (2048, 40, False),  # whole units of 16 groups
        (576, 24, True),  # a unit of 16, then a partial unit of 2 groups
        (896, 16, False),  # a unit of 16, then 3 units of 4
        (1000, 8, True),  # k % 32 = 8: a padded last group, in a partial unit
        (344, 12, False),  # no unit of 16 at all
        (9, 7, True),  # less than one group
        # k > LONG_CHUNKED_K: 16 rows walk the reduction in chunks (of 4 units, AVX2 8), then
        # a unit of 4 and a padded partial one; 1 and 3 rows do not, with the same bits
        (4776, 16, True),
    ],
)
@pytest.mark.parametrize("isa", ISAS)
def test_int8_gemv_matches_numpy_and_is_batch_invariant(
    k: int, n: int, bias: bool, isa: str
) -> None:
    from localchat.engine.build.quantization import dequantize_q4, padded_k, quantize_q4
    from localchat.engine.kernels import gemv

    target = _target(isa)
    rng = np.random.default_rng(k * 31 + n)
    words, scale = quantize_q4(rng.standard_normal((n, k), dtype=np.float32) * 0.05, "float32")
    b = rng.standard_normal(n).astype(np.float32)
    dense = dequantize_q4(words, scale, k).astype(np.float64)
    x = rng.standard_normal((21, k), dtype=np.float32)
    x[3] = 0  # an all-zero row: scale 0, nothing divided by it
    x[5, : min(k, 40)] *= 1000  # groups of very different magnitude in one row
    lib = _build(target, gemv.gemv_q4(k, n, "float32", isa, bias))
    rows = {}
    # 16 and 21 rows: prefill's blocks of 8 (21: then blocks of 4 and 1), their 4-group units
    # four rows at once and their lane sums together
    for m in (1, 3, 16, 21):
        args = (x[:m], words, scale, *([b] if bias else []))
        got = _run(lib, args, m, n)
        extra = b if bias else 0
        exact = _quantize_x(x[:m], padded_k(k)).astype(np.float64) @ dense.T + extra
        assert rel_err(got, exact) <= 2e-6, f"m={m}: against the int8-quantized x"
        assert rel_err(got, x[:m].astype(np.float64) @ dense.T + extra) <= 2e-2, f"m={m}"
        rows[m] = got
    for m in (3, 16):
        assert np.array_equal(rows[m][:1], rows[1]), f"row 0 differs with {m} rows"
    assert np.array_equal(rows[16][:3], rows[3]), "rows 0-2 differ with 16 rows"
    assert np.array_equal(rows[21][:16], rows[16]), "rows 0-15 differ with 21 rows"
    assert np.array_equal(rows[21][16:19], _run(lib, (x[16:19], words, scale,
                                                      *([b] if bias else [])), 3, n))


@pytest.mark.parametrize("isa", ISAS)
def test_int8_gemv_float16(isa: str) -> None:
    """q4f16 modes: x, scales, bias and y in float16 (accumulation in float32)."""
    from localchat.engine.build.quantization import dequantize_q4, padded_k, quantize_q4
    from localchat.engine.kernels import gemv

    target = _target(isa)
    k, n = 640, 24
    rng = np.random.default_rng(7)
    words, scale = quantize_q4(rng.standard_normal((n, k), dtype=np.float32) * 0.05, "float16")
    x = rng.standard_normal((4, k)).astype(np.float16)
    b = rng.standard_normal(n).astype(np.float16)
    import tvm

    func = gemv.gemv_q4(k, n, "float16", isa, True)
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
    y = tvm.runtime.tensor(np.zeros((4, n), np.float16), tvm.cpu())
    lib["main"](*[tvm.runtime.tensor(a, tvm.cpu()) for a in (x, words, scale, b)], y)
    dense = dequantize_q4(words, scale, k).astype(np.float64)
    xq = _quantize_x(x.astype(np.float32), padded_k(k)).astype(np.float64)
    ref = xq @ dense.T + b.astype(np.float64)
    assert rel_err(y.numpy().astype(np.float64), ref) <= 2e-3


def test_models_pick_the_vnni_gemv() -> None:
    """`gemv_isa` says "vnni" on a VNNI CPU, and that is what the models' Linear layers get."""
    from localchat.engine.kernels.common import gemv_isa, has_avx512

    target = _target()
    assert gemv_isa(target) == "vnni"
    assert has_avx512(target)


def test_models_pick_the_avx2_gemv_without_avx512() -> None:
    """An AVX2 CPU without AVX-512 gets the pmaddubsw GEMV ("avx2"), not the float one."""
    from localchat.engine.kernels.common import gemv_isa, has_avx512

    target = _target("avx2")
    if has_avx512(target):
        pytest.skip("this CPU has AVX-512: it runs the VNNI or table-lookup GEMV")
    assert gemv_isa(target) == "avx2"


@pytest.fixture(scope="module")
def smollm2_greedy() -> tuple[Path, list[int], list[int]]:
    """(SmolLM2's HF folder, the prompt, q0f32's 128 greedy tokens after it)."""
    from localchat.engine.runtime import Model

    from fixtures import converted, smollm2_hf_dir

    src = smollm2_hf_dir()
    ref = Model(converted(src, "q0f32"), "cpu")
    prompt = ref.tokenizer.encode(
        "<|im_start|>user\nWrite a short story about a lighthouse keeper who finds a message in "
        "a bottle.<|im_end|>\n<|im_start|>assistant\n"
    )
    seq = ref.new_sequence()
    tokens = [int(np.argmax(ref.prefill(seq, prompt)))]
    for _ in range(AGREE_STEPS - 1):
        tokens.append(int(np.argmax(ref.decode([seq], [tokens[-1]])[0])))
    return src, prompt, tokens


def _agreement(smollm2_greedy, quant: str) -> float:
    """How often `quant`, teacher-forced on q0f32's greedy tokens, picks the same top-1 token."""
    from localchat.engine.runtime import Model

    from fixtures import converted
    from model_oracle import run_teacher_forced

    src, prompt, tokens = smollm2_greedy
    ours = run_teacher_forced(Model(converted(src, quant), "cpu"), prompt, tokens)
    return float(np.mean([int(np.argmax(o) == t) for o, t in zip(ours, tokens)]))


def test_smollm2_q4_top1_agreement_with_q0f32(smollm2_greedy) -> None:
    """On the real SmolLM2-135M, q4f32_1 picks q0f32's greedy token at >= 60% of 128 steps (q4
    teacher-forced on q0f32's tokens). The bound is the weight format's, not the kernels': the
    same 4-bit weights in transformers (float activations) agree at 64%, the float-activation
    kernel at 64%, the int8 VNNI kernel at 65% (SmolLM2's weights come from a Q4_1 GGUF and are
    re-quantized to symmetric 4-bit groups); this guards int8 activations against costing
    more."""
    agree = _agreement(smollm2_greedy, "q4f32_1")
    assert agree >= 0.6, f"top-1 agreement {agree:.1%}"


def test_smollm2_q4_asym_top1_agreement_with_q0f32(smollm2_greedy) -> None:
    """q4f32_asym holds SmolLM2's Q4_1 weights exactly and its Q8_0 embedding / LM head exactly
    (8-bit), so what differs from q0f32 is only the int8 activations of the VNNI kernels (float
    activations: 100%): >= 90% of 128 steps."""
    agree = _agreement(smollm2_greedy, "q4f32_asym")
    assert agree >= 0.9, f"top-1 agreement {agree:.1%}"


@pytest.mark.parametrize("kind,k", [("q4", 2048), ("q4", 8192), ("q4_k", 2048), ("q8", 2048),
                                    ("q6_k", 2048), ("q6_k", 8192)])
def test_decode_gemvs_prefetch_their_weight_rows_ahead(kind: str, k: int) -> None:
    """Each int8 decode GEMV prefetches W 4 KiB ahead of its reads (one sequential stream per
    thread reads ~15% below the memory's speed without it): the next rows as a row starts
    (`common.row_prefetch`), or in the 4-bit and Q6_K GEMVs, for rows longer than 2 KiB, a
    line ahead of each line a unit or super-block reads."""
    import tvm

    from localchat.engine.kernels.gemv import gemv_q4, gemv_q8
    from localchat.engine.kernels.gemv_q6 import gemv_q6_k

    target = _target()
    n = 64
    func = {
        "q4": lambda: gemv_q4(k, n, "float32", "vnni"),
        "q4_k": lambda: gemv_q4(k, n, "float32", "vnni", False, True, "uint8"),
        "q8": lambda: gemv_q8(k, n, "float32", "vnni"),
        "q6_k": lambda: gemv_q6_k(k, n, "float32", "vnni"),
    }[kind]()
    ex = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
    assert "@llvm.prefetch" in ex.mod.inspect_source("ll")
