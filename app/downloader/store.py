"""The local model store: where pulled models live, how they are listed, found and removed.

Layout (``LOCALCHAT_HOME`` puts everything under one directory)::

    <data>/models/<name>/<quantization>/localchat-config.json   one model directory
    <data>/models/<name>/<quantization>/lib/<target>-<key>.so    its compiled libraries
    <data>/models/.locks/                                        one lock file per model
    <cache>/downloads/                                           source files of pulls
    <cache>/libs/                                                compiled-library cache

A model directory is built in a hidden sibling (``.staging-*``) and renamed into place, so a
half-finished pull is never listed; leftovers of a killed pull are removed by the next one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from localchat.errors import ModelNotFoundError, StoreError

MODEL_CONFIG = "localchat-config.json"
HOME_ENV = "LOCALCHAT_HOME"
APP_NAME = "localchat"
LIB_SUFFIXES = (".so", ".dylib", ".dll", ".tar", ".wasm")
# `<target key>-<16 hex library key>`: the name localchat.engine.compile gives a library
_LIBRARY_KEY = re.compile(r"^(?P<target>.+)-[0-9a-f]{16}$")
_STAGING = ".staging-"
_TRASH = ".trash-"


def safe_name(name: str) -> str:
    """The directory name for a model name (`org/repo` becomes `org--repo`)."""
    cleaned = name.strip().replace("/", "--")
    if (
        not cleaned
        or cleaned.startswith(".")
        or any(c in cleaned for c in '\\:*?"<>|\0')
        or cleaned in ("..", ".")
    ):
        raise StoreError(f"invalid model name {name!r}")
    return cleaned


def dir_size(path: Path) -> int:
    """Total size in bytes of the regular files under `path`."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


@dataclass(frozen=True)
class StoredModel:
    """One model in the store, as `localchat list` shows it."""

    name: str
    quantization: str
    path: Path
    targets: tuple[str, ...]
    size_bytes: int
    config: dict[str, Any]
    libraries: tuple[str, ...] = ()  # file names under lib/


    @property
    def ref(self) -> str:
        """The unambiguous reference `name:quantization`."""
        return f"{self.name}:{self.quantization}"

    @property
    def compiled(self) -> bool:
        """Whether at least one compiled library is present."""
        return bool(self.targets)


