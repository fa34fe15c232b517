"""A gpt-oss chat model for the tool-calling tests: tests/moe_variants.py's tiny random gpt-oss
(its weights linked, so its compiled library is test_engine_gpt_oss.py's) with a byte-level
tokenizer that has OpenAI's harmony markers as special tokens, and a short harmony chat
template that renders tools the way gpt-oss's does (a `functions` namespace in the developer
message; calls as messages to `functions.<name>`; results from `functions.<name>`).

The tokenizer has no merges: each byte is a token (the 256 byte symbols are ids 0-255, then
`<|endoftext|>` and the harmony markers), within the model's 301-token vocabulary.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from arch_chat_fixtures import write_chat_folder
from fixtures import cache_dir, converted, one_builder_at_a_time
from moe_variants import build_variant

VARIANT = "gpt-oss"
SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
            "<|constrain|>", "<|return|>", "<|call|>"]
PICK = {"type": "function", "function": {
    "name": "pick", "description": "Pick a side.",
    "parameters": {"type": "object", "properties": {"side": {"type": "string",
                                                             "enum": ["left", "right"]}},
                   "required": ["side"]}}}
COUNT = {"type": "function", "function": {
    "name": "count", "description": "Count to n.",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                          "maximum": 3}},
                   "required": ["n"]}}}
# gpt-oss's template, cut to what the tests use: tools, user / system turns, the assistant's
# calls and answers, tool results, and the generation prompt `<|start|>assistant`.
TEMPLATE = (
    "{%- if tools %}<|start|>developer<|message|># Tools\nnamespace functions {\n"
    "{%- for t in tools %}\ntype {{ t.function.name }} = (_: "
    "{{ t.function.parameters | tojson }}) => any;{%- endfor %}\n}<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}<|start|>developer<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{%- for c in m.tool_calls %}"
    "<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary json"
    "<|message|>{{ c.function.arguments | tojson }}<|call|>{%- endfor %}"
    "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' %}<|start|>functions.{{ m.name or 'tool' }} to=assistant"
    "<|channel|>commentary<|message|>{{ m.content }}<|end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)


def _tokenizer_json() -> str:
    """The byte-level tokenizer: one token per byte (id = the byte), then the special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from localchat.engine.build.gguf import bytes_to_unicode

    vocab = {symbol: byte for byte, symbol in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok.to_str()


@one_builder_at_a_time
def harmony_chat_source() -> Path:
    """The HF folder: the gpt-oss variant's config and weights, the harmony tokenizer and
    template; its stop tokens harmony's `<|return|>` and `<|call|>`."""
    from tokenizers import Tokenizer

    variant = build_variant(VARIANT)
    text = _tokenizer_json()
    digest = hashlib.sha256((text + TEMPLATE + variant.name).encode()).hexdigest()[:10]
    out = cache_dir() / "variants" / f"harmony-chat-{digest}"
    if (out / "config.json").exists():
        return out
    tok = Tokenizer.from_str(text)
    stops = [tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]
    return write_chat_folder(variant, out, text, TEMPLATE, "<|return|>", stops)


def harmony_chat_model() -> Path:
    """The harmony chat model at q0f32 (its library is test_engine_gpt_oss.py's q0f32 model's:
    the model config is the same)."""
    return converted(harmony_chat_source(), "q0f32")
