"""Tiny random RWKV-7 checkpoints in BlinkDL's `.pth` layout (bfloat16, as published), and the
`rwkv` package's reference model (`RWKV_x070`, cpu fp32) run on them in a subprocess.

Values are drawn in the ranges trained RWKV-7 models have, so every term of the time-mix
matters: decays w0 spread from slow to fast, non-zero LoRAs, mixes in (0, 1), k_k near 0.85,
k_a near 1, v0 near 1 (a real value residual), LayerNorm weights near 1. The head is a
permutation of the embedding so next-token distributions are peaked as in a trained model.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from fixtures import cache_dir, one_builder_at_a_time, rwkv_package_dir

BASE: dict[str, Any] = {
    "vocab_size": 1001,
    "hidden_size": 96,
    "head_size": 32,  # 3 heads
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "decay_low_rank_dim": 24,
    "a_low_rank_dim": 16,
    "v_low_rank_dim": 24,
    "gate_low_rank_dim": 40,
}

VARIANTS: dict[str, dict[str, Any]] = {
    "rwkv7-odd": {},
    # the World vocabulary's size, so the World tokenizer and template work end to end
    "rwkv7-world": {"vocab_size": 65536, "hidden_size": 64, "intermediate_size": 192},
}


def _state_dict(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    c, hs, f = cfg["hidden_size"], cfg["head_size"], cfg["intermediate_size"]
    heads, layers, vocab = c // hs, cfg["num_hidden_layers"], cfg["vocab_size"]

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=g) * scale

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=g)

    sd: dict[str, torch.Tensor] = {"emb.weight": randn(vocab, c, scale=0.5)}
    for i in range(layers):
        p = f"blocks.{i}."
        lns = ("ln0", "ln1", "ln2") if i == 0 else ("ln1", "ln2")
        for ln in lns:
            sd[p + ln + ".weight"] = 1 + randn(c, scale=0.2)
            sd[p + ln + ".bias"] = randn(c, scale=0.1)
        att = p + "att."
        for m in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            sd[att + m] = rand(1, 1, c)
        ratio = torch.arange(c, dtype=torch.float32) / (c - 1)
        # trained decays: w0 from -7 (w ~ 1, slow) to 0 (w ~ 0.74, fast), plus noise
        sd[att + "w0"] = (-7 + 7 * ratio ** (0.85 + i / max(layers - 1, 1)) +
                          randn(c, scale=0.3)).reshape(1, 1, c)
        for name, rank in (("w", cfg["decay_low_rank_dim"]), ("a", cfg["a_low_rank_dim"]),
                           ("v", cfg["v_low_rank_dim"]), ("g", cfg["gate_low_rank_dim"])):
            sd[att + name + "1"] = randn(c, rank, scale=1.0 / c**0.5)
            sd[att + name + "2"] = randn(rank, c, scale=(2.0 if name != "g" else 1.0) / rank**0.5)
        sd[att + "a0"] = randn(1, 1, c, scale=0.5)
        sd[att + "v0"] = 1 + randn(1, 1, c, scale=0.5)  # BlinkDL writes these in layer 0 too
        sd[att + "k_k"] = 0.85 + randn(1, 1, c, scale=0.1)
        sd[att + "k_a"] = 1 + randn(1, 1, c, scale=0.2)
        sd[att + "r_k"] = randn(heads, hs, scale=0.3)
        for lin in ("receptance", "key", "value", "output"):
            sd[att + lin + ".weight"] = randn(c, c, scale=1.0 / c**0.5)
        sd[att + "ln_x.weight"] = ((1 + i) / layers) ** 0.7 + randn(c, scale=0.1)
        sd[att + "ln_x.bias"] = randn(c, scale=0.05)
        ffn = p + "ffn."
        sd[ffn + "x_k"] = rand(1, 1, c)
        sd[ffn + "key.weight"] = randn(f, c, scale=1.0 / c**0.5)
        sd[ffn + "value.weight"] = randn(c, f, scale=0.5 / f**0.5)
    sd["ln_out.weight"] = 1 + randn(c, scale=0.2)
    sd["ln_out.bias"] = randn(c, scale=0.1)
    # head row perm[i] = embedding row i: token i predicts perm[i], so greedy runs walk through
    # the vocabulary instead of repeating one token
    perm = torch.randperm(vocab, generator=g)
    head = torch.empty(vocab, c)
    head[perm] = sd["emb.weight"] * 2
    sd["head.weight"] = head
    return {k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}


@one_builder_at_a_time
def build_variant(name: str) -> Path:
    """The folder holding `model.pth`, a tiny random RWKV-7 of variant `name` (seeded, so stable
    across runs)."""
    import torch

    cfg = {**BASE, **VARIANTS[name]}
    digest = hashlib.sha256(json.dumps([cfg, torch.__version__, "rwkv7-v1"],
                                       sort_keys=True).encode()).hexdigest()[:10]
    out = cache_dir() / "variants" / f"{name}-{digest}"
    if (out / "model.pth").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}-"))
    torch.save(_state_dict(cfg, 7), tmp / "model.pth")
    tmp.rename(out)
    return out


_REFERENCE = r"""
import json, sys
import numpy as np, torch
from rwkv.model import RWKV
pth, prompt, steps, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
model = RWKV(model=pth[:-len(".pth")], strategy="cpu fp32")
with torch.no_grad():
    logits, state = model.forward(list(prompt), None)
    rows, tokens = [logits.numpy().copy()], [int(logits.argmax())]
    for _ in range(steps - 1):
        logits, state = model.forward([tokens[-1]], state)
        rows.append(logits.numpy().copy())
        tokens.append(int(logits.argmax()))
np.savez(out, logits=np.stack(rows), tokens=np.array(tokens))
"""


@one_builder_at_a_time
def reference_greedy(pth: Path, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """The `rwkv` package's RWKV-7 (`RWKV_V7_ON=1`, cpu fp32) greedy continuation of `prompt`
    (state carried between calls) and the logits before each generated token; cached."""
    key = hashlib.sha256(json.dumps([str(pth), prompt, steps]).encode()).hexdigest()[:12]
    out = pth.parent / f"ref-{key}.npz"
    if not out.exists():
        env = {**os.environ, "RWKV_V7_ON": "1", "RWKV_JIT_ON": "0", "RWKV_CUDA_ON": "0",
               "PYTHONPATH": str(rwkv_package_dir())}
        tmp = out.with_suffix(".part.npz")
        subprocess.run([sys.executable, "-c", _REFERENCE, str(pth), json.dumps(prompt),
                        str(steps), str(tmp)], env=env, check=True, capture_output=True)
        tmp.rename(out)
    data = np.load(out)
    return [int(t) for t in data["tokens"]], data["logits"]
