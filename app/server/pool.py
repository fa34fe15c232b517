"""The models a server holds: loaded on first use (one load at a time), the least recently used
idle one unloaded when `max_loaded` is reached, and unloaded when its keep-alive expires.

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

from localchat.errors import InvalidRequestError, ModelNotFoundError
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
        matches = self.store.find(ref)  # the store's resolution: a bare name is its default
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
        else:
            self._resolved = {k: v for k, v in self._resolved.items() if v[1] not in paths}
        for path, name in self.listed_names().items():
            self.loaded[path].ref = name

    # -- loading -------------------------------------------------------------------------------
    async def preload(self, ref: str) -> LoadedModel:
        """Load a command-line model (a store reference or a model directory)."""
        path = Path(ref).expanduser()
        from localchat import model_dir as md

        if md.is_model_dir(path):
            loaded = await self._get(str(path.resolve()), path.resolve(), directory=True)
            self._aliases[loaded.ref] = loaded.path
            return loaded
        model_id, path = self.resolve(ref)
        return await self._get(model_id, path)

    async def acquire(self, model: Any) -> LoadedModel:
        """The loaded model for a request, held (never unloaded) until `release`."""
        model_id, path = self.resolve(model)
        loaded = await self._get(model_id, path)
        loaded.active += 1
        return loaded

    async def release(self, loaded: LoadedModel, keep_alive: float | None = None) -> None:
        """End a request's hold on a model.

        keep_alive: seconds the model stays loaded once idle (0: unload now, < 0: forever,
        None: leave the current setting).
        """
        loaded.active -= 1
        loaded.last_used = time.monotonic()
        if keep_alive is not None:
            loaded.expires_at = None if keep_alive < 0 else time.time() + keep_alive
        async with self._changed:
            self._changed.notify_all()
        if loaded.active == 0 and loaded.expires_at is not None \
                and loaded.expires_at <= time.time():
            await self.unload(loaded)

    async def _get(self, model_id: str, path: Path, directory: bool = False) -> LoadedModel:
        loaded = self.loaded.get(path)
        if loaded is not None and not loaded.closing:
            return loaded
        async with self._load_lock:
            loaded = self.loaded.get(path)
            if loaded is not None and not loaded.closing:
                return loaded
            await self._make_room()
            self.loading.add(model_id)
            try:
                engine = await asyncio.to_thread(self._open, path)
            finally:
                self.loading.discard(model_id)
            from localchat import model_dir as md
            from localchat.store import dir_size

            ref = engine.name if directory else model_id
            loaded = LoadedModel(ref=ref, path=path, engine=engine, size_bytes=dir_size(path),
                                 config=md.load_config(path))
            self.loaded[path] = loaded
            log.info("loaded %s from %s", ref, path)
            return loaded

    def _open(self, path: Path) -> Any:
        from localchat import Engine

        cfg = self.config
        return Engine.open(path, device=cfg.device, overflow="error",
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
