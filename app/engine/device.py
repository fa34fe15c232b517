"""Which device to run on, what the installed TVM can drive, and the compile target for each."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import tvm
from tvm.target import Target

from localchat.engine.amx import request_amx
from localchat.errors import DeviceError

DEVICE_KINDS = ("cuda", "metal", "vulkan", "cpu")


@dataclass(frozen=True)
class Device:
    """A device to run on: its kind, the TVM runtime device and the compile target."""

    kind: str
    # None on a runtime-only TVM (no compiler): the model's lib/ must hold a library compiled
    # for this device elsewhere (`localchat convert --device cuda:sm_90` there)
    target: Target | None

    @property
    def tvm_device(self) -> tvm.runtime.Device:
        return tvm.device(self.kind, 0)


# LLVM feature name -> the /proc/cpuinfo flag that says the OS lets programs use it. LLVM names
# the host CPU by its family and model (say znver4), which implies AVX-512; a hypervisor may
# still hide AVX-512 or AMX from its guests, and code using them then dies of SIGILL.
_CPUINFO_FLAGS = {
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512dq": "avx512dq",
    "avx512vl": "avx512vl",
    "avx512vnni": "avx512_vnni",
    "avx512bf16": "avx512_bf16",
    "avx512fp16": "avx512_fp16",
    "avxvnni": "avx_vnni",
    "amx-tile": "amx_tile",
    "amx-int8": "amx_int8",
    "amx-bf16": "amx_bf16",
}


_AMX_FEATURES = [feature for feature in _CPUINFO_FLAGS if feature.startswith("amx-")]


def _os_cpu_flags() -> set[str] | None:
    """The flags of /proc/cpuinfo's first processor (None where there is no such file)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        return None
    return None


def hidden_cpu_features(mcpu: str, flags: set[str] | None) -> list[str]:
    """The LLVM features `mcpu` implies that the OS does not report (to turn off)."""
    if not flags:
        return []
    from tvm.target import codegen

    probe = Target({"kind": "llvm", "mcpu": mcpu})
    return [feature for feature, flag in _CPUINFO_FLAGS.items()
            if flag not in flags and codegen.llvm_cpu_has_features([feature], probe)]


def cpu_target(num_cores: int | None = None) -> Target:
    """llvm for this very CPU, so LLVM uses its vector extensions (AVX2/AVX-512/NEON), less
    any the OS hides (see `hidden_cpu_features`); `num_cores` defaults to all CPUs."""
    from tvm.target import codegen

    mcpu = codegen.llvm_get_system_cpu()
    spec: dict[str, object] = {
        "kind": "llvm", "mcpu": mcpu, "num-cores": num_cores or os.cpu_count() or 1
    }
    flags = _os_cpu_flags()
    hidden = hidden_cpu_features(mcpu, flags)
    if flags and "amx_tile" in flags and not request_amx():
        # AMX's tiles are a process's only once Linux grants them (`amx.request_amx`)
        hidden += [f for f in _AMX_FEATURES if f not in hidden]
    if hidden:
        spec["mattr"] = [f"-{feature}" for feature in hidden]
    return Target(spec)


def portable_cpu_target() -> Target:
    """llvm for any x86-64 (or arm64) Linux CPU: the host side of a library compiled here for
    another machine's GPU, whose CPU may lack this one's vector extensions."""
    import platform

    triple = "aarch64-linux-gnu" if platform.machine() in ("aarch64", "arm64") else \
        "x86_64-pc-linux-gnu"
    return Target({"kind": "llvm", "mtriple": triple})


def local_cuda_arch() -> str | None:
    """The local GPU's SM architecture (`sm_90`), or None where no CUDA device is present."""
    dev = tvm.cuda(0)
    return "sm_" + dev.compute_version.replace(".", "") if dev.exist else None


