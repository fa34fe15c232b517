"""The server tests' shared fixtures: one main `localchat serve` for the whole session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_helpers import MAX_BODY, MODEL, Server, make_home, start_server, stop_server


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
