"""The modes that hold llama.cpp's Q4_0 exactly (q4f32_0, q4f16_0): value (q - 8) * d per group of
32, d float16 (18 bytes per 32 weights, as a Q4_0 block), the embedding and LM head 8-bit.

A GGUF import dequantizes to float32 and re-quantizes: the quantizer must find every block's d and
nibbles again (llama.cpp's own files, and groups whose extreme value is not q = 0, as an
importance-weighted quantizer writes them), and quantize float weights as llama.cpp's reference
does. A tiny Llama written as an F32 GGUF and quantized by llama.cpp itself
(`llama_cpp.llama_model_quantize`) is imported by default as q4f32_0, its stored 4-bit weights
dequantize to exactly what `gguf.quants.dequantize` gives, and it generates greedily as the q0f32
import of the same file does. The kernels read the float16 scales: they must equal numpy on the
dequantized weights.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from localchat.engine.build.q6_k import dequantize_q6_k
from localchat.engine.build.quantization import (
    dequantize_q4,
    dequantize_q8,
    get_quant_mode,
    quantize_q4_0,
    quantize_weight,
)
from localchat.errors import QuantizationError

from model_oracle import rel_err


def _q4_0_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's reference Q4_0 (gguf-py's) of `w`: (float16 d [N, K/32], nibbles [N, K])."""
    from gguf import GGMLQuantizationType, quants

    raw = quants.quantize(w, GGMLQuantizationType.Q4_0).reshape(-1, 18)
    d = raw[:, :2].copy().view(np.float16).reshape(w.shape[0], -1)
    qs = raw[:, 2:]
    nibbles = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(w.shape)
    return d, nibbles.astype(np.int32)


def _nibbles(words: np.ndarray) -> np.ndarray:
    shifts = np.arange(8, dtype=np.uint32) * 4
    return ((words[..., None] >> shifts) & 15).astype(np.int32).reshape(words.shape[0], -1)


def test_float_weights_quantize_to_llama_cpp_reference_bits() -> None:
    """From float weights, the same d and nibbles as llama.cpp's quantize_row_q4_0_ref."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 256), dtype=np.float32) * 0.05
    w[3, :32] = 0  # an all-zero group: d = 0, nibble 8
    w[5] *= 300
    w[7, 40] = -2.5  # a negative extreme: d > 0
    words, d = quantize_q4_0(w)
    want_d, want_q = _q4_0_blocks(w)
    assert words.dtype == np.uint32 and words.shape == (48, 32)
    assert d.dtype == np.float16 and d.shape == (48, 8)
    assert np.array_equal(d.view(np.uint16), want_d.view(np.uint16))
    assert np.array_equal(_nibbles(words), want_q)
    assert d[3, 0] == 0 and (_nibbles(words)[3, :32] == 8).all()
    assert d[7, 1] > 0


def test_q4_0_blocks_round_trip_exactly() -> None:
    """Weights dequantized from Q4_0 blocks quantize back to blocks with the very same values:
    llama.cpp's own (its extreme at q = 0) and others (no q = 0 in the group, either sign of d,
    a zero group), which a plain re-quantization would round differently."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(1)
    w = rng.standard_normal((32, 512), dtype=np.float32) * 0.03
    kind = GGMLQuantizationType.Q4_0
    from_file = quants.dequantize(quants.quantize(w, kind), kind).reshape(w.shape)
    words, d = quantize_q4_0(from_file)
    assert np.array_equal(dequantize_q4(words, d), from_file)
    assert np.array_equal(d.view(np.uint16), _q4_0_blocks(w)[0].view(np.uint16))

    q = rng.integers(1, 16, (32, 16, 32))  # never 0: the extreme is at most 7 |d|
    q[:, :, 0] = rng.integers(9, 16, (32, 16))  # ... and sometimes positive
    scales = (rng.standard_normal((32, 16)) * 0.01).astype(np.float16)
    scales[0, 0] = 0
    other = ((q - 8) * scales.astype(np.float32)[..., None]).reshape(32, 512).astype(np.float32)
    words, d = quantize_q4_0(other)
    assert np.array_equal(dequantize_q4(words, d), other)
    # what llama.cpp's rounding alone would give is not exact for most of these groups
    naive = quants.dequantize(quants.quantize(other, kind), kind).reshape(other.shape)
    assert not np.array_equal(naive, other)


