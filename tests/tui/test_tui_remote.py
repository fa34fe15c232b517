"""The terminal UI over a real `localchat serve` (`localchat --server URL`): a server subprocess
serves the real SmolLM2-135M-Instruct (the server tests' own helpers start it, with an API key)
and Textual's Pilot drives the app through `RemoteBackend`: the served model listed, a streamed
reply with client-side stats (the settings showing the server's defaults), Esc stopping it with
the partial text kept, a server error shown as one line (pulling and deleting through it:
test_tui_pull.py); the conversation's settings sent as the request's fields (the extensions
too: top_k is seen to act); and `localchat --server` at launch: a clear error for an
unreachable server or a wrong key, the key taken from LOCALCHAT_API_KEY."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server.serve_helpers import (
    MODEL,
    MODEL_REF,
    Server,
    free_port,
    make_home,
    start_server,
    stop_server,
)
from textual.widgets import DataTable, Input, Label, Static
from tui_helpers import chat_ready, send, set_fields, stop_a_long_reply, wait_for

from localchat import Engine, GenerationConfig
from localchat.tui.app import LocalchatApp
from localchat.tui.db import ChatDB
from localchat.tui.remote import RemoteBackend, request_body
from localchat.tui.screens.chat import ChatScreen
from localchat.tui.screens.dialogs import SettingsScreen
from localchat.tui.screens.models import ModelsScreen
from localchat.tui.settings import ChatSettings

SIZE = (120, 40)
KEY = "tui-test-key"
LOCALCHAT = Path(sys.executable).parent / "localchat"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Server]:
    """A real `localchat serve` on the test model, with an API key."""
    # compiled here first, into the user's library cache, where the server finds it: its own
    # LOCALCHAT_HOME is new, and a compile in there would be repeated by every run
    Engine.open(model_dir, device="cpu").close()
    root = tmp_path_factory.mktemp("tui-serve")
    srv = start_server(make_home(root), root / "server.log", "--model", "smollm2",
                       "--api-key", KEY)
    yield srv
    stop_server(srv)


@pytest.fixture
def backend(server: Server) -> Iterator[RemoteBackend]:
    b = RemoteBackend(server.url, KEY)
    yield b
    b.close()


@pytest.mark.asyncio
async def test_the_served_model_is_listed_beside_the_catalog_the_server_pulls_from(
        home: Path, backend: RemoteBackend) -> None:
    app = LocalchatApp(backend=backend)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        assert isinstance(screen, ModelsScreen)
        await wait_for(pilot, lambda: screen.loaded, what="the model list")
        assert backend.manages_store  # localchat serve has the Ollama API: pull and delete
        table = screen.query_one(DataTable)
        row = table.get_row_at(0)
        assert row[0] == MODEL and row[1] == "installed"  # the name the server lists
        assert row[2] == "llama" and row[5].endswith(" MB")  # from the server's /api/tags
        assert row[3] == "q0f32"  # a bare name's quantization: from /api/tags too
        assert table.row_count > 1 and table.get_row_at(1)[1] != "installed"  # the catalog
        assert not screen.query_one("#welcome").display
        table.move_cursor(row=0)
        await pilot.press("enter")  # an installed model: a chat over the server
        chat = await chat_ready(pilot, app)
        assert chat.model is not None and chat.model.name == MODEL
        assert chat.model.context_window == 8192  # from the server's /api/show
        status = str(chat.query_one("#status", Static).render())
        assert f"ready on {backend.where}" in status


@pytest.mark.asyncio
async def test_a_question_streams_a_reply_with_client_side_stats(
        home: Path, backend: RemoteBackend, model_dir: Path) -> None:
    app = LocalchatApp(model="smollm2", backend=backend)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_ready(pilot, app)
        # the settings show the server's defaults for the model (its /api/show), and "server
        # default" for what it does not tell
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen), what="settings")
        defaults = GenerationConfig.from_model_defaults(model_dir)
        placeholder = {name: app.screen.query_one(f"#{name}", Input).placeholder
                       for name in ("temperature", "top_k", "max_tokens")}
        assert placeholder == {"temperature": f"{defaults.temperature:g} (default)",
                               "top_k": f"{defaults.top_k} (default)",
                               "max_tokens": "server default"}
        await pilot.press("escape")
        await set_fields(pilot, app, temperature="0", max_tokens="24")
        await wait_for(pilot, lambda: app.screen is screen, what="settings to close")
        await send(pilot, screen, "What is the capital of France?")
        user, answer = screen.views
        assert answer.status == "done" and "Paris" in answer.content
        assert "Paris" in answer.body.source
        stats = screen.last_stats
        assert stats is not None and stats.prompt_tokens > 10  # from the server's usage
        assert 1 < stats.completion_tokens <= 24 and stats.finish_reason in ("stop", "length")
        assert stats.ttft_s > 0 and stats.decode_tok_s > 0  # measured here
        line = str(screen.query_one("#stats", Static).render())
        assert f"decode {stats.decode_tok_s:.1f} tok/s" in line and "/8192 tok" in line
    [row] = ChatDB().conversations()
    assert row.model == "smollm2" and row.settings["max_tokens"] == 24
    assert "Paris" in ChatDB().messages(row.id)[-1].content


@pytest.mark.asyncio
async def test_escape_stops_the_remote_reply_keeping_the_partial_text(
        home: Path, backend: RemoteBackend) -> None:
    app = LocalchatApp(model="smollm2", backend=backend)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_ready(pilot, app)
        answer = await stop_a_long_reply(pilot, screen)
        assert screen.last_stats is not None
        assert screen.last_stats.finish_reason == "cancelled"
        assert screen.last_stats.completion_tokens < 300
    stored = ChatDB().messages(screen.conversation_id)
    assert stored[-1].status == "cancelled" and stored[-1].content == answer.content


@pytest.mark.asyncio
async def test_a_server_error_is_shown_as_one_line_on_the_reply(
        home: Path, backend: RemoteBackend) -> None:
    app = LocalchatApp(model="smollm2", backend=backend)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_ready(pilot, app)
        # valid for the form, refused by the server: the prompt plus 9000 exceed 8192 tokens
        await set_fields(pilot, app, max_tokens="9000")
        await wait_for(pilot, lambda: app.screen is screen, what="settings to close")
        await send(pilot, screen, "Hello")
        answer = screen.views[-1]
        assert answer.status == "error" and answer.content == ""
        header = str(answer.query_one(".message-header", Label).render())
        assert "maximum context length is 8192 tokens" in header and "(HTTP 400)" in header
        assert "\n" not in header and "Traceback" not in header


@pytest.mark.asyncio
async def test_a_model_the_server_does_not_serve_is_a_load_error_naming_what_it_serves(
        home: Path, backend: RemoteBackend) -> None:
    app = LocalchatApp(model="no-such-model", backend=backend)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen)
                       and app.screen.load_error is not None, what="the load error")
        status = str(app.screen.query_one("#status", Static).render())
        assert "could not load no-such-model" in status
        assert f"does not serve 'no-such-model'; it serves: {MODEL}" in status


def run_localchat(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`localchat ARGS` with no terminal (stdin from /dev/null, output captured)."""
    return subprocess.run([str(LOCALCHAT), *args], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL, env={**os.environ, **env})


