"""The kernels' thread count: --threads N, LOCALCHAT_NUM_THREADS, else one per physical core;
bad values are one-line errors, and the count set is the count the engine's pool runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from localchat.engine import threads

from fixtures import converted, smollm2_hf_dir

LOCALCHAT = str(Path(sys.executable).parent / "localchat")

# Opens the model with `configure_threads(N)`, generates, and prints how many OS threads the
# process has: TVM's pool adds N - 1 workers to the engine's scheduler thread (it runs task 0).
COUNT_CHILD = r"""
import json, os, sys
from localchat.engine.threads import configure_threads
configure_threads(int(sys.argv[2]) if sys.argv[2] != "-" else None)
from localchat.engine.engine import Engine
engine = Engine.open(sys.argv[1], device="cpu")
reply = engine.chat([{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0).result()
print(json.dumps({"tasks": len(os.listdir("/proc/self/task")), "text": reply.text}))
engine.close()
"""


@pytest.fixture(scope="module")
def model_dir() -> str:
    path = converted(smollm2_hf_dir(), "q4f32_1")
    from localchat.engine.runtime import Model

    Model(path, "cpu")  # compiled once here; the children below only load it
    return str(path)


def test_parse_threads_accepts_whole_numbers_and_names_the_source() -> None:
    assert threads.parse_threads(" 3 ") == 3
    for bad in ("0", "-2", "two", "1.5", ""):
        with pytest.raises(threads.ThreadCountError, match="LOCALCHAT_NUM_THREADS must be"):
            threads.parse_threads(bad, "LOCALCHAT_NUM_THREADS")


def test_configure_threads_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(threads.THREADS_ENV, raising=False)
    monkeypatch.delenv(threads.TVM_THREADS_ENV, raising=False)
    assert threads.configure_threads() == threads.physical_cores() >= 1
    monkeypatch.setenv(threads.TVM_THREADS_ENV, "5")  # a user's own TVM setting is kept
    assert threads.configure_threads() == 5
    monkeypatch.setenv(threads.THREADS_ENV, "3")  # ours wins over it
    assert threads.configure_threads() == 3 and os.environ[threads.TVM_THREADS_ENV] == "3"
    assert threads.configure_threads(1) == 1  # and --threads over both
    monkeypatch.setenv(threads.THREADS_ENV, "lots")
    with pytest.raises(threads.ThreadCountError):
        threads.configure_threads()
    assert threads.ensure_threads() == threads.physical_cores()  # never raises


def _tasks(model_dir: str, count: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", COUNT_CHILD, model_dir, count],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_engine_runs_the_configured_number_of_threads(model_dir: str) -> None:
    one, three = _tasks(model_dir, "1"), _tasks(model_dir, "3")
    assert three["tasks"] - one["tasks"] == 2  # two more pool workers
    assert one["text"] == three["text"]  # the count never changes the numbers' meaning
    from_env = _tasks(model_dir, "-", {threads.THREADS_ENV: "3"})
    assert from_env["tasks"] == three["tasks"]


@pytest.mark.parametrize("argv, message", [
    (["run", "MODEL", "hi", "--threads", "0"], "argument --threads: a whole number"),
    (["--threads", "two"], "argument --threads: a whole number"),
    (["serve", "--threads", "-1"], "argument --threads: a whole number"),
])
def test_bad_thread_counts_are_usage_errors(model_dir: str, argv: list[str], message: str) -> None:
    argv = [model_dir if a == "MODEL" else a for a in argv]
    out = subprocess.run([LOCALCHAT, *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_bad_environment_value_is_a_one_line_error(model_dir: str) -> None:
    out = subprocess.run([LOCALCHAT, "run", model_dir, "hi", "--max-tokens", "2"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, threads.THREADS_ENV: "many"})
    assert out.returncode == 1, out.stderr
    assert "LOCALCHAT_NUM_THREADS must be a whole number of threads" in out.stderr
    assert "Traceback" not in out.stderr
    ok = subprocess.run([LOCALCHAT, "run", model_dir, "hi", "--max-tokens", "2", "--threads",
                         "1", "--temperature", "0"], capture_output=True, text=True, timeout=300,
                        env={**os.environ, threads.THREADS_ENV: "many"})
    assert ok.returncode == 0, ok.stderr  # --threads given: the variable is not consulted
