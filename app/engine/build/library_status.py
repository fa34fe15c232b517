"""Whether each stored model has this device's library, remembered between runs so that
`localchat list` answers without importing TVM (about a second) when nothing changed.

The answer depends on the model's files, the library key's inputs (the engine's code and the
TVM release) and the machine; all of them are cheap to fingerprint, so a cached answer is used
only while every one is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from localchat import model_dir as md
from localchat.errors import LocalchatError

CACHE_FILE = "library-status.json"
_ENGINE = Path(__file__).resolve().parent.parent


def _code_digest() -> str:
    """The engine code a library key depends on (models, kernels, compile, quantization)."""
    h = hashlib.sha256()
    files = sorted((_ENGINE / "models").glob("*.py")) + sorted((_ENGINE / "kernels").glob("*.py"))
    files += [_ENGINE / "build" / "compile.py", _ENGINE / "build" / "quantization.py"]
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _machine_digest() -> str:
    """The machine the target is picked for: its architecture, CPU and the TVM release."""
    h = hashlib.sha256(platform.machine().encode())
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    h.update(line.encode())
                if line.startswith("flags"):
                    break
    except OSError:
        h.update(platform.processor().encode())
    try:
        h.update(metadata.version("apache-tvm").encode())
    except metadata.PackageNotFoundError:
        pass
    return h.hexdigest()[:16]


def _model_digest(path: Path) -> str:
    config = path / md.CONFIG_FILE
    stat = config.stat()
    libs = sorted(p.name for p in (path / md.LIB_DIR).glob("*")) if (path / md.LIB_DIR).is_dir() \
        else []
    return hashlib.sha256(json.dumps(
        [str(path), stat.st_size, stat.st_mtime_ns, libs]).encode()).hexdigest()[:16]


def library_status(model_dirs: Iterable[Path], cache_dir: Path) -> dict[Path, str]:
    """For each model directory: "yes" (this device's library is there), "stale" (an older
    build for this target), "no", or "?" where the engine cannot tell."""
    dirs = list(model_dirs)
    cache_file = cache_dir / CACHE_FILE
    try:
        cached = json.loads(cache_file.read_text(encoding="utf-8"))
        cached = cached if isinstance(cached, dict) else {}
    except (OSError, ValueError):
        cached = {}
    common = _code_digest() + _machine_digest()
    keys: dict[Path, str] = {}
    for path in dirs:
        try:
            keys[path] = common + _model_digest(path)
        except OSError:
            keys[path] = ""
    out = {p: cached[k] for p, k in keys.items() if k and k in cached}
    missing = [p for p in dirs if p not in out]
    if missing:
        out.update(_computed(missing))
        fresh = {keys[p]: out[p] for p in dirs if keys[p] and out[p] != "?"}
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_name(f".{CACHE_FILE}.{os.getpid()}")
            tmp.write_text(json.dumps(fresh), encoding="utf-8")
            os.replace(tmp, cache_file)
        except OSError:  # a read-only cache only costs the next run its speed
            pass
    return out


def _computed(dirs: list[Path]) -> dict[Path, str]:
    """The status of each model from its library key (imports TVM)."""
    out = {p: "yes" if md.library_targets(p) else "no" for p in dirs}
    try:
        from localchat.engine.build import library_stem
        from localchat.engine.build.compile import target_key
        from localchat.engine.device import select_device

        target = select_device("auto").target
        key = target_key(target)
    except Exception:  # no usable TVM: "has any library"
        return out
    for path in dirs:
        try:
            stem = library_stem(path, target)
        except (LocalchatError, KeyError, TypeError, ValueError):
            out[path] = "?"
            continue
        files = md.library_files(path)
        if any(Path(f).stem == stem for f in files):
            out[path] = "yes"
        elif key in md.library_targets(path):
            out[path] = "stale"
        else:
            out[path] = "no"
    return out
