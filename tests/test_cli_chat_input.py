"""The interactive chat's input through a real pty: a multi-line paste and a \"\"\" block are
one message each, and the banner names the model, not its quantization folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures import converted, smollm2_hf_dir

LOCALCHAT = str(Path(sys.executable).with_name("localchat"))


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> str:
    model = converted(smollm2_hf_dir(), "q0f32")
    from localchat.engine.runtime import Model

    Model(model, "cpu")  # compile here, once: the chat below only loads it
    home = tmp_path_factory.mktemp("home")
    (home / "models" / "smollm2").mkdir(parents=True)
    (home / "models" / "smollm2" / "q0f32").symlink_to(model, target_is_directory=True)
    return str(home)


def test_paste_and_block_are_one_message_each(home: str) -> None:
    pytest.importorskip("pexpect")
    # Driven from a fresh interpreter: forking this threaded process could deadlock (see
    # test_cli_run.py).
    proc = subprocess.run([sys.executable, __file__, "drive-pty", home],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def drive(home: str) -> None:
    import pexpect

    child = pexpect.spawn(LOCALCHAT, ["run", "smollm2", "--max-tokens", "8"], encoding="utf-8",
                          timeout=120, env={**os.environ, "TERM": "dumb", "LOCALCHAT_HOME": home},
                          dimensions=(40, 200))
    try:
        child.expect_exact("chatting with smollm2 (")  # the model's name, not "q0f32"
        child.expect_exact(">>> ")
        # A paste: three lines arriving at once are one user message.
        child.send("Here is a list:\nred\ngreen\n")
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect(r"context: \d+ of \d+ tokens, 2 messages")
        child.expect_exact(">>> ")
        # A block between """ lines, typed line by line, is one message too.
        child.sendline('"""')
        child.expect_exact("... ")
        child.sendline("first line")
        child.expect_exact("... ")
        child.sendline('second line"""')
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect(r"context: \d+ of \d+ tokens, 4 messages")
        child.expect_exact(">>> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


if __name__ == "__main__" and sys.argv[1:2] == ["drive-pty"]:
    drive(sys.argv[2])
