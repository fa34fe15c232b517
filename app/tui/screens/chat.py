"""The chat view: messages streamed as Markdown, live stats, the prompt, and the actions on a
conversation (stop, regenerate, edit & resend, settings, export, copy). The model loads in a
thread worker; replies stream with `async for` on the event loop (the engine's scheduler thread
generates, so the UI thread never waits on TVM); the database is written off the UI thread."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Markdown, Static

from localchat import FinishEvent, LocalchatError, ReplyStats
from localchat.paths import data_dir
from localchat.tui.backend import ChatModel
from localchat.tui.db import ChatDB, title_from
from localchat.tui.screens.dialogs import InfoScreen, SettingsScreen
from localchat.tui.settings import ChatSettings
from localchat.tui.widgets.jobs import human_bytes
from localchat.tui.widgets.messages import MessageView
from localchat.tui.widgets.prompt import PromptInput

RENDER_INTERVAL_S = 0.08  # shortest time between two Markdown renders of a streaming reply
MAX_RENDER_INTERVAL_S = 0.4  # longest: the text never lags further behind the model
STATS_INTERVAL_S = 0.5  # between two updates of the live stats line
# The share of one core the UI thread may spend on a streaming reply (Markdown, layout,
# compositing). On a 2-core machine every millisecond drawn is taken from the decode threads,
# and a render that holds the GIL delays the engine's next step; the interval between renders
# grows with what the last ones cost, so a long reply does not slow the model as it grows.
UI_CPU_BUDGET = 0.04


def next_render_interval(cpu_spent_s: float) -> float:
    """The wait before the next Markdown render, given the UI thread's CPU time since the last
    one: that cost at `UI_CPU_BUDGET`, within the interval bounds."""
    return min(MAX_RENDER_INTERVAL_S, max(RENDER_INTERVAL_S, cpu_spent_s / UI_CPU_BUDGET))


@dataclass
class LiveStats:
    """What the stats line shows; filled while a reply streams, then from its ReplyStats."""

    ttft_s: float | None = None
    prefill_tok_s: float | None = None
    decode_tok_s: float | None = None
    context_tokens: int | None = None
    completion_tokens: int = 0
    finish_reason: str = ""

    @classmethod
    def of(cls, stats: ReplyStats) -> LiveStats:
        """From a finished reply's stats."""
        return cls(stats.ttft_s, stats.prefill_tok_s, stats.decode_tok_s, stats.context_tokens,
                   stats.completion_tokens, stats.finish_reason)


STAT_LABELS = {
    "prompt_tokens": "Prompt tokens",
    "reused_tokens": "Reused tokens",
    "completion_tokens": "Completion tokens",
    "ttft_s": "Time to first token",
    "prefill_tok_s": "Prefill speed",
    "decode_tok_s": "Decode speed",
    "sampling_s": "Sampling time",
    "finish_reason": "Finish reason",
    "context_tokens": "Context tokens",
    "dropped_messages": "Dropped messages",
}


def format_stat(name: str, value: Any) -> str:
    """A stat for people, by its name's unit: `*_tok_s` a rate, `*_s` a duration (ms under a
    second), `*_bytes` a size (MB, GB), whole numbers (counts) with thousands separators."""
    if value is None:
        return "–"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if name.endswith("_tok_s"):
        return f"{value:,.1f} tok/s"
    if name.endswith("_s"):
        if value >= 1:
            return f"{value:,.2f} s"
        ms = value * 1000
        return f"{ms:.1f} ms" if ms < 10 else f"{ms:,.0f} ms"
    if name.endswith("_bytes"):
        return human_bytes(value)
    if isinstance(value, int) or value.is_integer():
        return f"{int(value):,}"
    return f"{value:,.2f}"


def _stat_label(name: str) -> str:
    """A label for a stat STAT_LABELS does not name: its words, the unit suffix as what it
    measures ("load_s" -> "Load time")."""
    for suffix, what in (("_tok_s", "speed"), ("_s", "time"), ("_bytes", "size")):
        if name.endswith(suffix):
            name = f"{name.removesuffix(suffix)} {what}"
            break
    return name.replace("_", " ").capitalize()