def read_model_config(path: Path) -> dict[str, Any]:
    """The localchat-config.json of a model directory, or StoreError if unreadable."""
    try:
        data = json.loads((Path(path) / MODEL_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StoreError(f"cannot read {Path(path) / MODEL_CONFIG}: {exc}") from None
    if not isinstance(data, dict):
        raise StoreError(f"{Path(path) / MODEL_CONFIG} is not a JSON object")
    return data


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to `path` through a temporary file and a rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library_files(model_dir: Path) -> tuple[str, ...]:
    """File names of the compiled libraries in a model directory's lib/ folder."""
    lib = Path(model_dir) / "lib"
    if not lib.is_dir():
        return ()
    return tuple(sorted(f.name for f in lib.iterdir()
                        if f.is_file() and not f.name.startswith(".") and f.suffix in LIB_SUFFIXES))


def library_target(file_name: str) -> str:
    """The target key of a library file (`llvm-znver4-0123456789abcdef.so` -> `llvm-znver4`)."""
    stem = Path(file_name).stem
    match = _LIBRARY_KEY.match(stem)
    return match.group("target") if match else stem


def library_targets(model_dir: Path) -> tuple[str, ...]:
    """Target keys of the compiled libraries in a model directory's lib/ folder."""
    return tuple(sorted({library_target(f) for f in library_files(model_dir)}))


class Store:
    """The model store rooted at the platform data/cache dirs, or at `home`/LOCALCHAT_HOME."""

    def __init__(self, home: Path | str | None = None) -> None:
        home = home if home is not None else os.environ.get(HOME_ENV) or None
        if home is not None:
            root = Path(home).expanduser().resolve()
            self.data_dir = root
            self.cache_dir = root / "cache"
        else:
            import platformdirs

            self.data_dir = Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))
            self.cache_dir = Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False))

    # paths -----------------------------------------------------------------------------------
    @property
    def models_dir(self) -> Path:
        """Where model directories live."""
        return self.data_dir / "models"

    @property
    def downloads_dir(self) -> Path:
        """Where source files are downloaded to (kept until the pull succeeds)."""
        return self.cache_dir / "downloads"

    @property
    def libs_dir(self) -> Path:
        """The cache of compiled libraries (shared by all models)."""
        return self.cache_dir / "libs"

    def model_dir(self, name: str, quantization: str) -> Path:
        """Directory of one model (whether or not it exists)."""
        return self.models_dir / safe_name(name) / safe_name(quantization)

    # locking ---------------------------------------------------------------------------------
    def _lock(self, key: str) -> FileLock:
        locks = self.models_dir / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        # One FileLock object per path and process: re-entrant in a thread, exclusive across
        # threads (thread-local state) and processes (flock).
        return FileLock(str(locks / f"{key}.lock"), is_singleton=True)

    @contextmanager
    def lock(self, name: str, quantization: str, timeout: float = -1) -> Iterator[None]:
        """Hold the lock of one model; waits up to `timeout` seconds (-1: forever)."""
        lock = self._lock(f"{safe_name(name)}@{safe_name(quantization)}")
        try:
            lock.acquire(timeout=timeout)
        except Timeout:
            raise StoreError(
                f"{name}:{quantization} is being pulled or removed by another localchat process"
            ) from None
        try:
            yield
        finally:
            lock.release()

    # reading ---------------------------------------------------------------------------------
    def _model_at(self, path: Path) -> StoredModel | None:
        if not (path / MODEL_CONFIG).is_file():
            return None
        try:
            config = read_model_config(path)
        except StoreError:
            return None
        return StoredModel(
            name=str(config.get("name") or path.parent.name),
            quantization=str(config.get("quantization") or path.name),
            path=path,
            targets=library_targets(path),
            size_bytes=dir_size(path),
            config=config,
            libraries=library_files(path),
        )

    def models(self) -> list[StoredModel]:
        """Every complete model in the store, sorted by name then quantization."""
        found: list[StoredModel] = []
        if not self.models_dir.is_dir():
            return found
        for name_dir in sorted(self.models_dir.iterdir()):
            if name_dir.name.startswith(".") or not name_dir.is_dir():
                continue
            for quant_dir in sorted(name_dir.iterdir()):
                if quant_dir.name.startswith(".") or not quant_dir.is_dir():
                    continue
                model = self._model_at(quant_dir)
                if model is not None:
                    found.append(model)
        return sorted(found, key=lambda m: (m.name.lower(), m.quantization))

    def get(self, name: str, quantization: str) -> StoredModel | None:
        """The model `name` at `quantization`, or None if it is not in the store."""
        return self._model_at(self.model_dir(name, quantization))

    def find(self, ref: str, quantization: str | None = None) -> list[StoredModel]:
        """Stored models matching `name`, `name:quantization` or a name plus `quantization`."""
        name, _, quant = ref.strip().rpartition(":") if ":" in ref else (ref.strip(), "", "")
        quant = quant or quantization or ""
        key = safe_name(name).lower()
        matches = [m for m in self.models() if safe_name(m.name).lower() == key]
        if quant:
            matches = [m for m in matches if m.quantization == quant]
        return matches

    def resolve(self, name_or_path: str | Path, quantization: str | None = None,
                prefer: tuple[str, ...] = ()) -> Path:
        """The model directory for a store reference or a path to a model directory.

        A name with several quantizations picks the first of `prefer` present, else fails
        listing them. Raises ModelNotFoundError with close matches when nothing fits.
        """
        path = Path(name_or_path).expanduser()
        if (path / MODEL_CONFIG).is_file():
            return path.resolve()
        ref = str(name_or_path)
        try:
            matches = self.find(ref, quantization)
        except StoreError:
            matches = []
        if len(matches) == 1:
            return matches[0].path
        if len(matches) > 1:
            for q in prefer:
                for m in matches:
                    if m.quantization == q:
                        return m.path
            refs = ", ".join(m.ref for m in matches)
            raise ModelNotFoundError(f"{ref!r} is stored in several quantizations: {refs}")
        if path.exists():
            raise ModelNotFoundError(f"{path} is not a model directory (no {MODEL_CONFIG})")
        from localchat.recipes import close_matches

        names = {m.name for m in self.models()} | {m.ref for m in self.models()}
        near = close_matches(ref, names)
        hint = f" Did you mean: {', '.join(near)}?" if near else ""
        raise ModelNotFoundError(
            f"no model {ref!r} in the store ({self.models_dir}).{hint} "
            f"Get it with `localchat pull {ref.split(':')[0]}`."
        )

    # writing ---------------------------------------------------------------------------------
    def _clean_leftovers(self, parent: Path, quantization: str) -> None:
        """Remove staging/trash dirs of this model left by killed processes (lock held)."""
        if not parent.is_dir():
            return
        q = safe_name(quantization)
        for entry in parent.iterdir():
            # also the dot-prefixed temporaries a converter makes beside the staging dir
            bare = "." + entry.name.lstrip(".")
            if entry.name.startswith(".") and bare.startswith((f"{_STAGING}{q}-", f"{_TRASH}{q}-")):
                shutil.rmtree(entry, ignore_errors=True)

    @contextmanager
    def staging(self, name: str, quantization: str, *, replace: bool = False) -> Iterator[Path]:
        """Yield an empty temporary directory; on success it becomes the model directory.

        The model's lock is held throughout. The directory must contain localchat-config.json
        when the block ends; on any exception (Ctrl-C included) it is deleted and the store is
        unchanged. Without `replace`, an existing model makes this raise StoreError.
        """
        final = self.model_dir(name, quantization)
        with self.lock(name, quantization):
            if final.exists() and not replace:
                raise StoreError(f"{name}:{quantization} is already in the store at {final}")
            final.parent.mkdir(parents=True, exist_ok=True)
            self._clean_leftovers(final.parent, quantization)
            tmp = Path(tempfile.mkdtemp(prefix=f"{_STAGING}{final.name}-", dir=final.parent))
            try:
                yield tmp
                if not (tmp / MODEL_CONFIG).is_file():
                    raise StoreError(f"refusing to register {name}:{quantization}: "
                                     f"no {MODEL_CONFIG} was written")
                self._commit(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise

    def _commit(self, tmp: Path, final: Path) -> None:
        """Rename the staged directory into place, moving an old version aside first."""
        _fsync_dir(tmp)
        old = None
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f"{_TRASH}{final.name}-", dir=final.parent))
            os.rename(final, old / "model")
        os.rename(tmp, final)
        _fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def add_library(self, name: str, quantization: str, library_name: str,
                    library: Path) -> Path:
        """Install a compiled library as `lib/<library_name>.so` of a stored model, atomically."""
        with self.lock(name, quantization):
            model = self.model_dir(name, quantization)
            if not (model / MODEL_CONFIG).is_file():
                raise ModelNotFoundError(f"no model {name}:{quantization} in the store")
            return install_library(model, library_name, library)

    def remove(self, ref: str, quantization: str | None = None) -> list[StoredModel]:
        """Delete the models matching `ref` (all quantizations of a bare name); returns them."""
        matches = self.find(ref, quantization)
        if not matches:
            raise ModelNotFoundError(f"no model {ref!r} in the store")
        for model in matches:
            with self.lock(model.name, model.quantization):
                if not model.path.exists():
                    continue
                trash = Path(tempfile.mkdtemp(prefix=f"{_TRASH}{model.path.name}-",
                                              dir=model.path.parent))
                os.rename(model.path, trash / "model")  # unlisted from here on
                shutil.rmtree(trash, ignore_errors=True)
            try:
                model.path.parent.rmdir()  # the name folder, once its last model is gone
            except OSError:
                pass
        return matches


def install_library(model_dir: Path, name: str, library: Path) -> Path:
    """Put `library` at `model_dir/lib/<name><suffix>` (hard link or copy, then a rename).

    `name` is the file stem the runtime looks for: the engine's `<target key>-<library key>`.
    """
    lib_dir = Path(model_dir) / "lib"
    lib_dir.mkdir(exist_ok=True)
    suffix = Path(library).suffix if Path(library).suffix in LIB_SUFFIXES else ".so"
    dest = lib_dir / f"{safe_name(name)}{suffix}"
    if Path(library).resolve() == dest.resolve():
        return dest
    fd, tmp = tempfile.mkstemp(dir=lib_dir, prefix=".lib-", suffix=suffix)
    os.close(fd)
    try:
        try:  # the compile cache and the store usually share a disk: no second copy
            os.unlink(tmp)
            os.link(library, tmp)
        except OSError:
            shutil.copyfile(library, tmp)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def _fsync_dir(path: Path) -> None:
    """Flush a directory entry to disk where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
