"""Bad input to `localchat convert`: one clear error line each, nothing written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hub_server import tiny_tokenizer_json
from llama_variants import build_variant


def convert(src: Path, out: Path, quant: str = "q0f32", *extra: str
            ) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "localchat.cli",
            "convert",
            str(src),
            "--quant",
            quant,
            "--output",
            str(out),
            "--no-compile",
            *extra,
        ],
        capture_output=True,
        text=True,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("localchat: error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "Traceback" not in proc.stderr


@pytest.fixture
def good(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(build_variant("llama-gqa"), src)
    (src / "tokenizer.json").write_bytes(tiny_tokenizer_json())  # `convert` needs a tokenizer
    return src


def test_folder_without_config(tmp_path: Path, good: Path) -> None:
    (good / "config.json").unlink()
    out = tmp_path / "out"
    assert_one_line_error(convert(good, out), "no config.json")
    assert not out.exists()


def test_unknown_architecture(tmp_path: Path, good: Path) -> None:
    cfg = json.loads((good / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    cfg["model_type"] = "gpt_neox"
    (good / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    assert_one_line_error(convert(good, out), "GPTNeoXForCausalLM", "unsupported")
    assert not out.exists()


def test_truncated_safetensors(tmp_path: Path, good: Path) -> None:
    weights = good / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    assert_one_line_error(convert(good, out), "truncated")
    assert not out.exists()
    assert not list(tmp_path.glob(".out*")), "temporary files left behind"


def test_unknown_quantization(tmp_path: Path, good: Path) -> None:
    out = tmp_path / "out"
    assert_one_line_error(convert(good, out, "q3f99"), "q3f99", "q4f32_1")
    assert not out.exists()


def test_failed_convert_keeps_existing_model(tmp_path: Path, good: Path) -> None:
    out = tmp_path / "out"
    assert convert(good, out).returncode == 0
    before = sorted(p.name for p in out.iterdir())
    (good / "model.safetensors").write_bytes(b"\x00" * 16)
    assert_one_line_error(convert(good, out, "q0f32", "--force"))
    assert sorted(p.name for p in out.iterdir()) == before


def test_unsupported_option_is_named(tmp_path: Path, good: Path) -> None:
    cfg = json.loads((good / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    (good / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(convert(good, tmp_path / "out"), "dynamic")


def test_existing_model_directory_needs_force(tmp_path: Path, good: Path) -> None:
    out = tmp_path / "out"
    assert convert(good, out).returncode == 0
    before = (out / "localchat-config.json").stat().st_mtime_ns
    assert_one_line_error(convert(good, out), "already a model directory", "--force")
    assert (out / "localchat-config.json").stat().st_mtime_ns == before
    assert convert(good, out, "q0f32", "--force").returncode == 0


def test_output_naming_a_file(tmp_path: Path, good: Path) -> None:
    out = tmp_path / "out.txt"
    out.write_text("keep me")
    assert_one_line_error(convert(good, out), "is a file")
    assert out.read_text() == "keep me"


def test_negative_vocab_size(tmp_path: Path, good: Path) -> None:
    cfg = json.loads((good / "config.json").read_text())
    cfg["vocab_size"] = -5
    (good / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(convert(good, tmp_path / "out"), "vocab_size", "-5")
    assert not (tmp_path / "out").exists()


def test_layer_count_that_disagrees_with_the_checkpoint(tmp_path: Path, good: Path) -> None:
    cfg = json.loads((good / "config.json").read_text())
    cfg["num_hidden_layers"] = 1  # the checkpoint has 2
    (good / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(convert(good, tmp_path / "out"), "num_hidden_layers=1", "2 layers")
    assert not (tmp_path / "out").exists()


def test_folder_without_a_tokenizer(tmp_path: Path, good: Path) -> None:
    (good / "tokenizer.json").unlink()
    assert_one_line_error(convert(good, tmp_path / "out"), "no tokenizer")
    assert not (tmp_path / "out").exists()


def test_help_names_every_quantization_mode() -> None:
    """`localchat convert --help` lists every mode the engine knows (the help is spelled out
    so that it needs no engine import; this keeps the two in step)."""
    from localchat.engine.build.quantization import QUANT_MODES

    out = subprocess.run(
        [sys.executable, "-m", "localchat.cli", "convert", "--help"],
        capture_output=True, text=True, check=True,
    ).stdout
    flat = " ".join(out.split())
    missing = [name for name in QUANT_MODES if name not in flat]
    assert not missing, f"convert --help does not name {missing}"
