"""A detached tmux session on its own server socket (never the user's tmux), driven the way a
user types: for the terminal UI's tests in a real terminal."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path


class Tmux:
    """tmux at `socket`, session `name`: run tmux commands, type, read the screen, wait."""

    def __init__(self, socket: Path, name: str = "lc") -> None:
        self.socket = socket
        self.name = name

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
