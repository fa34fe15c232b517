"""Embeddings on the compiled BERT-family encoders: the same vectors as sentence-transformers on
the same weights, batching that changes nothing, truncation, Matryoshka dimensions, and the
clear errors between chat and embedding models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from localchat import ContextWindowError, Engine, InvalidRequestError
from localchat.errors import UnsupportedModelError

from encoder_fixtures import (
    MAX_SEQ_LENGTH,
    QWEN3_PROMPTS,
    SENTENCES,
    build_encoder,
    build_qwen3_embedding,
    tiny_chat_model,
)
from fixtures import converted

TEXTS = [SENTENCES[0], "hello", SENTENCES[3] + " " + SENTENCES[1], "a b c", SENTENCES[4]]
LONG = " ".join(SENTENCES * 3)  # well over MAX_SEQ_LENGTH tokens


@pytest.fixture(scope="module")
def engines() -> dict[str, Engine]:
    """Every tiny encoder at q0f32, opened once for the module."""
    opened = {name: Engine.open(converted(build_encoder(name), "q0f32"), device="cpu")
              for name in ("bert-mean", "bert-cls", "nomic-mean", "nomic-cls")}
    yield opened
    for engine in opened.values():
        engine.close()


def reference(name: str, texts: list[str]) -> np.ndarray:
    """sentence-transformers' vectors of `texts` for encoder `name` (torch, float32)."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(build_encoder(name)), device="cpu").encode(texts)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("name", ["bert-mean", "bert-cls", "nomic-mean", "nomic-cls"])
def test_vectors_equal_sentence_transformers(engines: dict[str, Engine], name: str) -> None:
    result = engines[name].embed(TEXTS)
    ref = reference(name, TEXTS)
    assert result.vectors.shape == ref.shape == (len(TEXTS), 36)
    assert result.vectors.dtype == np.float32
    assert cosines(result.vectors, ref).min() >= 0.9999
    assert np.allclose(np.linalg.norm(result.vectors, axis=1), 1.0, atol=1e-5)  # Normalize


def test_mean_and_cls_pooling_differ_on_the_same_weights(engines: dict[str, Engine]) -> None:
    # bert-mean and bert-cls share weights (same seed and shape): only the pooling differs
    mean, cls = engines["bert-mean"].embed(TEXTS), engines["bert-cls"].embed(TEXTS)
    assert cosines(mean.vectors, cls.vectors).max() < 0.999


@pytest.mark.parametrize("name", ["bert-mean", "nomic-cls"])
def test_a_batch_of_different_lengths_equals_each_text_alone(engines: dict[str, Engine],
                                                             name: str) -> None:
    engine = engines[name]
    batch = engine.embed(TEXTS)
    alone = np.stack([engine.embed(t).vectors[0] for t in TEXTS])
    assert len(set(batch.token_counts)) > 2  # lengths really differ
    np.testing.assert_allclose(batch.vectors, alone, atol=1e-6)


def test_token_counts_include_the_special_tokens(engines: dict[str, Engine]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_encoder("bert-mean"))
    result = engines["bert-mean"].embed(TEXTS)
    assert result.token_counts == [len(tok(t)["input_ids"]) for t in TEXTS]
    assert result.prompt_tokens == sum(result.token_counts)
    assert result.truncated == [False] * len(TEXTS)


def test_token_ids_embed_as_their_text(engines: dict[str, Engine]) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(build_encoder("bert-mean"))(TEXTS[0])["input_ids"]
    engine = engines["bert-mean"]
    np.testing.assert_allclose(engine.embed([ids]).vectors, engine.embed(TEXTS[0]).vectors,
                               atol=1e-6)


def test_long_texts_are_cut_as_sentence_transformers_cuts_them(engines: dict[str, Engine]
                                                               ) -> None:
    engine = engines["nomic-mean"]
    result = engine.embed([LONG, "short"])
    assert result.truncated == [True, False]
    assert result.token_counts[0] == MAX_SEQ_LENGTH
    assert cosines(result.vectors, reference("nomic-mean", [LONG, "short"])).min() >= 0.9999
    with pytest.raises(ContextWindowError) as err:
        engine.embed([LONG], truncate=False)
    assert err.value.param == "input" and f"at most {MAX_SEQ_LENGTH}" in str(err.value)


