"""Compile a model definition to a device library, cached on disk by everything that shapes it.

The cache key covers the architecture and its config, the quantization, the target, the TVM
version and a version of our own kernels, so any change that could alter the library builds a
new one, and an unchanged model never compiles twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tvm
from tvm.target import Target

from localchat import model_dir as md
from localchat.engine.build.quantization import QuantMode
from localchat.engine.models import Architecture
from localchat.errors import CompileError

# Bump when kernels or the pass pipeline change in a way the key would not otherwise see.
KERNEL_VERSION = 4
_log = logging.getLogger("localchat.compile")


@dataclass(frozen=True)
class CompiledLibrary:
    """A compiled library on disk and how long it took to obtain it."""

    path: Path
    compiled: bool  # False when it came from the cache
    seconds: float


def target_key(target: Target) -> str:
    """A short, filesystem-safe name for a target: its kind plus the CPU or GPU architecture."""
    kind = target.kind.name
    attrs = target.attrs
    detail = str(attrs.get("mcpu", "") or attrs.get("arch", "") or "")
    mattr = [str(a) for a in attrs.get("mattr", None) or []]
    if mattr:  # features turned off (a CPU whose hypervisor hides AVX-512): its own name
        detail += "_" + hashlib.sha256(",".join(mattr).encode()).hexdigest()[:6]
    return f"{kind}-{detail}" if detail else kind


def library_key(arch: Architecture, config: Any, mode: QuantMode, target: Target) -> str:
    """Hash of everything that determines the compiled library."""
    payload = {
        "arch": arch.name,
        "config": config.to_dict(),
        "quantization": mode.name,
        "target": str(target),
        "tvm": tvm.__version__,
        "kernels": KERNEL_VERSION,
        "sources": _source_digest(arch.name),
    }
    blob = json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


_ENGINE = Path(__file__).resolve().parent.parent
# Modules whose code can shape a library: the models and kernels packages and the quantization
# modes. The registry (models/__init__.py) is left out: it only lists architectures, and adding
# one must not recompile the others.
_CODE_PACKAGES = ("localchat.engine.models.", "localchat.engine.kernels.")
_CODE_MODULES = ("localchat.engine.build.quantization",)


def build_sources(arch_name: str) -> list[Path]:
    """The source files an architecture's build reads: its module and, transitively, the model
    and kernel modules (and the quantization modes) it imports."""
    import ast

    from localchat.engine.models import REGISTRY

    entry = next((e for e in REGISTRY if e.name == arch_name), None)
    if entry is None:
        raise CompileError(f"unknown architecture {arch_name!r}")

    def path_of(module: str) -> Path | None:
        parts = module.split(".")[2:]  # drop "localchat.engine"
        path = _ENGINE.joinpath(*parts).with_suffix(".py")
        return path if path.is_file() else None

    def imports(path: Path) -> set[str]:
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        return {m for m in found if m.startswith(_CODE_PACKAGES) or m in _CODE_MODULES}

    todo, seen = [f"localchat.engine.models.{entry.module}"], set()
    while todo:
        module = todo.pop()
        path = path_of(module)
        if module in seen or path is None:
            continue
        seen.add(module)
        todo.extend(imports(path))
    files = sorted({p for p in map(path_of, seen) if p is not None})
    return [*files, Path(__file__).resolve()]


def _source_digest(arch_name: str) -> str:
    """Hash of the sources that generate this architecture's library code, so editing one of
    its kernels invalidates the cache even when KERNEL_VERSION was not bumped."""
    h = hashlib.sha256()
    for f in build_sources(arch_name):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def export_module(arch: Architecture, config: Any, mode: QuantMode, target: Target):
    """The model as a Relax IRModule plus its parameter names, in the packed order."""
    model = arch.build(config, mode, target)
    mod, named_params = model.export_tvm(spec=model.get_default_spec())
    return mod, [name for name, _ in named_params]


def write_library(export: Callable[[], tvm.IRModule], target: Target, path: Path) -> None:
    """Compile the module `export()` returns for `target` and write the library to `path`
    atomically (a temporary file renamed into place); CompileError on any failure, the export's
    included."""
    folder = path.parent
    try:
        with quiet_native_output():
            mod = export()
            executable = tvm.compile(mod, target=target, relax_pipeline=relax_pipeline(target))
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".build-", suffix=path.suffix)
        os.close(fd)
        try:
            with quiet_native_output():
                executable.export_library(tmp)
            os.chmod(tmp, md.FILE_MODE)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        raise CompileError(f"could not write the compiled library to {folder}: {exc}") from None
    except Exception as exc:  # TVM raises its own error types from C++
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise CompileError(f"compiling for {target_key(target)} failed: {first}") from exc


def relax_pipeline(target: Target) -> tvm.transform.Pass:
    """Our Relax pipeline: TVM's default for the target kind; GPUs get dlight rules from it.

    GPUs differ in one rule: dlight's gpu.Matmul crashes (segfault) in TVM 0.27 on metal
    targets, and on CUDA once a reduction is 128 or longer (every real model), so matmuls are
    scheduled by the GEMV/fallback rules instead.
    """
    from tvm import relax  # the compiler's: a runtime-only TVM cannot import it

    if target.kind.name == "llvm":
        return relax.get_default_pipeline(target)
    from tvm.relax.backend import gpu_generic
    from tvm.s_tir import dlight as dl

    legalize = gpu_generic.legalize_passes(target)[:-1] + [
        dl.ApplyDefaultSchedule(
            dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()
        )
    ]
    passes = (
        gpu_generic.library_dispatch_passes(target)
        + legalize
        + gpu_generic.dataflow_lower_passes(target)
        + gpu_generic.finalize_passes(target)
    )

    @tvm.transform.module_pass(opt_level=0)
    def pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return pipeline


def library_file_name(arch: Architecture, config: Any, mode: QuantMode, target: Target) -> str:
    """The file name of this model's library for `target` (see model_dir.library_file_name)."""
    return md.library_file_name(target_key(target), library_key(arch, config, mode, target))