def test_mode_layout_and_padding() -> None:
    """q4f32_0: 4-bit words and float16 scales, 8-bit head, like llama.cpp's Q4_0 files; a K
    that is not a multiple of 32 pads with zero weights (nibble 8)."""
    mode = get_quant_mode("q4f32_0")
    assert mode.bits == 4 and not mode.asymmetric and mode.gguf_type == "Q4_0"
    assert mode.group_dtype == "float16" and mode.head_bits == 8
    assert get_quant_mode("q4f16_0").dtype == "float16"
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 40), dtype=np.float32)
    parts = quantize_weight(w, mode)
    assert parts["weight"].shape == (4, 8) and parts["scale"].shape == (4, 2)
    assert (_nibbles(parts["weight"])[:, 40:] == 8).all()
    back = dequantize_q4(parts["weight"], parts["scale"], 40)
    assert np.abs(back - w).max() <= np.abs(parts["scale"]).astype(np.float32).max() / 2 + 1e-6
    with pytest.raises(QuantizationError, match="float16"):
        quantize_q4_0(np.array([[0.0] * 31 + [1e6]], np.float32))


@pytest.mark.parametrize("k,n,bias", [(576, 24, True), (344, 12, False), (9, 7, True)])
def test_kernels_read_float16_scales(k: int, n: int, bias: bool) -> None:
    """The decode GEMV (the variant this CPU runs, and the generic one) and the prefill matmul
    with float16 scales equal numpy on the dequantized weights, to float rounding."""
    from test_quant_asym import _check, _compile

    from localchat.engine.device import cpu_target
    from localchat.engine.kernels import gemv, matmul
    from localchat.engine.kernels.common import gemv_isa

    rng = np.random.default_rng(k + n)
    w = rng.standard_normal((n, k), dtype=np.float32) * 0.05
    words, d = quantize_q4_0(w)
    dense = dequantize_q4(words, d, k)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    isa = gemv_isa(cpu_target())
    funcs = {
        "generic": gemv.gemv_q4(k, n, "float32", False, bias, scale_dtype="float16"),
        "linear_q4": matmul.linear_q4(k, n, "float32", bias, scale_dtype="float16"),
    }
    if isa:
        funcs["isa"] = gemv.gemv_q4(k, n, "float32", isa, bias, scale_dtype="float16")
    lib = _compile(funcs)
    x = rng.standard_normal((6, k), dtype=np.float32)
    kernels = {name: ((words, d), dense) for name in funcs}
    # the VNNI GEMV rounds x to int8 per group (~1e-3 relative)
    _check(lib, kernels, x, b, n, 2e-2 if isa in ("vnni", "avx2") else 1e-5)