def test_dimensions_keep_the_first_values_renormalized(engines: dict[str, Engine]) -> None:
    engine = engines["nomic-mean"]
    full = engine.embed(TEXTS).vectors
    cut = engine.embed(TEXTS, dimensions=8).vectors
    assert cut.shape == (len(TEXTS), 8)
    expected = full[:, :8] / np.linalg.norm(full[:, :8], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, expected, atol=1e-6)
    for bad in (0, 37, -1, 2.5, True):
        with pytest.raises(InvalidRequestError) as err:
            engine.embed(TEXTS, dimensions=bad)
        assert err.value.param == "dimensions"


@pytest.mark.parametrize("bad", [[], "", ["ok", ""], [[]], [3.5], [[10**9]]])
def test_bad_input_is_an_invalid_request(engines: dict[str, Engine], bad: object) -> None:
    with pytest.raises(InvalidRequestError) as err:
        engines["bert-mean"].embed(bad)
    assert err.value.param == "input"


def test_q0f16_stays_close(engines: dict[str, Engine]) -> None:
    for name in ("bert-mean", "nomic-cls"):
        with Engine.open(converted(build_encoder(name), "q0f16"), device="cpu") as half:
            assert cosines(half.embed(TEXTS).vectors, reference(name, TEXTS)).min() >= 0.999


def test_float_weights_are_stored_as_the_gemm_reads_them() -> None:
    """New conversions store the projections as panels (`kernels.gemm.weight_panels`); a model
    converted before, whose config lacks `weight_panels`, still builds with [n, k] weights."""
    from localchat import model_dir as md
    from localchat.engine.build.quantization import get_quant_mode
    from localchat.engine.device import cpu_target
    from localchat.engine.models.bert import Encoder, EncoderConfig

    data = md.load_config(converted(build_encoder("bert-mean"), "q0f32"))["model_config"]
    assert data["weight_panels"] is True
    old = {k: v for k, v in data.items() if k != "weight_panels"}
    h = data["hidden_size"]  # 36: qkv's 108 rows end inside a panel of 16
    for config, want in ((data, (7, h, 16)), (old, (3 * h, h))):
        model = Encoder(EncoderConfig.from_dict(config), get_quant_mode("q0f32"), cpu_target())
        shape = dict(model.named_parameters())["layers.0.attn.qkv.weight"].shape
        assert tuple(int(d) for d in shape) == want


def test_an_embedding_engine_cannot_chat(engines: dict[str, Engine]) -> None:
    engine = engines["bert-mean"]
    for call in (lambda: engine.chat([{"role": "user", "content": "hi"}]),
                 lambda: engine.complete("hi"), lambda: engine.conversation(),
                 lambda: engine.template):
        with pytest.raises(InvalidRequestError, match="is an embedding model") as err:
            call()
        assert err.value.param == "model"


def test_localchat_run_refuses_an_embedding_model() -> None:
    model = converted(build_encoder("bert-mean"), "q0f32")
    done = subprocess.run([sys.executable, "-m", "localchat.cli", "run", str(model), "hello"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "is an embedding model" in lines[0], done.stderr


def test_a_chat_model_makes_no_embeddings() -> None:
    with Engine.open(converted(tiny_chat_model(), "q0f32"), device="cpu") as chat:
        assert not chat.is_embedding
        with pytest.raises(InvalidRequestError, match="is a chat model") as err:
            chat.embed(["hello"])
        assert err.value.param == "model"


def test_the_pooling_is_recorded_at_convert_time() -> None:
    config = json.loads((converted(build_encoder("nomic-cls"), "q0f32")
                         / "localchat-config.json").read_text())
    # sentence-transformers saves empty "query" and "document" prompts: recorded as they are
    assert config["embedding"] == {"pooling": "cls", "normalize": True,
                                   "max_tokens": MAX_SEQ_LENGTH, "dimensions": 36,
                                   "prompts": {"query": "", "document": ""},
                                   "default_prompt": None}
    assert config["architecture"] == "nomic_bert"


def _st_folder(tmp_path: Path, modules: list[dict], pooling: dict | None,
               st_config: dict | None = None) -> Path:
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if st_config is not None:
        (tmp_path / "sentence_bert_config.json").write_text(json.dumps(st_config))
    return tmp_path


MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
           {"idx": 1, "name": "1", "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling"}]


def test_legacy_pooling_flags_and_max_seq_length_are_read(tmp_path: Path) -> None:
    from localchat.engine.build.pooling import read_pooling

    folder = _st_folder(tmp_path, MODULES, {"word_embedding_dimension": 384,
                                            "pooling_mode_cls_token": True,
                                            "pooling_mode_mean_tokens": False},
                        {"max_seq_length": 256})
    settings = read_pooling(folder, 512, 384)
    assert (settings.pooling, settings.normalize, settings.max_tokens) == ("cls", False, 256)


def test_a_folder_without_modules_json_is_mean_pooled_unnormalized(tmp_path: Path) -> None:
    from localchat.engine.build.pooling import read_pooling

    settings = read_pooling(tmp_path, 128, 36)
    assert (settings.pooling, settings.normalize, settings.max_tokens) == ("mean", False, 128)


@pytest.mark.parametrize("extra, pooling, message", [
    ([{"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"}],
     {"pooling_mode": "mean"}, "Dense"),
    ([], {"pooling_mode": "weightedmean"}, "weightedmean"),
    ([], {"pooling_mode": ["mean", "cls"]}, "several modes"),
])
def test_what_localchat_cannot_pool_is_refused(tmp_path: Path, extra: list, pooling: dict,
                                               message: str) -> None:
    from localchat.engine.build.pooling import read_pooling

    with pytest.raises(UnsupportedModelError, match=message):
        read_pooling(_st_folder(tmp_path, MODULES + extra, pooling), 128, 36)


# -- Qwen3-Embedding: the Qwen3 decoder, causal within each text, pooled at its last token ------
@pytest.fixture(scope="module")
def qwen3() -> Engine:
    """The tiny Qwen3-Embedding at q0f32 (one compile for every test below)."""
    with Engine.open(converted(build_qwen3_embedding(), "q0f32"), device="cpu") as engine:
        yield engine


def qwen3_reference(texts: list[str], folder: Path | None = None, **kwargs: object
                    ) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder or build_qwen3_embedding()), device="cpu")
    return model.encode(texts, **kwargs)


