"""One chat message on screen: who wrote it, a reasoning model's thinking in a collapsed block
above the reply (t expands it), its Markdown body, its state (streaming, stopped, failed) and,
under a finished reply, its stats line (token counts, prefill and decode
speed, time to first token: what `ollama run --verbose` prints after each reply). Focus one to
copy it, copy its last code block, or edit and resend it; its header then names those keys
(the footer has no room for them at 80 columns)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Collapsible, Label, Markdown, Static

CODE_BLOCK = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.S)
STATUS_MARKS = {"cancelled": "⏹ stopped", "error": "⚠ failed", "streaming": "…"}


def reply_stats_line(stats: Mapping[str, Any]) -> str:
    """A reply's stats (`ReplyStats.to_dict()`, or the stored copy) as one line: prompt and
    reply token counts with their prefill and decode speeds, and the time to first token. A
    speed that was not measured (0, or missing: a remote server's prefill) shows as "–"."""

    def count(name: str) -> str:
        value = stats.get(name)
        return f"{int(value):,}" if isinstance(value, (int, float)) else "–"

    def rate(name: str) -> str:
        value = stats.get(name)
        return f"{value:,.1f} tok/s" if isinstance(value, (int, float)) and value > 0 else "–"

    reused = stats.get("reused_tokens")
    prompt = f"prompt {count('prompt_tokens')} tok"
    if isinstance(reused, (int, float)) and reused > 0:
        prompt += f" (+{int(reused):,} reused)"
    ttft = stats.get("ttft_s")
    first = "–"
    if isinstance(ttft, (int, float)) and ttft > 0:
        first = f"{ttft * 1000:,.0f} ms" if ttft < 10 else f"{ttft:,.1f} s"
    return (f"{prompt}, prefill {rate('prefill_tok_s')} · reply {count('completion_tokens')} "
            f"tok, decode {rate('decode_tok_s')} · TTFT {first}")


def last_code_block(text: str) -> str | None:
    """The body of the last fenced code block in `text` (an unclosed one counts), or None."""
    blocks = CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


class MessageView(Vertical, can_focus=True):
    """A message: a header line, a Markdown body and, for a reply with stats, a stats line."""

    DEFAULT_CSS = """
    MessageView > .message-stats {
        color: $text-muted;
        text-style: dim;
    }
    MessageView > .message-thinking {
        border: none;
        padding: 0;
        margin: 0;
    }
    MessageView .thinking-text {
        color: $text-muted;
        text-style: italic;
    }
    """

    BINDINGS = [
        Binding("c", "copy", "Copy", show=False),
        Binding("b", "copy_code", "Copy code", show=False),
        Binding("e", "edit", "Edit & resend", show=False),
        Binding("t", "toggle_thinking", "Thinking", show=False),
    ]

    class EditRequested(Message):
        """The user wants to edit this (user) message and resend from it."""

        def __init__(self, view: MessageView) -> None:
            super().__init__()
            self.view = view

    def __init__(self, role: str, content: str = "", *, author: str = "",
                 status: str = "done", message_id: int | None = None,
                 stats: Mapping[str, Any] | None = None, thinking: str = "") -> None:
        super().__init__(classes=f"message -{role}")
        self.role = role
        self.content = content
        self.author = author or ("you" if role == "user" else role)
        self.status = status
        self.message_id = message_id
        self.error: str | None = None
        self.stats: Mapping[str, Any] | None = stats or None
        self.thinking = thinking

    def compose(self) -> ComposeResult:
        yield Label(self._header(), classes="message-header", markup=False)
        block = Collapsible(Static(self.thinking, classes="thinking-text", markup=False),
                            title=self._thinking_title(), collapsed=True,
                            classes="message-thinking")
        block.display = bool(self.thinking)  # from the first layout: no block, no line
        yield block
        yield Markdown(self.content, classes="message-body")
        yield Label(self.stats_text, classes="message-stats", markup=False)

    def on_mount(self) -> None:
        self.query_one(".message-stats", Label).display = bool(self.stats)

    @property
    def thinking_block(self) -> Collapsible:
        """The collapsible block that holds the thinking (hidden when there is none)."""
        return self.query_one(".message-thinking", Collapsible)

    def _thinking_title(self) -> str:
        words = len(self.thinking.split())
        doing = "thinking…" if self.status == "streaming" else "thought"
        return f"{doing} ({words} words · t to {'show' if self._collapsed() else 'hide'})"

    def _collapsed(self) -> bool:
        try:
            return self.thinking_block.collapsed
        except Exception:  # noqa: BLE001 - not composed yet: it starts collapsed
            return True

    def set_thinking(self, thinking: str) -> None:
        """Show the reply's thinking so far (the block stays as the user left it)."""
        self.thinking = thinking
        block = self.thinking_block
        block.display = bool(thinking)
        block.query_one(".thinking-text", Static).update(thinking)
        block.title = self._thinking_title()

    def on_collapsible_expanded(self, event: Collapsible.Expanded) -> None:
        self.thinking_block.title = self._thinking_title()  # clicked open

    def on_collapsible_collapsed(self, event: Collapsible.Collapsed) -> None:
        self.thinking_block.title = self._thinking_title()

    def action_toggle_thinking(self) -> None:
        """Expand or collapse the thinking block."""
        if not self.thinking:
            self.notify("no thinking in this message", severity="warning")
            return
        block = self.thinking_block
        block.collapsed = not block.collapsed
        block.title = self._thinking_title()

    @property
    def stats_text(self) -> str:
        """The stats line under the reply ("" when it has no stats)."""
        return reply_stats_line(self.stats) if self.stats else ""

    def set_stats(self, stats: Mapping[str, Any] | None) -> None:
        """Show a finished reply's stats (`ReplyStats.to_dict()`) under it."""
        self.stats = stats or None
        line = self.query_one(".message-stats", Label)
        line.update(self.stats_text)
        line.display = bool(self.stats)

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
            keys += " · t thinking" if self.thinking else ""
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
        if self.thinking:
            self.thinking_block.title = self._thinking_title()

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