def test_launch_checks_the_server_and_its_key_before_the_ui(server: Server) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    out = run_localchat("--server", dead, env={})
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().startswith(f"localchat: error: cannot reach the server at {dead}")
    out = run_localchat("--server", server.url, "--api-key", "wrong", env={})
    assert out.returncode == 1
    assert "incorrect API key provided (HTTP 401)" in out.stderr
    # the right key from the environment passes the check; then the UI wants a terminal
    out = run_localchat("--server", server.url, env={"LOCALCHAT_API_KEY": KEY})
    assert out.returncode == 2 and "needs a terminal" in out.stderr


def test_the_request_carries_the_conversations_settings() -> None:
    settings = ChatSettings(system="Be brief.", temperature=0.5, top_p=0.9, top_k=5, min_p=0.1,
                            repetition_penalty=1.2, max_tokens=7, seed=3, output_format="json")
    body = request_body(MODEL_REF, [{"role": "user", "content": "Hi"}], settings)
    assert body == {
        "model": MODEL_REF, "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Hi"}],
        "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2,
        "max_tokens": 7, "seed": 3, "response_format": {"type": "json_object"},
    }
    plain = request_body(MODEL_REF, [{"role": "user", "content": "Hi"}], ChatSettings())
    assert set(plain) == {"model", "messages", "stream", "stream_options"}  # server defaults


def test_sampling_extensions_reach_the_server(backend: RemoteBackend) -> None:
    model = backend.load("smollm2")
    messages = [{"role": "user", "content": "Name three colors."}]

    def text(**settings: Any) -> str:
        return model.reply("k", messages, ChatSettings(max_tokens=16, **settings)).result().text

    greedy = text(temperature=0.0)
    # top_k=1 leaves one candidate: a hot, seeded sample is the greedy reply again, which it is
    # not without top_k, so the server did apply the extension
    assert text(temperature=2.0, seed=7, top_k=1) == greedy
    assert text(temperature=2.0, seed=7) != greedy
