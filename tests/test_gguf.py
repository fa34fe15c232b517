"""GGUF import: SmolLM2's GGUF gives the tokenizer ids of transformers and llama.cpp, the weights
transformers dequantizes, and a q0f32 model whose logits and greedy tokens match transformers';
synthetic GGUFs show the Q/K un-permutation, sentencepiece vocabularies, rope recovery, errors,
and `localchat pull file.gguf` through the CLI.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from localchat.engine.build import gguf as lg
from localchat.engine.models.llama import (
    GGUF_LAYER_TENSORS,
    GGUF_TENSORS,
    llama3_rope_from_freqs,
)
from localchat.errors import ModelConfigError, UnsupportedModelError

from fixtures import (
    build_lock,
    cache_dir,
    converted,
    keep_libraries,
    seed_libraries,
    smollm2_gguf,
    smollm2_hf_dir,
)
from hub_server import tiny_llama_folder

ENGINE = Path(__file__).resolve().parent.parent / "app" / "engine"
CORPUS = [
    "Hello, world! This is a plain English sentence.",
    "The year 2024 had 366 days; π ≈ 3.14159 and 1,000,000 > 999.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # recursion\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
    "你好，世界！我们今天去公园散步吧。",
    "日本語のテキストと한국어 텍스트",
    "emoji 🎉🚀 family 👨‍👩‍👧 flag 🇫🇷 skin 👍🏽",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\r\nwindows newlines\n\n\n\nmany blank lines",
    "x" + " " * 17 + "y" + "\t\t\t" + "z",
    "ÄÖÜ straße naïve café résumé",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "URLs like https://example.com/a?b=c&d=e#f and emails a.b@c.de",
    "",
]


# -- SmolLM2 ---------------------------------------------------------------------------------
def _digest(*files: Path) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:10]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="module")
def imported(gguf_path: Path) -> Path:
    """Our HF folder of the SmolLM2 GGUF, cached in the test cache by this importer's source
    (the reader and the Llama module's GGUF map)."""
    sources = (ENGINE / "build" / "gguf.py", ENGINE / "models" / "llama.py")
    out = cache_dir() / f"smollm2-gguf-import-{_digest(*sources)}"
    with build_lock(out.name):
        if not (out / "config.json").exists():
            tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".gguf-import-"))
            lg.gguf_to_hf_folder(gguf_path, tmp)
            tmp.rename(out)
    return out


