"""Modal dialogs: confirm, ask for a line of text, help, model details, per-conversation
settings (with inline validation, and each blank field showing the default it means) and the
conversation list."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Select, Static, TextArea
from textual.widgets.option_list import Option

from localchat.errors import InvalidRequestError
from localchat.tui.backend import ModelInfo
from localchat.tui.db import ChatDB, ConversationRow
from localchat.tui.settings import (
    FIELD_LABELS,
    OUTPUT_FORMATS,
    ChatSettings,
    parse_field,
    parse_schema,
    parse_settings,
)

HELP = """\
[b]Everywhere[/b]
  F1            this help              Ctrl+P   command palette (every action)
  F2            models                 F3       conversations
  Ctrl+Q        quit                   Ctrl+C   copy a selection or stop a reply

[b]Models[/b]
  type, /       filter the list        ↑ ↓      move
  Enter         chat with an installed model, or pull a catalog one
  p             pull (the highlighted catalog model, or a name / repo / path)
  d             delete the model (asks first)
  i             details                b        compile for this device
  Esc           cancel the newest running pull

[b]Chat[/b]
  Enter         send                   ↑        recall earlier prompts
  Ctrl+J        newline (Shift+Enter too, where the terminal sends it)
  Esc, Ctrl+C   stop the reply (the partial text is kept, marked stopped)
  Ctrl+R        regenerate the last reply       Ctrl+N   new conversation
  Ctrl+S        settings (system prompt, parameters, output format)
  Ctrl+O        export to Markdown              Ctrl+T   stats of the last reply
  Ctrl+B        copy the last reply (OSC 52: works over SSH and tmux)
  Ctrl+G        thinking on/off for this chat (reasoning models: Qwen3, DeepSeek-R1)
  Tab           focus the messages; on one: c copy, b copy its last code block,
                e edit & resend (your messages), t show/hide the thinking