def stats_text(stats: Mapping[str, Any]) -> str:
    """A reply's stats (`ReplyStats.to_dict()`) as aligned lines, every number formatted."""
    labels = {name: STAT_LABELS.get(name) or _stat_label(name) for name in stats}
    width = max((len(label) for label in labels.values()), default=0) + 2
    return "\n".join(f"{labels[name]:<{width}}{format_stat(name, value)}"
                     for name, value in stats.items())


def export_markdown(title: str, model: str, messages: list[dict[str, str]],
                    directory: Path) -> Path:
    """Write a conversation as Markdown under `directory`; returns the file's path."""
    directory.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:40] or "conversation"
    path = directory / f"{slug}-{time.strftime('%Y%m%d-%H%M%S')}.md"
    parts = [f"# {title}\n", f"*model: {model}*\n"]
    for m in messages:
        who = {"user": "You", "assistant": model, "system": "System"}.get(m["role"], m["role"])
        note = " *(stopped)*" if m.get("status") == "cancelled" else ""
        parts.append(f"## {who}{note}\n\n{m['content']}\n")
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


class ChatScreen(Screen[None]):
    """One conversation with one model."""

    BINDINGS = [
        # the footer shows the first keys a newcomer needs and fits 80 columns with the app's
        # F1-F3; F1 help and the command palette list the rest (Ctrl+C stops, too: app.py)
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+r", "regenerate", "Regenerate", show=False),
        Binding("ctrl+s", "settings", "Settings"),
        Binding("ctrl+o", "export", "Export", show=False),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+b", "copy_last", "Copy reply", show=False),
        Binding("ctrl+t", "stats_details", "Stats", show=False),
        Binding("ctrl+g", "toggle_think", "Thinking on/off", show=False),
    ]

    def __init__(self, model_ref: str, conversation_id: int | None = None) -> None:
        super().__init__()
        self.model_ref = model_ref
        self.conversation_id = conversation_id
        self.settings = ChatSettings()
        self.model: ChatModel | None = None
        self.stream: Any = None  # the ReplyStream being shown
        self.replying = False  # from sending until the reply is shown and stored
        self.stop_requested = False  # stop pressed before the reply's stream began
        self.stats = LiveStats()
        self.last_stats: ReplyStats | None = None
        self.edit_from: MessageView | None = None
        self.load_error: str | None = None
        self.title_text = "New chat"

    @property
    def db(self) -> ChatDB:
        """The app's chat database."""
        return self.app.db  # type: ignore[attr-defined, no-any-return]

    def compose(self) -> ComposeResult:
        yield Header()
        yield VerticalScroll(id="messages")
        yield Static("", id="status")
        yield Static("", id="stats")
        yield PromptInput(id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = self.model_ref
        self.query_one("#messages").anchor()
        self.query_one(PromptInput).focus()
        self._set_status(f"loading {self.model_ref}…")
        if self.conversation_id is not None:
            self._open_conversation(self.conversation_id)
        self._load_model()
        self._show_stats()

    # loading ---------------------------------------------------------------------------------
    def _open_conversation(self, conversation_id: int) -> None:
        row = self.db.conversation(conversation_id)
        if row is None:
            self.notify(f"conversation {conversation_id} no longer exists", severity="error")
            self.conversation_id = None
            return
        self.settings = ChatSettings.from_dict(row.settings)
        self.title_text = row.title
        self.title = row.title
        views = [
            MessageView(m.role, m.content, author=self._author(m.role), status=m.status,
                        message_id=m.id, stats=m.stats if m.role == "assistant" else None,
                        thinking=m.thinking)
            for m in self.db.messages(conversation_id) if m.role in ("user", "assistant")
        ]
        self.query_one("#messages").mount_all(views)
        last = next((m for m in reversed(self.db.messages(conversation_id))
                     if m.role == "assistant" and m.stats), None)
        if last is not None and last.stats:
            known = {f.name for f in dataclasses.fields(ReplyStats)}
            self.last_stats = ReplyStats(**{k: v for k, v in last.stats.items() if k in known})
            self.stats = LiveStats.of(self.last_stats)

    def _author(self, role: str) -> str:
        return "you" if role == "user" else self.model_ref

    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def _load_model(self) -> None:
        backend = self.app.backend  # type: ignore[attr-defined]

        def log(line: str) -> None:
            self.app.call_from_thread(self._set_status, line)

        started = time.monotonic()
        try:
            model = backend.load(self.model_ref, context_window=self.settings.context_window,
                                 log=log)
        except LocalchatError as exc:
            self.app.call_from_thread(self._load_failed, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - any failure is shown, the app stays up
            self.app.call_from_thread(self._load_failed, f"{type(exc).__name__}: {exc}")
            return
        self.app.call_from_thread(self._loaded, model, time.monotonic() - started)

    def _loaded(self, model: ChatModel, seconds: float) -> None:
        self.model = model
        self._set_status(f"{model.name} ready on {model.device} ({seconds:.1f} s)")
        self._show_stats()

    def _load_failed(self, message: str) -> None:
        self.load_error = message
        self._set_status(f"[b red]could not load {self.model_ref}:[/] {message}")

    def _set_status(self, text: str) -> None:
        self.query_one("#status", Static).update(text)

    # stats -----------------------------------------------------------------------------------
    def stats_line(self) -> str:
        """The stats line's text."""
        s = self.stats
        window = self.model.context_window if self.model else None
        device = self.model.device if self.model else "…"

        def num(v: float | None, fmt: str) -> str:
            return "–" if v is None else format(v, fmt)

        ctx = f"{s.context_tokens if s.context_tokens is not None else '–'}/{window or '–'}"
        return (f"TTFT {num(s.ttft_s, '.2f')} s · prefill {num(s.prefill_tok_s, '.1f')} tok/s"
                f" · decode {num(s.decode_tok_s, '.1f')} tok/s · context {ctx} tok"
                f" · device {device}")

    def _show_stats(self) -> None:
        # The stats bar is one line high whatever its text: no layout pass (and full repaint).
        self.query_one("#stats", Static).update(self.stats_line(), layout=False)

    def action_stats_details(self) -> None:
        st = self.last_stats
        text = stats_text(st.to_dict()) if st else "no reply yet"
        self.app.push_screen(InfoScreen("Last reply", text))

    # sending ---------------------------------------------------------------------------------
    @property
    def views(self) -> list[MessageView]:
        """The messages on screen, in order."""
        return list(self.query_one("#messages").query_children(MessageView))

    @property
    def busy(self) -> bool:
        """Whether a reply is streaming."""
        return self.replying

    @on(PromptInput.Submitted)
    def _submitted(self, event: PromptInput.Submitted) -> None:
        text = event.text.strip()
        if not text:
            return
        if self.busy:
            self.notify("a reply is streaming: Esc or Ctrl+C stops it", severity="warning")
            return
        if self.model is None:
            why = self.load_error or "the model is still loading"
            self.notify(f"cannot send yet: {why}", severity="warning")
            return
        event.prompt.remember(text)
        event.prompt.load_text("")
        cut = self.edit_from
        self.edit_from = None
        self._reply(text, cut_from=cut)

    def action_regenerate(self) -> None:
        if self.busy or self.model is None:
            return
        views = self.views
        if not views:
            return
        if views[-1].role == "assistant":
            views = views[:-1]
        if not views or views[-1].role != "user":
            return
        self._reply(None, cut_from=self.views[len(views)] if len(views) < len(self.views)
                    else None)

    @on(MessageView.EditRequested)
    def _edit(self, event: MessageView.EditRequested) -> None:
        if self.busy:
            return
        self.edit_from = event.view
        prompt = self.query_one(PromptInput)
        prompt.load_text(event.view.content)
        prompt.focus()
        self.notify("editing: Enter resends from this message (later ones are dropped)")

    def action_stop(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
        elif self.replying:  # the stream is still being opened: cancelled as soon as it is
            self.stop_requested = True
        elif self.edit_from is not None:
            self.edit_from = None
            self.query_one(PromptInput).load_text("")

    @work(exclusive=True, group="reply", exit_on_error=False)
    async def _reply(self, text: str | None, cut_from: MessageView | None = None) -> None:
        """Send `text` (None: regenerate the reply to the last user message) and stream the
        reply into a new message view; `cut_from` and later messages are dropped first."""
        self.replying, self.stop_requested = True, False
        try:
            await self._send_and_stream(text, cut_from)
        finally:
            self.replying = False

    async def _send_and_stream(self, text: str | None, cut_from: MessageView | None) -> None:
        assert self.model is not None
        model, box = self.model, self.query_one("#messages")
        key = str(id(self))
        if cut_from is not None:
            views = self.views
            dropped = views[views.index(cut_from):]
            first_id = next((v.message_id for v in dropped if v.message_id is not None), None)
            if self.conversation_id is not None and first_id is not None:
                await asyncio.to_thread(self.db.delete_from, self.conversation_id, first_id)
            await box.remove_children(dropped)
        if self.conversation_id is None:
            self.title_text = title_from(text or "New chat")
            self.title = self.title_text
            self.conversation_id = await asyncio.to_thread(
                self.db.create_conversation, self.model_ref, self.title_text,
                self.settings.to_dict())
        cid = self.conversation_id
        if text is not None:
            user_id = await asyncio.to_thread(self.db.add_message, cid, "user", text)
            await box.mount(MessageView("user", text, message_id=user_id))
        history = [v.as_dict() for v in self.views]
        view = MessageView("assistant", author=model.name, status="streaming")
        await box.mount(view)
        box.anchor()
        self.stats = LiveStats(context_tokens=self.stats.context_tokens)
        self._show_stats()
        started = time.monotonic()
        first_token: float | None = None
        tokens, pieces, last_draw = 0, [], 0.0
        thoughts: list[str] = []  # a reasoning model's thinking, shown in its own block
        thoughts_shown, last_thought = 0, 0.0
        unwritten, last_write = [], 0.0
        interval, cpu_mark = RENDER_INTERVAL_S, time.thread_time()  # the UI thread's CPU clock
        reply = None
        error: str | None = None
        writer = Markdown.get_stream(view.body)
        try:
            self.stream = await asyncio.to_thread(model.reply, key, history, self.settings)
            if self.stop_requested:
                self.stream.cancel()
            async for event in self.stream:
                now = time.monotonic()
                if isinstance(event, FinishEvent):
                    reply = event.reply
                else:
                    tokens += 1
                    if first_token is None:
                        first_token = now
                        self.stats.ttft_s = now - started
                if event.text:
                    pieces.append(event.text)
                    unwritten.append(event.text)
                if event.reasoning:
                    thoughts.append(event.reasoning)
                if len(thoughts) != thoughts_shown and (now - last_thought >= interval
                                                       or isinstance(event, FinishEvent)
                                                       or event.text):
                    thoughts_shown, last_thought = len(thoughts), now
                    view.set_thinking("".join(thoughts))
                # Markdown is re-rendered at most ~12 times a second, not per token, and less
                # often when renders get costly (UI_CPU_BUDGET).
                if unwritten and (now - last_write >= interval
                                  or isinstance(event, FinishEvent)):
                    if last_write:
                        cpu_now = time.thread_time()
                        interval = next_render_interval(cpu_now - cpu_mark)
                        cpu_mark = cpu_now
                    last_write = now
                    await writer.write("".join(unwritten))
                    unwritten.clear()
                if first_token is not None and now - last_draw > STATS_INTERVAL_S:
                    last_draw = now
                    if tokens > 1 and now > first_token:
                        self.stats.decode_tok_s = (tokens - 1) / (now - first_token)
                    self.stats.completion_tokens = tokens
                    self._show_stats()
        except LocalchatError as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - a failed reply is shown, the app stays up
            error = f"{type(exc).__name__}: {exc}"
        except asyncio.CancelledError:
            # The app is closing (Ctrl+Q) mid-reply: stop the model and keep what streamed,
            # marked stopped, as Esc would. Written here, synchronously: the loop is ending.
            if self.stream is not None:
                self.stream.cancel()
            if pieces or thoughts:
                self.db.add_message(cid, "assistant", "".join(pieces), status="cancelled",
                                    thinking="".join(thoughts))
            raise
        finally:
            self.stream = None
            await writer.stop()
        content = reply.text if reply is not None else "".join(pieces)
        thinking = reply.reasoning if reply is not None else "".join(thoughts)
        view.content = content
        view.set_thinking(thinking)
        await view.body.update(content)  # the whole text once more: fences never stay blank
        status = "error" if error else (
            "cancelled" if reply is not None and reply.finish_reason == "cancelled" else "done")
        if content or thinking or status != "error":
            view.message_id = await asyncio.to_thread(
                self.db.add_message, cid, "assistant", content, status=status,
                stats=reply.stats.to_dict() if reply is not None else None, thinking=thinking)
        view.set_status(status, error)
        if reply is not None:
            view.set_stats(reply.stats.to_dict())  # per reply, as `ollama run --verbose`
            self.last_stats = reply.stats
            self.stats = LiveStats.of(reply.stats)
        self._show_stats()

    # settings, export, copy, new -------------------------------------------------------------
    def action_settings(self) -> None:
        window = self.model.context_window if self.model else None
        # what a blank field means: the loaded model's defaults; None where the server does
        # not tell them, or before the model has loaded
        defaults = self.model.defaults if self.model else None
        unknown = "server default" if self.model else "model default"

        def done(settings: ChatSettings | None) -> None:
            if settings is None:
                return
            # the form has no thinking field: the chat's switch (Ctrl+G) stays
            settings = dataclasses.replace(settings, think=self.settings.think)
            reload = settings.context_window != self.settings.context_window
            self.settings = settings
            if self.conversation_id is not None:
                self.db.set_settings(self.conversation_id, settings.to_dict())
            if self.model is not None:
                self.model.forget(str(id(self)))
            if reload:
                self.model = None
                self._set_status(f"reloading {self.model_ref} with the new context window…")
                self._load_model()
            self.notify("settings saved")

        self.app.push_screen(SettingsScreen(self.settings, max_window=window,
                                            defaults=defaults, unknown=unknown), done)

    def action_toggle_think(self) -> None:
        """Switch this chat's thinking off or on (a reasoning model's; kept with the chat)."""
        if self.model is not None and not getattr(self.model, "thinks", True):
            self.notify(f"{self.model.name} does not think before answering",
                        severity="warning")
            return
        current = self.settings.think if self.settings.think is not None else True
        self.settings = dataclasses.replace(self.settings, think=not current)
        if self.conversation_id is not None:
            self.db.set_settings(self.conversation_id, self.settings.to_dict())
        self.notify(f"thinking {'on' if self.settings.think else 'off'} for this chat")

    def action_export(self) -> None:
        messages = [dict(v.as_dict(), status=v.status) for v in self.views]
        if self.settings.system:
            messages.insert(0, {"role": "system", "content": self.settings.system})
        path = export_markdown(self.title_text, self.model_ref, messages,
                               data_dir() / "exports")
        self.exported = path
        self.notify(f"exported to {path}", timeout=10)
        self._set_status(f"exported to {path}")

    def action_copy_last(self) -> None:
        for view in reversed(self.views):
            if view.role == "assistant":
                view.action_copy()
                return

    def action_new_chat(self) -> None:
        self.app.open_chat(self.model_ref, replace_current=True)  # type: ignore[attr-defined]

    def on_unmount(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
        if self.model is not None:
            self.model.forget(str(id(self)))