def test_smollm2_tokenizer_ids_equal_transformers_and_llama_cpp(gguf_path: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok, _ = lg.build_tokenizer(lg.read_gguf(gguf_path).metadata)
    ours = Tokenizer.from_str(tok.to_str())  # as saved in tokenizer.json
    reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    for text in CORPUS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    try:
        import llama_cpp
    except ImportError:
        return
    llama = llama_cpp.Llama(str(gguf_path), vocab_only=True, verbose=False)
    for text in CORPUS:
        expect = llama.tokenize(text.encode(), add_bos=False, special=True)
        assert ours.encode(text, add_special_tokens=False).ids == expect, text


def test_smollm2_config_template_and_weights_equal_transformers(
        gguf_path: Path, imported: Path) -> None:
    from safetensors import safe_open

    reference_dir = smollm2_hf_dir()  # transformers' own import of the same GGUF
    config = json.loads((imported / "config.json").read_text())
    reference = json.loads((reference_dir / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "rms_norm_eps", "tie_word_embeddings",
                "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert config[key] == reference[key], key
    assert config["rope_theta"] == reference["rope_parameters"]["rope_theta"]
    meta = lg.read_gguf(gguf_path).metadata
    assert (imported / "chat_template.jinja").read_text() == meta["tokenizer.chat_template"]
    tok_config = json.loads((imported / "tokenizer_config.json").read_text())
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")

    with safe_open(imported / "model.safetensors", "np") as ours, \
            safe_open(reference_dir / "model.safetensors", "np") as theirs:
        assert set(ours.keys()) == set(theirs.keys())
        for name in ours.keys():
            assert np.array_equal(ours.get_tensor(name), theirs.get_tensor(name)), name


def test_smollm2_q0f32_logits_and_greedy_tokens_match_transformers(imported: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    from localchat.engine.runtime import Model

    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    hf = LlamaForCausalLM.from_pretrained(smollm2_hf_dir(), dtype=torch.float32).eval()
    model = Model(converted(imported, "q0f32"), "cpu")
    ids = model.tokenizer.encode(prompt)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    ref_first = out.logits[0][0].numpy()
    seq = model.new_sequence()
    logits = model.prefill(seq, ids)
    assert np.abs(logits - ref_first).max() / np.abs(ref_first).max() <= 1e-3
    tokens = [int(np.argmax(logits))]
    while len(tokens) < 16 and tokens[-1] not in model.eos_token_ids:
        tokens.append(int(np.argmax(model.decode([seq], [tokens[-1]])[0])))
    assert tokens == out.sequences[0, len(ids):].tolist()
    assert tokens[-1] == 2 and "Paris" in model.tokenizer.decode(tokens)  # ends at <|im_end|>


# -- synthetic GGUFs -------------------------------------------------------------------------
def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (what the importer undoes)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def write_llama_gguf(hf_dir: Path, path: Path, qtype: str = "F32",
                     embed_qtype: str | None = None) -> Path:
    """A GGUF of an HF Llama folder, written as llama.cpp's converter lays it out; matrices in
    `qtype`, the token embedding in `embed_qtype` (default: `qtype`)."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    weights = load_file(hf_dir / "model.safetensors")
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_dimension_count(config["hidden_size"] // heads)
    vocab = [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv_: kv_[1])]
    types = [3 if t in ("<s>", "</s>") else 1 for t in vocab]
    padding = config["vocab_size"] - len(vocab)  # llama.cpp pads to the embedding's rows
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(vocab + [f"[PAD{i}]" for i in range(len(vocab), len(vocab) + padding)])
    w.add_token_types(types + [5] * padding)
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    names = {v: k for k, v in GGUF_TENSORS.items()}
    for name, value in weights.items():
        if name in names:
            gname = names[name]
        else:
            _, _, i, *rest = name.split(".")
            part = ".".join(rest[:-1])
            short = next(k for k, v in GGUF_LAYER_TENSORS.items() if v == part)
            gname = f"blk.{i}.{short}.{rest[-1]}"
        if gname.endswith("attn_q.weight"):
            value = llama_cpp_permute(value, heads)
        elif gname.endswith("attn_k.weight"):
            value = llama_cpp_permute(value, kv)
        kind = embed_qtype if gname == "token_embd.weight" and embed_qtype else qtype
        qt = getattr(gguf.GGMLQuantizationType, kind)
        if value.ndim == 2 and qt != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, gguf.quants.quantize(value, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, np.ascontiguousarray(value, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def test_f32_gguf_round_trip_gives_back_the_hf_weights_exactly(tiny: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    path = write_llama_gguf(tiny, tmp_path / "tiny.gguf")
    out = lg.gguf_to_hf_folder(path, tmp_path / "hf")
    ours, original = load_file(out / "model.safetensors"), load_file(tiny / "model.safetensors")
    assert set(ours) == set(original)
    for name in original:
        assert np.array_equal(ours[name], original[name]), name
    config = json.loads((out / "config.json").read_text())
    want = json.loads((tiny / "config.json").read_text())
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "tie_word_embeddings", "num_hidden_layers", "intermediate_size"):
        assert config[key] == want[key], key
    from tokenizers import Tokenizer

    mine = Tokenizer.from_file(str(out / "tokenizer.json"))
    theirs = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    for text in CORPUS:
        assert mine.encode(text, add_special_tokens=False).ids == \
            theirs.encode(text, add_special_tokens=False).ids, text


def test_quantized_gguf_dequantizes_like_transformers(tiny: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.numpy import load_file
    from transformers import LlamaForCausalLM

    path = write_llama_gguf(tiny, tmp_path / "tiny-q8.gguf", "Q8_0")
    ours = load_file(lg.gguf_to_hf_folder(path, tmp_path / "hf") / "model.safetensors")
    theirs = LlamaForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                              dtype=torch.float32).state_dict()
    for name, value in ours.items():
        assert np.allclose(value, theirs[name].numpy(), rtol=0, atol=1e-6), name
    original = load_file(tiny / "model.safetensors")
    q = ours["model.layers.0.self_attn.q_proj.weight"]
    assert np.abs(q - original["model.layers.0.self_attn.q_proj.weight"]).max() < 0.01


def _sentencepiece_gguf(path: Path) -> tuple[Path, object]:
    """A GGUF with a sentencepiece-style (`llama`) vocabulary trained here, and its processor."""
    import gguf
    import sentencepiece as spm

    text = ["The quick brown fox jumps over the lazy dog.", "Hello world! Hello there.",
            "def main():\n    print('hi')\n", "数字 12345 and naïve café",
            "tabs\tand  double  spaces"] * 30
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_writer=proto, vocab_size=420, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, split_digits=True,
        allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", user_defined_symbols=["<tool>"], minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    n = sp.get_piece_size()
    tokens = [sp.id_to_piece(i) for i in range(n)]

    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        return 4 if tokens[i] == "<tool>" else 1

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types([kind(i) for i in range(n)])
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_tensor("token_embd.weight", np.zeros((n, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, sp


def test_sentencepiece_vocabulary_tokenizes_like_llama_cpp_and_sentencepiece(
        tmp_path: Path) -> None:
    path, sp = _sentencepiece_gguf(tmp_path / "spm.gguf")
    tok, config = lg.build_tokenizer(lg.read_gguf(path).metadata)
    assert config["add_bos_token"] is True and config["bos_token"] == "<s>"
    plain = ["Hello world!", " leading space", "The  quick\tbrown\n\nfox", "数字 12345 zebra",
             "naïve café ☃ 🎉", "unseen QXZ words"]
    for text in plain:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == sp.encode(text), text  # byte fallback included
        assert tok.decode(ids) == text
    try:
        import llama_cpp
    except ImportError:
        return
    llama = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in [*plain, "<tool> call", "<s>x</s>"]:
        assert tok.encode(text, add_special_tokens=False).ids == \
            llama.tokenize(text.encode(), add_bos=False, special=True), text


def test_llama3_rope_is_recovered_from_rope_freqs() -> None:
    head_dim, theta = 64, 500000.0
    expect = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (8192 / wavelen - 1.0) / 3.0
    factors = np.where(wavelen < 8192 / 4, 1.0, np.where(
        wavelen > 8192, 32.0, 1 / ((1 - smooth) / 32.0 + smooth)))
    assert llama3_rope_from_freqs(factors.astype(np.float32), head_dim, theta, 131072) == expect
    assert llama3_rope_from_freqs(np.ones(32), head_dim, theta, 131072) == {}
    assert llama3_rope_from_freqs(np.linspace(1, 3, 32), head_dim, theta, 131072) is None


def _gguf_with_architecture(path: Path, arch: str) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_q4_1_gguf_defaults_to_q4f32_asym_which_holds_it_exactly(tiny: Path,
                                                                  tmp_path: Path) -> None:
    """A Q4_1 file as llama.cpp writes them (matrices Q4_1, the embedding Q8_0): on the CPU, a
    pull without --quant converts it to q4f32_asym (on a GPU, or with --quant, as asked), and
    the model directory holds every weight of the file exactly."""
    import tvm
    import tvm.contrib.tvmjs as tvmjs

    from localchat.downloader.pull import EngineHooks, pull
    from localchat.engine import build
    from localchat.engine.build.quantization import dequantize_q4, dequantize_q8
    from localchat.prebuilt import PrebuiltIndex
    from localchat.store import Store

    path = write_llama_gguf(tiny, tmp_path / "tiny-q4_1.gguf", "Q4_1", embed_qtype="Q8_0")
    assert build.gguf_default_quantization(path, "cpu") == "q4f32_asym"
    assert build.gguf_default_quantization(path, "gpu") is None
    q8 = write_llama_gguf(tiny, tmp_path / "tiny-q8.gguf", "Q8_0")
    assert build.gguf_default_quantization(q8, "cpu") == "q8f32_0"
    f16 = write_llama_gguf(tiny, tmp_path / "tiny-f16.gguf", "F16")
    assert build.gguf_default_quantization(f16, "cpu") is None  # no mode holds it: the default

    asked = []

    class Stop(Exception):
        pass

    def convert(source: Path, output_dir: Path, quantization: str, **kwargs: object) -> None:
        asked.append(quantization)
        raise Stop

    store = Store(tmp_path / "home")
    for kind, quant in (("cpu", None), ("gpu", None), ("cpu", "q4f32_1")):
        hooks = EngineHooks(convert=convert, device_kind=kind, inspect_gguf=lg.inspect_gguf,
                            gguf_quantization=build.gguf_default_quantization)
        with pytest.raises(Stop):
            pull(str(path), hooks=hooks, store=store, quantization=quant,
                 prebuilt_index=PrebuiltIndex())
    assert asked == ["q4f32_asym", "q4f16_1", "q4f32_1"]

    out = build.convert_source(path, tmp_path / "model", "q4f32_asym", scratch_dir=tmp_path)
    params, _ = tvmjs.load_tensor_cache(str(out), tvm.cpu())
    params = {name: value.numpy() for name, value in params.items()}
    imported = lg.gguf_to_hf_folder(path, tmp_path / "hf")
    from safetensors.numpy import load_file

    file_weights = load_file(imported / "model.safetensors")
    emb = file_weights["model.embed_tokens.weight"]
    got = dequantize_q8(params["model.embed_tokens.weight"], params["model.embed_tokens.scale"])
    assert np.array_equal(got, emb)
    down = "model.layers.1.mlp.down_proj."
    got = dequantize_q4(params[down + "weight"], params[down + "scale"], asymmetric=True)
    assert np.array_equal(got, file_weights[down + "weight"])

    # `localchat convert FILE.gguf` without --quant, on the CPU: the same choice, and it says so
    cli_out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "localchat.cli", "convert", str(path), "--output",
                           str(cli_out), "--device", "cpu", "--no-compile"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "q4f32_asym: it holds this file's weights exactly" in proc.stderr
    meta = json.loads((cli_out / "localchat-config.json").read_text())
    assert meta["quantization"] == "q4f32_asym" and meta["source"] == {"path": str(path)}


def test_unsupported_or_broken_files_are_refused_before_conversion(tmp_path: Path) -> None:
    from localchat.downloader.pull import EngineHooks, pull
    from localchat.prebuilt import PrebuiltIndex
    from localchat.store import Store

    gpt2 = _gguf_with_architecture(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gpt2'"):
        lg.inspect_gguf(gpt2)

    def no_convert(*args: object, **kwargs: object) -> None:
        raise AssertionError("conversion must not start")

    store = Store(tmp_path / "home")
    hooks = EngineHooks(convert=no_convert, inspect_gguf=lg.inspect_gguf)
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        pull(str(gpt2), hooks=hooks, store=store, prebuilt_index=PrebuiltIndex())
    assert store.models() == []
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelConfigError, match="not a GGUF file"):
        pull(str(fake), hooks=hooks, store=store, prebuilt_index=PrebuiltIndex())
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gpt2.read_bytes()[:40])
    with pytest.raises(Exception) as err:
        lg.read_gguf(truncated)
    assert err.type.__module__.startswith("localchat"), err.value


def test_each_gguf_architecture_of_the_registry_has_its_map(tmp_path: Path) -> None:
    from localchat.engine.models import REGISTRY, gguf_architectures, gguf_map

    assert "llama" in gguf_architectures()
    for entry in REGISTRY:
        for name in entry.gguf_architectures:
            assert gguf_map(name) is entry.load().gguf is not None, name
    assert gguf_map("gpt2") is None
    gpt2 = _gguf_with_architecture(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(UnsupportedModelError, match=r"GGUF import supports llama\b"):
        lg.inspect_gguf(gpt2)


# -- through the CLI -------------------------------------------------------------------------
@pytest.mark.slow
def test_pull_gguf_file_then_chat_through_the_cli(gguf_path: Path, tmp_path: Path) -> None:
    """`localchat pull ./file.gguf` imports, re-quantizes to q4f32_1, compiles; `run` chats."""
    home = tmp_path / "home"
    libs = home / "cache" / "libs"
    # A library is named by the hash of (config, quantization, target, TVM, kernels), so one
    # kept from an earlier run is exactly what compiling would produce: compile once per machine.
    seed_libraries(libs)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_HUB_OFFLINE")}
    env.update(LOCALCHAT_HOME=str(home), HF_ENDPOINT="http://127.0.0.1:9",
               LOCALCHAT_DISK_RESERVE="0", PIP_NO_INDEX="1")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([sys.executable, "-m", "localchat.cli", *args], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    pulled = cli("pull", str(gguf_path), "--quant", "q4f32_1")
    keep_libraries(libs)
    name = gguf_path.stem.lower()
    assert pulled.stdout.startswith(f"pulled {name}:q4f32_1: ") and "(from local)" in pulled.stdout
    shown = json.loads(cli("show", name, "--json").stdout)
    assert shown["source"] == {"kind": "file", "path": str(gguf_path), "format": "gguf"}
    assert "own Jinja" in shown["template"]
    assert not any(p.name.startswith(".gguf-import") for p in (home / "cache" / "downloads")
                   .iterdir()), "the intermediate HF folder is removed"
    reply = json.loads(cli("run", name, "What is the capital of France?", "--json",
                           "--max-tokens", "12").stdout.strip().splitlines()[-1])
    assert reply["text"].strip() and reply["finish_reason"] in ("stop", "length")
