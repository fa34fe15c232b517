"""BlinkDL `.pth` checkpoints of any RWKV version: which version a file is (from its tensor
names), and the folder the converter reads made from a lone RWKV-7 `.pth` (config.json inferred
from the tensor shapes, the checkpoint linked in, the World vocabulary). RWKV-4 files are
prepared by `rwkv4_pth`, whose `prepare_pth_source` is the one entry point for every version,
RWKV-6 files by `rwkv6_pth`.

The World vocabulary (the same file for RWKV-4, 6 and 7 World models) is taken from beside the
checkpoint, else from an installed `rwkv` package, else from localchat's cache, where it is
unpacked from the `rwkv` wheel on PyPI (`pip download`) the first time it is needed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from localchat.engine.tokenizer import WORLD_VOCAB_FILE
from localchat.errors import ModelConfigError, UnsupportedModelError, WeightsError

SUPPORTED = "RWKV-4, RWKV-6 and RWKV-7"
WORLD_VOCAB_ROWS = 65536  # embedding rows of every RWKV World model
VOCAB_WHEEL = "rwkv==0.8.32"  # the PyPI wheel that carries the World vocabulary


def checkpoint_version(names: set[str] | list[str]) -> int:
    """The RWKV version of a BlinkDL checkpoint from its tensor names: 7 (`att.r_k`,
    `att.k_k`), 6 (`att.time_faaaa` with a decay LoRA `time_decay_w1`), 5 (`time_faaaa` or
    `ln_x` otherwise), else 4."""
    names = set(names)
    if any(n.endswith((".att.r_k", ".att.k_k")) for n in names):
        return 7
    if any(n.endswith(".att.time_decay_w1") for n in names):
        return 6
    if any(".time_faaaa" in n or ".att.ln_x." in n for n in names):
        return 5
    return 4


def refuse_unsupported(version: int, where: str) -> None:
    """Raise a clear error for a version localchat does not run (5)."""
    if version not in (4, 6, 7):
        raise UnsupportedModelError(
            f"{where}: an RWKV-{version} checkpoint; localchat runs {SUPPORTED} .pth files")


def config_from_checkpoint(path: Path) -> dict[str, Any]:
    """The config.json of a BlinkDL RWKV-7 `.pth`, inferred from its tensor shapes."""
    from localchat.engine.build.weights import open_checkpoint_file

    path = Path(path)
    src = open_checkpoint_file(path)
    names = set(src.names)
    if "emb.weight" not in names or "blocks.0.att.r_k" not in names:
        raise WeightsError(f"{path.name}: not an RWKV-7 checkpoint (no emb / att.r_k)")
    layers = 1 + max(int(m.group(1)) for n in names if (m := re.match(r"blocks\.(\d+)\.", n)))
    vocab, hidden = src.get("emb.weight").shape
    heads, head_size = src.get("blocks.0.att.r_k").shape

    def rank(lora: str) -> int:
        # layer 0 has no value residual: its v LoRA (if the file has one) is unused
        layer = 1 if lora == "v1" and layers > 1 else 0
        name = f"blocks.{layer}.att.{lora}"
        return int(src.get(name).shape[1]) if name in names else 0

    if any(".ffn.s_emb" in n for n in names):
        raise UnsupportedModelError(f"{path.name}: an RWKV-7 DeepEmbed checkpoint (ffn.s_emb); "
                                    f"localchat runs the plain RWKV-7 layout")
    return {
        "architectures": ["Rwkv7ForCausalLM"],
        "model_type": "rwkv7",
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "head_size": int(head_size),
        "num_attention_heads": int(heads),
        "intermediate_size": int(src.get("blocks.0.ffn.key.weight").shape[0]),
        "num_hidden_layers": int(layers),
        "decay_low_rank_dim": rank("w1"),
        "a_low_rank_dim": rank("a1"),
        "v_low_rank_dim": rank("v1"),
        "gate_low_rank_dim": rank("g1"),
        "layer_norm_epsilon": 1e-5,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "tie_word_embeddings": False,
    }


def _cache_dir() -> Path:
    from localchat.paths import cache_dir

    return cache_dir() / "rwkv-world"


def world_vocab(pth: Path) -> Path:
    """The World vocabulary file: beside `pth`, else the installed `rwkv` package's (a
    dependency of localchat, so this is where it comes from offline), else localchat's cached
    copy (unpacked from the `rwkv` wheel, downloaded with pip once, for an install without
    dependencies)."""
    beside = Path(pth).parent / WORLD_VOCAB_FILE
    if beside.is_file():
        return beside
    spec = importlib.util.find_spec("rwkv")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            if (Path(folder) / WORLD_VOCAB_FILE).is_file():
                return Path(folder) / WORLD_VOCAB_FILE
    cached = _cache_dir() / WORLD_VOCAB_FILE
    if cached.is_file():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent, prefix=".wheel-") as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", VOCAB_WHEEL, "-d", tmp],
            capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("rwkv-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelConfigError(
                f"the RWKV World vocabulary ({WORLD_VOCAB_FILE}) is not beside {Path(pth).name} "
                f"and `pip download {VOCAB_WHEEL}` failed; put the file next to the checkpoint "
                f"(or `pip install rwkv`)")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next(n for n in zf.namelist() if n.endswith(WORLD_VOCAB_FILE))
            part = cached.with_suffix(".part")
            part.write_bytes(zf.read(member))
            part.replace(cached)
    return cached


def link_checkpoint(pth: Path, dest: Path) -> None:
    """`dest/<name>.pth`: a link to `pth`, or a copy where links are not possible."""
    target = dest / pth.name
    if not target.exists():
        try:
            os.symlink(pth.resolve(), target)
        except OSError:
            shutil.copy2(pth, target)


def add_world_vocab(pth: Path, dest: Path, vocab_size: int) -> None:
    """The World vocabulary into `dest` for a World-sized model (65536 rows; the tiny test
    models and non-World checkpoints get none)."""
    if vocab_size == WORLD_VOCAB_ROWS and not (dest / WORLD_VOCAB_FILE).exists():
        shutil.copy2(world_vocab(pth), dest / WORLD_VOCAB_FILE)


def prepare_rwkv7_source(pth: Path, dest: Path) -> Path:
    """Make `dest` a folder the converter reads from the RWKV-7 `pth`. Returns `dest`."""
    pth, dest = Path(pth), Path(dest)
    config = config_from_checkpoint(pth)
    dest.mkdir(parents=True, exist_ok=True)
    link_checkpoint(pth, dest)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    add_world_vocab(pth, dest, config["vocab_size"])
    return dest
