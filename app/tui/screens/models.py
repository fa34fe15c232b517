"""The models view: installed models and the recipe catalog in one table, filtered as you
type; pull, delete, details, compile; the jobs panel; the welcome view on an empty store."""

from __future__ import annotations

import time

from textual import events, on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input, Static

from localchat.recipes import catalogue
from localchat.tui.backend import CatalogEntry, ModelInfo
from localchat.tui.screens.dialogs import AskScreen, ConfirmScreen, InfoScreen, model_details
from localchat.tui.widgets.jobs import JobsPanel, human_bytes

COLUMNS = ("Model", "Status", "Arch", "Quant", "Compiled for", "Size", "Last used / license",
           "Description")


def _ago(t: float | None) -> str:
    if t is None:
        return "never"
    s = max(0.0, time.time() - t)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.0f} {unit} ago"
    return "just now"


def in_catalogue_order(entries: list[CatalogEntry]) -> list[CatalogEntry]:
    """`entries` in the recipes' catalogue order (newer releases of a line first, so RWKV-7
    before RWKV-4), whatever order a backend gave; names no recipe has come last, by name."""
    rank = {r.name: i for i, r in enumerate(catalogue())}
    return sorted(entries, key=lambda c: (rank.get(c.name, len(rank)), c.name))


class ModelsScreen(Screen[None]):
    """Installed and available models."""

    BINDINGS = [
        Binding("enter", "activate", "Chat / pull", show=False),
        Binding("p", "pull", "Pull"),
        Binding("d", "delete", "Delete"),
        Binding("i", "details", "Details"),
        Binding("b", "compile", "Compile", show=False),  # the footer fits 80 columns: F1 has it
        Binding("slash", "focus_filter", "Filter", show=False),
        Binding("escape", "cancel_job", "Cancel pull", show=False),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.installed: list[ModelInfo] = []
        self.catalog: list[CatalogEntry] = []
        self.last_used: dict[str, float] = {}
        self.loaded = False

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("", id="welcome")
        yield Input(placeholder="filter models (type to filter)…", id="filter",
                    select_on_focus=False)
        yield DataTable(id="models", cursor_type="row", zebra_stripes=True)
        yield JobsPanel(self.app.jobs, id="jobs")  # type: ignore[attr-defined]
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "models"
        table = self.query_one(DataTable)
        table.add_columns(*COLUMNS)
        table.loading = True
        self.query_one("#welcome").display = False
        table.focus()
        self.reload()

    @work(thread=True, exclusive=True, group="models-list", exit_on_error=False)
    def reload(self) -> None:
        """Read the store and the catalog off the UI thread, then show them."""
        backend = self.app.backend  # type: ignore[attr-defined]
        installed, catalog = backend.models(), in_catalogue_order(backend.catalog())
        last_used = self.app.db.last_used()  # type: ignore[attr-defined]
        self.app.call_from_thread(self._show, installed, catalog, last_used)

    def _show(self, installed: list[ModelInfo], catalog: list[CatalogEntry],
              last_used: dict[str, float]) -> None:
        self.installed, self.catalog, self.last_used = installed, catalog, last_used
        table = self.query_one(DataTable)
        table.loading = False
        box = self.query_one("#filter", Input)
        # a loading table cannot hold the focus, which fell to the filter: give it back once
        # the loading indicator is gone, so p, d, i and b act (unless the user began typing a
        # filter meanwhile); `loaded` says the list is shown and the focus settled
        refocus = self.focused is None or (self.focused is box and not box.value)

        def settled() -> None:
            if refocus:
                table.focus()
            self.loaded = True

        self.call_after_refresh(settled)
        welcome = self.query_one("#welcome", Static)
        welcome.display = not installed
        backend = self.app.backend  # type: ignore[attr-defined]
        if not installed and not backend.manages_store:
            welcome.update("[b]The server serves no models.[/b] Pull one on the server's "
                           "machine (`localchat pull NAME`), then reopen this view (F2).")
        elif not installed:
            rec = backend.recommended()
            welcome.update(
                "[b]Welcome to localchat.[/b] No models are installed yet.\n"
                f"Recommended for this device: [b]{rec}[/b] (tiny, works without the hub). "
                "Press [b]Enter[/b] to pull it, or pick any model below; [b]p[/b] pulls an HF "
                "repo id, a local folder or a .gguf file."
            )
        self._fill()
        if not installed and backend.manages_store:  # the cursor on the recommended model
            table.move_cursor(row=table.get_row_index(f"catalog:{rec}"))

    def _fill(self) -> None:
        table = self.query_one(DataTable)
        needle = self.query_one("#filter", Input).value.strip().lower()
        table.clear()
        installed_names = {m.name for m in self.installed}
        for m in self.installed:
            if needle and needle not in f"{m.ref} {m.architecture}".lower():
                continue
            used = self.last_used.get(m.ref) or self.last_used.get(m.name)
            table.add_row(m.ref, "installed", m.architecture, m.quantization,
                          ", ".join(m.targets) or "—", human_bytes(m.size_bytes), _ago(used),
                          "", key=f"installed:{m.ref}")
        for c in self.catalog:
            if c.name in installed_names:
                continue
            text = f"{c.name} {c.display_name} {c.architecture} {c.description}".lower()
            if needle and needle not in text:
                continue
            table.add_row(c.name, "available", c.architecture, "", "",
                          f"~{c.disk_mb} MB", c.license, c.description, key=f"catalog:{c.name}")

    # filtering -------------------------------------------------------------------------------
    @on(Input.Changed, "#filter")
    def _filter_changed(self) -> None:
        self._fill()

    @on(Input.Submitted, "#filter")
    def _filter_submitted(self) -> None:
        self.query_one(DataTable).focus()
        self.action_activate()

    def on_key(self, event: events.Key) -> None:
        # typing on the table filters: the first printable key not bound moves to the filter
        table = self.query_one(DataTable)
        if (self.focused is table and event.is_printable and event.character
                and event.character not in "pdib/"):
            box = self.query_one("#filter", Input)
            box.focus()
            box.insert_text_at_cursor(event.character)
            event.stop()
        elif event.key == "down" and self.focused is self.query_one("#filter", Input):
            table.focus()
            event.stop()

    def action_focus_filter(self) -> None:
        self.query_one("#filter", Input).focus()

    # the highlighted row ---------------------------------------------------------------------
    def selected(self) -> tuple[str, str] | None:
        """("installed", ref) or ("catalog", name) for the highlighted row."""
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value or ""
        kind, _, name = key.partition(":")
        return kind, name

    def _installed(self, ref: str) -> ModelInfo | None:
        return next((m for m in self.installed if m.ref == ref), None)

    @on(DataTable.RowSelected)
    def _row_selected(self) -> None:
        self.action_activate()

    def _store_action(self, what: str) -> bool:
        """Whether the backend can `what` (pull, delete, compile); says why not if not."""
        if self.app.backend.manages_store:  # type: ignore[attr-defined]
            return True
        self.notify(f"{what} is not available over --server: do it on the server's machine "
                    f"(localchat {what} NAME)", severity="warning")
        return False

    def action_activate(self) -> None:
        picked = self.selected()
        if picked is None:
            return
        kind, name = picked
        if kind == "installed":
            self.app.open_chat(name)  # type: ignore[attr-defined]
        elif self._store_action("pull"):
            self.app.start_pull(name)  # type: ignore[attr-defined]

    def action_pull(self) -> None:
        if not self._store_action("pull"):
            return
        picked = self.selected()
        name = picked[1] if picked and picked[0] == "catalog" else ""

        def done(ref: str | None) -> None:
            if ref:
                self.app.start_pull(ref)  # type: ignore[attr-defined]

        self.app.push_screen(AskScreen("Pull which model? (name, org/repo[@revision], HF "
                                       "folder or .gguf file)", name,
                                       placeholder="smollm2-135m-instruct"), done)

    def action_delete(self) -> None:
        if not self._store_action("rm"):
            return
        picked = self.selected()
        if picked is None or picked[0] != "installed":
            self.notify("select an installed model to delete", severity="warning")
            return
        ref = picked[1]

        def done(yes: bool | None) -> None:
            if yes:
                self._remove(ref)

        self.app.push_screen(ConfirmScreen(f"Delete {ref} from the store?"), done)

    @work(thread=True, group="remove", exit_on_error=False)
    def _remove(self, ref: str) -> None:
        try:
            self.app.backend.remove(ref)  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - shown to the user
            self.app.call_from_thread(self.notify, f"delete failed: {exc}", severity="error")
            return
        self.app.call_from_thread(self.notify, f"deleted {ref}")
        self.reload()

    def action_details(self) -> None:
        picked = self.selected()
        if picked is None:
            return
        kind, name = picked
        model = self._installed(name) if kind == "installed" else None
        if model is not None:
            self.app.push_screen(InfoScreen(model.ref, model_details(model)))
            return
        entry = next((c for c in self.catalog if c.name == name), None)
        if entry is not None:
            text = (f"{entry.display_name}\n\n{entry.description}\n\nsource: {entry.repo}\n"
                    f"architecture: {entry.architecture}\nlicense: {entry.license}\n"
                    f"download: ~{entry.download_mb} MB, on disk: ~{entry.disk_mb} MB")
            self.app.push_screen(InfoScreen(entry.name, text))

    def action_compile(self) -> None:
        if not self._store_action("pull"):
            return
        picked = self.selected()
        model = self._installed(picked[1]) if picked and picked[0] == "installed" else None
        if model is None:
            return
        self.app.start_pull(model.ref)  # type: ignore[attr-defined]

    def action_cancel_job(self) -> None:
        for job in reversed(self.app.jobs):  # type: ignore[attr-defined]
            if job.active:
                job.cancel_requested = True
                self.notify(f"cancelling the pull of {job.ref}")
                return
