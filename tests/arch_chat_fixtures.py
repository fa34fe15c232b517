"""The odd-shaped tiny models of each dense architecture (tests/llama_variants.py, the very
weights and compiled libraries of tests/test_odd_shapes.py) made chat models: the same weights
and config with a tiny byte-level BPE tokenizer and Qwen3's real chat template (tools and think
blocks), converted to q0f32 in the test cache.

The windows are small (128 tokens on Phi-3, whose window is its original context; 512 on the
others), and Qwen3's tool prompt is 600 characters of instructions: the tokenizer is trained on
the rendered prompts themselves, without splitting at spaces, so that its merges span whole
phrases and a prompt with a tool takes a few dozen tokens. Its 1001 tokens are the models'
vocabulary; the chat tokens are its last ids.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from reasoning_fixtures import TEMPLATE_FILE, _corpus

from fixtures import _engine_digest, cache_dir, one_builder_at_a_time
from llama_variants import build_variant

ARCHS = ["qwen3-odd", "gemma2-odd", "gemma3-odd", "olmo2-odd", "smollm3-odd", "phi3-odd"]
VOCAB = 1001
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TAGS = ["<think>", "</think>"]
TOOL = {"type": "function", "function": {
    "name": "pick", "description": "Pick a side.",
    "parameters": {"type": "object", "properties": {"side": {"type": "string",
                                                             "enum": ["left", "right"]}},
                   "required": ["side"]}}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
SYSTEM = "You are a careful assistant. Answer briefly."
# a system prompt long enough for the prefix cache (which reuses 64 tokens or more) that a
# prompt with it still fits Phi-3's 128 tokens with its reply
LONG_SYSTEM = " ".join(_corpus()[700:705])
QUESTIONS = ["hello", "Which side? Pick one.", "ka lo mi su", "Is it yes or no?"]


def _prompts() -> list[str]:
    """The texts the tests render: Qwen3's template over our messages, with and without the
    tool, with the reply formats the server's grammars write."""
    from localchat.engine.templates import JinjaTemplate

    template = JinjaTemplate(TEMPLATE_FILE.read_text(encoding="utf-8"))
    texts = []
    for question in QUESTIONS:
        for system in ([], [{"role": "system", "content": SYSTEM}]):
            messages = [*system, {"role": "user", "content": question}]
            texts.append(template.render(messages, tools=[TOOL]))
            texts.append(template.render(messages))
    texts += ['<tool_call>\n{"name": "pick", "arguments": {"side": "left"}}\n</tool_call>',
              '{"answer": "yes"}', '{"answer": "no"}']
    return texts


@one_builder_at_a_time
def chat_tokenizer_json() -> str:
    """The tokenizer (its tokenizer.json text), trained once into the test cache."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    prompts = _prompts()
    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:10]
    path = cache_dir() / f"arch-chat-tokenizer-{digest}.json"
    if path.exists():
        return path.read_text(encoding="utf-8")
    tok = Tokenizer(models.BPE())
    # no split at spaces: merges may join words, so the template's fixed text compresses
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    base = VOCAB - len(SPECIALS) - len(THINK_TAGS)
    trainer = trainers.BpeTrainer(vocab_size=base, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    words = _corpus()[:600]  # some pseudo-words, for replies that are not the prompts
    # the chat tokens are added after training: kept out of the merges
    plain = []
    for text in prompts:
        for tag in SPECIALS + THINK_TAGS:
            text = text.replace(tag, "\n")
        plain.append(text)
    tok.train_from_iterator(plain * 40 + words, trainer)
    if tok.get_vocab_size() != base:
        raise RuntimeError(f"the BPE vocabulary has {tok.get_vocab_size()} tokens, not {base}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TAGS])
    assert tok.get_vocab_size() == VOCAB
    text = tok.to_str()
    tmp = path.with_suffix(".part")
    tmp.write_text(text, encoding="utf-8")
    tmp.rename(path)
    return text


@one_builder_at_a_time
def chat_source(arch: str) -> Path:
    """The HF folder: `arch`'s odd variant (its weights linked) with the chat tokenizer and
    Qwen3's template; config.json unchanged but for the end-of-turn token."""
    from tokenizers import Tokenizer

    variant = build_variant(arch)
    text = chat_tokenizer_json()
    template = TEMPLATE_FILE.read_text(encoding="utf-8")
    digest = hashlib.sha256((text + template + variant.name).encode()).hexdigest()[:10]
    out = cache_dir() / "variants" / f"chat-{arch}-{digest}"
    if (out / "config.json").exists():
        return out
    im_end = Tokenizer.from_str(text).token_to_id("<|im_end|>")
    return write_chat_folder(variant, out, text, template, "<|im_end|>", im_end)


def write_chat_folder(variant: Path, out: Path, tokenizer_json: str, template: str,
                      eos_token: str, eos_ids: int | list[int]) -> Path:
    """`out`: an HF folder of `variant`'s config (its end-of-turn ids `eos_ids`) and weights
    (linked) with a tokenizer.json and a chat template, written aside and then renamed."""
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    config: dict[str, Any] = json.loads((variant / "config.json").read_text())
    config["eos_token_id"] = eos_ids
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "model.safetensors").symlink_to(variant / "model.safetensors")
    (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template, "eos_token": eos_token, "pad_token": "<|endoftext|>",
        "bos_token": None, "model_max_length": 512}, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


@one_builder_at_a_time
def chat_model(arch: str) -> Path:
    """`arch`'s chat model at q0f32 with its library in place (the odd-shapes test's library:
    the model config is the same, so the compiled library is shared through the cache)."""
    from localchat.engine.build.convert import convert_model

    src = chat_source(arch)
    out = cache_dir() / "converted" / f"{src.name}-q0f32-{_engine_digest()}"
    if not (out / "localchat-config.json").exists():
        convert_model(src, out, "q0f32", compile_for="cpu")
    return out
