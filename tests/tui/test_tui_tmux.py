"""`localchat` in a real terminal: started in a tmux session (120x40) on a store holding the real
SmolLM2-135M-Instruct, a question typed with send-keys, the reply read back with capture-pane."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from localchat import Engine
from localchat.tui.db import ChatDB

from tmux_driver import Tmux

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not on PATH")
LOCALCHAT = Path(sys.executable).parent / "localchat"


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[Tmux]:
    # a short socket path: AF_UNIX paths are limited to ~100 bytes
    t = Tmux(Path("/tmp") / f"lc-tmux-{uuid.uuid4().hex[:8]}")
    yield t
    subprocess.run(["tmux", "-S", str(t.socket), "kill-server"], capture_output=True)
    t.socket.unlink(missing_ok=True)


def test_localchat_in_tmux_answers_paris(store_home: Path, model_dir: Path, tmux: Tmux,
                                         tmp_path: Path) -> None:
    Engine.open(model_dir, device="cpu").close()  # a library to compile is compiled up front
    assert LOCALCHAT.exists(), LOCALCHAT
    # a fixed size with no client attached (no `window-size manual`: tmux 3.3a's server
    # segfaults on it when the session is created detached with -x/-y)
    conf = tmp_path / "tmux.conf"
    conf.write_text("set -g default-size 120x40\n")
    tmux("-f", str(conf), "new-session", "-d", "-s", tmux.name, "-x", "120", "-y", "40",
         "-e", f"LOCALCHAT_HOME={store_home}", "-e", "TERM=xterm-256color",
         f"{LOCALCHAT} --model smollm2 --device cpu; sleep 30")
    assert tmux("display", "-p", "-t", tmux.name, "#{window_width}x#{window_height}").strip() \
        == "120x40"
    tmux.wait(lambda s: "ready on cpu" in s, 60, "the model to load")
    # Default settings: the settings dialog is driven by the Pilot tests; over tmux, Tab
    # presses raced the dialog's focus on a loaded CI machine.
    tmux.type("What is the capital of France?")
    tmux.keys("Enter")
    # at the default temperature a 135M model may ramble on: once the reply streams (the
    # decode rate shows), Esc stops it, and the partial reply is stored
    tmux.wait(lambda s: re.search(r"decode +[\d.]+ tok/s", s) is not None, 60,
              "the reply to stream")
    tmux.keys("Escape")
    deadline = time.monotonic() + 30
    while True:  # the reply is stored when it has finished streaming
        replies = [m.content for c in ChatDB().conversations() for m in ChatDB().messages(c.id)
                   if m.role == "assistant"]
        if replies:
            break
        assert time.monotonic() < deadline, f"no reply stored:\n{tmux.screen()}"
        time.sleep(0.2)
    [reply] = replies
    words = re.findall(r"[A-Za-z]{3,}", reply)
    assert words, reply
    # the end of the reply is on screen (the view follows the bottom), with the decode rate
    tmux.wait(lambda s: words[-1] in s and re.search(r"decode +[\d.]+ tok/s", s)
                       is not None, 20, f"the reply's last word {words[-1]!r} and the stats")
    tmux.keys("C-q")
    tmux.wait(lambda s: "ready on cpu" not in s, 10, "localchat to quit")
    [row] = ChatDB().conversations()  # what was typed reached the app and was stored
    assert row.title == "What is the capital of France?"
