"""Pilot helpers shared by the terminal-UI tests: wait on a condition, open a chat and wait for
its model, fill the settings dialog, send a prompt and wait for the reply, stop a long one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from textual.widgets import Input, Label

from localchat.tui.app import LocalchatApp
from localchat.tui.screens.chat import ChatScreen
from localchat.tui.screens.dialogs import SettingsScreen
from localchat.tui.widgets.messages import MessageView
from localchat.tui.widgets.prompt import PromptInput


async def wait_for(pilot, condition: Callable[[], object], timeout: float = 30.0,
                   what: str = "condition") -> None:
    """Let the app run until `condition()` is true; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await pilot.pause(0.05)
        await asyncio.sleep(0)


async def chat_ready(pilot, app: LocalchatApp) -> ChatScreen:
    """The chat screen that was opened, once its model has loaded."""
    await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen), what="the chat screen")
    screen = app.screen
    assert isinstance(screen, ChatScreen)
    await wait_for(pilot, lambda: screen.model is not None or screen.load_error,
                   timeout=120, what="the model to load")
    assert screen.load_error is None, screen.load_error
    return screen


async def set_fields(pilot, app: LocalchatApp, **values: str) -> None:
    """Open the settings dialog, type each value into its field, and save."""
    await pilot.press("ctrl+s")
    await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen), what="settings")
    for name, text in values.items():
        box = app.screen.query_one(f"#{name}", Input)
        box.focus()
        await pilot.press("end")
        while box.value:
            await pilot.press("backspace")
        await pilot.press(*text)
    await pilot.press("ctrl+s")


async def send(pilot, screen: ChatScreen, text: str, timeout: float = 60) -> None:
    """Type `text` into the prompt, press Enter, and wait for the reply to end."""
    screen.query_one(PromptInput).focus()
    await pilot.press(*text)
    last = screen.views[-1] if screen.views else None
    await pilot.press("enter")
    await wait_for(pilot, lambda: not screen.busy and screen.views[-1] is not last
                   and screen.views[-1].role == "assistant", timeout=timeout, what="the reply")


async def stop_a_long_reply(pilot, screen: ChatScreen) -> MessageView:
    """Ask for a long story, press Esc after its first tokens, and check the partial reply is
    kept and marked stopped; its view."""
    screen.query_one(PromptInput).focus()
    await pilot.press(*"Write a very long story about a dragon.")
    await pilot.press("enter")
    await wait_for(pilot, lambda: screen.stats.completion_tokens >= 3, what="the first tokens")
    await pilot.press("escape")
    await wait_for(pilot, lambda: not screen.busy, timeout=10, what="the reply to stop")
    answer = screen.views[-1]
    assert answer.status == "cancelled" and answer.content
    assert "stopped" in str(answer.query_one(".message-header", Label).render())
    assert answer.body.source == answer.content
    return answer
