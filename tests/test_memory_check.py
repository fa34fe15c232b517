"""A model too large for the memory left is refused before loading, naming the sizes: the real
tiny model under a LOCALCHAT_MAX_MEMORY cap, through the engine API and the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from localchat import Engine
from localchat.engine.memory import available_memory, check_fits, weight_bytes_on_disk
from localchat.errors import InsufficientMemoryError, ModelConfigError
from localchat.units import parse_size

from fixtures import converted, smollm2_hf_dir


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return converted(smollm2_hf_dir(), "q0f32")


def test_weights_on_disk_are_the_shards(model_dir: Path) -> None:
    shards = sum(p.stat().st_size for p in model_dir.glob("params_shard_*.bin"))
    assert weight_bytes_on_disk(model_dir) == shards > 100_000_000


def test_engine_refuses_a_model_over_the_cap_naming_sizes(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALCHAT_MAX_MEMORY", "200MB")
    with pytest.raises(InsufficientMemoryError) as err:
        Engine.open(model_dir, device="cpu")
    msg = str(err.value)
    assert "200.0 MB available (capped by LOCALCHAT_MAX_MEMORY)" in msg
    assert f"weights {weight_bytes_on_disk(model_dir) / 1e6:.1f} MB" in msg
    assert err.value.needed_bytes > err.value.available_bytes == 200_000_000
    assert err.value.http_status == 507 and err.value.code == "insufficient_memory"


def test_a_cap_above_the_need_loads_and_generates(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALCHAT_MAX_MEMORY", "64GiB")
    with Engine.open(model_dir, device="cpu", options={"temperature": 0.0,
                                                       "max_tokens": 2}) as eng:
        assert eng.complete("Hello").result().token_ids


def test_check_fits_uses_free_memory_without_a_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCALCHAT_MAX_MEMORY", raising=False)
    free = available_memory()
    assert free is not None and free > 0  # /proc/meminfo's MemAvailable on Linux
    check_fits("small", 1000, 1000)
    with pytest.raises(InsufficientMemoryError, match=r"of memory available"):
        check_fits("huge", 4 * free, 0)


def test_malformed_cap_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALCHAT_MAX_MEMORY", "lots")
    with pytest.raises(ModelConfigError, match="LOCALCHAT_MAX_MEMORY: not a size"):
        available_memory()
    assert parse_size("8GiB") == 8 * 1024**3 and parse_size("1.5 GB") == 1_500_000_000


def test_cli_prints_one_line_and_no_traceback(model_dir: Path) -> None:
    env = {**os.environ, "LOCALCHAT_MAX_MEMORY": "100MB"}
    proc = subprocess.run([sys.executable, "-m", "localchat.cli", "run", str(model_dir), "Hi"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "needs about" in proc.stderr and "100.0 MB available" in proc.stderr


def test_pull_refuses_a_recipe_larger_than_the_machine_before_downloading(
        tmp_path: Path) -> None:
    """Mixtral 8x7B's 4-bit weights (~29 GB) on a machine capped at 16 GB: refused with both
    sizes before any request (the hub address is a closed port: reaching it would fail
    differently), and nothing is left in the store."""
    env = {**os.environ, "LOCALCHAT_MAX_MEMORY": "16GB", "LOCALCHAT_HOME": str(tmp_path),
           "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"}
    proc = subprocess.run([sys.executable, "-m", "localchat.cli", "pull", "mixtral-8x7b-instruct"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "mixtral-8x7b-instruct:q4f32_1 needs about 29.5 GB of memory" in proc.stderr
    assert "16.0 GB in all (capped by LOCALCHAT_MAX_MEMORY)" in proc.stderr
    assert not (tmp_path / "models" / "mixtral-8x7b-instruct").exists()
