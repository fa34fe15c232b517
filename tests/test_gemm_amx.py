"""Prefill's 4-bit matmul on Intel AMX (`kernels.gemm_amx`): compiled for an AMX CPU from any
machine (`convert --device cpu:sapphirerapids`), run against numpy where this CPU has AMX.
CI's machines have none: there the run is skipped, and `bench/amx_check.py` runs it (and whole
models) on one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tvm
from amx_reference import LAYOUTS, reference, weights

from localchat import model_dir as md
from localchat.cli import main
from localchat.engine.amx import request_amx
from localchat.engine.device import cpu_target, cross_compile_device, select_device
from localchat.engine.kernels.common import has_amx
from localchat.engine.kernels.gemm_amx import gemm_q4_amx
from localchat.errors import DeviceError

from hub_server import tiny_llama_folder

# `tdpbssd %tmm2, %tmm1, %tmm0` as LLVM encodes it (C in tile 0, A in 1, B in 2)
TDPBSSD = bytes.fromhex("c4e26b5ec1")


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


def test_running_on_another_cpus_spec_is_refused_with_the_command_that_compiles_for_it() -> None:
    with pytest.raises(DeviceError, match=r"convert SOURCE --device cpu:sapphirerapids"):
        select_device("cpu:sapphirerapids")


@pytest.mark.skipif(not has_amx(cpu_target()) or not request_amx(),
                    reason="this CPU has no AMX (or Linux did not grant its tiles)")
@pytest.mark.parametrize("layout,k,n,bias", [("q4", 200, 40, True), ("q4_0", 77, 17, False),
                                             ("asym", 200, 40, True), ("q4_k", 512, 33, False),
                                             ("q4_k", 300, 16, False)])
def test_the_amx_matmul_equals_numpy(layout: str, k: int, n: int, bias: bool) -> None:
    """Odd k (a padded last group, an odd group count: the tile sets' pairs and a last one), n
    not a multiple of 16 (a partial tile), rows not a multiple of 16 (a partial block), in
    each 4-bit layout: within float32 rounding of the int8-rounded reference."""
    asym, sdt = LAYOUTS[layout]
    func = gemm_q4_amx(k, n, "float32", bias, asym, sdt).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": func}),
                      target=cpu_target())
    rng = np.random.default_rng(0)
    words, params = weights(layout, n, k, rng)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    dev = tvm.cpu()
    for m in (1, 16, 37):
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = tvm.runtime.tensor(np.zeros((m, n), np.float32), dev)
        args = [x, words, params] + ([b] if bias else [])
        lib["main"](*[tvm.runtime.tensor(a, dev) for a in args], y)
        ref = reference(x, words, params, b)
        assert np.abs(y.numpy() - ref).max() <= 1e-5 * np.abs(ref).max(), m
