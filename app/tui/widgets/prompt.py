"""The message input: Enter sends, Ctrl+J (or Shift+Enter where the terminal reports it)
inserts a newline, a multi-line paste stays one message, Up on the first line recalls earlier
prompts."""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import TextArea


class PromptInput(TextArea):
    """A multi-line input that posts `Submitted` on Enter."""

    class Submitted(Message):
        """The user pressed Enter."""

        def __init__(self, prompt: PromptInput, text: str) -> None:
            super().__init__()
            self.prompt = prompt
            self.text = text

    def __init__(self, **kwargs: object) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus",
                         **kwargs)  # type: ignore[arg-type]
        self.prompts: list[str] = []
        self._recall: int | None = None

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
            return
        if event.key in ("ctrl+j", "shift+enter"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        if event.key == "up" and self.cursor_location[0] == 0 and self.prompts:
            if self._recall is None and self.text:
                return await super()._on_key(event)
            event.stop()
            event.prevent_default()
            self._recall = len(self.prompts) - 1 if self._recall is None else max(
                0, self._recall - 1)
            self.load_text(self.prompts[self._recall])
            return
        if event.key == "down" and self._recall is not None:
            last_row = self.document.line_count - 1
            if self.cursor_location[0] == last_row:
                event.stop()
                event.prevent_default()
                self._recall += 1
                if self._recall >= len(self.prompts):
                    self._recall = None
                    self.load_text("")
                else:
                    self.load_text(self.prompts[self._recall])
                return
        await super()._on_key(event)

    def remember(self, text: str) -> None:
        """Add a sent prompt to the history Up recalls."""
        if text and (not self.prompts or self.prompts[-1] != text):
            self.prompts.append(text)
        self._recall = None
