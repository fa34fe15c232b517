"""Unusual input to `localchat run`, through the real CLI in subprocesses: options after the
model and before the message, invalid UTF-8 in the argument and on stdin, a reply cut by
--max-tokens (said on stderr), and a one-shot reply that is not cut at 256 tokens.

The model is a tiny random Llama with a 1024-token window (its library is kept in the test
cache between runs, like test_store_healing's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures import keep_libraries, seed_libraries
from hub_server import tiny_llama_folder


def localchat(home: Path, *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "LOCALCHAT_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "localchat.cli", *args], input=stdin,
                          capture_output=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("input")
    src = tiny_llama_folder(root / "src")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 1024}))
    home = root / "home"
    libs = home / "cache" / "libs"
    libs.mkdir(parents=True)
    seed_libraries(libs)
    out = root / "tiny"
    proc = localchat(home, "convert", str(src), "--quant", "q4f32_1", "--output", str(out))
    assert proc.returncode == 0, proc.stderr.decode()
    keep_libraries(libs)
    return home, out


def one_error(proc: subprocess.CompletedProcess[bytes]) -> str:
    err = proc.stderr.decode()
    assert proc.returncode == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("localchat: error:"), err
    return lines[0]


def test_options_anywhere(model: tuple[Path, Path]) -> None:
    home, path = model
    after = localchat(home, "run", str(path), "--temperature", "0", "--max-tokens", "3",
                      "--raw", "--json", "hello world")
    before = localchat(home, "run", str(path), "hello world", "--temperature", "0",
                       "--max-tokens", "3", "--raw", "--json")
    assert after.returncode == 0, after.stderr.decode()
    assert json.loads(after.stdout)["token_ids"] == json.loads(before.stdout)["token_ids"]
    extra = localchat(home, "run", str(path), "one", "two")
    assert extra.returncode == 2 and b"unrecognized arguments: two" in extra.stderr


def test_invalid_utf8_argument_and_stdin_are_clear_errors(model: tuple[Path, Path]) -> None:
    home, path = model
    bad_arg = localchat(home, "run", str(path), os.fsdecode(b"caf\xe9 au lait"))
    assert "not valid UTF-8 (byte 0xe9" in one_error(bad_arg)
    bad_stdin = localchat(home, "run", str(path), stdin=b"hello \xff\xfe world\n")
    assert "stdin is not valid UTF-8 (byte 0xff at offset 6)" in one_error(bad_stdin)


def test_a_cut_reply_says_so_and_one_shot_is_not_cut_at_256(model: tuple[Path, Path]) -> None:
    home, path = model
    cut = localchat(home, "run", str(path), "hello", "--raw", "--json", "--max-tokens", "5")
    assert cut.returncode == 0 and json.loads(cut.stdout)["finish_reason"] == "length"
    assert "[cut at 5 tokens by --max-tokens" in cut.stderr.decode()
    full = localchat(home, "run", str(path), "hello", "--raw", "--json")
    out = json.loads(full.stdout)
    # a random model rarely ends by itself: it writes until the 1024-token window is full
    assert out["finish_reason"] == "stop" or len(out["token_ids"]) > 256, out["finish_reason"]
    if out["finish_reason"] == "length":
        assert "context window is full" in full.stderr.decode()