def cuda_target(arch: str | None = None, host: Target | None = None) -> Target:
    """CUDA for the given SM architecture (default: the local GPU's, else sm_80); the host
    side for this CPU unless `host` says otherwise."""
    arch = arch or local_cuda_arch() or "sm_80"
    return Target(
        {
            "kind": "cuda",
            "arch": arch,
            "max_threads_per_block": 1024,
            "max_shared_memory_per_block": 49152,
            "thread_warp_size": 32,
        },
        host=host or cpu_target(),
    )


def metal_target() -> Target:
    """Metal for Apple GPUs, with an arm64 macOS host."""
    return Target(
        {
            "kind": "metal",
            "max_threads_per_block": 1024,
            "max_shared_memory_per_block": 32768,
            "thread_warp_size": 32,
        },
        host={"kind": "llvm", "mtriple": "arm64-apple-macos", "mcpu": "apple-m1"},
    )


def vulkan_target() -> Target:
    return Target(
        {
            "kind": "vulkan",
            "max_threads_per_block": 256,
            "max_shared_memory_per_block": 32768,
            "thread_warp_size": 1,
            "supports_float16": True,
            "supports_int64": True,
        },
        host=cpu_target(),
    )


def backend_supported(kind: str) -> bool:
    """Whether the installed TVM can compile for and run on this kind of device."""
    if kind == "cpu":
        return True
    info = tvm.support.libinfo()
    flag = {"cuda": "USE_CUDA", "metal": "USE_METAL", "vulkan": "USE_VULKAN"}[kind]
    return str(info.get(flag, "OFF")).upper() not in ("OFF", "", "0", "FALSE", "NOTFOUND")


def _load_runtime_sidecar(kind: str) -> None:
    """A runtime-only TVM loads no device runtimes by itself (the full one does, through its
    compiler's backend hooks): load `libtvm_runtime_<kind>` beside libtvm_runtime, once."""
    import tvm.base

    name = f"tvm_runtime_{kind}"
    if compiler_available() or name in tvm.base._LOADED_LIBS:
        return
    from tvm_ffi.libinfo import load_lib_ctypes

    folder = Path(tvm.base._LOADED_LIBS["tvm_runtime"]._name).resolve().parent
    try:
        tvm.base._LOADED_LIBS[name] = load_lib_ctypes(
            package="tvm", target_name=name, extra_lib_paths=[folder], mode="RTLD_LOCAL")
    except (OSError, RuntimeError):
        return  # no such runtime in this install, or its driver library is missing
    if kind == "cuda":
        _register_cuda_jit()


def _register_cuda_jit() -> None:
    """A library compiled for CUDA where no GPU is (`cross_compile_device`) holds its kernels as
    CUDA source, which TVM compiles when the library is loaded, through the function
    `tvm_callback_cuda_compile`. TVM's own asks the compiler's current target for the
    architecture, which a runtime-only TVM lacks: this one compiles for the local GPU."""
    import tvm_ffi

    arch = local_cuda_arch() or "sm_80"

    @tvm_ffi.register_global_func("tvm_callback_cuda_compile", override=True)
    def compile_source(code: str) -> bytes:
        from tvm.support import nvcc

        try:  # NVRTC through cuda-bindings, where installed: no compiler process
            return bytes(nvcc.compile_cuda(code, target_format="cubin", arch=arch,
                                           compiler="nvrtc"))
        except Exception:  # else the nvcc program of the CUDA toolkit
            return bytes(nvcc.compile_cuda(code, target_format="fatbin", arch=arch,
                                           compiler="nvcc"))


def device_present(kind: str) -> bool:
    """Whether a device of this kind exists on this machine and its runtime is usable."""
    if kind == "cpu":
        return True
    _load_runtime_sidecar(kind)
    try:
        return bool(tvm.device(kind, 0).exist)
    except Exception:  # a runtime that is not compiled in raises
        return False


def _target_for(kind: str) -> Target | None:
    if not compiler_available():
        return None
    return {
        "cpu": cpu_target,
        "cuda": cuda_target,
        "metal": metal_target,
        "vulkan": vulkan_target,
    }[kind]()


