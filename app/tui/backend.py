"""The UI's narrow view of the engine: list, pull, remove and load models, and stream replies.

`Backend` and `ChatModel` are what screens call (from worker threads: every method may block);
`LocalBackend` runs the engine in this process; `localchat.tui.remote.RemoteBackend` speaks the
OpenAI API over httpx to a server (`localchat --server URL`) behind the same protocol.
Nothing heavy (TVM, numpy) is imported until a model is loaded or pulled.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from localchat.tui.settings import ChatSettings

if TYPE_CHECKING:
    from localchat import Conversation, Engine, ReplyStream
    from localchat.downloader import DownloadProgress

Log = Callable[[str], None]
RECOMMENDED = "smollm2-135m-instruct"  # tiny, and pullable without the hub (an offline wheel)


@dataclass(frozen=True)
class ModelInfo:
    """An installed model."""

    ref: str  # name:quantization
    name: str
    quantization: str
    architecture: str
    targets: tuple[str, ...]
    size_bytes: int
    path: str
    config: dict[str, Any] = field(default_factory=dict, compare=False)
    libraries: tuple[str, ...] = ()

    @property
    def compiled(self) -> bool:
        """Whether a library is compiled for some device."""
        return bool(self.targets)


@dataclass(frozen=True)
class CatalogEntry:
    """A known model that can be pulled by name."""

    name: str
    display_name: str
    architecture: str
    description: str
    license: str
    download_mb: int
    disk_mb: int
    repo: str


class PullCancelled(Exception):
    """A pull stopped at the user's request (downloads are kept: the next pull resumes)."""


@dataclass(frozen=True)
class Pulled:
    """A finished pull: the ref of the model it installed ("" where that is not known) and a
    summary line."""

    ref: str
    summary: str


class ChatModel(Protocol):
    """A loaded model that streams replies."""

    name: str
    context_window: int
    device: str
    # the sampling defaults a reply gets when the conversation sets nothing (GenerationConfig's
    # field names), or None where they are not known (a server that does not tell)
    defaults: dict[str, Any] | None
    # whether the model may think before answering (a reasoning model: Qwen3, DeepSeek-R1)
    thinks: bool

    def reply(self, key: str, messages: Sequence[dict[str, str]],
              settings: ChatSettings) -> ReplyStream:
        """Start the reply to `messages` (the last one the user's) of conversation `key`."""

    def forget(self, key: str) -> None:
        """Drop what is held for conversation `key` (its state), if anything."""

    def close(self) -> None:
        """Stop replies and free the model."""


class Backend(Protocol):
    """Models: installed, known, pull, remove, load. `manages_store` is False where pull,
    remove and compile are not offered (a remote server): the screens say so up front."""

    manages_store: bool

    def models(self) -> list[ModelInfo]:
        """The installed models."""

    def catalog(self) -> list[CatalogEntry]:
        """The known models one can pull by name."""

    def recommended(self) -> str:
        """The model to offer on an empty store."""

    def load(self, ref: str, *, context_window: int | None = None,
             log: Log | None = None) -> ChatModel:
        """A loaded model (cached: loading the same ref again returns the same one)."""

    def remove(self, ref: str) -> None:
        """Delete an installed model."""

    def pull(self, ref: str, *, progress: DownloadProgress, stage: Callable[[str], None],
             log: Log, cancelled: Callable[[], bool]) -> Pulled:
        """Pull `ref` into the store; what it installed. Raises PullCancelled."""

    def close(self) -> None:
        """Free every loaded model."""


