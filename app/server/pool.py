"""The models a server holds: loaded on first use (one load at a time), the least recently used
idle one unloaded when `max_loaded` is reached, and unloaded when its keep-alive expires.

Keep-alive and context window work as in Ollama. A request may say how long the model stays
loaded once idle (`keep_alive`, applied when the request starts; 0 unloads it as soon as it is
idle); one that does not gets the server's default (5 minutes), or forever for a command-line
model. A request runs with the context window it asks for (`num_ctx`, clamped to the model's
own window, which is also what its KV cache is sized for) or the server's default: a model
loaded with another window is reloaded with this one once its running replies have ended.

Clients name models by store reference only (`name` or `name:quant`); a directory path is
accepted only from the command line (`--model`), so a request can never make the server load
code from a folder of its choosing. A stored model is listed by the name users run it by
(`listed`, from `Store.display_ref`): the bare name for its default quantization, `name:quant`
for the others.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localchat.errors import InvalidRequestError, ModelNotFoundError, StoreError
from localchat.server.config import ServerConfig
from localchat.store import Store, StoredModel

log = logging.getLogger("localchat.server")


@dataclass(eq=False)
class LoadedModel:
    """One open engine and its bookkeeping."""

    ref: str  # the id clients see: its listed name (or the engine's name for a directory)
    path: Path
    engine: Any
    size_bytes: int
    config: dict[str, Any]
    loaded_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    active: int = 0
    expires_at: float | None = None  # wall-clock time after which an idle model is unloaded
    closing: bool = False
    keep_alive: float = -1.0  # seconds it stays loaded once idle (< 0: forever)

    @property
    def context_window(self) -> int:
        """The context window its engine runs with (what its KV cache holds per sequence)."""
        return int(self.engine.context_window)

    def expiry(self) -> float | None:
        """When it will be unloaded if nothing uses it (None: never): its set expiry when idle,
        else its keep-alive counted from now."""
        if self.active == 0 and self.expires_at is not None:
            return self.expires_at
        return None if self.keep_alive < 0 else time.time() + self.keep_alive


class ModelPool:
    """Opens engines by reference and hands them to requests."""

    def __init__(self, config: ServerConfig, store: Store | None = None) -> None:
        self.config = config
        self.store = store or Store()
        self.loaded: dict[Path, LoadedModel] = {}
        self.loading: set[str] = set()
        self.starting = False  # command-line models are still being loaded
        self._aliases: dict[str, Path] = {}  # extra names (command-line directories)
        self._resolved: dict[str, tuple[str, Path]] = {}  # client name -> (id, directory)
        self._windows: dict[Path, int] = {}  # model directory -> its own context window
        self._pinned: set[Path] = set()  # command-line models: loaded until told otherwise
        self._load_lock = asyncio.Lock()
        self._changed = asyncio.Condition()

    # -- names ---------------------------------------------------------------------------------
    def stored(self) -> list[StoredModel]:
        """The models in the store."""
        return self.store.models()

    def listed(self) -> list[tuple[str, StoredModel]]:
        """Every stored model with the name it is listed by (see `Store.display_ref`)."""
        stored = self.stored()
        return [(self.store.display_ref(m, stored), m) for m in stored]

    def listed_names(self) -> dict[Path, str]:
        """The listed name of each loaded model, by directory: a stored one's as the store
        names it now, a command-line directory's its engine's name."""
        names = {m.path: name for name, m in self.listed()}
        return {path: names.get(path, loaded.ref) for path, loaded in self.loaded.items()}

    def resolve(self, model: Any) -> tuple[str, Path]:
        """(listed name, model directory) for a client's model reference; either spelling of
        a default quantization (`name`, `name:quant`) names the same model."""
        if not isinstance(model, str) or not model.strip():
            raise InvalidRequestError("'model' must be a non-empty string", "model")
        ref = model.strip()
        if ref in self._aliases:
            return ref, self._aliases[ref]
        cached = self._resolved.get(ref)
        if cached is not None and cached[1].is_dir():
            return cached
        if any(c in ref for c in "/\\") or ref.startswith((".", "~")):
            raise ModelNotFoundError(f"the model {ref!r} does not exist: name a stored model")
        try:
            matches = self.store.find(ref)  # the store's resolution: a bare name is its default
        except StoreError:  # a name no model can have (a NUL, a leading dot...)
            raise InvalidRequestError(f"invalid model name {ref!r}: name a stored model "
                                      f"(`name` or `name:quant`)", "model") from None
        if matches:
            self._resolved[ref] = (self.store.display_ref(matches[0]), matches[0].path)
            return self._resolved[ref]
        names = sorted({m.ref for m in self.stored()} | {m.name for m in self.stored()})
        near = difflib.get_close_matches(ref, names, n=3, cutoff=0.6)
        hint = f" Did you mean: {', '.join(near)}?" if near else ""
        raise ModelNotFoundError(f"the model {ref!r} does not exist.{hint}", suggestions=near)

    def forget(self, paths: set[Path] | None = None) -> None:
        """Drop the names resolved to `paths` (models being deleted), or every resolved name
        (None: the store changed, and with it what a bare name may mean); loaded models take
        the names the store gives them now."""
        if paths is None:
            self._resolved.clear()
            self._windows.clear()
        else:
            self._resolved = {k: v for k, v in self._resolved.items() if v[1] not in paths}
            self._windows = {k: v for k, v in self._windows.items() if k not in paths}
        for path, name in self.listed_names().items():
            self.loaded[path].ref = name

    # -- context windows -----------------------------------------------------------------------
    def model_window(self, path: Path) -> int:
        """The model's own context window (its config's `context_window_size`)."""
        if path not in self._windows:
            loaded = self.loaded.get(path)
            if loaded is not None:
                config = loaded.config
            else:
                from localchat import model_dir as md

                config = md.load_config(path)
            self._windows[path] = int(config["context_window_size"])
        return self._windows[path]

    def window_for(self, path: Path, num_ctx: int | None, ref: str = "") -> int:
        """The context window a request runs with: `num_ctx` (a request's), else the server's
        default, else the model's own; more than the model's own is clamped to it (logged), as
        Ollama does; less than 2 is a 400."""
        limit = self.model_window(path)
        want = num_ctx if num_ctx is not None else self.config.context_length
        if want is None:
            return limit
        if isinstance(want, bool) or not isinstance(want, int) or want < 2:
            raise InvalidRequestError(f"num_ctx must be an integer >= 2, got {want!r}",
                                      "num_ctx")
        if want > limit:
            log.warning("%s: requested context window %d exceeds the model's %d; using %d",
                        ref or path.name, want, limit, limit)
            return limit
        return want

    # -- loading -------------------------------------------------------------------------------
    async def preload(self, ref: str) -> LoadedModel:
        """Load a command-line model (a store reference or a model directory); it stays loaded
        until a request's keep_alive says otherwise."""
        path = Path(ref).expanduser()
        from localchat import model_dir as md

        if md.is_model_dir(path):
            path = path.resolve()
            self._pinned.add(path)
            loaded = await self._get(str(path), path, self.window_for(path, None),
                                     directory=True)
            self._aliases[loaded.ref] = loaded.path
            return loaded
        model_id, path = self.resolve(ref)
        self._pinned.add(path)
        return await self._get(model_id, path, self.window_for(path, None, model_id))

    def default_keep_alive(self, path: Path) -> float:
        """Seconds a model stays loaded once idle when a request does not say (< 0: forever)."""
        return -1.0 if path in self._pinned else float(self.config.keep_alive)

    async def acquire(self, model: Any, *, num_ctx: int | None = None,
                      keep_alive: float | None = None) -> LoadedModel:
        """The loaded model for a request, held (never unloaded) until `release`.

        num_ctx: the context window the request wants (None: the server's default); a model
        loaded with another one is reloaded. keep_alive: seconds the model stays loaded once
        idle (0: unload as soon as it is idle, < 0: forever; None: the default), set now.
        """
        model_id, path = self.resolve(model)
        window = self.window_for(path, num_ctx, model_id)
        loaded = await self._get(model_id, path, window)
        loaded.active += 1
        loaded.keep_alive = self.default_keep_alive(path) if keep_alive is None else keep_alive
        loaded.expires_at = None
        return loaded

    async def release(self, loaded: LoadedModel, keep_alive: float | None = None) -> None:
        """End a request's hold on a model; once idle, its keep-alive starts counting.

        keep_alive: replaces the model's keep-alive (seconds once idle; 0: unload now, < 0:
        forever; None: keep the one its requests set).
        """
        loaded.active -= 1
        loaded.last_used = time.monotonic()
        if keep_alive is not None:
            loaded.keep_alive = keep_alive
        if loaded.active == 0:
            loaded.expires_at = (None if loaded.keep_alive < 0
                                 else time.time() + loaded.keep_alive)
        async with self._changed:
            self._changed.notify_all()
        if loaded.active == 0 and loaded.expires_at is not None \
                and loaded.expires_at <= time.time():
            await self.unload(loaded)

    async def expire(self, model: Any) -> LoadedModel | None:
        """Unload a model as soon as its running replies end (Ollama's keep_alive 0 with no
        prompt); returns it, or None when it was not loaded (nothing is loaded for this)."""
        _, path = self.resolve(model)
        loaded = self.loaded.get(path)
        if loaded is None or loaded.closing:
            return None
        loaded.keep_alive = 0.0
        if loaded.active == 0:
            await self.unload(loaded)
        return loaded

    async def _get(self, model_id: str, path: Path, window: int,
                   directory: bool = False) -> LoadedModel:
        loaded = self.loaded.get(path)
        if loaded is not None and not loaded.closing and loaded.context_window == window:
            return loaded
        async with self._load_lock:
            loaded = self.loaded.get(path)
            aliases = [a for a, p in self._aliases.items() if p == path]
            if loaded is not None and not loaded.closing:
                if loaded.context_window == window:
                    return loaded
                # Ollama's way: a request for another window waits for the running replies
                # (new ones wait behind this lock), then the model is opened again with it.
                log.info("reloading %s with a context window of %d (was %d)", loaded.ref,
                         window, loaded.context_window)
                loaded.closing = True
                async with self._changed:
                    await self._changed.wait_for(lambda: loaded.active == 0)
                await self.unload(loaded)
            await self._make_room()
            self.loading.add(model_id)
            try:
                engine = await asyncio.to_thread(self._open, path, window)
            finally:
                self.loading.discard(model_id)
            from localchat import model_dir as md
            from localchat.store import dir_size

            ref = engine.name if directory else model_id
            loaded = LoadedModel(ref=ref, path=path, engine=engine, size_bytes=dir_size(path),
                                 config=md.load_config(path),
                                 keep_alive=self.default_keep_alive(path))
            self.loaded[path] = loaded
            for alias in aliases:  # a command-line directory reloaded keeps its name
                self._aliases[alias] = path
            log.info("loaded %s from %s (context window %d)", ref, path,
                     loaded.context_window)
            return loaded

    def _open(self, path: Path, window: int) -> Any:
        from localchat import Engine

        cfg = self.config
        # the window sizes the KV cache too; the model's own window needs no argument
        context = window if window < self.model_window(path) else None
        return Engine.open(path, device=cfg.device, overflow="error", context_window=context,
                           max_batch_size=cfg.max_concurrency, max_queue=cfg.max_queue,
                           log=lambda message: log.info("%s", message))

    async def _make_room(self) -> None:
        """Unload least recently used idle models until one more fits (waits while all run)."""
        while len(self.loaded) >= max(1, self.config.max_loaded):
            idle = [m for m in self.loaded.values() if m.active == 0]
            if idle:
                await self.unload(min(idle, key=lambda m: m.last_used))
                continue
            async with self._changed:
                await self._changed.wait()

    async def unload(self, loaded: LoadedModel) -> None:
        """Close a model's engine (its running replies are cancelled)."""
        if self.loaded.get(loaded.path) is not loaded:
            return
        loaded.closing = True
        del self.loaded[loaded.path]
        for alias, path in list(self._aliases.items()):
            if path == loaded.path:
                del self._aliases[alias]
        await asyncio.to_thread(loaded.engine.close)
        log.info("unloaded %s", loaded.ref)

    async def reap(self) -> None:
        """Unload idle models whose keep-alive has expired."""
        now = time.time()
        for loaded in list(self.loaded.values()):
            if loaded.active == 0 and loaded.expires_at is not None and loaded.expires_at <= now:
                await self.unload(loaded)

    async def close(self) -> None:
        """Unload everything."""
        for loaded in list(self.loaded.values()):
            await self.unload(loaded)
