"""Pulling from the terminal UI: the recommended model pulled with one key from the loopback hub
(the real huggingface_hub client, HF_ENDPOINT pointed at it) shows its stages and bytes in the
jobs panel, opens a chat with the model when done, appears installed, and is deleted after
confirming; the same through a real `localchat serve` (`localchat --server URL`), whose
`/api/pull` progress becomes the job's stages and bytes and whose `/api/delete` removes it; and
a server without the Ollama API (a plain OpenAI-compatible one) refusing store actions with a
message, its settings dialog saying "server default" for the defaults it does not tell.

A tiny random Llama is hosted under the recommended recipe's repo id, so the name goes the whole
way a user's does: recipe -> hub -> convert -> compile -> store. Compiled libraries are shared
with the other pull tests' cache (a kept library is exactly what compiling would produce).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from server.serve_helpers import Server, start_server, stop_server
from textual.widgets import DataTable, Input, Static
from tui_helpers import chat_ready, wait_for

from localchat.tui.app import LocalchatApp
from localchat.tui.backend import RECOMMENDED
from localchat.tui.remote import RemoteBackend
from localchat.tui.screens.dialogs import SETTINGS_FIELDS, SettingsScreen
from localchat.tui.screens.models import ModelsScreen

from fixtures import keep_libraries, seed_libraries
from hub_server import HubServer, folder_files, tiny_llama_folder

SIZE = (120, 40)
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the recommended recipe's repo
PULLED = f"{RECOMMENDED}:q4f32_1"
PULL_ENV = {"LOCALCHAT_DISK_RESERVE": "0", "PIP_NO_INDEX": "1", "HF_TOKEN": None,
            "HF_HUB_OFFLINE": None, "TRANSFORMERS_OFFLINE": None,
            "LOCALCHAT_PREBUILT_INDEX": None}


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    root = tmp_path_factory.mktemp("tui-pull-repos")
    with HubServer() as server:
        server.add_repo(REPO, folder_files(tiny_llama_folder(root / "tiny-llama")))
        yield server


def seeded_home(root: Path) -> Path:
    """An empty store whose compile cache holds the tests' kept libraries."""
    home = root / "home"
    libs = home / "cache" / "libs"
    libs.mkdir(parents=True)
    seed_libraries(libs)
    return home


def rows(screen: ModelsScreen) -> list[str]:
    """The names of the installed models' rows (a recipe's "available" row can bear the same
    name as an installed default quantization), None in place of other rows."""
    table = screen.query_one(DataTable)
    cells = [table.get_row_at(i) for i in range(table.row_count)]
    return [str(c[0]) if str(c[1]) == "installed" else None for c in cells]  # type: ignore


async def pull_recommended_then_delete(app: LocalchatApp, pulled: str = PULLED) -> None:
    """On an empty store: Enter pulls the recommended model; its job goes through download,
    convert and compile with byte progress; a chat with the model opens and loads it; F2 shows
    it listed (as `pulled`); d, y deletes it."""
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        assert isinstance(screen, ModelsScreen)
        await wait_for(pilot, lambda: screen.loaded, what="the model list")
        assert screen.query_one("#welcome").display
        await pilot.press("enter")  # the cursor sits on the recommended model
        await wait_for(pilot, lambda: app.jobs and not app.jobs[0].active, timeout=900,
                       what="the pull to end")
        job = app.jobs[0]
        assert job.state == "done", job.message
        assert job.ref == RECOMMENDED
        assert "download" in job.stages
        assert "convert to q4f32_1" in job.stages
        assert any(s.startswith("compile for llvm") for s in job.stages), job.stages
        assert job.stages.index("download") < job.stages.index("convert to q4f32_1")
        assert job.files_total >= 2 and job.files_done == job.files_total
        assert job.bytes_total > 100_000 and job.bytes_done == job.bytes_total
        assert job.model == pulled
        chat = await chat_ready(pilot, app)  # the finished pull opened a chat with the model
        assert chat.model_ref == pulled and chat.model is not None
        await pilot.press("f2")
        assert app.screen is screen
        await wait_for(pilot, lambda: pulled in rows(screen), what="the pulled model listed")
        assert not screen.query_one("#welcome").display
        panel = screen.query_one("#jobs", Static)
        await wait_for(pilot, lambda: f"{RECOMMENDED}: done" in str(panel.render()),
                       what="the jobs panel")
        table = screen.query_one(DataTable)
        table.move_cursor(row=rows(screen).index(pulled))
        await pilot.press("d", "y")
        await wait_for(pilot, lambda: pulled not in rows(screen), what="the model to go")


