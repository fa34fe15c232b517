"""A reasoning model's thinking in the terminal UI, driven by Textual's Pilot on the tiny Qwen3
"chain" model (its reply to any chat: `<think>ka lo</think>mi su`): the thinking sits in a
collapsed block above the answer, `t` on the focused reply expands and collapses it, Ctrl+G
switches the chat's thinking off (reaching the template, kept with the chat's settings), and
a reopened chat shows the stored thinking."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from reasoning_fixtures import CHAIN_ANSWER, CHAIN_THINKING, qwen3_think_model
from textual.widgets import Collapsible, Static
from tui_helpers import chat_ready, notifications, send, wait_for

from localchat import Engine
from localchat.tui.app import LocalchatApp
from localchat.tui.backend import LocalBackend
from localchat.tui.db import ChatDB
from localchat.tui.screens.dialogs import HELP

pytestmark = pytest.mark.asyncio
SIZE = (120, 40)
NAME = "qwen3-chain"


@pytest.fixture(scope="module")
def chain_dir() -> Path:
    path = qwen3_think_model(chain=True)
    Engine.open(path, device="cpu").close()  # its library, before any test's home
    return path


@pytest.fixture
def chain_home(home: Path, chain_dir: Path) -> Path:
    (home / "models" / NAME).mkdir(parents=True)
    (home / "models" / NAME / "q0f32").symlink_to(chain_dir, target_is_directory=True)
    return home


@pytest.fixture
def backend(chain_home: Path) -> Iterator[LocalBackend]:
    b = LocalBackend(device="cpu")
    yield b
    b.close()


async def test_thinking_block_expand_key_and_per_chat_switch(backend: LocalBackend) -> None:
    assert "Ctrl+G" in HELP and "t show/hide the thinking" in HELP  # the F1 key list
    app = LocalchatApp(model=NAME, backend=backend)
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_ready(pilot, app)
        await send(pilot, screen, "hello")
        _, answer = screen.views
        assert answer.status == "done" and answer.content == CHAIN_ANSWER
        assert answer.body.source == CHAIN_ANSWER  # the answer alone in the Markdown body
        block = answer.query_one(Collapsible)
        assert block.display and block.collapsed  # collapsed above the answer
        assert answer.thinking == CHAIN_THINKING
        text = answer.query_one(".thinking-text", Static)
        assert str(text.render()) == CHAIN_THINKING
        assert not text.region.height  # hidden while collapsed
        assert answer.region.y < answer.body.region.y and block.region.y < answer.body.region.y
        answer.focus()
        await pilot.press("t")
        await wait_for(pilot, lambda: not block.collapsed and text.region.height > 0,
                       what="the thinking to expand")
        assert "hide" in str(block.title)
        await pilot.press("t")
        await wait_for(pilot, lambda: block.collapsed, what="the thinking to collapse")
        cid = screen.conversation_id
        # Ctrl+G: this chat's thinking off, kept with its settings; the prompt grows by the
        # empty think block Qwen3's template writes then
        on_prompt = screen.last_stats.prompt_tokens
        await pilot.press("ctrl+g")
        await wait_for(pilot, lambda: screen.settings.think is False, what="the switch")
        assert "thinking off" in notifications(app)
        assert ChatDB().conversation(cid).settings["think"] is False
        screen.model.forget(str(id(screen)))  # the next reply re-renders the whole chat
        await send(pilot, screen, "hello")
        assert screen.views[-1].status == "done"
        engine = screen.model.engine
        history = [{"role": "user", "content": "hello"},
                   {"role": "assistant", "content": CHAIN_ANSWER},
                   {"role": "user", "content": "hello"}]
        stats = screen.last_stats
        assert stats.prompt_tokens + stats.reused_tokens == engine.count_tokens(history,
                                                                                 think=False)
        assert engine.count_tokens(history, think=False) > engine.count_tokens(history)
        assert on_prompt > 0
    stored = ChatDB().messages(cid)
    assert [m.thinking for m in stored] == ["", CHAIN_THINKING, "", CHAIN_THINKING]

    app = LocalchatApp(backend=backend)  # reopened: the thinking and the switch are kept
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_ready(pilot, app)
        assert screen.settings.think is False
        reopened = screen.views[1]
        assert reopened.thinking == CHAIN_THINKING and reopened.query_one(Collapsible).collapsed
        assert not screen.views[0].query_one(Collapsible).display  # no thinking: no block
