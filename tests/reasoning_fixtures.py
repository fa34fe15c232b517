"""A tiny Qwen3 reasoning model for tests: the qwen3-odd random weights with a byte-level BPE
tokenizer trained here and Qwen3's chat template (tests/qwen3_chat_template.jinja, the text of
Qwen3's published tokenizer_config), converted to q0f32 in the test cache.

Two tokenizers: "ids" has `<think>` and `</think>` as single added tokens (as Qwen3's vocabulary
does), "text" has no such tokens, so the tags are spelled by several byte-level pieces. A random
model writes a think block only when made to: the engine tests constrain its reply with a Lark
grammar (the structured-output machinery), e.g. `<think>` thinking `</think>` answer. For the
front ends, whose clients cannot send a grammar (Ollama, the terminal UI), the "chain" model
has its weights set so that each token of CHAIN is followed by the next whatever the context
(attention off, the MLP a lookup from a token to the next one's embedding): its greedy reply to
any chat prompt is `<think>ka lo</think>mi su`.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import tempfile
from pathlib import Path

from fixtures import cache_dir, converted, one_builder_at_a_time
from llama_variants import build_variant

TEMPLATE_FILE = Path(__file__).with_name("qwen3_chat_template.jinja")
VOCAB = 1001  # qwen3-odd's vocabulary
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TAGS = ["<think>", "</think>"]
FILLERS = ["<|fill_0|>", "<|fill_1|>"]  # the text tokenizer's stand-ins for the tags' ids


def _corpus() -> list[str]:
    """Seeded pseudo-words and chat-ish lines: enough for a few hundred BPE merges."""
    rng = random.Random(7)
    sylls = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "be", "du", "th", "in", "er", "an"]
    lines = []
    for _ in range(3000):
        words = ["".join(rng.choice(sylls) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(3, 12))]
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ",", ""]))
    lines += ["user", "assistant", "system", "Hello there", "The answer is yes."] * 20
    return lines


def _tokenizer_json(by_id: bool) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    extra = THINK_TAGS if by_id else FILLERS
    base = VOCAB - len(SPECIALS) - len(extra)
    trainer = trainers.BpeTrainer(vocab_size=base, initial_alphabet=pre_tokenizers.ByteLevel
                                  .alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    if tok.get_vocab_size() != base:
        raise RuntimeError(f"the BPE vocabulary has {tok.get_vocab_size()} tokens, not {base}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    if by_id:  # Qwen3's tags are added tokens that are not "special" (decode keeps them)
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TAGS])
    else:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in FILLERS])
    assert tok.get_vocab_size() == VOCAB
    return tok.to_str()


# The chain model's reply: each token is followed by the next (the prompt ends with "\n").
CHAIN = ["\n", "<think>", "ka", " lo", "</think>", "mi", " su", "<|im_end|>"]
CHAIN_THINKING, CHAIN_ANSWER = "ka lo", "mi su"


def _chain_weights(src: Path, dst: Path, tok: object) -> None:
    """qwen3-odd's weights made into a lookup from each CHAIN token to the next one."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    w = load_file(str(src))
    ids = []
    for piece in CHAIN:
        found = tok.encode(piece).ids  # type: ignore[attr-defined]
        assert len(found) == 1, (piece, found)
        ids.append(found[0])
    emb = w["model.embed_tokens.weight"].astype(np.float64)
    w["model.layers.0.self_attn.o_proj.weight"][:] = 0  # the context does not matter
    for name in ("gate_proj", "up_proj", "down_proj"):
        w[f"model.layers.0.mlp.{name}.weight"][:] = 0
    gate, up = w["model.layers.0.mlp.gate_proj.weight"], w["model.layers.0.mlp.up_proj.weight"]
    down = w["model.layers.0.mlp.down_proj.weight"]
    for unit, (this, after) in enumerate(zip(ids, ids[1:], strict=False)):
        key = emb[this] / np.linalg.norm(emb[this])
        gate[unit] = 4.0 * key  # fires (silu(x) ~ x) only for this token's normalized embedding
        up[unit] = 4.0 * key
        down[:, unit] = emb[after] / np.linalg.norm(emb[after]) * 0.5
    w["model.norm.weight"] *= 50.0  # peaked: the chain holds under sampling too
    save_file(w, str(dst))


@one_builder_at_a_time
def qwen3_think_source(by_id: bool = True, chain: bool = False) -> Path:
    """The HF folder of the tiny Qwen3 reasoning model (built once into the test cache)."""
    text = _tokenizer_json(by_id)
    template = TEMPLATE_FILE.read_text(encoding="utf-8")
    variant = build_variant("qwen3-odd")
    kind = ("ids" if by_id else "text") + ("-chain" if chain else "")
    digest = hashlib.sha256((text + template + variant.name + kind + "2").encode()
                            ).hexdigest()[:10]
    out = cache_dir() / "variants" / f"qwen3-think-{kind}-{digest}"
    if (out / "config.json").exists():
        return out
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(text)
    im_end = tok.token_to_id("<|im_end|>")
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".qwen3-think-"))
    config = json.loads((variant / "config.json").read_text())
    config["eos_token_id"] = im_end
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if chain:
        _chain_weights(variant / "model.safetensors", tmp / "model.safetensors", tok)
    else:
        shutil.copy2(variant / "model.safetensors", tmp / "model.safetensors")
    (tmp / "tokenizer.json").write_text(text)
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "model_max_length": 512}, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": im_end}))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


@one_builder_at_a_time
def qwen3_think_model(by_id: bool = True, chain: bool = False) -> Path:
    """The tiny Qwen3 reasoning model converted to q0f32 (its library compiled once)."""
    return converted(qwen3_think_source(by_id, chain), "q0f32")


def think_grammar(thinking: str = r"/[a-z]{2,6}( [a-z]{2,6}){1,3}/",
                  answer: str = r"/[a-z]{2,6}( [a-z]{2,6}){0,2}/", *, open_tag: bool = True,
                  by_id: bool = True, ids: tuple[int, int] | None = None) -> dict:
    """A Lark response format forcing `<think>` thinking `</think>` answer (the tags as their
    token ids when `ids` are given, else as text); open_tag False: the prompt opened it."""
    if ids is not None:
        open_t, close_t = f"<[{ids[0]}]>", f"<[{ids[1]}]>"
    else:
        open_t, close_t = '"<think>"', '"</think>"'
    head = f"{open_t} " if open_tag else ""
    return {"type": "grammar", "grammar": f"start: {head}{thinking} {close_t} {answer}\n"}
