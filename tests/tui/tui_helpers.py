"""Pilot helpers shared by the terminal-UI tests: wait on a condition, open a chat and wait for
its model, fill the settings dialog, send a prompt and wait for the reply, stop a long one, read
the notifications and the footer; and `PinnedBackend`, the real store and catalog with a
stand-in model that never generates (for tests and snapshots that must not wait on TVM)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence

from textual.widgets import Footer, Input, Label
from textual.widgets._footer import FooterKey

from localchat.errors import LocalchatError
from localchat.tui.app import LocalchatApp
from localchat.tui.backend import CatalogEntry, LocalBackend, Log, ModelInfo, Pulled
from localchat.tui.db import ChatDB
from localchat.tui.screens.chat import ChatScreen
from localchat.tui.screens.dialogs import SettingsScreen
from localchat.tui.settings import ChatSettings
from localchat.tui.widgets.messages import MessageView
from localchat.tui.widgets.prompt import PromptInput

PINNED_CATALOG = ("qwen2.5-0.5b-instruct", "rwkv-world-169m", "smollm2-135m-instruct")
SCHEMA = '{"type": "object", "properties": {"capital": {"type": "string"}}}'


class FixedModel:
    """A loaded model that never generates, with fixed sampling defaults: the tests that use
    it show stored messages only."""

    name = "smollm2:q0f32"
    context_window = 8192
    device = "cpu"
    defaults = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0,
                "repetition_penalty": 1.1, "repetition_window": 64, "max_tokens": None,
                "seed": None}

    def reply(self, key: str, messages: Sequence[dict[str, str]], settings: ChatSettings) -> None:
        raise LocalchatError("the stand-in model generates nothing")

    def forget(self, key: str) -> None:
        pass

    def close(self) -> None:
        pass


class PinnedBackend(LocalBackend):
    """The real store and catalog, with what differs between machines pinned: each installed
    model's compiled-for targets, path and size; loading gives a `FixedModel`, and a pull ends
    at once, as if it had installed the model it names. The catalog is cut to a fixed few
    recipes, so adding a recipe does not change every snapshot."""

    def models(self) -> list[ModelInfo]:
        return [dataclasses.replace(m, targets=("llvm",), path=f"/models/{m.ref}",
                                    size_bytes=538_000_000) for m in super().models()]

    def catalog(self) -> list[CatalogEntry]:
        return [c for c in super().catalog() if c.name in PINNED_CATALOG]

    def load(self, ref: str, *, context_window: int | None = None,
             log: Log | None = None) -> FixedModel:  # type: ignore[override]
        return FixedModel()

    def pull(self, ref: str, *, progress: object, stage: Callable[[str], None], log: Log,
             cancelled: Callable[[], bool]) -> Pulled:  # type: ignore[override]
        stage("download")
        return Pulled(ref, f"pulled {ref}")


def stored_conversation(model: str = "smollm2:q0f32") -> int:
    """A conversation in the database, as a finished chat leaves it (with fixed stats)."""
    db = ChatDB()
    cid = db.create_conversation(model, "What is the capital of France?",
                                 ChatSettings(system="Answer in one sentence.", temperature=0.0,
                                              max_tokens=64, output_format="json_schema",
                                              json_schema=SCHEMA).to_dict())
    db.add_message(cid, "user", "What is the capital of France?")
    db.add_message(cid, "assistant", "The capital of France is **Paris**.\n\n```python\n"
                   "print('Paris')\n```", stats={
                       "prompt_tokens": 1031, "completion_tokens": 17, "ttft_s": 0.125,
                       "prefill_tok_s": 2480.0, "decode_tok_s": 42.5, "sampling_s": 0.0031,
                       "finish_reason": "stop", "context_tokens": 1048})
    db.add_message(cid, "user", "And of Germany?")
    db.add_message(cid, "assistant", "The capital of Germany is", status="cancelled")
    db.close()
    return cid


def notifications(app: LocalchatApp) -> str:
    """Every notification's text so far, one a line."""
    return "\n".join(n.message for n in app._notifications)


def footer_overflow(app: LocalchatApp) -> list[str]:
    """The footer's keys that do not show whole on screen (cut at its right edge or hidden
    under the command palette's key docked there); [] when every key and label shows."""
    footer = app.screen.query_one(Footer)
    keys = list(footer.query(FooterKey))
    palette = [k for k in keys if k.has_class("-command-palette")]
    right = min([k.region.x for k in palette] + [app.size.width])
    cut = [k for k in keys if k not in palette and (k.region.right > right
                                                      or not k.region.width)]
    cut += [k for k in palette if k.region.right > app.size.width]
    return [f"{k.key_display} {k.description}" for k in cut]


def footer_text(app: LocalchatApp) -> list[str]:
    """The footer's keys and labels, those laid out (a footer recomposes when the bindings
    change, and its keys have no place on screen until the next layout)."""
    return [f"{k.key_display} {k.description}"
            for k in app.screen.query_one(Footer).query(FooterKey) if k.region.width]


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


async def start_a_long_reply(pilot, screen: ChatScreen) -> None:
    """Ask for a long story and wait for its first tokens."""
    screen.query_one(PromptInput).focus()
    await pilot.press(*"Write a very long story about a dragon.")
    await pilot.press("enter")
    await wait_for(pilot, lambda: screen.stats.completion_tokens >= 3, what="the first tokens")


async def stop_a_long_reply(pilot, screen: ChatScreen) -> MessageView:
    """Ask for a long story, press Esc after its first tokens, and check the partial reply is
    kept and marked stopped; its view."""
    await start_a_long_reply(pilot, screen)
    return await stop_the_reply(pilot, screen)


async def stop_the_reply(pilot, screen: ChatScreen, key: str = "escape") -> MessageView:
    """Press `key` while a reply streams, and check the partial reply is kept and marked
    stopped; its view."""
    await pilot.press(key)
    await wait_for(pilot, lambda: not screen.busy, timeout=10, what="the reply to stop")
    answer = screen.views[-1]
    assert answer.status == "cancelled" and answer.content
    assert "stopped" in str(answer.query_one(".message-header", Label).render())
    assert answer.body.source == answer.content
    return answer
