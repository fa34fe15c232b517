"""Which device to run on, what the installed TVM can drive, and the compile target for each."""

from __future__ import annotations

import os
from dataclasses import dataclass

import tvm
from tvm.target import Target

from localchat.errors import DeviceError

DEVICE_KINDS = ("cuda", "metal", "vulkan", "cpu")


@dataclass(frozen=True)
class Device:
    """A device to run on: its kind, the TVM runtime device and the compile target."""

    kind: str
    target: Target

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
    hidden = hidden_cpu_features(mcpu, _os_cpu_flags())
    if hidden:
        spec["mattr"] = [f"-{feature}" for feature in hidden]
    return Target(spec)


def cuda_target(arch: str | None = None) -> Target:
    """CUDA for the given SM architecture (default: the local GPU's, else sm_80)."""
    if arch is None:
        dev = tvm.cuda(0)
        arch = "sm_" + dev.compute_version.replace(".", "") if dev.exist else "sm_80"
    return Target(
        {
            "kind": "cuda",
            "arch": arch,
            "max_threads_per_block": 1024,
            "max_shared_memory_per_block": 49152,
            "thread_warp_size": 32,
        },
        host=cpu_target(),
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


def device_present(kind: str) -> bool:
    """Whether a device of this kind exists on this machine and its runtime is usable."""
    if kind == "cpu":
        return True
    try:
        return bool(tvm.device(kind, 0).exist)
    except Exception:  # a runtime that is not compiled in raises
        return False


def _target_for(kind: str) -> Target:
    return {
        "cpu": cpu_target,
        "cuda": cuda_target,
        "metal": metal_target,
        "vulkan": vulkan_target,
    }[kind]()


def select_device(requested: str = "auto") -> Device:
    """The device to use: `auto` takes the first present and supported of CUDA, Metal, Vulkan,
    then CPU; a named kind must exist and be supported, or DeviceError says why not."""
    if requested == "auto":
        for kind in DEVICE_KINDS:
            if backend_supported(kind) and device_present(kind):
                return Device(kind, _target_for(kind))
        return Device("cpu", cpu_target())
    if requested not in DEVICE_KINDS:
        raise DeviceError(
            f"unknown device {requested!r} (choose from auto, {', '.join(DEVICE_KINDS)})"
        )
    if not backend_supported(requested):
        raise DeviceError(f"this TVM build has no {requested} support")
    if not device_present(requested):
        raise DeviceError(f"no {requested} device found on this machine")
    return Device(requested, _target_for(requested))
