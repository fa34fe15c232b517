"""`localchat run` as a user runs it: one message, JSON, raw text, stdin, user mistakes, and the
interactive chat driven through a pseudo-terminal (/stats, /set, /system, /reset, Ctrl-C)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures import converted, smollm2_hf_dir

LOCALCHAT = str(Path(sys.executable).with_name("localchat"))
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def model_dir() -> str:
    path = converted(smollm2_hf_dir(), "q0f32")
    # Compile here, once, so the CLI processes below (with their own timeouts) only load it.
    from localchat.engine.runtime import Model

    Model(path, "cpu")
    return str(path)


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """`localchat run ARGS`, greedy unless ARGS give a temperature (the default samples)."""
    greedy = [] if "--temperature" in args else ["--temperature", "0"]
    return subprocess.run(
        [LOCALCHAT, "run", *args, *greedy],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=300,
    )


def error_lines(stderr: str) -> list[str]:
    """stderr without TVM's compile-time warnings."""
    return [line for line in stderr.splitlines() if line and "Warning:" not in line]


def test_one_message_streams_the_reply_and_json_has_the_same_text(model_dir: str) -> None:
    plain = run(model_dir, QUESTION, "--max-tokens", "16", "--stats")
    assert plain.returncode == 0, plain.stderr
    assert "Paris" in plain.stdout
    stats = error_lines(plain.stderr)
    assert len(stats) == 1 and re.match(r"prompt \d+ tok, completion \d+ tok, ttft", stats[0])
    as_json = run(model_dir, QUESTION, "--max-tokens", "16", "--json")
    assert as_json.returncode == 0, as_json.stderr
    out = json.loads(as_json.stdout)
    assert out["text"] + "\n" == plain.stdout
    assert out["finish_reason"] == "stop"
    assert out["prompt_tokens"] > 20 and len(out["token_ids"]) == out["stats"]["completion_tokens"]
    assert {"prefill_tok_s", "decode_tok_s", "ttft_s"} <= set(out["stats"])


def test_piped_stdin_is_one_message(model_dir: str) -> None:
    piped = run(model_dir, "--json", "--max-tokens", "16", stdin=QUESTION + "\n")
    direct = run(model_dir, QUESTION, "--json", "--max-tokens", "16")
    assert piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout)["token_ids"] == json.loads(direct.stdout)["token_ids"]


def test_raw_skips_the_template_and_stop_flags_apply(model_dir: str) -> None:
    raw = run(model_dir, "The capital of France is", "--raw", "--json", "--max-tokens", "8")
    out = json.loads(raw.stdout)
    assert out["prompt_tokens"] == 5  # the text's own tokens, no chat markup
    assert out["finish_reason"] == "length"
    chat = run(model_dir, QUESTION, "--json", "--max-tokens", "16", "--stop", "Paris")
    out = json.loads(chat.stdout)
    assert out["finish_reason"] == "stop" and "Paris" not in out["text"]
    sampled = [
        json.loads(run(model_dir, "Name an animal.", "--json", "--temperature", "1.0",
                       "--top-p", "0.9", "--top-k", "50", "--min-p", "0.01",
                       "--repeat-penalty", "1.1", "--seed", "42", "--max-tokens", "8",
                       "--system", "You are a zookeeper.").stdout)["token_ids"]
        for _ in range(2)
    ]  # fmt: skip
    assert sampled[0] == sampled[1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--template", "nosuch"], "unknown conversation template 'nosuch'"),
        (["--raw", "--system", "x"], "--raw sends the text as it is"),
        (["--context-window", "1"], "--context-window must be at least 2"),
    ],
)
def test_user_mistakes_are_one_line_errors(model_dir: str, args: list[str], message: str) -> None:
    result = run(model_dir, "hi", *args)
    assert result.returncode == 1
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("localchat: error:"), result.stderr
    assert message in lines[0]


def test_missing_model_and_empty_message_are_one_line_errors(model_dir: str, tmp_path) -> None:
    missing = run(str(tmp_path / "nope"), "hi")
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert len(error_lines(missing.stderr)) == 1
    empty = run(model_dir, stdin="  \n")
    assert empty.returncode == 1 and error_lines(empty.stderr) == [
        "localchat: error: the message is empty"
    ]


def test_interactive_chat_through_a_pty(model_dir: str) -> None:
    pytest.importorskip("pexpect")
    # pexpect forks this process before exec; after earlier tests it holds TVM and engine
    # threads, and a fork of a threaded process can deadlock before exec. So the terminal
    # session is driven from a fresh interpreter.
    proc = subprocess.run(
        [sys.executable, __file__, "drive-pty", model_dir],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def drive_interactive_chat(model_dir: str) -> None:
    """The interactive session the test above checks (run in its own process)."""
    import pexpect
    child = pexpect.spawn(
        LOCALCHAT,
        ["run", model_dir, "--max-tokens", "24", "--temperature", "0"],
        encoding="utf-8",
        timeout=120,
        env={**os.environ, "TERM": "dumb"},
        dimensions=(40, 200),
    )
    try:
        child.expect("/help for commands")
        child.expect_exact(">>> ")
        child.sendline(QUESTION)
        child.expect("Paris")
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect(r"prompt (\d+) tok, completion")
        first_prompt = int(child.match.group(1))
        child.expect_exact(">>> ")

        child.sendline("And of Germany?")
        child.expect("Berlin")
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect(r"prompt (\d+) tok \(\+(\d+) reused\)")
        second_prompt, reused = int(child.match.group(1)), int(child.match.group(2))
        assert reused > first_prompt > second_prompt  # only the new turn was prefilled
        child.expect(r"context: (\d+) of 8192 tokens, 4 messages")
        child.expect_exact(">>> ")

        child.sendline("/set temperature 0.7")
        child.expect_exact("temperature = 0.7")
        child.sendline("/set temperature x")
        child.expect_exact("localchat: error: temperature must be a number, got 'x'")
        child.sendline("/set temperature 0")
        child.expect_exact("temperature = 0.0")
        child.sendline("/system You are a pirate.")
        child.expect_exact("(system prompt set)")
        child.sendline("/bogus")
        child.expect_exact("unknown command /bogus")

        child.sendline("/reset")
        child.expect_exact("(conversation cleared)")
        child.sendline("/stats")
        child.expect(r"context: 0 of 8192 tokens, 1 messages")  # the system prompt stays
        child.expect_exact(">>> ")

        # Ctrl-C stops a long reply and the chat goes on.
        child.sendline("/set max_tokens 1000")
        child.expect_exact("max_tokens = 1000")
        child.expect_exact(">>> ")
        child.sendline("Write a very long story about a brave knight and a dragon.")
        child.expect(r"\n[^\n]{20,}")  # part of the reply has streamed
        time.sleep(0.5)
        child.sendintr()
        child.expect_exact("[stopped]")
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect(r"completion (\d+) tok, .* finish cancelled")
        assert int(child.match.group(1)) < 1000
        child.expect_exact(">>> ")

        # Ctrl-C at the prompt does not leave; /exit does.
        child.sendintr()
        child.expect_exact("(use /exit or Ctrl-D to leave)")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


if __name__ == "__main__" and sys.argv[1:2] == ["drive-pty"]:
    drive_interactive_chat(sys.argv[2])
