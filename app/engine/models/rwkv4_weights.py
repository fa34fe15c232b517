"""RWKV-4 weight names: our parameters from an HF (`rwkv.blocks.N.attention.*`) or a BlinkDL
`.pth` (`blocks.N.att.*`) checkpoint, with the conversion-time transforms (pre-LayerNorm folded
into the embeddings, time_decay stored as -exp(time_decay), rescale_every applied)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from localchat.engine.models.rwkv4 import Rwkv4Config

# our name within a block -> (HF name, BlinkDL name) within a block
_BLOCK_NAMES = {
    "ln1.weight": ("ln1.weight", "ln1.weight"),
    "ln1.bias": ("ln1.bias", "ln1.bias"),
    "ln2.weight": ("ln2.weight", "ln2.weight"),
    "ln2.bias": ("ln2.bias", "ln2.bias"),
    "att.time_decay": ("attention.time_decay", "att.time_decay"),
    "att.time_first": ("attention.time_first", "att.time_first"),
    "att.time_mix_k": ("attention.time_mix_key", "att.time_mix_k"),
    "att.time_mix_v": ("attention.time_mix_value", "att.time_mix_v"),
    "att.time_mix_r": ("attention.time_mix_receptance", "att.time_mix_r"),
    "att.key.weight": ("attention.key.weight", "att.key.weight"),
    "att.value.weight": ("attention.value.weight", "att.value.weight"),
    "att.receptance.weight": ("attention.receptance.weight", "att.receptance.weight"),
    "att.output.weight": ("attention.output.weight", "att.output.weight"),
    "ffn.time_mix_k": ("feed_forward.time_mix_key", "ffn.time_mix_k"),
    "ffn.time_mix_r": ("feed_forward.time_mix_receptance", "ffn.time_mix_r"),
    "ffn.key.weight": ("feed_forward.key.weight", "ffn.key.weight"),
    "ffn.receptance.weight": ("feed_forward.receptance.weight", "ffn.receptance.weight"),
    "ffn.value.weight": ("feed_forward.value.weight", "ffn.value.weight"),
}
_TOP_NAMES = {
    "emb": ("rwkv.embeddings.weight", "emb.weight"),
    "pre_ln.weight": ("rwkv.blocks.0.pre_ln.weight", "blocks.0.ln0.weight"),
    "pre_ln.bias": ("rwkv.blocks.0.pre_ln.bias", "blocks.0.ln0.bias"),
    "ln_out.weight": ("rwkv.ln_out.weight", "ln_out.weight"),
    "ln_out.bias": ("rwkv.ln_out.bias", "ln_out.bias"),
    "head.weight": ("head.weight", "head.weight"),
}


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return ((x - mu) / np.sqrt(var + eps) * w.astype(np.float64) + b.astype(np.float64)).astype(
        np.float32
    )


def hf_params(
    cfg: Rwkv4Config, get: Callable[[str], np.ndarray], names: set[str]
) -> Iterator[tuple[str, np.ndarray]]:
    """Our float parameters, by our names, from an HF or a BlinkDL checkpoint."""
    blink = "emb.weight" in names
    col = 1 if blink else 0

    def top(key: str) -> np.ndarray:
        return np.asarray(get(_TOP_NAMES[key][col]), dtype=np.float32)

    emb = top("emb")
    eps = cfg.layer_norm_epsilon
    yield "embeddings.weight", _layer_norm(emb, top("pre_ln.weight"), top("pre_ln.bias"), eps)
    every = cfg.rescale_every
    for i in range(cfg.num_hidden_layers):
        prefix = f"blocks.{i}." if blink else f"rwkv.blocks.{i}."
        for ours, pair in _BLOCK_NAMES.items():
            value = np.asarray(get(prefix + pair[col]), dtype=np.float32)
            if ours.startswith("att.time_") or ours.startswith("ffn.time_"):
                value = value.reshape(-1)
            if ours == "att.time_decay":
                value = -np.exp(value)
            if every > 0 and ours in ("att.output.weight", "ffn.value.weight"):
                value = value / np.float32(2 ** (i // every))
            yield f"blocks.{i}.{ours}", value
    yield "ln_out.weight", top("ln_out.weight")
    yield "ln_out.bias", top("ln_out.bias")
    if _TOP_NAMES["head.weight"][col] in names:
        yield "head.weight", top("head.weight")
    else:  # a tied head is the raw embedding (ours has the pre-LayerNorm folded in)
        yield "head.weight", emb