"""


class ConfirmScreen(ModalScreen[bool]):
    """Yes or no."""

    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.question, id="question")
            with Horizontal(classes="buttons"):
                yield Button("Yes (y)", id="yes", variant="error")
                yield Button("No (n)", id="no")

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)


class AskScreen(ModalScreen[str | None]):
    """One line of text (a name to pull, a new title); Esc cancels."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, question: str, value: str = "", placeholder: str = "") -> None:
        super().__init__()
        self.question, self.value, self.placeholder = question, value, placeholder

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.question)
            yield Input(self.value, placeholder=self.placeholder, id="answer")

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class HelpScreen(ModalScreen[None]):
    """Every key."""

    BINDINGS = [Binding("escape,f1,q", "close", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog wide", id="help"):
            yield Static(HELP)

    def action_close(self) -> None:
        self.dismiss(None)


class InfoScreen(ModalScreen[None]):
    """A block of text (model details, detailed stats)."""

    BINDINGS = [Binding("escape,q", "close", "Close")]

    def __init__(self, title: str, text: str) -> None:
        super().__init__()
        self.title_text, self.text = title, text

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog wide"):
            yield Label(f"[b]{self.title_text}[/b]")
            yield Static(self.text, markup=False, id="info-body")

    def action_close(self) -> None:
        self.dismiss(None)


def model_details(model: ModelInfo) -> str:
    """What the details view shows of an installed model."""
    cfg = model.config
    source = cfg.get("source") or {}
    lines = [
        f"path:          {model.path}",
        f"architecture:  {model.architecture}",
        f"quantization:  {model.quantization}",
        f"template:      {cfg.get('template', '')}",
        f"context:       {cfg.get('context_window_size', '')}",
        f"source:        {json.dumps(source) if source else ''}",
        f"size:          {model.size_bytes / 1e6:.1f} MB",
        f"compiled for:  {', '.join(model.targets) or 'not compiled (press b)'}",
        f"libraries:     {', '.join(model.libraries)}",
        "",
        "config:",
        json.dumps(cfg, indent=2, sort_keys=True, default=str),
    ]
    return "\n".join(lines)


SETTINGS_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "max_tokens", "seed", "context_window")


def default_placeholders(defaults: Mapping[str, Any] | None, window: int | None,
                         unknown: str = "model default") -> dict[str, str]:
    """What each blank settings field means, shown in it: the model's default
    (`ChatModel.defaults`, GenerationConfig's names; "0.8 (default)") or, where that is not
    known (a server that does not tell), `unknown`."""
    known = defaults or {}
    out = {name: _default_text(name, known) if name in known else unknown
           for name in SETTINGS_FIELDS}
    out["context_window"] = f"{window} (the model's)" if window else unknown
    return out


def _default_text(name: str, defaults: Mapping[str, Any]) -> str:
    value = defaults[name]
    if value is None:
        text = {"max_tokens": "no limit", "seed": "random"}.get(name, "none")
    else:
        text = f"{value:g}" if isinstance(value, float) else str(value)
    window = defaults.get("repetition_window")
    if name == "repetition_penalty" and value != 1 and window:
        text += f" over the last {window} tokens"
    return f"{text} (default)"


class SettingsScreen(ModalScreen[ChatSettings | None]):
    """The conversation's system prompt, parameters and output format (text, JSON, or a JSON
    Schema typed in a text area). Each field is checked as it is typed; Save applies only when
    every field is valid (a schema must also compile), otherwise the reason stays shown inline."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, settings: ChatSettings, max_window: int | None = None,
                 defaults: Mapping[str, Any] | None = None,
                 unknown: str = "model default") -> None:
        super().__init__()
        self.settings = settings
        self.max_window = max_window
        self.placeholders = default_placeholders(defaults, max_window, unknown)

    def compose(self) -> ComposeResult:
        text = self.settings.as_text()
        # the form scrolls to the focused field; it takes no focus itself, so Tab goes from
        # field to field and the first one (the system prompt) has the focus from the start
        with VerticalScroll(classes="dialog wide", id="settings", can_focus=False):
            yield Label("[b]Conversation settings[/b] (blank: the model's default)")
            yield Label(FIELD_LABELS["system"])
            yield TextArea(text["system"], id="system", classes="system-prompt")
            for name in SETTINGS_FIELDS:
                with Horizontal(classes="field"):
                    yield Label(FIELD_LABELS[name], classes="field-label")
                    yield Input(text[name], id=name, placeholder=self.placeholders[name])
                yield Label("", id=f"error-{name}", classes="field-error")
            with Horizontal(classes="field"):
                yield Label(FIELD_LABELS["output_format"], classes="field-label")
                yield Select([(label, key) for key, label in OUTPUT_FORMATS.items()],
                             value=text["output_format"], allow_blank=False,
                             id="output_format")
            yield TextArea(text["json_schema"], id="json_schema", classes="json-schema")
            yield Label("", id="error-json_schema", classes="field-error")
            with Horizontal(classes="buttons"):
                yield Button("Save (Ctrl+S)", id="save", variant="primary")
                yield Button("Cancel (Esc)", id="cancel")

    def on_mount(self) -> None:
        # before the first paint, so typing lands there; it is on screen already, and a
        # scroll to it would hide the dialog's title
        self.query_one("#system", TextArea).focus(scroll_visible=False)
        self._show_schema()

    def _show_error(self, name: str, message: str) -> None:
        self.query_one(f"#error-{name}", Label).update(message)
        self.query_one(f"#{name}").set_class(bool(message), "-invalid")

    def _show_schema(self) -> None:
        """The schema box (and its error) only while the output format is a JSON Schema."""
        shown = self.query_one("#output_format", Select).value == "json_schema"
        self.query_one("#json_schema").display = shown
        self.query_one("#error-json_schema").display = shown
        if shown:
            self._check_schema()

    def _check_schema(self) -> None:
        try:
            parse_schema(self.query_one("#json_schema", TextArea).text)
        except InvalidRequestError as exc:
            self._show_error("json_schema", str(exc))
        else:
            self._show_error("json_schema", "")

    @on(Select.Changed, "#output_format")
    def _format_changed(self) -> None:
        self._show_schema()

    @on(TextArea.Changed, "#json_schema")
    def _schema_changed(self) -> None:
        self._check_schema()

    @on(Input.Changed)
    def _changed(self, event: Input.Changed) -> None:
        name = event.input.id or ""
        try:
            parse_field(name, event.value, max_window=self.max_window)
        except InvalidRequestError as exc:
            self._show_error(name, str(exc))
        else:
            self._show_error(name, "")

    def fields(self) -> dict[str, str]:
        """The form's current text, by field."""
        out = {name: self.query_one(f"#{name}", Input).value for name in SETTINGS_FIELDS}
        out["system"] = self.query_one("#system", TextArea).text
        out["output_format"] = str(self.query_one("#output_format", Select).value)
        out["json_schema"] = self.query_one("#json_schema", TextArea).text
        return out

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        try:
            settings = parse_settings(self.fields(), max_window=self.max_window)
        except InvalidRequestError as exc:
            name = exc.param if exc.param in (*SETTINGS_FIELDS, "json_schema") else "temperature"
            self._show_error(name, str(exc))
            self.notify(f"not saved: {exc}", severity="error")
            return
        self.dismiss(settings)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.0f} {unit} ago"
    return "just now"


