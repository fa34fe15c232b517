"""The Textual app `localchat` opens: the last conversation when its model is still installed
(else the models view; `--model` opens a new chat), pull jobs, the chat database, F1 help and
every action in the command palette. Ctrl+C stops a streaming reply and never quits (Ctrl+Q
does); a finished pull opens a chat with the model it installed.

First paint does not wait on TVM, the store or the database's disk: models are listed and
loaded, and the last conversation looked up, in thread workers; the engine is imported only
when a model is loaded.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import ModalScreen, Screen

from localchat.tui.backend import Backend, LocalBackend, PullCancelled
from localchat.tui.db import ChatDB, ConversationRow
from localchat.tui.screens.chat import ChatScreen
from localchat.tui.screens.dialogs import ConversationsScreen, HelpScreen
from localchat.tui.screens.models import ModelsScreen
from localchat.tui.widgets.jobs import Job, JobProgress


class LocalchatApp(App[int]):
    """localchat's terminal UI."""

    CSS_PATH = "localchat.tcss"
    TITLE = "localchat"
    BINDINGS = [
        Binding("f1", "help", "Help"),
        Binding("f2", "models", "Models"),
        Binding("f3", "conversations", "Chats"),
        # replaces Textual's Ctrl+C (a hint to quit); a selection is still copied first, by
        # the focused input's and the screen's own Ctrl+C, which pass when nothing is selected
        Binding("ctrl+c", "interrupt", show=False, system=True),
    ]

    def __init__(self, *, model: str | None = None, backend: Backend | None = None,
                 db_path: Path | str | None = None, device: str = "auto") -> None:
        super().__init__()
        self.start_model = model
        self.backend: Backend = backend or LocalBackend(device)
        self._own_backend = backend is None
        self.db_path = db_path
        self.db: ChatDB
        self.jobs: list[Job] = []
        self._pull_lock = threading.Lock()  # pulls run one at a time; later ones queue

    def on_mount(self) -> None:
        self.db = ChatDB(self.db_path)
        self.push_screen(ModelsScreen())
        if self.start_model:
            self.open_chat(self.start_model)
        else:
            self._resume_last_chat()

    def on_unmount(self) -> None:
        for job in self.jobs:
            job.cancel_requested = True
        if self._own_backend:
            self.backend.close()

    @work(thread=True, group="resume", exit_on_error=False)
    def _resume_last_chat(self) -> None:
        """Open the most recently updated conversation when its model is still installed."""
        row = self.db.latest_conversation()
        if row is None:
            return
        try:
            installed = self.backend.models()
        except Exception:  # noqa: BLE001 - the models view shows what went wrong
            return
        if any(row.model in (m.ref, m.name) for m in installed):
            self.call_from_thread(self._resume, row)

    def _resume(self, row: ConversationRow) -> None:
        if isinstance(self.screen, ModelsScreen):  # unless the user went elsewhere meanwhile
            self.open_chat(row.model, row.id)

    # navigation ------------------------------------------------------------------------------
    def models_screen(self) -> ModelsScreen | None:
        """The models view (always at the bottom of the stack)."""
        return next((s for s in self.screen_stack if isinstance(s, ModelsScreen)), None)

    def open_chat(self, model: str, conversation_id: int | None = None, *,
                  replace_current: bool = False) -> None:
        """Show a chat with `model`: a new conversation, or the stored one."""
        screen = ChatScreen(model, conversation_id)
        if isinstance(self.screen, ChatScreen) or replace_current:
            self.switch_screen(screen)
        else:
            self.push_screen(screen)

    def action_models(self) -> None:
        while len(self.screen_stack) > 2:
            self.pop_screen()

    def action_interrupt(self) -> None:
        """Ctrl+C that copied nothing: stop the streaming reply, if any; it never quits."""
        screen = self.screen
        if isinstance(screen, ChatScreen) and screen.busy:
            screen.action_stop()
        else:
            self.notify("Ctrl+Q quits", timeout=3)

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            self.pop_screen()
        else:
            self.push_screen(HelpScreen())

    def action_conversations(self) -> None:
        def done(result: object) -> None:
            if result == "new":
                current = self.screen
                model = current.model_ref if isinstance(current, ChatScreen) else None
                if model is None:
                    self.notify("pick a model in the models view (F2) and press Enter")
                    self.action_models()
                else:
                    self.open_chat(model)
            elif isinstance(result, int):
                row = self.db.conversation(result)
                if row is not None:
                    self.open_chat(row.model, row.id)

        self.push_screen(ConversationsScreen(self.db), done)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Help", "Every key (F1)", self.action_help)
        yield SystemCommand("Models", "Installed and available models (F2)", self.action_models)
        yield SystemCommand("Conversations", "Open, rename, delete, search (F3)",
                            self.action_conversations)
        models = self.models_screen()
        if models is not None:
            yield SystemCommand("Pull a model", "Name, org/repo, folder or .gguf",
                                models.action_pull)
        if isinstance(screen, ChatScreen):
            for title, help_text, action in (
                ("Stop the reply", "Keep the partial text (Esc, Ctrl+C)", screen.action_stop),
                ("Regenerate", "Replace the last reply (Ctrl+R)", screen.action_regenerate),
                ("Settings", "System prompt and parameters (Ctrl+S)", screen.action_settings),
                ("Export to Markdown", "Write the conversation to a file (Ctrl+O)",
                 screen.action_export),
                ("Copy the last reply", "To the clipboard via OSC 52 (Ctrl+B)",
                 screen.action_copy_last),
                ("New conversation", "With the same model (Ctrl+N)", screen.action_new_chat),
                ("Reply stats", "The last reply's counts and timings (Ctrl+T)",
                 screen.action_stats_details),
            ):
                yield SystemCommand(title, help_text, action)
        if isinstance(screen, ModelsScreen):
            for title, help_text, action in (
                ("Delete the model", "Remove it from the store (d)", screen.action_delete),
                ("Model details", "Config, template, source, files (i)", screen.action_details),
                ("Compile for this device", "When not compiled yet (b)", screen.action_compile),
                ("Cancel the pull", "The newest running one (Esc)", screen.action_cancel_job),
            ):
                yield SystemCommand(title, help_text, action)

    # pulls -----------------------------------------------------------------------------------
    def start_pull(self, ref: str) -> Job:
        """Queue a pull of `ref`; the jobs panel shows its progress."""
        job = Job(ref)
        self.jobs.append(job)
        self._run_pull(job)
        self.notify(f"pulling {ref}")
        return job

    @work(thread=True, group="pull", exit_on_error=False)
    def _run_pull(self, job: Job) -> None:
        with self._pull_lock:
            if job.cancel_requested:
                job.state = "cancelled"
                return
            job.state = "running"
            try:
                pulled = self.backend.pull(
                    job.ref, progress=JobProgress(job), stage=job.set_stage,
                    log=lambda line: setattr(job, "message", line),
                    cancelled=lambda: job.cancel_requested,
                )
            except PullCancelled:
                job.state, job.message = "cancelled", "downloads kept: pulling again resumes"
            except Exception as exc:  # noqa: BLE001 - a failed job is shown, the app stays up
                job.state, job.message = "failed", str(exc) or type(exc).__name__
            else:
                job.model = pulled.ref
                job.state, job.message = "done", pulled.summary
        self.call_from_thread(self.pull_ended, job)

    def pull_ended(self, job: Job) -> None:
        """Say how `job` ended; a finished pull refreshes the models view and opens a chat with
        the model, unless a reply is streaming or a dialog is open (then it only says so)."""
        if job.state != "done":
            self.notify(f"pull {job.state}: {job.ref}", severity="warning")
            return
        models = self.models_screen()
        if models is not None:
            models.reload()
        screen = self.screen
        if not job.model:
            self.notify(f"pull done: {job.ref}")
        elif isinstance(screen, ModalScreen) or (isinstance(screen, ChatScreen) and screen.busy):
            self.notify(f"pulled {job.model}: Enter on it in the models view (F2) opens a chat",
                        timeout=10)
        else:
            self.notify(f"pulled {job.model}")
            self.open_chat(job.model)
