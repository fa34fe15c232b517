"""BlinkDL RWKV-6 ("Finch") `.pth` checkpoints: the folder the converter reads, made from a lone
file (config.json inferred from the tensor shapes, the checkpoint linked in, the World
vocabulary for World-sized models). `rwkv4_pth.prepare_pth_source` is the one entry point for
every version; it sends RWKV-6 files here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from localchat.engine.models import rwkv7_pth
from localchat.errors import UnsupportedModelError, WeightsError

MIXES = 5  # time_maa_w1 holds the LoRA inputs of the w, k, v, r and g mixes side by side


def config_from_checkpoint(path: Path) -> dict[str, Any]:
    """The config.json of a BlinkDL RWKV-6 `.pth`, inferred from its tensor shapes."""
    from localchat.engine.build.weights import open_checkpoint_file

    path = Path(path)
    src = open_checkpoint_file(path)
    names = set(src.names)
    needed = ("emb.weight", "blocks.0.att.time_faaaa", "blocks.0.att.time_maa_w1",
              "blocks.0.att.time_decay_w1")
    missing = [n for n in needed if n not in names]
    if missing:
        raise WeightsError(f"{path.name}: not an RWKV-6 checkpoint (no {', '.join(missing)})")
    layers = 1 + max(int(m.group(1)) for n in names if (m := re.match(r"blocks\.(\d+)\.", n)))
    vocab, hidden = src.get("emb.weight").shape
    heads, head_size = src.get("blocks.0.att.time_faaaa").shape[:2]
    attention = int(src.get("blocks.0.att.key.weight").shape[0])
    if attention != hidden or heads * head_size != hidden:
        raise UnsupportedModelError(
            f"{path.name}: an RWKV-6 checkpoint whose attention width ({attention}, "
            f"{heads} heads of {head_size}) differs from its width {hidden}; localchat runs "
            f"the World models' layout, where they are equal")
    if any(n.endswith(".att.time_state") for n in names):
        raise UnsupportedModelError(f"{path.name}: an RWKV-6 state-tuned checkpoint "
                                    f"(att.time_state); localchat runs plain RWKV-6 files")
    return {
        "architectures": ["Rwkv6ForCausalLM"],
        "model_type": "rwkv6",
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "head_size": int(head_size),
        "num_attention_heads": int(heads),
        "intermediate_size": int(src.get("blocks.0.ffn.key.weight").shape[0]),
        "num_hidden_layers": int(layers),
        "mix_low_rank_dim": int(src.get("blocks.0.att.time_maa_w1").shape[1]) // MIXES,
        "decay_low_rank_dim": int(src.get("blocks.0.att.time_decay_w1").shape[1]),
        "layer_norm_epsilon": 1e-5,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "tie_word_embeddings": False,
    }


def prepare_rwkv6_source(pth: Path, dest: Path) -> Path:
    """Make `dest` a folder the converter reads from the RWKV-6 `pth`. Returns `dest`."""
    pth, dest = Path(pth), Path(dest)
    config = config_from_checkpoint(pth)
    dest.mkdir(parents=True, exist_ok=True)
    rwkv7_pth.link_checkpoint(pth, dest)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    rwkv7_pth.add_world_vocab(pth, dest, config["vocab_size"])
    return dest
