"""Tiny random RWKV-6 ("Finch") checkpoints in BlinkDL's `.pth` layout (bfloat16, as published),
and the `rwkv` package's generic reference model (`RWKV`, which runs v6 files as `att_*_v6_0`,
cpu fp32) run on them in a subprocess.

The subprocess keeps the reference away from the module-level switch of `rwkv.model`
(`RWKV_V7_ON=1` makes its `RWKV` the RWKV-7 class) that the RWKV-7 tests and `localchat debug`
flip in-process. Values are drawn in the ranges trained RWKV-6 models have, so every term of
the time-mix matters: decays from slow (w ~ 0.998) to fast, mix and decay LoRAs that move the
interpolations and decays by O(1), a bonus u of both signs, mixes in (0, 1), LayerNorm weights
near 1. The head is a permutation of the embedding so next-token distributions are peaked as in
a trained model.
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

# One shape for every test, so the file compiles few libraries: the World vocabulary's size (the
# World tokenizer and template work end to end) over odd-ish small dimensions.
BASE: dict[str, Any] = {
    "vocab_size": 65536,
    "hidden_size": 96,
    "head_size": 32,  # 3 heads
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "mix_low_rank_dim": 16,
    "decay_low_rank_dim": 24,
}

VARIANTS: dict[str, dict[str, Any]] = {
    "rwkv6-world": {},
}


def _state_dict(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    c, hs, f = cfg["hidden_size"], cfg["head_size"], cfg["intermediate_size"]
    heads, layers, vocab = c // hs, cfg["num_hidden_layers"], cfg["vocab_size"]
    d_mix, d_decay = cfg["mix_low_rank_dim"], cfg["decay_low_rank_dim"]

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
        for m in ("x", "w", "k", "v", "r", "g"):
            sd[att + "time_maa_" + m] = rand(1, 1, c)
        sd[att + "time_maa_w1"] = randn(c, 5 * d_mix, scale=2.0 / c**0.5)
        sd[att + "time_maa_w2"] = randn(5, d_mix, c, scale=0.6 / d_mix**0.5)
        ratio = torch.arange(c, dtype=torch.float32) / (c - 1)
        # trained decays: time_decay from -6 (w ~ 0.998, slow) to 0.5 (w ~ 0.19, fast)
        sd[att + "time_decay"] = (-6 + 6.5 * ratio ** (0.7 + i / max(layers - 1, 1)) +
                                  randn(c, scale=0.3)).reshape(1, 1, c)
        sd[att + "time_decay_w1"] = randn(c, d_decay, scale=1.5 / c**0.5)
        sd[att + "time_decay_w2"] = randn(d_decay, c, scale=1.5 / d_decay**0.5)
        sd[att + "time_faaaa"] = randn(heads, hs, scale=0.6) + 0.3
        for lin in ("receptance", "key", "value", "gate", "output"):
            sd[att + lin + ".weight"] = randn(c, c, scale=1.0 / c**0.5)
        sd[att + "ln_x.weight"] = ((1 + i) / layers) ** 0.7 + randn(c, scale=0.1)
        sd[att + "ln_x.bias"] = randn(c, scale=0.05)
        ffn = p + "ffn."
        sd[ffn + "time_maa_k"] = rand(1, 1, c)
        sd[ffn + "time_maa_r"] = rand(1, 1, c)
        sd[ffn + "key.weight"] = randn(f, c, scale=1.0 / c**0.5)
        sd[ffn + "receptance.weight"] = randn(c, c, scale=1.0 / c**0.5)
        sd[ffn + "value.weight"] = randn(c, f, scale=0.7 / f**0.5)
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
    """The folder holding `model.pth`, a tiny random RWKV-6 of variant `name` (seeded, so stable
    across runs)."""
    import torch

    cfg = {**BASE, **VARIANTS[name]}
    digest = hashlib.sha256(json.dumps([cfg, torch.__version__, "rwkv6-v1"],
                                       sort_keys=True).encode()).hexdigest()[:10]
    out = cache_dir() / "variants" / f"{name}-{digest}"
    if (out / "model.pth").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}-"))
    torch.save(_state_dict(cfg, 6), tmp / "model.pth")
    tmp.rename(out)
    return out


_REFERENCE = r"""
import json, sys
import numpy as np, torch
import torch.nn.functional as F
from rwkv.model import RWKV
pth, prompt, steps, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
model = RWKV(model=pth, strategy="cpu fp32", verbose=False)
assert model.version == 6, model.version
# it folds blocks.0.ln0 into the embedding in the file's dtype (bfloat16 here, a rounding of its
# own: its RWKV_x070 does it in float32); localchat folds in float32, so do that here too
w = torch.load(pth, map_location="cpu")
model.w["emb.weight"] = F.layer_norm(w["emb.weight"].float(), (w["emb.weight"].shape[1],),
                                     weight=w["blocks.0.ln0.weight"].float(),
                                     bias=w["blocks.0.ln0.bias"].float())
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
    """The `rwkv` package's RWKV-6 (generic `RWKV`, cpu fp32) greedy continuation of `prompt`
    (state carried between calls) and the logits before each generated token; cached."""
    key = hashlib.sha256(json.dumps([str(pth), prompt, steps]).encode()).hexdigest()[:12]
    out = pth.parent / f"ref-{key}.npz"
    if not out.exists():
        env = {k: v for k, v in os.environ.items() if k != "RWKV_V7_ON"}
        env.update({"RWKV_JIT_ON": "0", "RWKV_CUDA_ON": "0",
                    "PYTHONPATH": str(rwkv_package_dir())})
        tmp = out.with_suffix(".part.npz")
        subprocess.run([sys.executable, "-c", _REFERENCE, str(pth), json.dumps(prompt),
                        str(steps), str(tmp)], env=env, check=True, capture_output=True)
        tmp.rename(out)
    data = np.load(out)
    return [int(t) for t in data["tokens"]], data["logits"]
