"""A TVM runtime without its compiler (`TVM_USE_RUNTIME_LIB=1`, as on a machine that only runs)
loads a model whose library was compiled elsewhere and gives the same logits; it names the
command to run where none was compiled for its device. `localchat convert --device cuda:sm_80`
compiles for a GPU that is not on this machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from localchat import model_dir as md
from localchat.cli import main
from localchat.engine.device import cross_compile_device
from localchat.engine.runtime import Model
from localchat.errors import DeviceError

from fixtures import converted
from hub_server import tiny_llama_folder
from llama_variants import build_variant

PROMPT = [5, 17, 200, 3, 99, 41]
_RUN = r"""
import json, sys
import numpy as np
import tvm.base
from localchat.engine.runtime import Model
from localchat.errors import LocalchatError
assert tvm.base._RUNTIME_ONLY
try:
    model = Model(sys.argv[1], "cpu")
except LocalchatError as exc:
    print(json.dumps({"error": str(exc)}))
    sys.exit(0)
seq = model.new_sequence()
first = model.prefill(seq, json.loads(sys.argv[2]))
second = model.decode([seq], [int(np.argmax(first))])[0]
print(json.dumps({"library": model.library.path.name, "logits": [first.tolist(), second.tolist()]}))
"""


def _runtime_only(model_dir: Path) -> dict:
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1"}
    out = subprocess.run([sys.executable, "-c", _RUN, str(model_dir), json.dumps(PROMPT)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_runtime_without_the_compiler_runs_a_library_compiled_here(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(converted(build_variant("llama-odd"), "q0f32"), folder)
    full = Model(folder, "cpu")  # compiles (or finds) the library and links it into lib/
    seq = full.new_sequence()
    first = full.prefill(seq, PROMPT)
    second = full.decode([seq], [int(np.argmax(first))])[0]
    got = _runtime_only(folder)
    assert got["library"] == full.library.path.name
    np.testing.assert_array_equal(np.asarray(got["logits"][0], dtype=np.float32), first)
    np.testing.assert_array_equal(np.asarray(got["logits"][1], dtype=np.float32), second)


def test_a_runtime_without_the_compiler_names_the_command_when_no_library_is_there(
        tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(converted(build_variant("llama-odd"), "q0f32"), folder,
                    ignore=shutil.ignore_patterns("lib"))
    got = _runtime_only(folder)
    assert "no library compiled for llvm" in got["error"]
    assert "localchat convert SOURCE --device cpu" in got["error"]


def test_convert_compiles_for_a_gpu_elsewhere(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The library for cuda:sm_80 holds its kernels as CUDA source (no GPU here to build them
    for), which the runtime there compiles when it loads it; nothing is loaded here."""
    out = tmp_path / "for-gpu"
    source = tiny_llama_folder(tmp_path / "source")
    assert main(["convert", str(source), "--quant", "q4f16_1",
                 "--device", "cuda:sm_80", "-o", str(out)]) == 0
    libs = md.library_files(out)
    assert len(libs) == 1 and libs[0].startswith("cuda-sm_80-")
    assert b"__global__" in (out / md.LIB_DIR / libs[0]).read_bytes()
    assert not md.check_files(out)  # the manifest records the library
    assert "copy" in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["cuda:80", "metal:sm_80", "cuda:sm_x"])
def test_a_bad_cross_compile_spec_is_refused(spec: str) -> None:
    with pytest.raises(DeviceError, match="cannot compile for"):
        cross_compile_device(spec)


def test_a_gpu_prefills_a_windowed_model_in_chunks_no_longer_than_its_window() -> None:
    from localchat.engine.runtime import prefill_chunk_for

    gemma3 = {"model_config": {"sliding_window": 512}}
    assert prefill_chunk_for(gemma3, "cuda", 2048) == 512
    assert prefill_chunk_for(gemma3, "cuda", 256) == 256
    assert prefill_chunk_for(gemma3, "cpu", 2048) == 2048  # our CPU kernels window within one
    assert prefill_chunk_for({"model_config": {"sliding_window": 0}}, "metal", 2048) == 2048


def test_running_on_a_gpu_spec_without_the_gpu_says_how_to_compile_for_it() -> None:
    from localchat.engine.device import backend_supported, device_present, select_device

    if not backend_supported("cuda") or device_present("cuda"):
        pytest.skip("this TVM has no CUDA, or this machine has a CUDA GPU")
    with pytest.raises(DeviceError, match=r"convert --device cuda:sm_90"):
        select_device("cuda:sm_90")
