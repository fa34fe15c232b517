"""Qwen3-Embedding: the Qwen3 decoder block (`llama`'s, with per-head q/k RMSNorm) run as a text
encoder for embeddings, state "encoder" like `bert`.

The hub repos (Qwen/Qwen3-Embedding-0.6B, -4B, -8B) say `Qwen3ForCausalLM` in config.json and
hold only the decoder (no LM head); what makes them embedding models is their
sentence-transformers files (last-token pooling, Normalize), so convert picks this architecture
for a Qwen3 source that has them (`models.detect_architecture(..., sentence_transformers=True)`).
A bare `Qwen3Model` checkpoint is one too: it has no head to chat with.

The forward is the chat model's over a packed batch of texts: attention is causal within each
text and never crosses texts (`kernels.encoder.packed_attention` with `causal` and grouped
key/value heads), rotary positions restart at 0 in every text, q and k are RMSNorm-ed per head
before rotary, and the final norm ends it. `encode` returns every token's last hidden state;
the runtime (`engine.embedding`) pools the last token (the end-of-text the tokenizer appends)
and normalizes. Parameter names are `llama`'s, so its weight reader serves this model too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.target import Target

from localchat.engine.build.quantization import QuantMode
from localchat.engine.kernels import encoder as kernels
from localchat.engine.models import Architecture, llama, qwen3
from localchat.engine.models.bert import rope_angles
from localchat.engine.models.export import encoder_spec
from localchat.engine.models.layers import BuildContext, Embedding, Linear, RMSNorm
from localchat.errors import ModelConfigError, UnsupportedModelError


def config_from_hf(hf: dict[str, Any]) -> llama.LlamaConfig:
    """A Qwen3 config.json read as the chat model reads it, checked for what the encoder runs
    (plain rotary, no sliding window); an encoder takes whole texts, so its "prefill chunk" is
    the longest text."""
    cfg = qwen3.config_from_hf(hf)
    if cfg.rope_scaling:
        raise UnsupportedModelError(f"Qwen3-Embedding with rope scaling "
                                    f"{cfg.rope_scaling.get('rope_type')!r} is not supported")
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        raise UnsupportedModelError("Qwen3-Embedding with a sliding window is not supported")
    if cfg.head_dim % 2:
        raise UnsupportedModelError(f"rotary positions need an even head_dim, not {cfg.head_dim}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ModelConfigError(f"num_attention_heads {cfg.num_attention_heads} is not a multiple "
                               f"of num_key_value_heads {cfg.num_key_value_heads}")
    cfg.prefill_chunk_size = cfg.context_window_size
    return cfg


def config_from_dict(data: dict[str, Any]) -> llama.LlamaConfig:
    """The config as stored in localchat-config.json."""
    return llama.LlamaConfig.from_dict(data)


class PackedAttention(nn.Module):
    """Qwen3's attention over a packed batch: fused q/k/v, per-head q/k RMSNorm, rotary by the
    position in each text, causal within each text (grouped key/value heads)."""

    def __init__(self, cfg: llama.LlamaConfig, ctx: BuildContext) -> None:
        self.cfg = cfg
        d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.qkv_proj = Linear(cfg.hidden_size, (nq + 2 * nkv) * d, cfg.qkv_bias, ctx)
        self.o_proj = Linear(nq * d, cfg.hidden_size, cfg.o_bias, ctx)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, ctx)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, ctx)

    def forward(self, x: nn.Tensor, starts: nn.Tensor, rope: list[nn.Tensor]) -> nn.Tensor:
        cfg = self.cfg
        d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        b, s, _ = x.shape
        q, k, v = op.split(self.qkv_proj(x), [nq * d, (nq + nkv) * d], axis=-1)
        # each head's d values normalized: rows of a [b, s * heads, d] tensor
        q = op.reshape(self.q_norm(op.reshape(q, (b, s * nq, d))), (b, s, nq * d))
        k = op.reshape(self.k_norm(op.reshape(k, (b, s * nkv, d))), (b, s, nkv * d))
        qkv = op.concat([q, k, v], dim=-1)
        func = kernels.packed_attention(nq, d, cfg.context_window_size, str(x.dtype), True,
                                        kv_heads=nkv, causal=True)
        out = op.tensor_ir_op(func, "packed_attention", args=[qkv, starts, *rope],
                              out=nn.Tensor.placeholder((b, s, nq * d), x.dtype))
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    """Qwen3's pre-norm block: x += attention(norm(x)); x += mlp(norm(x))."""

    def __init__(self, cfg: llama.LlamaConfig, ctx: BuildContext) -> None:
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.self_attn = PackedAttention(cfg, ctx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.mlp = llama.LlamaMLP(cfg, ctx)

    def forward(self, x: nn.Tensor, starts: nn.Tensor, rope: list[nn.Tensor]) -> nn.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), starts, rope)
        return x + self.mlp(self.post_attention_layernorm(x), False)


