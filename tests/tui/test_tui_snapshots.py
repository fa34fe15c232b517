"""Snapshots (pytest-textual-snapshot, 100x30) of the main screens: the welcome view on an empty
store, the models view with an installed model, a stored conversation reopened, the settings
dialog and F1 help. Refresh with `pytest tests/tui/test_tui_snapshots.py --snapshot-update`
and look at the SVGs under `__snapshots__/` before committing them.

What differs between machines is pinned: the installed model's compiled-for target, path and
size come from a backend that reports the real store with those fields fixed, and the chat's
model "loads" as a fixed stand-in that never generates (a snapshot must not wait on TVM, nor
show a device or a timing); the stored reply's stats are written into the database as fixed
numbers. The catalog is the real one (the recipes in the source tree)."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from textual.pilot import Pilot
from tui_helpers import wait_for

from localchat.errors import LocalchatError
from localchat.tui.app import LocalchatApp
from localchat.tui.backend import CatalogEntry, LocalBackend, Log, ModelInfo
from localchat.tui.db import ChatDB
from localchat.tui.screens.chat import ChatScreen
from localchat.tui.screens.dialogs import HelpScreen, SettingsScreen
from localchat.tui.screens.models import ModelsScreen
from localchat.tui.settings import ChatSettings

SIZE = (100, 30)
PINNED_CATALOG = ("qwen2.5-0.5b-instruct", "rwkv-world-169m", "smollm2-135m-instruct")
SCHEMA = '{"type": "object", "properties": {"capital": {"type": "string"}}}'
Snap = Callable[..., bool]


class FixedModel:
    """A loaded model that never generates: the snapshots show stored messages only."""

    name = "smollm2:q0f32"
    context_window = 8192
    device = "cpu"

    def reply(self, key: str, messages: Sequence[dict[str, str]], settings: ChatSettings) -> None:
        raise LocalchatError("the snapshot tests generate nothing")

    def forget(self, key: str) -> None:
        pass

    def close(self) -> None:
        pass


class PinnedBackend(LocalBackend):
    """The real store and catalog, with what differs between machines pinned: each installed
    model's compiled-for targets, path and size; loading gives a `FixedModel`. The catalog is
    cut to a fixed few recipes, so adding a recipe does not change every snapshot."""

    def models(self) -> list[ModelInfo]:
        return [dataclasses.replace(m, targets=("llvm",), path=f"/models/{m.ref}",
                                    size_bytes=538_000_000) for m in super().models()]

    def catalog(self) -> list[CatalogEntry]:
        return [c for c in super().catalog() if c.name in PINNED_CATALOG]

    def load(self, ref: str, *, context_window: int | None = None,
             log: Log | None = None) -> FixedModel:  # type: ignore[override]
        return FixedModel()


async def steady_cursors(pilot: Pilot) -> None:
    """Stop every text cursor on screen blinking: a blink would make the snapshot depend on
    the moment it is taken."""
    for box in pilot.app.screen.query("Input, TextArea"):
        box.cursor_blink = False  # type: ignore[attr-defined]
    await pilot.pause()


async def models_listed(pilot: Pilot) -> None:
    """Wait until the models view shows its list."""
    app = pilot.app
    await wait_for(pilot, lambda: isinstance(app.screen, ModelsScreen) and app.screen.loaded,
                   what="the model list")
    await steady_cursors(pilot)


def test_welcome_on_an_empty_store(home: Path, snap_compare: Snap) -> None:
    app = LocalchatApp(backend=PinnedBackend())
    assert snap_compare(app, terminal_size=SIZE, run_before=models_listed)


def test_models_view_with_an_installed_model(store_home: Path, snap_compare: Snap) -> None:
    app = LocalchatApp(backend=PinnedBackend())
    assert snap_compare(app, terminal_size=SIZE, run_before=models_listed)


def stored_conversation() -> int:
    """A conversation in the database, as a finished chat leaves it (with fixed stats)."""
    db = ChatDB()
    cid = db.create_conversation("smollm2:q0f32", "What is the capital of France?",
                                 ChatSettings(system="Answer in one sentence.", temperature=0.0,
                                              max_tokens=64, output_format="json_schema",
                                              json_schema=SCHEMA).to_dict())
    db.add_message(cid, "user", "What is the capital of France?")
    db.add_message(cid, "assistant", "The capital of France is **Paris**.\n\n```python\n"
                   "print('Paris')\n```", stats={
                       "prompt_tokens": 31, "completion_tokens": 17, "ttft_s": 0.125,
                       "prefill_tok_s": 248.0, "decode_tok_s": 42.5,
                       "finish_reason": "stop", "context_tokens": 48})
    db.add_message(cid, "user", "And of Germany?")
    db.add_message(cid, "assistant", "The capital of Germany is", status="cancelled")
    db.close()
    return cid


def open_stored_chat(cid: int, then: str = "") -> Callable[[Pilot], Awaitable[None]]:
    """run_before: open conversation `cid`, wait for its (fixed) model, then press `then`."""

    async def run(pilot: Pilot) -> None:
        app = pilot.app
        assert isinstance(app, LocalchatApp)
        await models_listed(pilot)
        app.open_chat("smollm2:q0f32", cid)
        await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen)
                       and app.screen.model is not None, what="the chat")
        if then:
            await pilot.press(then)
        await steady_cursors(pilot)

    return run


def test_a_stored_conversation_reopened(store_home: Path, snap_compare: Snap) -> None:
    app = LocalchatApp(backend=PinnedBackend())
    assert snap_compare(app, terminal_size=SIZE, run_before=open_stored_chat(
        stored_conversation()))


def test_the_settings_dialog(store_home: Path, snap_compare: Snap) -> None:
    app = LocalchatApp(backend=PinnedBackend())

    async def run(pilot: Pilot) -> None:
        await open_stored_chat(stored_conversation(), "ctrl+s")(pilot)
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, SettingsScreen),
                       what="the settings dialog")
        # its end: the output format, with the stored schema in its box
        pilot.app.screen.query_one("#settings").scroll_end(animate=False)
        await steady_cursors(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run)


def test_f1_help(home: Path, snap_compare: Snap) -> None:
    app = LocalchatApp(backend=PinnedBackend())

    async def run(pilot: Pilot) -> None:
        await models_listed(pilot)
        await pilot.press("f1")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, HelpScreen), what="help")
        await steady_cursors(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run)
