"""Compile a model definition to a device library, cached on disk by everything that shapes it.

The cache key covers the architecture and its config, the quantization, the target, the TVM
version and a version of our own kernels, so any change that could alter the library builds a
new one, and an unchanged model never compiles twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tvm
from tvm import relax
from tvm.target import Target

from localchat.engine.models import Architecture
from localchat.engine.quantization import QuantMode
from localchat.errors import CompileError

# Bump when kernels or the pass pipeline change in a way the key would not otherwise see.
KERNEL_VERSION = 4


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
        "sources": _source_digest(),
    }
    blob = json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _source_digest() -> str:
    """Hash of the sources that generate library code, so editing a kernel invalidates the cache
    even when KERNEL_VERSION was not bumped."""
    engine = Path(__file__).resolve().parent
    files = sorted(engine.glob("kernels*.py")) + [engine / "attention_cpu.py", Path(__file__)]
    files += sorted((engine / "models").glob("*.py"))
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def export_module(arch: Architecture, config: Any, mode: QuantMode, target: Target):
    """The model as a Relax IRModule plus its parameter names, in the packed order."""
    model = arch.build(config, mode, target)
    mod, named_params = model.export_tvm(spec=model.get_default_spec())
    return mod, [name for name, _ in named_params]


def relax_pipeline(target: Target) -> tvm.transform.Pass:
    """Our Relax pipeline: TVM's default for the target kind; GPUs get dlight rules from it.

    GPUs differ in one rule: dlight's gpu.Matmul crashes (segfault) in TVM 0.27 on metal
    targets, and on CUDA once a reduction is 128 or longer (every real model), so matmuls are
    scheduled by the GEMV/fallback rules instead.
    """
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


def compile_library(
    arch: Architecture,
    config: Any,
    mode: QuantMode,
    target: Target,
    lib_dir: Path,
    log: Callable[[str], None] | None = None,
) -> CompiledLibrary:
    """Return the cached library for this model and target, compiling it first if needed."""
    lib_dir = Path(lib_dir)
    path = lib_dir / f"{target_key(target)}-{library_key(arch, config, mode, target)}.so"
    if path.exists():
        return CompiledLibrary(path, compiled=False, seconds=0.0)
    start = time.perf_counter()
    if log:
        log(f"compiling {arch.name} ({mode.name}) for {target_key(target)}")
    try:
        mod, _ = export_module(arch, config, mode, target)
        executable = tvm.compile(mod, target=target, relax_pipeline=relax_pipeline(target))
        lib_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=lib_dir, prefix=".build-", suffix=".so")
        os.close(fd)
        try:
            executable.export_library(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        raise CompileError(f"could not write the compiled library to {lib_dir}: {exc}") from None
    except Exception as exc:  # TVM raises its own error types from C++
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise CompileError(f"compiling for {target_key(target)} failed: {first}") from exc
    return CompiledLibrary(path, compiled=True, seconds=time.perf_counter() - start)