def test_qwen3_embedding_converts_from_its_sentence_transformers_files() -> None:
    config = json.loads((converted(build_qwen3_embedding(), "q0f32")
                         / "localchat-config.json").read_text())
    assert config["architecture"] == "qwen3_embedding"
    assert config["embedding"] == {"pooling": "last", "normalize": True,
                                   "max_tokens": MAX_SEQ_LENGTH, "dimensions": 72,
                                   "prompts": QWEN3_PROMPTS, "default_prompt": None}


def test_a_qwen3_without_sentence_transformers_files_stays_a_chat_model() -> None:
    from localchat.engine.models import detect_architecture

    from llama_variants import build_variant

    hf = json.loads((build_variant("qwen3-odd") / "config.json").read_text())
    assert detect_architecture(hf).name == "qwen3"
    assert detect_architecture(hf, sentence_transformers=True).name == "qwen3_embedding"
    # a bare Qwen3Model has no head to chat with
    assert detect_architecture({**hf, "architectures": ["Qwen3Model"]}).name == "qwen3_embedding"
    config = json.loads((converted(build_variant("qwen3-odd"), "q0f32")
                         / "localchat-config.json").read_text())
    assert config["architecture"] == "qwen3" and "embedding" not in config


def test_qwen3_embedding_equals_sentence_transformers(qwen3: Engine) -> None:
    result = qwen3.embed(TEXTS)
    ref = qwen3_reference(TEXTS)
    assert result.vectors.shape == ref.shape == (len(TEXTS), 72)
    assert cosines(result.vectors, ref).min() >= 0.9999
    assert np.allclose(np.linalg.norm(result.vectors, axis=1), 1.0, atol=1e-5)
    # the tokenizer appends the end-of-text token, the one the pooling reads
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_qwen3_embedding())
    ids = [tok(t, truncation=True, max_length=MAX_SEQ_LENGTH)["input_ids"] for t in TEXTS]
    assert all(i[-1] == tok.eos_token_id for i in ids)
    assert result.token_counts == [len(i) for i in ids]


def test_qwen3_embedding_batch_of_different_lengths_equals_each_text_alone(qwen3: Engine
                                                                           ) -> None:
    batch = qwen3.embed(TEXTS)
    alone = np.stack([qwen3.embed(t).vectors[0] for t in TEXTS])
    assert len(set(batch.token_counts)) > 2
    np.testing.assert_allclose(batch.vectors, alone, atol=1e-6)


