"""Prefill's 4-bit matmul on Intel AMX (`kernels.gemm_amx`): compiled for an AMX CPU from any
machine (`convert --device cpu:sapphirerapids`), run against numpy where this CPU has AMX.
CI's machines have none: there the run is skipped, and `bench/amx_check.py` runs it (and whole
models) on one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tvm

from localchat import model_dir as md
from localchat.cli import main
from localchat.engine.amx import request_amx
from localchat.engine.device import cpu_target, cross_compile_device
from localchat.engine.kernels.common import has_amx
from localchat.engine.kernels.gemm_amx import gemm_q4_amx
from localchat.errors import DeviceError

from hub_server import tiny_llama_folder

# `tdpbssd %tmm2, %tmm1, %tmm0` as LLVM encodes it (C in tile 0, A in 1, B in 2)
TDPBSSD = bytes.fromhex("c4e26b5ec1")


def quantize_x(x: np.ndarray, kp: int) -> tuple[np.ndarray, np.ndarray]:
    """x's int8 values and scales per group of 32 as the kernels round them (max |x| / 127,
    to nearest even), zero-padded to kp."""
    m, k = x.shape
    padded = np.zeros((m, kp), np.float32)
    padded[:, :k] = x
    groups = padded.reshape(m, kp // 32, 32)
    amax = np.abs(groups).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return np.rint(groups * inv[..., None]).astype(np.int32), amax / np.float32(127)


def reference(x: np.ndarray, w: np.ndarray, s: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """y = x (int8-rounded) @ ((W - 8) * S)^T (+ b), the products summed in float64."""
    n, kw = w.shape
    kp = kw * 8
    xq, xs = quantize_x(x, kp)
    q = ((w[:, :, None] >> (np.arange(8, dtype=np.uint32) * 4)) & 15).astype(np.int32) - 8
    dots = np.einsum("mgk,ngk->mng", xq, q.reshape(n, kp // 32, 32)).astype(np.float64)
    y = (dots * xs[:, None, :] * s.astype(np.float32)[None]).sum(-1)
    return y + b if b is not None else y


def test_convert_compiles_amx_prefill_for_another_cpu(tmp_path: Path) -> None:
    """`convert --device cpu:sapphirerapids` (from any machine) gives a library whose prefill
    runs on AMX tiles; one for a CPU without AMX has no tile instruction."""
    source = tiny_llama_folder(tmp_path / "source")
    found = {}
    for cpu in ("sapphirerapids", "icelake-server"):
        out = tmp_path / cpu
        assert main(["convert", str(source), "--quant", "q4f32_1", "--device", f"cpu:{cpu}",
                     "-o", str(out)]) == 0
        [lib] = md.library_files(out)
        assert lib.startswith(f"llvm-{cpu}-")
        found[cpu] = TDPBSSD in (out / md.LIB_DIR / lib).read_bytes()
    assert found == {"sapphirerapids": True, "icelake-server": False}


@pytest.mark.parametrize("spec", ["cpu:nosuchcpu", "cpu:Sapphire Rapids"])
def test_an_unknown_cpu_is_refused(spec: str) -> None:
    with pytest.raises(DeviceError, match="cannot compile for"):
        cross_compile_device(spec)


@pytest.mark.skipif(not has_amx(cpu_target()) or not request_amx(),
                    reason="this CPU has no AMX (or Linux did not grant its tiles)")
@pytest.mark.parametrize("k,n,bias,sdt", [(200, 40, True, "float32"), (77, 17, False, "float16"),
                                          (512, 64, False, "float32")])
def test_the_amx_matmul_equals_numpy(k: int, n: int, bias: bool, sdt: str) -> None:
    """Odd k (a padded last group), n not a multiple of 16 (a partial tile), rows not a multiple
    of 16 (a partial block): within float32 rounding of the int8-rounded reference."""
    lib = tvm.compile(tvm.IRModule({"main": gemm_q4_amx(k, n, "float32", bias, sdt)}),
                      target=cpu_target())
    rng = np.random.default_rng(0)
    kp = -(-k // 32) * 32
    for m in (1, 16, 37):
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = rng.integers(0, 2**32, (n, kp // 8), dtype=np.uint64).astype(np.uint32)
        s = (rng.random((n, kp // 32)) * 0.02 + 0.001).astype(sdt)
        b = rng.standard_normal(n).astype(np.float32) if bias else None
        dev = tvm.cpu()
        y = tvm.runtime.tensor(np.zeros((m, n), np.float32), dev)
        args = [x, w, s] + ([b] if bias else [])
        lib["main"](*[tvm.runtime.tensor(a, dev) for a in args], y)
        ref = reference(x, w, s, b)
        assert np.abs(y.numpy() - ref).max() <= 1e-5 * np.abs(ref).max(), m