@pytest.mark.asyncio
async def test_the_recommended_model_is_pulled_with_one_key_then_deleted(
        hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = seeded_home(tmp_path)
    monkeypatch.setenv("LOCALCHAT_HOME", str(home))
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    for key, value in PULL_ENV.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    try:
        await pull_recommended_then_delete(LocalchatApp(device="cpu"))
    finally:
        keep_libraries(home / "cache" / "libs")
    assert not any((home / "models").glob("*/*/localchat-config.json"))


@pytest.fixture
def pull_server(hub: HubServer, tmp_path: Path) -> Iterator[Server]:
    """A `localchat serve` over an empty store that pulls from the loopback hub."""
    home = seeded_home(tmp_path / "server")
    srv = start_server(home, tmp_path / "server.log", env={"HF_ENDPOINT": hub.url, **PULL_ENV})
    yield srv
    stop_server(srv)
    keep_libraries(home / "cache" / "libs")


@pytest.mark.asyncio
async def test_a_localchat_server_pulls_and_deletes_for_the_ui(
        pull_server: Server, home: Path) -> None:
    backend = RemoteBackend(pull_server.url)
    try:
        # a server lists its only quantization by the bare name
        await pull_recommended_then_delete(LocalchatApp(backend=backend), RECOMMENDED)
    finally:
        backend.close()
    assert httpx.get(f"{pull_server.url}/api/tags").json()["models"] == []
    assert not any((pull_server.home / "models").glob("*/*/localchat-config.json"))


class _OpenAIOnly(BaseHTTPRequestHandler):
    """A bare OpenAI-compatible server: a model list, and 404 for everything else."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/v1/models":
            self._answer(200, {"object": "list", "data": [{"id": "other-model",
                                                          "object": "model"}]})
        else:
            self._answer(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:  # noqa: N802
        self._answer(404, {"error": {"message": "not found"}})

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def openai_only() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OpenAIOnly)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.asyncio
async def test_a_server_without_the_ollama_api_refuses_store_actions_saying_why(
        openai_only: str, home: Path) -> None:
    backend = RemoteBackend(openai_only)
    app = LocalchatApp(backend=backend)
    try:
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen
            assert isinstance(screen, ModelsScreen)
            await wait_for(pilot, lambda: screen.loaded, what="the model list")
            assert rows(screen) == ["other-model"]  # no catalog: it cannot pull
            await pilot.press("p")
            await wait_for(pilot, lambda: "pull is not available over --server" in " ".join(
                n.message for n in app._notifications), what="the pull refusal")
            await pilot.press("d")
            await wait_for(pilot, lambda: "rm is not available over --server" in " ".join(
                n.message for n in app._notifications), what="the delete refusal")
            assert app.screen is screen and not app.jobs
    finally:
        backend.close()


@pytest.mark.asyncio
async def test_a_server_that_does_not_tell_its_defaults_shows_server_default(
        openai_only: str, home: Path) -> None:
    backend = RemoteBackend(openai_only)
    app = LocalchatApp(model="other-model", backend=backend)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await chat_ready(pilot, app)
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen),
                           what="settings")
            shown = {app.screen.query_one(f"#{name}", Input).placeholder
                     for name in SETTINGS_FIELDS}
            assert shown == {"server default"}
    finally:
        backend.close()
