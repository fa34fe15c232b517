"""BlinkDL `.pth` checkpoints: make a folder the converter reads from a lone `.pth` file
(config.json inferred from the tensor shapes, the checkpoint linked in, the World vocabulary for
World-sized models). `prepare_pth_source` is the one entry point for every RWKV version: it
tells the version from the tensor names (`rwkv7_pth.checkpoint_version`), prepares RWKV-4
here, RWKV-6 in `rwkv6_pth` and RWKV-7 in `rwkv7_pth`, and refuses RWKV-5 naming what is
supported. From the shell:

    python -m localchat.engine.models.rwkv4_pth FILE.pth FOLDER [--rescale-every 6]

then `localchat convert FOLDER -o OUT` as for an HF folder.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from localchat.engine.models import rwkv6_pth, rwkv7_pth
from localchat.errors import WeightsError

WORLD_VOCAB = "rwkv_vocab_v20230424.txt"


def config_from_checkpoint(path: Path, rescale_every: int = 6) -> dict[str, Any]:
    """An HF-style config.json for a BlinkDL RWKV-4 `.pth`, inferred from its tensor shapes."""
    from localchat.engine.build.weights import open_checkpoint_file

    src = open_checkpoint_file(Path(path))
    names = src.names
    if "emb.weight" not in names or "blocks.0.att.time_first" not in names:
        rwkv7_pth.refuse_unsupported(rwkv7_pth.checkpoint_version(names), Path(path).name)
        raise WeightsError(f"{Path(path).name}: not an RWKV-4 checkpoint (no emb / att.time_first)")
    rwkv7_pth.refuse_unsupported(rwkv7_pth.checkpoint_version(names), Path(path).name)
    layers = 1 + max(int(m.group(1)) for n in names if (m := re.match(r"blocks\.(\d+)\.", n)))
    vocab, hidden = src.get("emb.weight").shape
    return {
        "architectures": ["RwkvForCausalLM"],
        "model_type": "rwkv",
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "attention_hidden_size": int(src.get("blocks.0.att.key.weight").shape[0]),
        "intermediate_size": int(src.get("blocks.0.ffn.key.weight").shape[0]),
        "num_hidden_layers": int(layers),
        "layer_norm_epsilon": 1e-5,
        "rescale_every": int(rescale_every),
        "bos_token_id": 0,
        "eos_token_id": 0,
        "tie_word_embeddings": False,
    }


def prepare_pth_source(pth: Path, dest: Path, *, rescale_every: int = 6) -> Path:
    """Make `dest` a folder the converter reads from a BlinkDL `.pth` of any supported version:
    config.json inferred from `pth`, the checkpoint (linked, or copied where links are not
    possible) and the World vocabulary (beside the checkpoint, else `rwkv7_pth.world_vocab`'s)
    for a World-sized model, or when it lies next to the checkpoint. Returns `dest`."""
    pth, dest = Path(pth), Path(dest)
    from localchat.engine.build.weights import open_checkpoint_file

    version = rwkv7_pth.checkpoint_version(open_checkpoint_file(pth).names)
    rwkv7_pth.refuse_unsupported(version, pth.name)
    if version == 7:
        return rwkv7_pth.prepare_rwkv7_source(pth, dest)
    if version == 6:
        return rwkv6_pth.prepare_rwkv6_source(pth, dest)
    config = config_from_checkpoint(pth, rescale_every)
    dest.mkdir(parents=True, exist_ok=True)
    rwkv7_pth.link_checkpoint(pth, dest)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    vocab = pth.parent / WORLD_VOCAB
    if vocab.exists() and not (dest / WORLD_VOCAB).exists():
        shutil.copy2(vocab, dest / WORLD_VOCAB)
    rwkv7_pth.add_world_vocab(pth, dest, config["vocab_size"])
    return dest


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m localchat.engine.models.rwkv4_pth",
        description="Make a converter-ready folder from a BlinkDL RWKV-4, RWKV-6 or RWKV-7 "
        ".pth (then: localchat convert FOLDER -o OUT)",
    )
    parser.add_argument("pth", type=Path)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--rescale-every", type=int, default=6)
    ns = parser.parse_args(argv)
    print(prepare_pth_source(ns.pth, ns.folder, rescale_every=ns.rescale_every))


if __name__ == "__main__":
    main()
