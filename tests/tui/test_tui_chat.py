"""Chatting in the terminal UI with the real SmolLM2-135M-Instruct, driven by Textual's Pilot:
a streamed Markdown reply with live stats, Ctrl+C stopping it (keeping the partial text) and not
quitting, settings validated inline and showing the engine's defaults, regenerate / edit &
resend / copy / export, and conversations persisted in SQLite that the app reopens and continues
after a restart. One engine is loaded per module and shared by the apps."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from textual.widgets import Input, Label, Select, Static, TextArea
from tui_helpers import (
    chat_ready,
    notifications,
    send,
    set_fields,
    start_a_long_reply,
    stop_the_reply,
    wait_for,
)

from localchat import Engine
from localchat.tui.app import LocalchatApp
from localchat.tui.backend import LocalBackend
from localchat.tui.db import ChatDB
from localchat.tui.screens.dialogs import SETTINGS_FIELDS, ConversationsScreen, SettingsScreen
from localchat.tui.widgets.jobs import Job
from localchat.tui.widgets.prompt import PromptInput

pytestmark = pytest.mark.asyncio
SIZE = (120, 40)
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def backend(model_dir: Path) -> Iterator[LocalBackend]:
    """One in-process backend (and so one loaded engine) for every app of this module."""
    # Before any test's LOCALCHAT_HOME: a library the engine must (re)compile lands in the
    # user's library cache, where every test's store then finds it.
    Engine.open(model_dir, device="cpu").close()
    b = LocalBackend(device="cpu")
    yield b
    b.close()


async def test_ask_stream_stats_persist_restart_and_continue(
        store_home: Path, backend: LocalBackend) -> None:
    app = LocalchatApp(model="smollm2", backend=backend)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_ready(pilot, app)
        assert screen.focused is screen.query_one(PromptInput)
        await set_fields(pilot, app, temperature="0", max_tokens="24")
        await wait_for(pilot, lambda: app.screen is screen, what="settings to close")
        assert screen.settings.temperature == 0.0 and screen.settings.max_tokens == 24
        await send(pilot, screen, QUESTION)
        user, answer = screen.views
        assert user.content == QUESTION
        assert answer.status == "done" and "Paris" in answer.content
        assert "Paris" in answer.body.source
        stats = str(screen.query_one("#stats", Static).render())
        assert screen.stats.decode_tok_s and screen.stats.decode_tok_s > 0
        assert f"decode {screen.stats.decode_tok_s:.1f} tok/s" in stats
        assert "TTFT" in stats and "device cpu" in stats and "/8192 tok" in stats
        # the reply's own stats line, as `ollama run --verbose` prints after each reply: the
        # same numbers as its ReplyStats
        reply = screen.last_stats
        assert reply is not None and reply.decode_tok_s > 0 and reply.prefill_tok_s > 0
        line = str(answer.query_one(".message-stats", Label).render())
        assert f"decode {reply.decode_tok_s:,.1f} tok/s" in line, line
        assert f"prefill {reply.prefill_tok_s:,.1f} tok/s" in line, line
        assert f"prompt {reply.prompt_tokens:,} tok" in line, line
        assert f"reply {reply.completion_tokens:,} tok" in line, line
        assert f"TTFT {reply.ttft_s * 1000:,.0f} ms" in line, line
        assert answer.query_one(".message-stats", Label).display
        assert not user.query_one(".message-stats", Label).display  # a user message has none
        cid = screen.conversation_id
    db = ChatDB()
    [row] = db.conversations()
    assert row.id == cid and row.title == QUESTION and row.model == "smollm2"
    assert row.settings["temperature"] == 0.0
    stored = db.messages(cid)
    assert [m.role for m in stored] == ["user", "assistant"]
    assert "Paris" in stored[1].content and stored[1].stats["decode_tok_s"] > 0

    # restart: the app opens on the conversation, with its messages, and it continues
    app = LocalchatApp(backend=backend)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_ready(pilot, app)
        assert screen.conversation_id == cid
        assert [v.content for v in screen.views][0] == QUESTION
        reopened = str(screen.views[1].query_one(".message-stats", Label).render())
        assert line == reopened  # the stored reply shows the stats it had
        assert screen.settings.temperature == 0.0
        await pilot.press("f3")  # and it is listed
        await wait_for(pilot, lambda: isinstance(app.screen, ConversationsScreen),
                       what="the conversation list")
        assert app.screen.rows[0].title == QUESTION
        await pilot.press("escape")
        assert app.screen is screen
        await send(pilot, screen, "And of Germany?")
        assert len(screen.views) == 4 and screen.views[-1].status == "done"
        assert screen.views[-1].content
    assert [m.role for m in db.messages(cid)] == ["user", "assistant"] * 2


async def test_ctrl_c_stops_the_reply_keeping_the_partial_text_and_never_quits(
        store_home: Path, backend: LocalBackend) -> None:
    app = LocalchatApp(model="smollm2", backend=backend)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_ready(pilot, app)
        await start_a_long_reply(pilot, screen)
        # a pull that ends meanwhile does not take the user away from the streaming reply
        app.pull_ended(Job("smollm2", state="done", model="smollm2:q0f32"))
        await wait_for(pilot, lambda: "pulled smollm2:q0f32" in notifications(app),
                       what="the pull's notification")
        assert app.screen is screen and screen.busy
        answer = await stop_the_reply(pilot, screen, "ctrl+c")  # Esc: test_tui_remote.py
        assert screen.stats.completion_tokens < 200
        assert app.is_running and "Ctrl+Q quits" not in notifications(app)
        await pilot.press("ctrl+c")  # nothing streams now: it says how to quit
        assert app.is_running and app.screen is screen
        assert "Ctrl+Q quits" in notifications(app)
    stored = ChatDB().messages(screen.conversation_id)
    assert stored[-1].status == "cancelled" and stored[-1].content == answer.content


async def test_quitting_mid_reply_keeps_the_partial_text_marked(
        store_home: Path, backend: LocalBackend) -> None:
    app = LocalchatApp(model="smollm2", backend=backend)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_ready(pilot, app)
        screen.query_one(PromptInput).focus()
        await pilot.press(*"Write a very long story about a dragon.")
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.stats.completion_tokens >= 3, what="the first tokens")
        stream = screen.stream
        await pilot.press("ctrl+q")
    stored = ChatDB().messages(screen.conversation_id)
    assert [m.role for m in stored] == ["user", "assistant"]
    assert stored[-1].status == "cancelled" and stored[-1].content.strip()
    assert stream is not None and stream.cancelled  # the model stopped too
    assert stream.wait(timeout=10)


async def test_the_settings_show_the_engines_defaults_and_refuse_an_invalid_temperature(
        store_home: Path, backend: LocalBackend) -> None:
    app = LocalchatApp(model="smollm2", backend=backend)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_ready(pilot, app)
        before = screen.settings
        assert before.overrides() == {}  # the UI imposes no sampling value of its own
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen), what="settings")
        shown = {name: app.screen.query_one(f"#{name}", Input).placeholder
                 for name in SETTINGS_FIELDS}
        config = backend.load("smollm2").engine.config  # the model's, over the class's
        assert shown["temperature"] == f"{config.temperature:g} (default)"
        assert shown["top_k"] == f"{config.top_k} (default)"
        assert shown["top_p"] == f"{config.top_p:g} (default)"
        assert shown["repetition_penalty"].startswith(f"{config.repetition_penalty:g}")
        assert shown["max_tokens"] == "no limit (default)"
        assert shown["context_window"] == "8192 (the model's)"
        await pilot.press("escape")
        await set_fields(pilot, app, temperature="-1")
        dialog = app.screen
        assert isinstance(dialog, SettingsScreen)  # not saved: still open
        error = str(dialog.query_one("#error-temperature", Label).render())
        assert "temperature must be >= 0" in error
        assert dialog.query_one("#temperature", Input).has_class("-invalid")
        box = dialog.query_one("#temperature", Input)
        box.focus()
        await pilot.press("backspace", "backspace", "x")
        assert "temperature must be a number" in str(
            dialog.query_one("#error-temperature", Label).render())
        await pilot.press("escape")
        assert app.screen is screen and screen.settings == before


async def test_regenerate_edit_and_resend_copy_and_export(
        store_home: Path, backend: LocalBackend) -> None:
    app = LocalchatApp(model="smollm2", backend=backend)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_ready(pilot, app)
        await set_fields(pilot, app, temperature="0", max_tokens="12")
        await wait_for(pilot, lambda: app.screen is screen, what="settings to close")
        await send(pilot, screen, QUESTION)
        first = screen.views[-1].content
        assert "Paris" in first
        await pilot.press("ctrl+b")
        assert app.clipboard == first

        await pilot.press("ctrl+r")  # regenerate: the last reply is replaced
        await wait_for(pilot, lambda: not screen.busy and screen.views[-1].status == "done"
                       and screen.views[-1].message_id is not None, what="the new reply")
        assert len(screen.views) == 2 and screen.views[-1].content == first  # greedy

        screen.views[0].focus()  # edit & resend the first message: the chat branches there
        await pilot.press("e")
        prompt = screen.query_one(PromptInput)
        assert prompt.text == QUESTION and screen.focused is prompt
        prompt.load_text("")
        await send(pilot, screen, "What is the capital of Italy?")
        assert [v.content for v in screen.views][0] == "What is the capital of Italy?"
        # the branch saw only the edited message: the same as a fresh greedy reply to it
        fresh = backend.load("smollm2").engine.chat(
            [{"role": "user", "content": "What is the capital of Italy?"}],
            temperature=0.0, max_tokens=12).result().text
        assert len(screen.views) == 2 and screen.views[-1].content == fresh
        stored = ChatDB().messages(screen.conversation_id)
        assert [m.content for m in stored][0] == "What is the capital of Italy?"
        assert len(stored) == 2

        await pilot.press("ctrl+o")
        path = screen.exported
        text = Path(path).read_text()
        assert path.parent == store_home / "exports"
        assert "What is the capital of Italy?" in text and fresh in text
        assert str(path) in str(screen.query_one("#status", Static).render())


SCHEMA = ('{"type": "object", "properties": {"capital": {"type": "string"}}, '
          '"required": ["capital"]}')


async def test_a_json_schema_output_format_is_validated_applied_and_kept(
        store_home: Path, backend: LocalBackend) -> None:
    app = LocalchatApp(model="smollm2", backend=backend)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_ready(pilot, app)
        await set_fields(pilot, app, temperature="0", max_tokens="40")
        await wait_for(pilot, lambda: app.screen is screen, what="settings to close")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen), what="settings")
        dialog = app.screen
        schema_box = dialog.query_one("#json_schema", TextArea)
        assert not schema_box.display  # text output: no schema box
        fmt = dialog.query_one("#output_format", Select)
        fmt.focus()
        await pilot.press("enter", "down", "down", "enter")  # Text -> JSON object -> JSON Schema
        await wait_for(pilot, lambda: fmt.value == "json_schema", what="JSON Schema picked")
        assert schema_box.display
        error = dialog.query_one("#error-json_schema", Label)
        schema_box.focus()
        await pilot.press(*'{"type": ')
        assert "not valid JSON" in str(error.render())  # inline, as it is typed
        assert schema_box.has_class("-invalid")
        await pilot.press(*'"objekt"}')
        assert str(error.render()) == ""  # valid JSON ...
        await pilot.press("ctrl+s")  # ... but no schema: saving compiles it, and refuses
        assert app.screen is dialog and "does not compile" in str(error.render())
        assert screen.settings.output_format == "text"  # never applied
        schema_box.load_text(SCHEMA)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is screen, what="settings to close")
        assert screen.settings.output_format == "json_schema"
        assert screen.settings.response_format() == {
            "type": "json_schema", "json_schema": {"schema": json.loads(SCHEMA)}}
        await send(pilot, screen, QUESTION)
        answer = screen.views[-1]
        assert answer.status == "done"
        assert json.loads(answer.content) == {"capital": "Paris"}  # constrained by the schema
        cid = screen.conversation_id

    # kept: the reopened conversation has the format, and the form shows it again
    stored = ChatDB().conversation(cid)
    assert stored is not None and stored.settings["output_format"] == "json_schema"
    app = LocalchatApp(backend=backend)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_ready(pilot, app)  # the app opens on it: the last one
        assert screen.conversation_id == cid
        assert screen.settings.json_schema == SCHEMA
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen), what="settings")
        assert app.screen.query_one("#output_format", Select).value == "json_schema"
        assert app.screen.query_one("#json_schema", TextArea).text == SCHEMA
        assert app.screen.query_one("#json_schema", TextArea).display
