"""Fixtures of the terminal-UI tests: a LOCALCHAT_HOME per test (empty, or a store holding the
real SmolLM2-135M-Instruct as `smollm2:q0f32`), and a helper to wait on a condition."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from tui_helpers import wait_for

from fixtures import converted, smollm2_hf_dir


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The real SmolLM2-135M-Instruct converted to q0f32 (cached across runs)."""
    return converted(smollm2_hf_dir(), "q0f32")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty LOCALCHAT_HOME."""
    root = tmp_path / "home"
    root.mkdir()
    monkeypatch.setenv("LOCALCHAT_HOME", str(root))
    return root


@pytest.fixture
def store_home(home: Path, model_dir: Path) -> Path:
    """A LOCALCHAT_HOME whose store holds the test model as `smollm2:q0f32` (a link)."""
    (home / "models" / "smollm2").mkdir(parents=True)
    (home / "models" / "smollm2" / "q0f32").symlink_to(model_dir, target_is_directory=True)
    return home


@pytest.fixture
def wait() -> Callable[..., object]:
    """`await wait(pilot, condition, timeout=..., what=...)`: see `wait_for`."""
    return wait_for
