"""Tiny random BERT-family embedding models, saved by sentence-transformers, for oracle tests.

Each is a transformers `BertModel` or `NomicBertModel` of odd sizes (hidden 36, 3 heads, 2
layers, intermediate 50) with a WordPiece tokenizer trained here on a few sentences, wrapped as
`SentenceTransformer(modules=[Transformer, Pooling, Normalize])` and saved: the same folder is
what localchat converts and what `SentenceTransformer(folder).encode` reads as the oracle.
Built once into the test cache (seeded, so stable across runs).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from fixtures import cache_dir, one_builder_at_a_time

SHAPE = {"hidden_size": 36, "num_attention_heads": 3, "num_hidden_layers": 2,
         "intermediate_size": 50, "max_position_embeddings": 64}
MAX_SEQ_LENGTH = 40  # sentence-transformers truncates here (below the 64 positions)
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, embeddings are vectors of numbers",
    "a small test sentence for a tiny encoder model",
    "localchat runs language models on the cpu with tvm",
    "search engines compare the cosine of two vectors",
]
# name -> (transformers model class, pooling mode)
ENCODERS = {
    "bert-mean": ("BertModel", "mean"),
    "bert-cls": ("BertModel", "cls"),
    "nomic-mean": ("NomicBertModel", "mean"),
    "nomic-cls": ("NomicBertModel", "cls"),
}


def _tokenizer():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(SENTENCES * 3,
                            trainers.WordPieceTrainer(vocab_size=150, special_tokens=special))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


@one_builder_at_a_time
def build_encoder(name: str) -> Path:
    """The sentence-transformers folder of encoder `name` (see ENCODERS), built once."""
    import sentence_transformers
    import torch
    import transformers

    cls_name, pooling = ENCODERS[name]
    digest = hashlib.sha256(json.dumps(
        [cls_name, pooling, SHAPE, MAX_SEQ_LENGTH, SENTENCES, transformers.__version__,
         sentence_transformers.__version__], sort_keys=True).encode()).hexdigest()[:10]
    out = cache_dir() / "encoders" / f"{name}-{digest}"
    if (out / "modules.json").exists():
        return out
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as st_models

    tokenizer = _tokenizer()
    config_cls = getattr(transformers, cls_name.replace("Model", "Config"))
    config = config_cls(vocab_size=len(tokenizer), **SHAPE)
    torch.manual_seed(1234)
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():  # LayerNorms away from (1, 0), so a wrong one shows
        for pname, param in model.named_parameters():
            if "norm" in pname.lower():
                param.add_(torch.randn_like(param) * 0.2)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}-"))
    model.save_pretrained(tmp / "hf")
    tokenizer.save_pretrained(tmp / "hf")
    st = SentenceTransformer(modules=[
        st_models.Transformer(str(tmp / "hf"), max_seq_length=MAX_SEQ_LENGTH),
        st_models.Pooling(SHAPE["hidden_size"], pooling),
        st_models.Normalize(),
    ], device="cpu")
    st.save(str(tmp / "st"))
    if out.exists():
        shutil.rmtree(out)
    (tmp / "st").rename(out)
    shutil.rmtree(tmp, ignore_errors=True)
    return out


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


@one_builder_at_a_time
def tiny_chat_model() -> Path:
    """A tiny random chat model (llama_variants' llama-gqa with this module's tokenizer and a
    one-line chat template): what the embedding routes must refuse."""
    from llama_variants import build_variant

    source = build_variant("llama-gqa")
    out = cache_dir() / "encoders" / f"chat-{source.name}"
    if (out / "chat_template.jinja").exists():
        return out
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".chat-"))
    for f in source.iterdir():
        shutil.copy2(f, tmp / f.name)
    _tokenizer().save_pretrained(tmp)
    (tmp / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


# -- Qwen3-Embedding: a decoder pooled at its last token ---------------------------------------
# Odd sizes as the real models have them: head_dim given apart from hidden / heads (22, not a
# multiple of the vector width), grouped key/value heads (4 query heads share 2), and a small
# rope theta so that positions really rotate within a few tokens.
QWEN3_SHAPE = {"hidden_size": 72, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 22, "num_hidden_layers": 2, "intermediate_size": 50,
               "max_position_embeddings": 64, "rope_theta": 100.0, "rms_norm_eps": 1e-6,
               "tie_word_embeddings": True}
QWEN3_EOS = "<|endoftext|>"
QWEN3_PROMPTS = {"query": "Instruct: find the matching sentence\nQuery:", "document": ""}


def _qwen3_tokenizer():
    """A byte-level BPE trained on SENTENCES whose post-processor appends the end-of-text token
    (as Qwen3-Embedding's does: the token its last-token pooling reads), padding on the left."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES * 3, trainers.BpeTrainer(
        vocab_size=320, special_tokens=[QWEN3_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    eos = tok.token_to_id(QWEN3_EOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {QWEN3_EOS}", pair=f"$A {QWEN3_EOS} $B:1 {QWEN3_EOS}:1",
        special_tokens=[(QWEN3_EOS, eos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=QWEN3_EOS,
                                   pad_token=QWEN3_EOS, padding_side="left")


@one_builder_at_a_time
def build_qwen3_embedding(default_prompt: str | None = None) -> Path:
    """A tiny random Qwen3-Embedding saved by sentence-transformers (Transformer, last-token
    Pooling, Normalize; the `QWEN3_PROMPTS`, `default_prompt` their default), built once. Like
    the hub repos, its config.json says Qwen3ForCausalLM and its weights are the bare
    Qwen3Model's (no `model.` prefix, no LM head)."""
    import sentence_transformers
    import torch
    import transformers

    digest = hashlib.sha256(json.dumps(
        [QWEN3_SHAPE, MAX_SEQ_LENGTH, SENTENCES, QWEN3_PROMPTS, default_prompt,
         transformers.__version__, sentence_transformers.__version__],
        sort_keys=True).encode()).hexdigest()[:10]
    name = "qwen3-embedding" + (f"-{default_prompt}" if default_prompt else "")
    out = cache_dir() / "encoders" / f"{name}-{digest}"
    if (out / "modules.json").exists():
        return out
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as st_models

    tokenizer = _qwen3_tokenizer()
    config = transformers.Qwen3Config(vocab_size=len(tokenizer), **QWEN3_SHAPE,
                                      eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(4321)
    model = transformers.Qwen3Model(config).eval()
    with torch.no_grad():  # norms away from 1, so a wrong or missing one shows
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.add_(torch.randn_like(param) * 0.2)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}-"))
    model.save_pretrained(tmp / "hf")
    tokenizer.save_pretrained(tmp / "hf")
    st = SentenceTransformer(modules=[
        st_models.Transformer(str(tmp / "hf"), max_seq_length=MAX_SEQ_LENGTH),
        st_models.Pooling(QWEN3_SHAPE["hidden_size"], "lasttoken"),
        st_models.Normalize(),
    ], device="cpu", prompts=QWEN3_PROMPTS, default_prompt_name=default_prompt)
    st.save(str(tmp / "st"))
    # the hub repos' config.json names the causal LM, though the weights are the bare model's
    hf_config = json.loads((tmp / "st" / "config.json").read_text())
    hf_config["architectures"] = ["Qwen3ForCausalLM"]
    (tmp / "st" / "config.json").write_text(json.dumps(hf_config, indent=2))
    if out.exists():
        shutil.rmtree(out)
    (tmp / "st").rename(out)
    shutil.rmtree(tmp, ignore_errors=True)
    return out
