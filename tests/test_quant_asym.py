"""The asymmetric 4-bit modes (q4f32_asym, q4f16_asym): value q * scale + min per group of 32,
float16 scale and min (llama.cpp's Q4_1), and their 8-bit embedding / LM head (Q8_0's layout).

The quantizers must hold llama.cpp's blocks exactly (a Q4_1 or Q8_0 GGUF converts without loss,
checked on the real SmolLM2 fixture too), and every kernel that reads these layouts must equal
numpy on the dequantized weights, reductions that are not a multiple of 32 included, and give a
row the same bits whatever the other rows of the call. The models against transformers:
tests/test_odd_shapes.py (q4f32_asym); the agreement with q0f32 on SmolLM2:
tests/test_gemv_vnni.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from localchat.engine.build.quantization import (
    dequantize_q4,
    dequantize_q8,
    get_quant_mode,
    padded_k,
    quantize_q4_asym,
    quantize_q8,
    split_scale_min,
)
from localchat.errors import QuantizationError

from model_oracle import rel_err


def _gguf_round_trip(w: np.ndarray, qtype: str) -> np.ndarray:
    """`w` through llama.cpp's reference quantizer (gguf-py's) and back, as a GGUF holds it."""
    from gguf import GGMLQuantizationType, quants

    kind = getattr(GGMLQuantizationType, qtype)
    return quants.dequantize(quants.quantize(w, kind), kind).reshape(w.shape)


def test_q4_1_blocks_round_trip_exactly() -> None:
    """Weights that came out of a Q4_1 file (d * q + m, float32) quantize to the very same d, m
    and q, so they dequantize to the same floats; so do constant groups (d = 0)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 256), dtype=np.float32) * 0.05 + 0.01
    w[3, :32] = 0.25  # a constant group
    w[5] *= 300  # large magnitudes
    w = _gguf_round_trip(w, "Q4_1")
    words, scale_min = quantize_q4_asym(w)
    assert words.dtype == np.uint32 and words.shape == (64, 32)
    assert scale_min.dtype == np.float16 and scale_min.shape == (64, 16)  # side by side
    assert np.array_equal(dequantize_q4(words, scale_min, 256, asymmetric=True), w)
    scale, low = split_scale_min(scale_min)
    assert scale[3, 0] == 0 and low[3, 0] == np.float16(0.25)
    assert scale_min[5, 2] == scale[5, 1] and scale_min[5, 3] == low[5, 1]


def test_q8_0_blocks_round_trip_exactly() -> None:
    rng = np.random.default_rng(1)
    w = _gguf_round_trip(rng.standard_normal((32, 192), dtype=np.float32) * 0.1, "Q8_0")
    q, scale = quantize_q8(w)
    assert q.dtype == np.int8 and q.shape == (32, 192) and scale.dtype == np.float16
    assert np.array_equal(dequantize_q8(q, scale, 192), w)


def test_smollm2_weights_round_trip_exactly() -> None:
    """The real fixture: SmolLM2's Q4_1 GGUF (every matrix Q4_1 but the tied embedding, Q8_0),
    dequantized by transformers, converts to q4f32_asym without changing a single weight."""
    from safetensors.numpy import load_file

    from fixtures import smollm2_hf_dir

    weights = load_file(str(smollm2_hf_dir() / "model.safetensors"))
    matrices = {name: w for name, w in weights.items() if w.ndim == 2}
    assert len(matrices) == 211
    for name, w in matrices.items():
        if name == "model.embed_tokens.weight":
            back = dequantize_q8(*quantize_q8(w), w.shape[1])
        else:
            back = dequantize_q4(*quantize_q4_asym(w), w.shape[1], asymmetric=True)
        assert np.array_equal(back, w), name