class DecoderStack(nn.Module):
    """The embeddings, the blocks and the final norm, under `llama`'s parameter names."""

    def __init__(self, cfg: llama.LlamaConfig, ctx: BuildContext) -> None:
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, ctx)
        self.layers = nn.ModuleList([DecoderLayer(cfg, ctx)
                                     for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)


class Qwen3Encoder(nn.Module):
    """The exported encoder: `encode(input_ids [n], positions [n], starts [texts + 1])` -> the
    last hidden state (after the final norm) of every token, float32 [n, hidden]."""

    def __init__(self, cfg: llama.LlamaConfig, mode: QuantMode, target: Target) -> None:
        ctx = BuildContext(mode, target)
        if not ctx.cpu:
            raise UnsupportedModelError("Qwen3-Embedding runs on the CPU only for now")
        if cfg.qk_norm != "head" or cfg.norms != "pre":
            raise UnsupportedModelError("only Qwen3's block (per-head q/k norm, pre-norm) runs "
                                        "as an embedding model")
        self.cfg = cfg
        self.mode = mode
        self.model = DecoderStack(cfg, ctx)
        half = cfg.head_dim // 2
        self.rope_cos = nn.Parameter((cfg.context_window_size, half), "float32")
        self.rope_sin = nn.Parameter((cfg.context_window_size, half), "float32")

    def encode(self, input_ids: nn.Tensor, positions: nn.Tensor, starts: nn.Tensor) -> nn.Tensor:
        # positions are implied by `starts` (rotary restarts per text): the tables are indexed
        # inside the attention kernel; the argument is the encoder spec's, shared with BERT
        n = input_ids.shape[0]
        x = op.reshape(self.model.embed_tokens(input_ids), (1, n, self.cfg.hidden_size))
        rope = [self.rope_cos, self.rope_sin]
        for layer in self.model.layers:
            x = layer(x, starts, rope)
        x = op.reshape(self.model.norm(x), (n, self.cfg.hidden_size))
        return x.astype("float32") if x.dtype != "float32" else x

    def get_default_spec(self) -> nn.spec.ModuleSpec:
        return encoder_spec(self)


def hf_params(cfg: llama.LlamaConfig, get: Callable[[str], np.ndarray],
              names: set[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Our parameters from a Qwen3 checkpoint, with the `model.` prefix (Qwen3ForCausalLM) or
    without (Qwen3Model, as the Qwen3-Embedding repos store it); an LM head, if any, is
    ignored, then the rotary tables."""
    prefix = next((p for p in ("model.", "") if f"{p}embed_tokens.weight" in names), None)
    if prefix is None:
        raise ModelConfigError("the checkpoint has no embed_tokens.weight")

    def fetch(name: str) -> np.ndarray:
        return get(prefix + name.removeprefix("model."))

    # tied: llama's reader then yields no LM head, which an embedding model has no use for
    yield from llama.hf_params(dataclasses.replace(cfg, tie_word_embeddings=True), fetch, names)
    cos, sin = rope_angles(cfg.head_dim, cfg.rope_theta, cfg.context_window_size)
    yield "rope_cos", cos
    yield "rope_sin", sin


def _no_cache(cfg: Any, dtype: str, batch: int, tokens: int) -> int:
    return 0  # an encoder keeps no state between calls


def architecture(name: str) -> Architecture:
    """The registry's view of this module."""
    return Architecture(
        name=name,
        state="encoder",
        config_from_hf=config_from_hf,
        config_from_dict=config_from_dict,
        build=Qwen3Encoder,
        hf_params=hf_params,
        cache_bytes=_no_cache,
    )