def compiler_available() -> bool:
    """Whether the installed TVM can compile: a runtime-only install (`TVM_USE_RUNTIME_LIB=1`,
    or the compiler library missing) only loads libraries compiled on another machine."""
    import tvm.base

    return not getattr(tvm.base, "_RUNTIME_ONLY", False)


def runtime_target_key(kind: str) -> str:
    """The target key (`compile.target_key`) of the libraries that run on this machine's
    device `kind`, told without the compiler: `cuda-sm_90`, `metal`, `vulkan`; `llvm` for the
    CPU, whose libraries are named by the CPU as well (`llvm-znver5`)."""
    if kind == "cuda":
        return f"cuda-{local_cuda_arch() or 'sm_80'}"
    return "llvm" if kind == "cpu" else kind


def cross_compile_device(spec: str) -> Device | None:
    """`cuda:sm_90` -> a device to compile for without one being present (its library is
    copied to the machine that has it); `cpu:sapphirerapids` (an LLVM CPU name) likewise for
    another machine's x86-64 CPU; None for a spec without an architecture."""
    kind, _, arch = spec.partition(":")
    if not arch:
        return None
    if kind == "cpu" and re.fullmatch(r"[a-z][a-z0-9_-]*", arch):
        from tvm.target import codegen

        triple = Target({"kind": "llvm", "mtriple": "x86_64-pc-linux-gnu"})
        if arch not in set(codegen.llvm_get_cpu_archlist(triple)):
            raise DeviceError(f"cannot compile for {spec!r}: LLVM knows no x86-64 CPU {arch!r} "
                              f"(e.g. cpu:sapphirerapids, cpu:znver4)")
        return Device("cpu", Target({"kind": "llvm", "mtriple": "x86_64-pc-linux-gnu",
                                     "mcpu": arch}))
    if kind != "cuda" or not re.fullmatch(r"sm_\d+[a-z]?", arch):
        raise DeviceError(f"cannot compile for {spec!r}: name a CUDA architecture such as "
                          f"cuda:sm_80 or cuda:sm_90, or an x86-64 CPU such as "
                          f"cpu:sapphirerapids")
    if not backend_supported("cuda"):
        raise DeviceError("this TVM build has no cuda support")
    return Device("cuda", cuda_target(arch, host=portable_cpu_target()))


def select_device(requested: str = "auto") -> Device:
    """The device to use: `auto` takes the first present and supported of CUDA, Metal, Vulkan,
    then CPU; a named kind must exist and be supported, or DeviceError says why not. On a
    runtime-only TVM the device has no target: it runs libraries compiled elsewhere."""
    if requested == "auto":
        for kind in DEVICE_KINDS:
            if backend_supported(kind) and device_present(kind):
                return Device(kind, _target_for(kind))
        return Device("cpu", _target_for("cpu"))
    kind, _, arch = requested.partition(":")
    if kind not in DEVICE_KINDS:
        raise DeviceError(
            f"unknown device {requested!r} (choose from auto, {', '.join(DEVICE_KINDS)})"
        )
    if kind == "cpu" and arch:
        # another CPU's library could use instructions this one lacks (SIGILL, no message)
        raise DeviceError(f"{requested} names another machine's CPU: `localchat convert SOURCE "
                          f"--device {requested} -o DIR` compiles for it; run here with "
                          f"--device cpu")
    if not backend_supported(kind):
        raise DeviceError(f"this TVM build has no {kind} support")
    if not device_present(kind):
        hint = f"; `localchat convert --device {requested}` compiles for one elsewhere" \
            if arch else ""
        raise DeviceError(f"no {kind} device found on this machine{hint}")
    if arch and compiler_available():
        device = cross_compile_device(requested)
        assert device is not None  # an architecture is named
        return device
    return Device(kind, _target_for(kind))