def _rope(t: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotary (rotate-half) of t [n, d] at positions 0..n-1."""
    a, b = t[:, : t.shape[1] // 2], t[:, t.shape[1] // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=1)


def _attention_reference(qkv: np.ndarray, starts: list[int], heads: int, kv: int, d: int,
                         cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Causal grouped-query attention of each packed text, rotary by position in its text,
    in float64 (numpy, the textbook way)."""
    out = np.zeros((qkv.shape[0], heads * d))
    x = qkv.astype(np.float64)
    for lo, hi in zip(starts[:-1], starts[1:]):
        n = hi - lo
        c, s = cos[:n].astype(np.float64), sin[:n].astype(np.float64)
        for h in range(heads):
            g = h // (heads // kv)
            q = _rope(x[lo:hi, h * d:(h + 1) * d], c, s)
            k = _rope(x[lo:hi, (heads + g) * d:(heads + g + 1) * d], c, s)
            v = x[lo:hi, (heads + kv + g) * d:(heads + kv + g + 1) * d]
            scores = q @ k.T / np.sqrt(d) + np.triu(np.full((n, n), -np.inf), 1)
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[lo:hi, h * d:(h + 1) * d] = (p / p.sum(axis=1, keepdims=True)) @ v
    return out


def test_causal_grouped_packed_attention_matches_numpy() -> None:
    import tvm

    from localchat.engine.kernels.encoder import packed_attention
    from localchat.engine.models.bert import rope_angles

    heads, kv, d, max_len = 4, 2, 22, 24
    starts = [0, 7, 8, 29]  # 7 tokens, 1, then 21 (several query tiles and key vectors)
    func = packed_attention(heads, d, max_len, "float32", True, kv_heads=kv, causal=True)
    built = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                        tvm.target.Target({"kind": "llvm", "num-cores": 2}))["main"]
    rng = np.random.default_rng(7)
    qkv = (rng.standard_normal((starts[-1], (heads + 2 * kv) * d)) * 2).astype(np.float32)
    cos, sin = rope_angles(d, 100.0, max_len)
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.full((1, starts[-1], heads * d), np.nan, np.float32), dev)
    built(tvm.runtime.tensor(qkv[None], dev), tvm.runtime.tensor(np.array(starts, np.int32), dev),
          tvm.runtime.tensor(cos, dev), tvm.runtime.tensor(sin, dev), out)
    ref = _attention_reference(qkv, starts, heads, kv, d, cos, sin)
    np.testing.assert_allclose(out.numpy()[0], ref, rtol=1e-4, atol=1e-5)


def test_qwen3_embedding_prompts_as_sentence_transformers(qwen3: Engine, tmp_path: Path
                                                          ) -> None:
    query = qwen3.embed(TEXTS, prompt_name="query").vectors
    assert cosines(query, qwen3_reference(TEXTS, prompt_name="query")).min() >= 0.9999
    assert cosines(query, qwen3.embed(TEXTS).vectors).max() < 0.999  # the prompt counts
    np.testing.assert_allclose(qwen3.embed(TEXTS, prompt_name="document").vectors,
                               qwen3.embed(TEXTS).vectors, atol=1e-6)
    with pytest.raises(InvalidRequestError, match="unknown prompt_name 'passage'") as err:
        qwen3.embed(TEXTS, prompt_name="passage")
    assert err.value.param == "prompt_name"
    # a default prompt name is used when none is given, as sentence-transformers does
    source = build_qwen3_embedding(default_prompt="query")
    with Engine.open(converted(source, "q0f32"), device="cpu") as default:
        vectors = default.embed(TEXTS).vectors
    assert cosines(vectors, qwen3_reference(TEXTS, source)).min() >= 0.9999
    np.testing.assert_allclose(vectors, query, atol=1e-5)


def test_prompts_are_read_and_checked(tmp_path: Path) -> None:
    from localchat.engine.build.pooling import read_prompts
    from localchat.errors import ModelConfigError

    assert read_prompts(tmp_path) == {}
    path = tmp_path / "config_sentence_transformers.json"
    path.write_text(json.dumps({"prompts": {}, "default_prompt_name": None}))
    assert read_prompts(tmp_path) == {}
    path.write_text(json.dumps({"prompts": {"q": "Q: "}, "default_prompt_name": "q"}))
    assert read_prompts(tmp_path) == {"prompts": {"q": "Q: "}, "default_prompt": "q"}
    path.write_text(json.dumps({"prompts": {"q": "Q: "}, "default_prompt_name": "x"}))
    with pytest.raises(ModelConfigError, match="default_prompt_name 'x'"):
        read_prompts(tmp_path)
    path.write_text(json.dumps({"prompts": {"q": 3}}))
    with pytest.raises(ModelConfigError, match="prompts must map names to strings"):
        read_prompts(tmp_path)
