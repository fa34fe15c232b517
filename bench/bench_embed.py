"""Embeddings per second: localchat's compiled BERT encoder vs sentence-transformers (torch, CPU).

    python bench/bench_embed.py [--quant q0f32] [--seconds 3] [--threads N] [--keep DIR]

The model has the all-MiniLM-L6-v2 shape (hidden 384, 6 layers, 12 heads, intermediate 1536,
vocabulary 30522, mean pooling, normalized) with random weights; both sides load the very same
folder and tokenizer (a WordPiece trained here), and embed the same texts: batches of 1 and 32,
short (~16 tokens) and long (~128 tokens) texts. Each row is the best of a few timed rounds of
at least `--seconds`; the ratio is ours over sentence-transformers', measured in the same run.
Not a test: it prints a table.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

SHAPE = {"vocab_size": 30522, "hidden_size": 384, "num_hidden_layers": 6,
         "num_attention_heads": 12, "intermediate_size": 1536, "max_position_embeddings": 512}
WORDS = ("model vector search query document local engine token batch kernel matrix cosine "
         "similarity embedding sentence paragraph language machine learning compile library "
         "thread memory cache fast slow quick brown fox jumps over lazy dog river mountain "
         "city music science history").split()


def build_model(root: Path) -> Path:
    """A sentence-transformers folder with the MiniLM shape and random weights."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers import models as st_models
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator([" ".join(WORDS)] * 4,
                            trainers.WordPieceTrainer(vocab_size=400, special_tokens=special))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    torch.manual_seed(0)
    hf = root / "hf"
    BertModel(BertConfig(**SHAPE), add_pooling_layer=False).eval().save_pretrained(hf)
    fast.save_pretrained(hf)
    st = SentenceTransformer(modules=[st_models.Transformer(str(hf), max_seq_length=256),
                                      st_models.Pooling(SHAPE["hidden_size"], "mean"),
                                      st_models.Normalize()], device="cpu")
    st.save(str(root / "st"))
    return root / "st"


def texts(n: int, words: int, seed: int) -> list[str]:
    """`n` texts of `words` words each (one token per word with the tokenizer built here)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def rate(fn, batch: int, seconds: float, rounds: int = 3) -> float:
    """Best texts per second over `rounds` rounds of at least `seconds` each (after a warm-up)."""
    fn()
    best = 0.0
    for _ in range(rounds):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds / rounds:
                break
        best = max(best, calls * batch / elapsed)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quant", default="q0f32")
    ap.add_argument("--seconds", type=float, default=3.0, help="timed seconds per row and side")
    ap.add_argument("--threads", type=int, default=None, help="both sides (default: all cores)")
    ap.add_argument("--keep", type=Path, default=None, help="build the model here and keep it")
    args = ap.parse_args()
    threads = args.threads or os.cpu_count() or 1
    os.environ["LOCALCHAT_NUM_THREADS"] = str(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import numpy as np
    import torch

    torch.set_num_threads(threads)
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-embed-"))
    root.mkdir(parents=True, exist_ok=True)
    st_dir = root / "st" if (root / "st" / "modules.json").exists() else build_model(root)

    from sentence_transformers import SentenceTransformer

    from localchat import Engine
    from localchat.engine.build.convert import convert_model

    out = root / f"localchat-{args.quant}"
    if not (out / "localchat-config.json").exists():
        convert_model(st_dir, out, args.quant)
    ours = Engine.open(out, device="cpu")
    theirs = SentenceTransformer(str(st_dir), device="cpu")

    check = texts(4, 20, 99)
    cos = np.sum(ours.embed(check).vectors * theirs.encode(check), axis=1).min()
    print(f"all-MiniLM-L6-v2 shape, random weights, {args.quant}, {threads} thread(s); "
          f"min cosine to sentence-transformers {cos:.6f}")
    print(f"{'batch':>5} {'tokens':>6} {'localchat /s':>13} {'s-t /s':>9} {'ratio':>6}")
    for batch in (1, 32):
        for words in (14, 126):  # + [CLS] and [SEP]
            items = texts(batch, words, batch * 1000 + words)
            tokens = ours.embed(items[:1]).token_counts[0]
            ours_rate = rate(lambda i=items: ours.embed(i), batch, args.seconds)
            theirs_rate = rate(lambda i=items, b=batch: theirs.encode(i, batch_size=b), batch,
                               args.seconds)
            print(f"{batch:>5} {tokens:>6} {ours_rate:>13.1f} {theirs_rate:>9.1f} "
                  f"{ours_rate / theirs_rate:>5.2f}x", flush=True)
    ours.close()


if __name__ == "__main__":
    sys.exit(main())