def test_asym_quantizer_on_plain_floats() -> None:
    """Float weights: min and scale from the group's range (rounded to float16 as stored), q
    within half a step; a reduction that is not a multiple of 32 is padded with the row's last
    value (not 0: the kernels read only k columns); float16's range is enforced."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((7, 344), dtype=np.float32)
    words, scale_min = quantize_q4_asym(w)
    assert words.shape == (7, 352 // 8) and scale_min.shape == (7, 22)
    scale, low = split_scale_min(scale_min)
    full = dequantize_q4(words, scale_min, asymmetric=True)
    step = np.repeat(scale.astype(np.float32), 32, axis=1)[:, :344]
    assert np.all(np.abs(full[:, :344] - w) <= step * 0.5 + 1e-6)
    groups = np.pad(w, ((0, 0), (0, 8)), mode="edge").reshape(7, 11, 32)
    assert np.array_equal(low, groups.min(axis=-1).astype(np.float16))
    assert np.allclose(full[:, 344:], w[:, -1:], atol=float(scale.max()))
    head_words, head_scale_min = quantize_q4_asym(w[:, :320])  # whole groups alone
    assert np.array_equal(words[:, :40], head_words)
    assert np.array_equal(scale_min[:, :20], head_scale_min)
    with pytest.raises(QuantizationError, match="float16"):
        quantize_q4_asym(np.array([[0.0] * 31 + [1e6]], np.float32))
    with pytest.raises(QuantizationError, match="float16"):
        quantize_q8(np.array([[1e7] * 32], np.float32))


def test_modes() -> None:
    asym, sym = get_quant_mode("q4f32_asym"), get_quant_mode("q4f32_1")
    assert asym.asymmetric and asym.bits == 4 and asym.dtype == "float32"
    assert asym.group_dtype == "float16" and asym.head_bits == 8
    assert get_quant_mode("q4f16_asym").dtype == "float16"
    assert not sym.asymmetric and sym.group_dtype == "float32" and sym.head_bits == 4


def test_model_parameters_of_the_asym_layout() -> None:
    """A Linear has weight and scale (float16 scale and min side by side); the embedding and an
    untied LM head are int8 with float16 scales; the symmetric modes' parameters are as before."""
    from localchat.engine.build.convert import read_hf_config
    from localchat.engine.device import cpu_target
    from localchat.engine.models import detect_architecture

    from llama_variants import build_variant

    hf = read_hf_config(build_variant("llama-gqa"))
    arch = detect_architecture(hf)
    cfg = arch.config_from_hf(hf)

    def params(quant: str) -> dict[str, tuple[tuple[int, ...], str]]:
        model = arch.build(cfg, get_quant_mode(quant), cpu_target())
        return {n: (tuple(int(d) for d in p.shape), str(p.dtype))
                for n, p in model.named_parameters()}

    asym, sym = params("q4f32_asym"), params("q4f32_1")
    down = "model.layers.0.mlp.down_proj."
    assert asym[down + "weight"] == sym[down + "weight"] == ((64, 16), "uint32")
    assert asym[down + "scale"] == ((64, 8), "float16")
    assert sym[down + "scale"] == ((64, 4), "float32")
    assert set(asym) == set(sym)
    for head in ("model.embed_tokens.", "lm_head."):
        assert asym[head + "weight"] == ((512, 64), "int8")
        assert asym[head + "scale"] == ((512, 2), "float16")
        assert sym[head + "weight"] == ((512, 8), "uint32")


def _dense_asym(k: int, n: int, seed: int):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k), dtype=np.float32) * 0.05 + 0.02
    words, scale_min = quantize_q4_asym(w)
    q, qs = quantize_q8(w)
    dense4 = dequantize_q4(words, scale_min, k, asymmetric=True)
    return rng, (words, scale_min), dense4, (q, qs), dequantize_q8(q, qs, k)


def _check(lib, kernels, x, bias, n: int, tol: float, exact_x=None,
           rows: tuple[int, ...] = (1, 3, 6)) -> None:
    """Each kernel against numpy on the first `rows` rows of x, and row 0's bits the same for
    all."""
    import tvm

    dev = tvm.cpu()
    for name, (weights, dense) in kernels.items():
        first = []
        for m in rows:
            y = tvm.runtime.tensor(np.zeros((m, n), np.float32), dev)
            args = (x[:m], *weights, *([bias] if bias is not None else []))
            lib[name](*[tvm.runtime.tensor(a, dev) for a in args], y)
            xs = (exact_x if exact_x is not None else x)[:m].astype(np.float64)
            ref = xs @ dense.T.astype(np.float64) + (bias if bias is not None else 0)
            assert rel_err(y.numpy(), ref) <= tol, f"{name} m={m}"
            first.append(y.numpy()[0])
        assert all(np.array_equal(first[0], f) for f in first[1:]), name


def _compile(funcs: dict):
    import tvm

    from localchat.engine.device import cpu_target

    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    return tvm.compile(mod, cpu_target())  # one module, so LLVM runs once


