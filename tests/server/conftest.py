"""The server tests' shared fixtures: one main `localchat serve` for the whole session, and one
behind an API key with a tool-capable model beside it (the Responses and Messages tests)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_helpers import (
    KEYED_SERVER_KEY,
    MAX_BODY,
    MODEL,
    Server,
    make_home,
    start_server,
    stop_server,
)


@pytest.fixture(scope="session")
def server_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_home(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="session")
def server(server_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The main server: the model preloaded, 8 sequences batched, no key, a small body limit."""
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    srv = start_server(server_home, log, "--model", MODEL, "--max-concurrency", "8",
                       "--max-queue", "64", "--max-body-bytes", str(MAX_BODY))
    yield srv
    stop_server(srv)
    assert srv.proc.returncode is not None


@pytest.fixture(scope="session")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """SmolLM2 under its own template and under a tool-capable one, behind an API key."""
    from test_server_structured import TOOL_MODEL, tool_model_dir

    home = make_home(tmp_path_factory.mktemp("keyed"))
    tool_model_dir(home)
    log = tmp_path_factory.mktemp("keyed-log") / "server.log"
    srv = start_server(home, log, "--model", MODEL, "--model", TOOL_MODEL, "--max-models", "2",
                       "--api-key", KEYED_SERVER_KEY)
    yield srv
    stop_server(srv)
    shutil.rmtree(home / "models" / TOOL_MODEL, ignore_errors=True)
