"""Tiny random mixture-of-experts models (Qwen3-MoE, OLMoE, Mixtral), saved by transformers
from its config classes, for the oracle tests of tests/test_engine_moe.py: odd dims (hidden
144, expert width 88: a padded 4-bit group and a GEMV tail), 6 experts, top 2, 2 layers."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from fixtures import cache_dir, one_builder_at_a_time

BASE: dict[str, Any] = {
    "vocab_size": 301,
    "hidden_size": 144,
    "intermediate_size": 88,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 36,
    "max_position_embeddings": 512,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # renormalized top-k; the second layer dense (mlp_only_layers), as Qwen3-MoE allows
    "qwen3-moe": ("Qwen3MoeConfig", {"num_experts": 6, "moe_intermediate_size": 88,
                                     "norm_topk_prob": True, "mlp_only_layers": [1],
                                     "intermediate_size": 120}),
    # q/k norm over the whole projection, top-k probabilities as they are
    "olmoe": ("OlmoeConfig", {"num_experts": 6, "norm_topk_prob": False,
                              "head_dim": None}),  # hidden / heads
    "mixtral": ("MixtralConfig", {"num_local_experts": 6, "sliding_window": None}),
    # gpt-oss: sinks, q/k/v/o biases, a window of 5 (shorter than the tests' sequences) on the
    # first layer, YaRN (transformers' default: factor 32 over 4,096), biased router and
    # experts, clamped SwiGLU (its limit low enough that the clamp bites)
    "gpt-oss": ("GptOssConfig", {"num_local_experts": 6, "sliding_window": 5,
                                 "layer_types": ["sliding_attention", "full_attention"],
                                 "swiglu_limit": 0.5}),
    # the same with the experts' widths multiples of 32, as MXFP4 blocks need (OpenAI's format)
    "gpt-oss-mxfp4": ("GptOssConfig", {"num_local_experts": 6, "sliding_window": 5,
                                       "layer_types": ["sliding_attention", "full_attention"],
                                       "swiglu_limit": 0.5, "hidden_size": 128,
                                       "intermediate_size": 96, "head_dim": 32}),
    # every layer MoE, as llama.cpp's `qwen3moe` files are (GGUF import; not compiled)
    "qwen3-moe-all": ("Qwen3MoeConfig", {"num_experts": 6, "moe_intermediate_size": 88,
                                         "norm_topk_prob": True}),
}


@one_builder_at_a_time
def build_variant(name: str) -> Path:
    """Save the random model of variant `name` (seeded) in the test cache; return its folder."""
    import torch
    import transformers

    cls_name, extra = VARIANTS[name]
    kwargs = {k: v for k, v in {**BASE, **extra}.items() if v is not None}
    digest = hashlib.sha256(json.dumps([cls_name, kwargs, transformers.__version__, "head=perm"],
                                       sort_keys=True).encode()).hexdigest()[:10]
    out = cache_dir() / "variants" / f"{name}-{digest}"
    if (out / "config.json").exists():
        return out
    config = getattr(transformers, cls_name)(**kwargs)
    model_cls = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))
    torch.manual_seed(4321)
    model = model_cls(config).eval()
    with torch.no_grad():
        # the router's weights larger than the initializer's, so experts are chosen by clear
        # margins; the head the embeddings in a shuffled order, so the next token is clearly
        # decided and greedy decoding walks through the vocabulary (the head aligned with the
        # embeddings, as in llama_variants, repeats the last token; a random one repeats one)
        perm = torch.randperm(config.vocab_size)
        model.lm_head.weight.copy_(model.model.embed_tokens.weight[perm] * 4.0)
        for layer in model.model.layers:
            router = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)
            if router is not None and hasattr(router, "weight"):
                router.weight.normal_(0.0, 0.5)
            # gpt-oss initializes its biases to zero and its sinks near it: make them count
            for name, param in layer.named_parameters():
                if name.endswith(("_bias", "router.bias")) or name.endswith("attn.sinks"):
                    param.normal_(0.0, 1.0 if name.endswith("sinks") else 0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}-"))
    model.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def write_gguf_header(writer: Any, cfg: dict[str, Any]) -> None:
    """A GGUF writer's common metadata for a tiny model of config.json `cfg`: the block's
    sizes, rope base and norm epsilon, and a GPT-2 byte-level vocabulary (the 256 byte symbols
    then filler tokens up to vocab_size, no merges; bos 1, eos 2)."""
    from localchat.engine.build import gguf as lg

    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    n = cfg["vocab_size"]
    alphabet = list(lg.bytes_to_unicode().values())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(alphabet[:n] + [f"t{i}" for i in range(n - len(alphabet))])
    writer.add_token_types([1] * n)
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