# -- a GGUF quantized by llama.cpp -----------------------------------------------------------
def _llama_cpp_quantize(src: Path, dest: Path, ftype: str) -> Path:
    llama_cpp = pytest.importorskip("llama_cpp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dest).encode(),
                                        ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize {ftype} failed ({rc})"
    return dest


@pytest.fixture(scope="module", params=["Q4_0", "Q8_0"])
def exact_gguf(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A tiny Llama (tests/hub_server's) written as an F32 GGUF, quantized by llama.cpp to Q4_0
    or Q8_0, and the mode that holds that type."""
    from test_gguf import write_llama_gguf

    from hub_server import tiny_llama_folder

    ftype = request.param
    tmp = tmp_path_factory.mktemp(ftype.lower())
    f32 = write_llama_gguf(tiny_llama_folder(tmp / "tiny-llama"), tmp / "tiny-f32.gguf")
    gguf = _llama_cpp_quantize(f32, tmp / f"tiny-{ftype.lower()}.gguf", ftype)
    return gguf, {"Q4_0": "q4f32_0", "Q8_0": "q8f32_0"}[ftype]


def test_gguf_is_held_exactly_and_generates(exact_gguf: tuple[Path, str], tmp_path: Path) -> None:
    """llama.cpp's Q4_0 (Q8_0) file converts by default (CPU) to q4f32_0 (q8f32_0); every
    quantized parameter dequantizes to exactly llama.cpp's dequantization of the file's blocks
    (fused and with Q/K rows put back in HF's order), so does the 8-bit embedding (Q4_0 or
    Q8_0 in the file), and the model's greedy tokens and logits are those of the q0f32 import
    of the same file (which holds the dequantized values as they are)."""
    import tvm
    import tvm.contrib.tvmjs as tvmjs

    from localchat.engine import build
    from localchat.engine.build import gguf as lg
    from localchat.engine.build.weights import open_weights
    from localchat.engine.models import detect_architecture
    from localchat.engine.runtime import Model

    path, mode = exact_gguf
    ftype = get_quant_mode(mode).gguf_type
    assert lg.matrix_types(lg.read_gguf(path)) == {ftype}
    assert build.gguf_default_quantization(path, "cpu") == mode
    assert build.gguf_weights_dtype(mode) == "float32"

    out = build.convert_source(path, tmp_path / "q", mode, scratch_dir=tmp_path)
    params, _ = tvmjs.load_tensor_cache(str(out), tvm.cpu())
    params = {name: value.numpy() for name, value in params.items()}
    hf = lg.gguf_to_hf_folder(path, tmp_path / "hf")  # gguf.quants.dequantize, unpermuted
    config = lg.hf_config(lg.read_gguf(path))
    arch = detect_architecture(config)
    checked = 0
    with open_weights(hf) as weights:
        for name, value in arch.hf_params(arch.config_from_hf(config), weights.get,
                                          weights.names):
            scale_name = name[: -len("weight")] + "scale"
            if scale_name not in params:
                continue
            scale = params[scale_name]
            assert scale.dtype == np.float16
            if params[name].dtype == np.int8:  # 8-bit: the embedding, or every matrix in Q8_0
                got = dequantize_q8(params[name], scale, value.shape[1])
            else:
                got = dequantize_q4(params[name], scale, value.shape[1])
            assert np.array_equal(got, np.asarray(value, np.float32)), name
            checked += 1
    # per layer: fused qkv, o, fused gate/up, down; the embedding and the head
    assert checked == 2 * 4 + 2
    # the untied head and the embedding are 8-bit (and in Q8_0 every matrix)
    assert params["lm_head.weight"].dtype == np.int8
    assert (params["model.layers.0.mlp.down_proj.weight"].dtype == np.int8) == (ftype == "Q8_0")

    ref_dir = build.convert_source(path, tmp_path / "f32", "q0f32", scratch_dir=tmp_path)
    quantized, ref = Model(out, "cpu"), Model(ref_dir, "cpu")
    prompt = quantized.tokenizer.encode("hello world, the lighthouse")
    # q0f32 greedy; the quantized model fed the same tokens
    seq = ref.new_sequence()
    want = [ref.prefill(seq, prompt)]
    tokens = [int(np.argmax(want[-1]))]
    for _ in range(7):
        want.append(ref.decode([seq], [tokens[-1]])[0])
        tokens.append(int(np.argmax(want[-1])))
    seq = quantized.new_sequence()
    got = [quantized.prefill(seq, prompt)] + [quantized.decode([seq], [t])[0]
                                              for t in tokens[:-1]]
    # the same weights (the file's Q8_0 head is held exactly too); the kernels' summation order,
    # or with VNNI int8 activations, make the only difference
    assert rel_err(np.stack(got), np.stack(want)) < 2e-2
    for step, (a, b) in enumerate(zip(got, want)):
        top2 = np.sort(b)[-2:]
        if top2[1] - top2[0] > 2 * np.abs(a - b).max():  # not a near-tie: the same token
            assert int(np.argmax(a)) == tokens[step], step
    assert len(set(tokens)) > 1


# -- Q4_K (Q4_K_M files) ---------------------------------------------------------------------
def _q4_k_blocks(n: int, blocks: int, seed: int) -> np.ndarray:
    """Float32 [n, 256 blocks] weights as llama.cpp dequantizes Q4_K blocks (d * sc * q -
    dmin * m, float32) with random float16 d, dmin and 6-bit sc, m."""
    rng = np.random.default_rng(seed)
    d = (rng.random((n, blocks, 1)) * 0.01).astype(np.float16).astype(np.float32)
    dmin = (rng.random((n, blocks, 1)) * 0.01).astype(np.float16).astype(np.float32)
    sc = rng.integers(0, 64, (n, blocks, 8)).astype(np.float32)
    m = rng.integers(0, 64, (n, blocks, 8)).astype(np.float32)
    q = rng.integers(0, 16, (n, blocks, 8, 32)).astype(np.float32)
    q[..., 0] = 0  # llama.cpp's groups have their min at q = 0
    q[:, :, :4, 1] = 15  # some reach 15, the others stop lower
    return ((d * sc)[..., None] * q - (dmin * m)[..., None]).astype(np.float32).reshape(n, -1)


def test_q4_k_blocks_round_trip_exactly_in_4_5_bits() -> None:
    """Weights dequantized from Q4_K blocks quantize back to the same values in q4f32_k's
    super-block form (18 bytes per 32 weights, as Q4_K: sc and m in 6 bits, every value 0..63
    and both extremes of d and dmin round-tripping through the packed bytes); float weights
    quantize as Q4_K does (6-bit scales and mins <= 0), within half a step of each group's
    scale."""
    from localchat.engine.build.quantization import (
        pack_q4_k_params,
        q4_k_scale_min,
        q4_k_width,
        quantize_q4_k,
        unpack_q4_k_params,
    )

    n, blocks = 16, 4
    w = _q4_k_blocks(n, blocks, 3)
    words, params = quantize_q4_k(w)
    assert params.dtype == np.uint8 and params.shape == (n, q4_k_width(blocks * 8))
    assert q4_k_width(blocks * 8) == blocks * 16  # 12 bytes of sc, m and 4 of d, dmin
    assert words.nbytes + params.nbytes == n * blocks * 144  # Q4_K: 144 per super-block
    assert np.array_equal(dequantize_q4(words, params), w)

    every = np.arange(64).reshape(1, 8, 8)  # each 6-bit value, in every position of a block
    sc, m = every, every[:, ::-1, ::-1]
    d = np.array([[65504, -6e-8, 1, 0.5, 2, 3, 0.25, 1e-3]], np.float16)
    packed = pack_q4_k_params(sc, m, d, d[:, ::-1])
    assert packed.shape == (1, 8 * 16)
    for got, want in zip(unpack_q4_k_params(packed), (sc, m, d, d[:, ::-1]), strict=True):
        assert np.array_equal(got, want)

    rng = np.random.default_rng(5)
    f = rng.standard_normal((8, 344), dtype=np.float32)  # a partial super-block, a padded group
    words, params = quantize_q4_k(f)
    scale_min = q4_k_scale_min(params, 11)
    assert (scale_min[:, 1::2] <= 0).all()
    back = dequantize_q4(words, params, 344)
    assert np.abs(back - f).max() <= scale_min[:, 0::2].max() / 2 * 1.001
    assert np.abs(back - f).max() < 0.25
    mode = get_quant_mode("q4f32_k")
    assert mode.asymmetric and mode.group_dtype == "uint8" and mode.head_format == "Q6_K"


@pytest.mark.parametrize("k", [344, 512 + 96])  # a partial super-block; whole units and a tail
def test_q4_k_kernels_equal_float32_scales_bit_for_bit(k: int) -> None:
    """Every 4-bit CPU kernel (each GEMV form this CPU runs, the prefill matmul) gives the same
    bits from q4f32_k's super-block bytes as from the float32 scales and mins they stand for
    (d * sc and -dmin * m, exact in float32), and agrees with numpy."""
    import tvm
    from test_quant_asym import _check, _compile

    from localchat.engine.build.quantization import q4_k_scale_min, quantize_q4_k
    from localchat.engine.device import cpu_target
    from localchat.engine.kernels import gemv, matmul
    from localchat.engine.kernels.common import gemv_isa, has_avx512

    n = 40
    rng = np.random.default_rng(k)
    words, params = quantize_q4_k(rng.standard_normal((n, k), dtype=np.float32) * 0.05)
    pairs = q4_k_scale_min(params, -(-k // 32))
    dense = dequantize_q4(words, params, k)
    target = cpu_target()
    isas = {gemv_isa(target), "avx2", False} | ({True} if has_avx512(target) else set())
    funcs = {}
    for isa in isas:
        for layout, sdt in (("k", "uint8"), ("f", "float32")):
            funcs[f"gemv_{isa}_{layout}"] = gemv.gemv_q4(k, n, "float32", isa, True, asym=True,
                                                         scale_dtype=sdt)
            funcs[f"linear_{layout}"] = matmul.linear_q4(k, n, "float32", True, asym=True,
                                                         scale_dtype=sdt)
    lib = _compile(funcs)
    b = rng.standard_normal(n).astype(np.float32)
    x = rng.standard_normal((20, k), dtype=np.float32)
    dev = tvm.cpu()
    for name in funcs:
        if not name.endswith("_k"):
            continue
        twin = name[:-2] + "_f"
        out = {}
        for which, s in ((name, params), (twin, pairs)):
            y = tvm.runtime.tensor(np.zeros((20, n), np.float32), dev)
            lib[which](*[tvm.runtime.tensor(a, dev) for a in (x, words, s, b)], y)
            out[which] = y.numpy()
        assert np.array_equal(out[name], out[twin]), name
    int8 = any(i in ("vnni", "avx2") for i in isas)
    _check(lib, {name: ((words, params), dense) for name in funcs if name.endswith("_k")},
           x, b, n, 2e-2 if int8 else 1e-5)


@pytest.fixture(scope="module")
def q4_k_m_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with reductions of 256 (Q4_K's super-block) as an F32 GGUF, quantized by
    llama.cpp to Q4_K_M (Q4_K, and Q6_K for its output and some attn_v / ffn_down)."""
    import json

    import torch
    from test_gguf import write_llama_gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    from hub_server import tiny_tokenizer_json

    tmp = tmp_path_factory.mktemp("q4_k")
    hf = tmp / "tiny-llama-256"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=1)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(hf)
    (hf / "tokenizer.json").write_bytes(tiny_tokenizer_json())
    (hf / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))
    f32 = write_llama_gguf(hf, tmp / "tiny-f32.gguf")
    return _llama_cpp_quantize(f32, tmp / "tiny-q4_k_m.gguf", "Q4_K_M")


def test_q4_k_m_gguf_defaults_to_q4f32_k_which_holds_its_q4_k_blocks(q4_k_m_gguf: Path,
                                                                     tmp_path: Path) -> None:
    """llama.cpp's Q4_K_M file converts by default (CPU) to q4f32_k, which holds every matrix
    exactly: its Q4_K tensors in Q4_K, its Q6_K ones (the output head, attn_v and ffn_down in
    the layers llama.cpp gives more bits) in Q6_K, v apart from q and k there; the model loads
    and decodes."""
    import tvm
    import tvm.contrib.tvmjs as tvmjs

    from localchat.engine import build
    from localchat.engine.build import gguf as lg
    from localchat.engine.runtime import Model

    gf = lg.read_gguf(q4_k_m_gguf)
    assert lg.matrix_types(gf) == {"Q4_K", "Q6_K"}
    assert build.gguf_default_quantization(q4_k_m_gguf, "cpu") == "q4f32_k"
    out = build.convert_source(q4_k_m_gguf, tmp_path / "q4k", "q4f32_k", scratch_dir=tmp_path)
    params, _ = tvmjs.load_tensor_cache(str(out), tvm.cpu())
    params = {name: value.numpy() for name, value in params.items()}
    heads, kv, d = 4, 2, 64
    kinds = set()
    for i in range(2):
        v_q6 = gf.tensors[f"blk.{i}.attn_v.weight"].type_name == "Q6_K"
        attn = ({"self_attn.qk_proj": [("attn_q", heads * d), ("attn_k", kv * d)],
                 "self_attn.v_proj": [("attn_v", kv * d)]} if v_q6 else
                {"self_attn.qkv_proj": [("attn_q", heads * d), ("attn_k", kv * d),
                                        ("attn_v", kv * d)]})
        parts = {**attn, "self_attn.o_proj": [("attn_output", 256)],
                 "mlp.gate_up_proj": [("ffn_gate", 512), ("ffn_up", 512)],
                 "mlp.down_proj": [("ffn_down", 256)]}
        for ours, pieces in parts.items():
            prefix = f"model.layers.{i}.{ours}."
            weight, scale = params[prefix + "weight"], params[prefix + "scale"]
            q6 = weight.dtype == np.uint8
            got = dequantize_q6_k(weight, scale) if q6 else dequantize_q4(weight, scale)
            row = 0
            for short, rows in pieces:
                t = gf.tensors[f"blk.{i}.{short}.weight"]
                value = gf.tensor_values(t.name)
                if short in ("attn_q", "attn_k"):  # llama.cpp's rope row order, put back
                    value = lg.unpermute_rope_rows(value, heads if short == "attn_q" else kv)
                kinds.add(t.type_name)
                assert q6 == (t.type_name == "Q6_K"), t.name
                assert np.array_equal(got[row: row + rows, : value.shape[1]], value), t.name
                row += rows
    assert kinds == {"Q4_K", "Q6_K"}
    # the output head, Q6_K in the file, is held in Q6_K: exactly llama.cpp's values
    assert gf.tensors["output.weight"].type_name == "Q6_K"
    assert params["lm_head.weight"].dtype == np.uint8
    head = dequantize_q6_k(params["lm_head.weight"], params["lm_head.scale"])
    assert np.array_equal(head, gf.tensor_values("output.weight"))
    assert any(name.endswith("v_proj.weight") for name in params)  # a layer's v apart
    # the model computes with those weights: its logits are the q0f32 import's within int8
    # rounding of the activations (prefill, then decode steps; 2.1% at the first, where
    # q8f32_0's of the same file are 1.7% off and q4f32_1's 28%)
    ref = Model(build.convert_source(q4_k_m_gguf, tmp_path / "f32", "q0f32",
                                     scratch_dir=tmp_path), "cpu")
    model = Model(out, "cpu")
    ids = model.tokenizer.encode("hello world, hello again")
    seqs = (model.new_sequence(), ref.new_sequence())
    got, want = model.prefill(seqs[0], ids), ref.prefill(seqs[1], ids)
    for _ in range(3):
        assert rel_err(got, want) < 3e-2
        tok = int(np.argmax(want))
        got, want = model.decode([seqs[0]], [tok])[0], ref.decode([seqs[1]], [tok])[0]

    # a q4f32_k directory of an old layout (format 1: float32 scales and mins; format 2: an
    # 8-bit head; format 3: sc and m a byte each) is refused with what to do, not misread
    import json

    from localchat import model_dir as md
    from localchat.errors import ModelConfigError

    config = json.loads((out / md.CONFIG_FILE).read_text())
    assert config["format"] == 4
    md.validate_config({**config, "quantization": "q4f32_1", "format": 1})
    for old in (1, 2, 3):
        with pytest.raises(ModelConfigError, match="older localchat.*convert the model again"):
            md.validate_config({**config, "format": old})