@pytest.mark.parametrize(
    "k,n,bias",
    [
        (576, 24, True),  # SmolLM2's hidden size: vectors of 16 words, then a narrower one
        (344, 12, False),  # a padded last group
        (9, 7, True),  # less than one group
    ],
)
def test_float_kernels_match_numpy(k: int, n: int, bias: bool) -> None:
    """The generic and AVX-512 table GEMVs and the blocked prefill matmul with asymmetric
    weights, and the float 8-bit GEMV (the head without VNNI), to float rounding."""
    from localchat.engine.device import cpu_target
    from localchat.engine.kernels import gemv, matmul
    from localchat.engine.kernels.common import has_avx512

    rng, q4, dense4, q8, dense8 = _dense_asym(k, n, k + n)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    funcs = {
        "generic": (gemv.gemv_q4(k, n, "float32", False, bias, asym=True), q4, dense4),
        "linear_q4": (matmul.linear_q4(k, n, "float32", bias, asym=True), q4, dense4),
        "q8": (gemv.gemv_q8(k, n, "float32", False, bias), q8, dense8),
    }
    if has_avx512(cpu_target()):
        funcs["table"] = (gemv.gemv_q4(k, n, "float32", True, bias, asym=True), q4, dense4)
    lib = _compile({name: f for name, (f, _, _) in funcs.items()})
    x = rng.standard_normal((6, k), dtype=np.float32)
    _check(lib, {name: (w, d) for name, (_, w, d) in funcs.items()}, x, b, n, 1e-5)


@pytest.mark.parametrize(
    "k,n,bias",
    [
        (2048, 16, False),  # whole units of 16 groups
        (576, 24, True),  # a unit of 16, then a pair (q8) / a partial unit of 2 (q4)
        (1000, 8, True),  # k % 32 = 8: a padded last group
        (344, 12, False),  # no unit of 16: 2 units of 4 and a partial one (q4); 5 pairs and an
        # odd group (q8)
        (9, 7, True),  # less than one group
    ],
)
@pytest.mark.parametrize("isa", ["vnni", "avx2"])
def test_int8_kernels_match_the_int8_reference(k: int, n: int, bias: bool, isa: str) -> None:
    """The int8 GEMVs (asymmetric 4-bit, 8-bit; with VNNI or AVX2) equal the
    dequantized weights times x rounded to int8 per group as the kernels do (the 4-bit min term
    uses the int8 sums, so that holds exactly), and a row's bits do not depend on the other
    rows."""
    from test_gemv_vnni import _quantize_x, _target

    from localchat.engine.kernels import gemv

    _target(isa)  # skips where the CPU lacks `isa`
    rng, q4, dense4, q8, dense8 = _dense_asym(k, n, 3 * k + n)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    lib = _compile({
        "asym": gemv.gemv_q4(k, n, "float32", isa, bias, asym=True),
        "q8": gemv.gemv_q8(k, n, "float32", isa, bias),
    })
    kernels = {"asym": (q4, dense4), "q8": (q8, dense8)}
    x = rng.standard_normal((6, k), dtype=np.float32)
    x[2] = 0  # an all-zero row
    x[4, : min(k, 40)] *= 1000  # groups of very different magnitude in one row
    _check(lib, kernels, x, b, n, 2e-6, exact_x=_quantize_x(x, padded_k(k)))
    _check(lib, kernels, x, b, n, 2e-2)  # and near the float product


@pytest.mark.parametrize("isa", ["vnni", "avx2"])
def test_int8_kernels_in_tiles_of_w_for_many_rows(isa: str) -> None:
    """With more rows of x than one block (prefill; every matrix of the 8-bit modes), the int8
    GEMVs run W in tiles of rows per block of x: the same int8 reference, and a row's bits the
    same alone, in a block and in the tiled form."""
    from test_gemv_vnni import _quantize_x, _target

    from localchat.engine.kernels import gemv

    _target(isa)  # skips where the CPU lacks `isa`
    k, n = 600, 128  # two tiles of 64 rows; 19 rows of x: 2 blocks of 8, then 2 and 1
    rng, q4, dense4, q8, dense8 = _dense_asym(k, n, 9)
    lib = _compile({
        "asym": gemv.gemv_q4(k, n, "float32", isa, False, asym=True),
        "q8": gemv.gemv_q8(k, n, "float32", isa, False),
    })
    x = rng.standard_normal((19, k), dtype=np.float32)
    _check(lib, {"asym": (q4, dense4), "q8": (q8, dense8)}, x, None, n, 2e-6,
           exact_x=_quantize_x(x, padded_k(k)), rows=(1, 8, 19))


