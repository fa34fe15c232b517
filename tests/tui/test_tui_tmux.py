"""`localchat` in a real terminal: started in a tmux session (120x40) on a store holding the real
SmolLM2-135M-Instruct, a question typed with send-keys, the reply read back with capture-pane."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from localchat import Engine
from localchat.tui.db import ChatDB

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not on PATH")
LOCALCHAT = Path(sys.executable).parent / "localchat"


class Tmux:
    """One detached tmux session on its own server socket (never the user's tmux)."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.name = "lc"

    def __call__(self, *args: str) -> str:
        out = subprocess.run(["tmux", "-S", str(self.socket), *args], check=True,
                             capture_output=True, text=True, timeout=20)
        return out.stdout

    def keys(self, *keys: str) -> None:
        self("send-keys", "-t", self.name, *keys)

    def type(self, text: str) -> None:
        self("send-keys", "-t", self.name, "-l", text)

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", self.name)

    def wait(self, condition: Callable[[str], bool], timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if condition(text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}:\n{text}")
            time.sleep(0.2)


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
    # greedy and short: ctrl+s opens the settings, Tab moves from the system prompt to the
    # temperature, then on to max_tokens (top_p, top_k, min_p, repetition_penalty between)
    tmux.keys("C-s")
    tmux.wait(lambda s: "Conversation settings" in s, 10, "the settings dialog")
    # in a real terminal the dialog paints before its first field takes the focus, and a Tab
    # sent in between lands elsewhere; nothing on screen tells the moment, so give it a second
    time.sleep(1)
    tmux.keys("Tab")
    tmux.type("0")
    tmux.wait(lambda s: re.search(r"Temperature +▊ +0 ", s) is not None, 10,
              "the temperature typed")
    tmux.keys("Tab", "Tab", "Tab", "Tab", "Tab")
    tmux.type("24")
    tmux.wait(lambda s: re.search(r"Max tokens +▊ +24 ", s) is not None, 10,
              "the max tokens typed")
    tmux.keys("C-s")
    # the form scrolls with the focus (its title may be off screen): the dialog is gone when
    # no field shows and the status line it covered is whole again
    tmux.wait(lambda s: "Max tokens" not in s and "ready on cpu" in s, 10,
              "the settings to close")
    tmux.type("What is the capital of France?")
    tmux.keys("Enter")
    screen = tmux.wait(lambda s: "decode" in s and "Paris" in s
                       and "tok/s" in s.split("decode", 1)[1][:20]
                       and "decode – tok/s" not in s, 60, "the reply with Paris")
    assert "What is the capital of France?" in screen
    # the stats line updates while the reply streams: quit once the reply is stored
    deadline = time.monotonic() + 30
    while not any(m.role == "assistant" for c in ChatDB().conversations()
                  for m in ChatDB().messages(c.id)):
        assert time.monotonic() < deadline, "the reply was never stored"
        time.sleep(0.2)
    tmux.keys("C-q")
    tmux.wait(lambda s: "ready on cpu" not in s, 10, "localchat to quit")
    [row] = ChatDB().conversations()  # what was typed reached the app and was stored
    assert row.title == "What is the capital of France?"
    assert row.settings["temperature"] == 0.0 and row.settings["max_tokens"] == 24
    assert "Paris" in ChatDB().messages(row.id)[-1].content
