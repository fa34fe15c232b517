"""One chat message on screen: who wrote it, its Markdown body, and its state (streaming,
stopped, failed). Focus one to copy it, copy its last code block, or edit and resend it; its
header then names those keys (the footer has no room for them at 80 columns)."""

from __future__ import annotations

import re

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Label, Markdown

CODE_BLOCK = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.S)
STATUS_MARKS = {"cancelled": "⏹ stopped", "error": "⚠ failed", "streaming": "…"}


def last_code_block(text: str) -> str | None:
    """The body of the last fenced code block in `text` (an unclosed one counts), or None."""
    blocks = CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


class MessageView(Vertical, can_focus=True):
    """A message: a header line and a Markdown body."""

    BINDINGS = [
        Binding("c", "copy", "Copy", show=False),
        Binding("b", "copy_code", "Copy code", show=False),
        Binding("e", "edit", "Edit & resend", show=False),
    ]

    class EditRequested(Message):
        """The user wants to edit this (user) message and resend from it."""

        def __init__(self, view: MessageView) -> None:
            super().__init__()
            self.view = view

    def __init__(self, role: str, content: str = "", *, author: str = "",
                 status: str = "done", message_id: int | None = None) -> None:
        super().__init__(classes=f"message -{role}")
        self.role = role
        self.content = content
        self.author = author or ("you" if role == "user" else role)
        self.status = status
        self.message_id = message_id
        self.error: str | None = None

    def compose(self) -> ComposeResult:
        yield Label(self._header(), classes="message-header", markup=False)
        yield Markdown(self.content, classes="message-body")

    @property
    def body(self) -> Markdown:
        """The Markdown widget of the body."""
        return self.query_one(Markdown)

    def _header(self, focused: bool = False) -> str:
        mark = STATUS_MARKS.get(self.status, "")
        text = f"{self.author}  {mark}".rstrip()
        if self.error:
            text = f"{text}  {self.error}"
        if focused:
            keys = "c copy · b copy code" + (" · e edit & resend" if self.role == "user" else "")
            text = f"{text}  ({keys})"
        return text

    def on_focus(self) -> None:
        self.query_one(".message-header", Label).update(self._header(focused=True))

    def on_blur(self) -> None:
        self.query_one(".message-header", Label).update(self._header())

    def set_status(self, status: str, error: str | None = None) -> None:
        """Mark the message (e.g. "cancelled": the reply was stopped, its text is partial)."""
        self.status = status
        self.error = error
        self.set_class(status == "cancelled", "-cancelled")
        self.set_class(status == "error", "-error")
        self.query_one(".message-header", Label).update(self._header(self.has_focus))

    def as_dict(self) -> dict[str, str]:
        """The message for the model."""
        return {"role": self.role, "content": self.content}

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.content)
        self.notify("message copied")

    def action_copy_code(self) -> None:
        code = last_code_block(self.content)
        if code is None:
            self.notify("no code block in this message", severity="warning")
            return
        self.app.copy_to_clipboard(code)
        self.notify("code block copied")

    def action_edit(self) -> None:
        if self.role == "user":
            self.post_message(self.EditRequested(self))