@pytest.mark.parametrize("isa", ["vnni", "avx2"])
def test_int8_kernels_chunk_a_long_reduction_for_many_rows(isa: str) -> None:
    """Past `LONG_CHUNKED_K` the tiled form walks the reduction in chunks, carrying each
    accumulator between them: a row's bits are still the same alone, in a block and tiled."""
    from test_gemv_vnni import _quantize_x, _target

    from localchat.engine.kernels import gemv

    _target(isa)  # skips where the CPU lacks `isa`
    k, n = 4776, 16  # 9 units of 16 (AVX2: 18 of 8) in chunks, a unit of 4, a padded part
    assert k > gemv.LONG_CHUNKED_K
    rng, q4, dense4, _, _ = _dense_asym(k, n, 11)
    lib = _compile({"asym": gemv.gemv_q4(k, n, "float32", isa, True, asym=True)})
    x = rng.standard_normal((19, k), dtype=np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    _check(lib, {"asym": (q4, dense4)}, x, b, n, 2e-6, exact_x=_quantize_x(x, padded_k(k)),
           rows=(1, 8, 19))


def test_float16_activations() -> None:
    """q4f16_asym (the kernels this CPU runs): x, bias and y in float16; scales and mins are
    float16 as in q4f32_asym."""
    import tvm

    from localchat.engine.device import cpu_target
    from localchat.engine.kernels import gemv
    from localchat.engine.kernels.common import gemv_isa

    k, n = 640, 24
    rng, (words, scale_min), dense, (q, qs), dense8 = _dense_asym(k, n, 5)
    isa = gemv_isa(cpu_target())
    lib = _compile({
        "asym": gemv.gemv_q4(k, n, "float16", isa, True, asym=True),
        "q8": gemv.gemv_q8(k, n, "float16", isa, True),
    })
    x = rng.standard_normal((4, k)).astype(np.float16)
    b = rng.standard_normal(n).astype(np.float16)
    for name, weights, d in (("asym", (words, scale_min), dense), ("q8", (q, qs), dense8)):
        y = tvm.runtime.tensor(np.zeros((4, n), np.float16), tvm.cpu())
        lib[name](*[tvm.runtime.tensor(a, tvm.cpu()) for a in (x, *weights, b)], y)
        ref = x.astype(np.float64) @ d.T.astype(np.float64) + b.astype(np.float64)
        assert rel_err(y.numpy().astype(np.float64), ref) <= 2e-2, name


def test_gpu_dequantize_path_reads_only_real_columns() -> None:
    """The GPU formulation (dequantize + matmul; dequantized embedding rows) of an asymmetric
    Linear, an 8-bit head and the 8-bit embedding, with k not a multiple of 32, built as for a
    GPU but run on the CPU: numpy on the unpadded matrices."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend import nn

    from localchat.engine.device import cpu_target
    from localchat.engine.models.layers import BuildContext, Embedding, Linear

    k, n, vocab = 344, 24, 11
    mode = get_quant_mode("q4f32_asym")
    # built as for a GPU (dequantize + matmul), compiled and run on the CPU
    gpu = BuildContext(mode, tvm.target.Target({"kind": "cuda", "arch": "sm_80"}))

    class Net(nn.Module):
        def __init__(self) -> None:
            self.proj = Linear(k, n, False, gpu)
            self.head = Linear(k, vocab, False, gpu, head=True)
            self.emb = Embedding(vocab, k, gpu)

        def forward(self, x: nn.Tensor, ids: nn.Tensor):
            return self.proj(x), self.head(x), self.emb(ids), self.emb.lm_head(x)

    spec = {
        "forward": {
            "x": nn.spec.Tensor([3, k], "float32"),
            "ids": nn.spec.Tensor([4], "int32"),
            "$": {"param_mode": "packed", "effect_mode": "none"},
        }
    }
    mod, params = Net().export_tvm(spec=spec)
    vm = relax.VirtualMachine(tvm.compile(mod, target=cpu_target()), tvm.cpu())
    rng, (ww, ws), proj, _, _ = _dense_asym(k, n, 9)
    e = rng.standard_normal((vocab, k), dtype=np.float32)
    (hq, hs), (eq, es) = quantize_q8(e * 0.5), quantize_q8(e)
    values = {"proj.weight": ww, "proj.scale": ws, "head.weight": hq,
              "head.scale": hs, "emb.weight": eq, "emb.scale": es}
    packed = [tvm.runtime.tensor(values[name], tvm.cpu()) for name, _ in params]
    x = rng.standard_normal((3, k), dtype=np.float32)
    ids = np.array([0, 10, 3, 3], np.int32)
    y, logits, rows, tied = vm["forward"](
        tvm.runtime.tensor(x, tvm.cpu()), tvm.runtime.tensor(ids, tvm.cpu()), packed
    )
    x64 = x.astype(np.float64)
    assert rel_err(y.numpy(), x64 @ proj.T) <= 1e-5
    assert rel_err(logits.numpy(), x64 @ dequantize_q8(hq, hs, k).T) <= 1e-5
    assert np.array_equal(rows.numpy(), dequantize_q8(eq, es, k)[ids])
    assert rel_err(tied.numpy(), x64 @ dequantize_q8(eq, es, k).T) <= 1e-5