class ConversationsScreen(ModalScreen[Any]):
    """Saved conversations: search by title, open (Enter), rename (r), delete (d), new (n).
    Dismisses with a conversation id to open, "new", or None."""

    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("ctrl+r", "rename", "Rename"),
        Binding("ctrl+d", "delete", "Delete"),
        Binding("ctrl+n", "new", "New"),
    ]

    def __init__(self, db: ChatDB) -> None:
        super().__init__()
        self.db = db
        self.rows: list[ConversationRow] = []

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide", id="conversations"):
            yield Label("[b]Conversations[/b]  Enter open · Ctrl+R rename · Ctrl+D delete · "
                        "Ctrl+N new · Esc close")
            yield Input(placeholder="search titles…", id="search")
            yield OptionList(id="conversation-list")

    def on_mount(self) -> None:
        self.reload()

    def reload(self) -> None:
        """Re-read the list (filtered by the search box)."""
        self.rows = self.db.conversations(self.query_one("#search", Input).value)
        options = self.query_one(OptionList)
        options.clear_options()
        options.add_options([
            Option(f"{r.title}  ·  {r.model}  ·  {r.messages} messages  ·  {_ago(r.updated)}",
                   id=str(r.id))
            for r in self.rows
        ])
        if self.rows:
            options.highlighted = 0

    @on(Input.Changed, "#search")
    def _search(self) -> None:
        self.reload()

    @on(Input.Submitted, "#search")
    def _open_first(self) -> None:
        self._open(self.query_one(OptionList).highlighted)

    def _current(self) -> ConversationRow | None:
        index = self.query_one(OptionList).highlighted
        return self.rows[index] if index is not None and index < len(self.rows) else None

    @on(OptionList.OptionSelected)
    def _selected(self, event: OptionList.OptionSelected) -> None:
        self._open(event.option_index)

    def _open(self, index: int | None) -> None:
        if index is not None and index < len(self.rows):
            self.dismiss(self.rows[index].id)

    def action_new(self) -> None:
        self.dismiss("new")

    def action_close(self) -> None:
        self.dismiss(None)

    def action_rename(self) -> None:
        row = self._current()
        if row is None:
            return

        def done(title: str | None) -> None:
            if title:
                self.db.rename(row.id, title)
                self.reload()

        self.app.push_screen(AskScreen("New title:", row.title), done)

    def action_delete(self) -> None:
        row = self._current()
        if row is None:
            return

        def done(yes: bool | None) -> None:
            if yes:
                self.db.delete(row.id)
                self.reload()

        self.app.push_screen(ConfirmScreen(f"Delete the conversation “{row.title}”?"), done)