class LocalChatModel:
    """An in-process `Engine`; a conversation keeps its engine `Conversation` (and so its KV
    state) while the UI's history matches it, and falls back to a stateless `Engine.chat`
    over the whole history after a reopen, an edit or a regenerate."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.name = engine.name
        self.context_window = engine.context_window
        self.device = str(engine.model.device.kind)
        # the engine's own defaults: the model's generation_config.json over the class's
        self.defaults: dict[str, Any] | None = engine.config.to_dict()
        self.thinks = engine.thinks  # a reasoning model (its replies may hold thinking)
        self._conversations: dict[str, Conversation] = {}
        self._lock = threading.Lock()

    def reply(self, key: str, messages: Sequence[dict[str, str]],
              settings: ChatSettings) -> ReplyStream:
        *history, last = [{"role": m["role"], "content": m["content"]} for m in messages]
        if last["role"] != "user":
            raise ValueError("the last message must be the user's")
        system = [{"role": "system", "content": settings.system}] if settings.system else []
        overrides = settings.overrides()
        # the chat's thinking switch, for a model that thinks (others ignore it)
        think = settings.think if self.thinks else None
        with self._lock:
            conv = self._conversations.get(key)
            if conv is not None and (conv.busy or _plain(conv.messages) != system + history):
                self._conversations.pop(key).close()
                conv = None
            if conv is None and not history:
                conv = self.engine.conversation(system=settings.system or None)
                self._conversations[key] = conv
            if conv is not None:
                return conv.send(last["content"], think=think, **overrides)
        return self.engine.chat([*system, *history, last], think=think, **overrides)

    def forget(self, key: str) -> None:
        with self._lock:
            conv = self._conversations.pop(key, None)
        if conv is not None:
            conv.close()

    def close(self) -> None:
        self.engine.close()


def _plain(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the UI keeps them: role and content (the thinking is shown, not resent)."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def recipe_catalog() -> list[CatalogEntry]:
    """The recipes: the models `pull` knows by name."""
    from localchat.recipes import all_recipes

    return [
        CatalogEntry(r.name, r.display_name, r.architecture, r.description, r.license,
                     r.download_mb, r.disk_mb, r.repo)
        for r in sorted(all_recipes().values(), key=lambda r: r.name)
    ]


class LocalBackend:
    """The engine in this process, over the store at `home` (default: LOCALCHAT_HOME or the
    platform dirs), on `device`."""

    manages_store = True

    def __init__(self, device: str = "auto", home: Path | str | None = None) -> None:
        self.device = device
        self.home = home
        self._loaded: dict[tuple[str, int | None], LocalChatModel] = {}
        self._load_lock = threading.Lock()

    def _store(self) -> Any:
        from localchat.store import Store

        return Store(self.home)

    def models(self) -> list[ModelInfo]:
        out = []
        for m in self._store().models():
            out.append(ModelInfo(
                ref=m.ref, name=m.name, quantization=m.quantization,
                architecture=str(m.config.get("architecture") or m.config.get("model_type") or ""),
                targets=tuple(m.targets), size_bytes=m.size_bytes, path=str(m.path),
                config=dict(m.config), libraries=tuple(m.libraries),
            ))
        return out

    def catalog(self) -> list[CatalogEntry]:
        return recipe_catalog()

    def recommended(self) -> str:
        return RECOMMENDED

    def load(self, ref: str, *, context_window: int | None = None,
             log: Log | None = None) -> LocalChatModel:
        from localchat import Engine

        with self._load_lock:  # one load at a time; a second caller gets the cached one
            key = (ref, context_window)
            if key not in self._loaded:
                path = self._store().resolve(ref)
                engine = Engine.open(path, device=self.device, context_window=context_window,
                                     log=log)
                self._loaded[key] = LocalChatModel(engine)
            return self._loaded[key]

    def remove(self, ref: str) -> None:
        self._store().remove(ref)
        with self._load_lock:
            for key in [k for k in self._loaded if k[0] == ref]:
                self._loaded.pop(key).close()

    def pull(self, ref: str, *, progress: DownloadProgress, stage: Callable[[str], None],
             log: Log, cancelled: Callable[[], bool]) -> Pulled:
        from localchat.downloader import engine_hooks, parse_source, pull
        from localchat.recipes import QUANT_RE

        name, _, quant = ref.rpartition(":")
        if not (name and QUANT_RE.match(quant)):  # `name:quant` compiles a stored model
            name, quant = ref, ""
        parse_source(name)  # an unknown name fails before the engine (TVM) is loaded

        def check() -> None:
            if cancelled():
                raise PullCancelled(f"pull of {ref} cancelled")

        store = self._store()
        stage("prepare")
        hooks = engine_hooks(self.device, store, log)
        check()
        convert, compile_ = hooks.convert, hooks.compile

        def converting(source: Path, output_dir: Path, quantization: str, **kw: Any) -> Any:
            check()
            stage(f"convert to {quantization}")
            return convert(source, output_dir, quantization, **kw)

        def compiling(model_dir: Path) -> Path:
            check()
            stage(f"compile for {hooks.target_key}")
            assert compile_ is not None
            return compile_(model_dir)

        hooks = replace(hooks, convert=converting,
                        compile=compiling if compile_ is not None else None)
        stage("download")
        result = pull(name, hooks=hooks, store=store, quantization=quant or None,
                      progress=progress, log=log)
        return Pulled(f"{result.name}:{result.quantization}", result.summary())

    def close(self) -> None:
        with self._load_lock:
            for model in self._loaded.values():
                model.close()
            self._loaded.clear()
