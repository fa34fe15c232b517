"""Snapshots (pytest-textual-snapshot, 100x30) of the main screens: the welcome view on an empty
store, the models view with an installed model, a stored conversation (the app opens on it),
the settings dialog (each blank field showing the model's default) and F1 help. Refresh with
`pytest tests/tui/test_tui_snapshots.py --snapshot-update` and look at the SVGs under
`__snapshots__/` before committing them.

What differs between machines is pinned (tui_helpers.PinnedBackend): the installed model's
compiled-for target, path and size come from a backend that reports the real store with those
fields fixed, and the chat's model "loads" as a fixed stand-in that never generates, with fixed
sampling defaults (a snapshot must not wait on TVM, nor show a device or a timing); the stored
reply's stats are written into the database as fixed numbers. The catalog is the real one (the
recipes in the source tree), cut to a fixed few."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from textual.pilot import Pilot
from tui_helpers import PinnedBackend, stored_conversation, wait_for

from localchat.tui.app import LocalchatApp
from localchat.tui.screens.chat import ChatScreen
from localchat.tui.screens.dialogs import HelpScreen, SettingsScreen
from localchat.tui.screens.models import ModelsScreen

SIZE = (100, 30)
Snap = Callable[..., bool]


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


def open_stored_chat(then: str = "") -> Callable[[Pilot], Awaitable[None]]:
    """run_before: wait for the app to reopen the stored conversation (the last one) and its
    (fixed) model, then press `then`."""

    async def run(pilot: Pilot) -> None:
        app = pilot.app
        await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen)
                       and app.screen.model is not None, what="the chat")
        if then:
            await pilot.press(then)
        await steady_cursors(pilot)

    return run


def test_a_stored_conversation_reopened(store_home: Path, snap_compare: Snap) -> None:
    stored_conversation()
    app = LocalchatApp(backend=PinnedBackend())
    assert snap_compare(app, terminal_size=SIZE, run_before=open_stored_chat())


def test_the_settings_dialog(store_home: Path, snap_compare: Snap) -> None:
    stored_conversation()
    app = LocalchatApp(backend=PinnedBackend())

    async def run(pilot: Pilot) -> None:
        await open_stored_chat("ctrl+s")(pilot)
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