def compile_library(
    arch: Architecture,
    config: Any,
    mode: QuantMode,
    target: Target,
    lib_dir: Path | None = None,
    log: Callable[[str], None] | None = None,
) -> CompiledLibrary:
    """Return the cached library for this model and target, compiling it first if needed.

    `lib_dir` defaults to the first library cache this user may write. A cached library is
    used only when it matches its recorded sha256; otherwise it is compiled again.
    """
    lib_dir = Path(lib_dir) if lib_dir is not None else md.writable_library_cache_dir()
    path = lib_dir / library_file_name(arch, config, mode, target)
    if md.verified_cache_library(path, log):
        return CompiledLibrary(path, compiled=False, seconds=0.0)
    shared = md.shared_library_cache_dir()
    if shared is not None and shared != lib_dir and md.verified_cache_library(shared / path.name):
        copied = md.copy_cached_library(shared / path.name, lib_dir)
        if copied is not None:
            return CompiledLibrary(copied, compiled=False, seconds=0.0)
    start = time.perf_counter()
    if log:
        log(f"compiling {arch.name} ({mode.name}) for {target_key(target)}; the first compile "
            f"of a model takes about a minute")
    write_library(lambda: export_module(arch, config, mode, target)[0], target, path)
    md.write_library_record(path)
    seconds = time.perf_counter() - start
    if shared is not None and shared != lib_dir:
        md.copy_cached_library(path, shared)  # best effort: the shared folder may be read-only
    if log:
        log(f"compiled {path.name} in {seconds:.1f} s")
    return CompiledLibrary(path, compiled=True, seconds=seconds)


@contextmanager
def quiet_native_output() -> Iterator[None]:
    """Send what TVM and LLVM print on file descriptor 2 (e.g. "Warning: Fast mode
    segfaults...") to the debug log instead of the terminal."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode("utf-8", "replace").strip()
            if text:
                _log.debug("native output: %s", text)


def prebuilt_library(model_dir: Path, target_key: str,
                     log: Callable[[str], None] | None = None) -> CompiledLibrary:
    """The library a model directory's lib/ holds for `target_key` (`runtime_target_key`),
    compiled on another machine: what a runtime-only TVM runs, since it cannot compile. Only a
    copy that matches its recorded sha256; CompileError names the command that makes one."""
    model_dir = Path(model_dir)
    # the key, or a longer one of it (`llvm` -> `llvm-znver5`: the CPU's name is not known)
    names = [name for name in md.library_files(model_dir)
             if f"{md.library_target(name)}-".startswith(f"{target_key}-")]
    # the newest first: an older compile of the same model is left over from an earlier engine
    names.sort(key=lambda name: (model_dir / md.LIB_DIR / name).stat().st_mtime, reverse=True)
    for name in names:
        found = md.trusted_library(model_dir, name, log=log)
        if found is not None:
            return CompiledLibrary(found, compiled=False, seconds=0.0)
    spec = target_key.replace("cuda-", "cuda:") if target_key.startswith("cuda-") else \
        {"llvm": "cpu"}.get(target_key, target_key)
    raise CompileError(
        f"{model_dir.name} has no library compiled for {target_key}, and this TVM is a runtime "
        f"without its compiler: compile one where the full apache-tvm is installed "
        f"(`localchat convert SOURCE --device {spec} -o DIR`) and copy the directory here")


def model_library(
    model_dir: Path,
    arch: Architecture,
    config: Any,
    mode: QuantMode,
    target: Target,
    log: Callable[[str], None] | None = None,
) -> CompiledLibrary:
    """The library a model directory runs with on `target`: its own lib/, else a library
    cache, else compiled into the first cache this user may write; only ever a copy that
    matches its recorded sha256. Linked into the model's lib/ when that is writable; a store
    this user may only read is never written."""
    model_dir = Path(model_dir)
    name = library_file_name(arch, config, mode, target)
    found = md.trusted_library(model_dir, name, log=log)
    if found is not None and found.parent == model_dir / md.LIB_DIR:
        return CompiledLibrary(found, compiled=False, seconds=0.0)
    library = compile_library(arch, config, mode, target, log=log) if found is None else (
        CompiledLibrary(found, compiled=False, seconds=0.0))
    if os.access(model_dir, os.W_OK) and (
            not (model_dir / md.LIB_DIR).exists() or os.access(model_dir / md.LIB_DIR, os.W_OK)):
        try:
            path = md.install_library(model_dir, library.path, name)
            md.remove_stale_libraries(model_dir, keep=name)
            return CompiledLibrary(path, library.compiled, library.seconds)
        except OSError:
            pass  # a store we may read but not write: run from the cache
    return library
