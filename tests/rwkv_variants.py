"""Tiny random RWKV-4 models for oracle tests: saved by transformers (HF layout) and, from the
same weights, as a BlinkDL `.pth` for the `rwkv` package's reference model.

Random initialisation is replaced by values in the ranges trained RWKV-4 models have (decays
spread over several orders of magnitude, mixes in (0, 1), LayerNorm weights near 1), and the
head is a permutation of the embedding so next-token distributions are peaked as in a trained
model (with a purely random head the top-1 is decided by noise-level margins).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from fixtures import cache_dir, one_builder_at_a_time, rwkv_package_dir

WORLD_VOCAB = "rwkv_vocab_v20230424.txt"

BASE: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "attention_hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "context_length": 1024,
    "layer_norm_epsilon": 1e-5,
    "rescale_every": 0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "tie_word_embeddings": False,
}

VARIANTS: dict[str, dict[str, Any]] = {
    "rwkv4": {},
    "rwkv4-rescale": {"rescale_every": 2},
    # the World vocabulary, so the model directory works with the World tokenizer end to end
    "rwkv4-world": {"vocab_size": 65536, "num_hidden_layers": 2},
    # sizes that are not multiples of 32 (tests/test_odd_shapes.py; transformers' RWKV needs
    # attention_hidden_size == hidden_size)
    "rwkv4-odd": {
        "vocab_size": 1001,
        "hidden_size": 72,
        "attention_hidden_size": 72,
        "intermediate_size": 344,
        "num_hidden_layers": 2,  # transformers' RWKV initialisation divides by layers - 1
    },
}

# HF name within a block -> BlinkDL name within a block
_TO_BLINK = {
    "attention.time_mix_key": "att.time_mix_k",
    "attention.time_mix_value": "att.time_mix_v",
    "attention.time_mix_receptance": "att.time_mix_r",
    "attention.": "att.",
    "feed_forward.time_mix_key": "ffn.time_mix_k",
    "feed_forward.time_mix_receptance": "ffn.time_mix_r",
    "feed_forward.": "ffn.",
    "pre_ln.": "ln0.",
}


def _init_like_trained(model, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    with torch.no_grad():
        emb = model.rwkv.embeddings.weight
        emb.copy_(torch.randn(emb.shape, generator=g) * 0.5)
        for i, block in enumerate(model.rwkv.blocks):
            att, ffn = block.attention, block.feed_forward
            a = att.time_decay.shape[0]
            ratio = torch.arange(a, dtype=torch.float32) / max(a - 1, 1)
            # trained decays: -5 .. 3 in log space (w = -exp(decay) from -0.007 to -20)
            att.time_decay.copy_(-5 + 8 * ratio ** (0.7 + 1.3 * i / max(layers - 1, 1)))
            att.time_first.copy_(torch.rand(a, generator=g) * 2 - 0.5)
            for p in (
                att.time_mix_key,
                att.time_mix_value,
                att.time_mix_receptance,
                ffn.time_mix_key,
                ffn.time_mix_receptance,
            ):
                p.copy_(torch.rand(p.shape, generator=g))
            for lin, gain in (
                (att.key, 1.0),
                (att.value, 1.0),
                (att.receptance, 1.0),
                (att.output, 0.5),
                (ffn.key, 1.0),
                (ffn.receptance, 1.0),
                (ffn.value, 0.5),
            ):
                fan_in = lin.weight.shape[1]
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * gain / fan_in**0.5)
            lns = [block.ln1, block.ln2] + ([block.pre_ln] if i == 0 else [])
            for ln in lns:
                ln.weight.copy_(1 + 0.2 * torch.randn(h, generator=g))
                ln.bias.copy_(0.1 * torch.randn(h, generator=g))
        model.rwkv.ln_out.weight.copy_(1 + 0.2 * torch.randn(h, generator=g))
        model.rwkv.ln_out.bias.copy_(0.1 * torch.randn(h, generator=g))
        # head row perm[i] = embedding row i: token i predicts perm[i], so greedy runs walk
        # through the vocabulary instead of repeating one token
        perm = torch.randperm(cfg.vocab_size, generator=g)
        model.head.weight[perm] = model.rwkv.embeddings.weight


@one_builder_at_a_time
def build_variant(name: str) -> Path:
    """Save a random RWKV-4 of variant `name` (seeded, so stable across runs) and return it.

    The folder holds config.json + model.safetensors (HF layout), the World vocabulary (for the
    65536-token variant) and, in
    `blink/`, the same weights as a BlinkDL `.pth` (`blink/model.pth`).
    """
    import torch
    import transformers

    kwargs = {**BASE, **VARIANTS[name]}
    digest = hashlib.sha256(
        json.dumps(
            [kwargs, transformers.__version__, torch.__version__, "init-v3"], sort_keys=True
        ).encode()
    ).hexdigest()[:10]
    out = cache_dir() / "variants" / f"{name}-{digest}"
    if (out / "config.json").exists():
        return out
    config = transformers.RwkvConfig(**kwargs)
    torch.manual_seed(1234)
    model = transformers.RwkvForCausalLM(config).eval()
    _init_like_trained(model, 1234)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}-"))
    model.save_pretrained(tmp)
    if config.vocab_size == 65536:
        shutil.copy2(rwkv_package_dir() / "rwkv" / WORLD_VOCAB, tmp / WORLD_VOCAB)
    (tmp / "blink").mkdir()
    torch.save(to_blink_state_dict(model), tmp / "blink" / "model.pth")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def to_blink_state_dict(model) -> dict:
    """The model's weights under BlinkDL names (as RWKV-4 .pth checkpoints hold them)."""
    out = {}
    for name, value in model.state_dict().items():
        if name.startswith("rwkv.embeddings."):
            key = "emb." + name[len("rwkv.embeddings.") :]
        elif name.startswith("rwkv.ln_out."):
            key = name[len("rwkv.") :]
        elif name.startswith("rwkv.blocks."):
            key = name[len("rwkv.") :]
            for hf, blink in _TO_BLINK.items():
                key = key.replace(hf, blink)
        else:
            key = name
        out[key] = value.detach().clone().contiguous()
    return out
