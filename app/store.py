"""The local model store: where pulled models live, how they are listed, found and removed.

Layout (``LOCALCHAT_HOME`` puts everything under one directory)::

    <data>/models/<name>/<quantization>/localchat-config.json   one model directory
    <data>/models/<name>/<quantization>/lib/<target>-<key>.so    its compiled libraries
    <data>/models/.defaults/<name>                               a name's default quantization
    <data>/models/.locks/                                        one lock file per model
    <cache>/downloads/                                           source files of pulls
    <cache>/libs/                                                compiled-library cache

The model-directory format itself (config schema, library names) is `localchat.model_dir`.

Names work as in Ollama: a bare `name` means `name:<its default quantization>` (the one the first
pull of the name made, or the one a later `pull NAME` without `--quant` made); `name:quant` means
that one. `resolve` is the one resolver of a model reference every front end goes through.

A model directory is built in a hidden sibling (``.staging-*``) and renamed into place, so a
half-finished pull is never listed; leftovers of a killed pull are removed by the next one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from localchat import model_dir as md
from localchat.errors import LocalchatError, ModelConfigError, ModelNotFoundError, StoreError
from localchat.paths import cache_dir, data_dir

_STAGING = ".staging-"
_DEFAULTS = ".defaults"  # under models/: one file per name, the quantization a bare name means
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
    problems: tuple[md.FileProblem, ...] = ()  # what is damaged (empty: nothing found)
    repair: str = ""  # the command that repairs it

    @property
    def damaged(self) -> bool:
        """Whether a file is missing, truncated, unreadable or altered, or the config is bad."""
        return bool(self.problems)

    def damage_message(self) -> str:
        """One line: the damaged file and the command that repairs the model."""
        return md.damage_message(self.ref, list(self.problems), self.repair)

    @property
    def ref(self) -> str:
        """The unambiguous reference `name:quantization`."""
        return f"{self.name}:{self.quantization}"

    @property
    def compiled(self) -> bool:
        """Whether at least one compiled library is present."""
        return bool(self.targets)


class Store:
    """The model store rooted at the platform data/cache dirs, or at `home`/LOCALCHAT_HOME."""

    def __init__(self, home: Path | str | None = None) -> None:
        self.data_dir = data_dir(home)
        self.cache_dir = cache_dir(home)

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
        """The cache of compiled libraries (shared by all models; see model_dir)."""
        return self.cache_dir / "libs"

    def model_dir(self, name: str, quantization: str) -> Path:
        """Directory of one model (whether or not it exists)."""
        return self.models_dir / safe_name(name) / safe_name(quantization)

    # locking ---------------------------------------------------------------------------------
    def _lock(self, key: str) -> FileLock:
        locks = self.models_dir / ".locks"
        try:
            locks.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot write to the store {self.models_dir}: "
                             f"{exc.strerror or exc}") from None
        # One FileLock object per path and process: re-entrant in a thread, exclusive across
        # threads (thread-local state) and processes (flock).
        return FileLock(str(locks / f"{key}.lock"), is_singleton=True)

    @contextmanager
    def lock(self, name: str, quantization: str, timeout: float = -1,
             on_wait: Callable[[], None] | None = None) -> Iterator[None]:
        """Hold the lock of one model; waits up to `timeout` seconds (-1: forever), calling
        `on_wait` first when another process holds it."""
        lock = self._lock(f"{safe_name(name)}@{safe_name(quantization)}")
        try:
            try:
                lock.acquire(timeout=0)
            except Timeout:
                if timeout == 0:
                    raise
                if on_wait is not None:
                    on_wait()
                lock.acquire(timeout=timeout)
        except PermissionError as exc:
            raise StoreError(f"cannot lock {name}:{quantization} in {self.models_dir}: "
                             f"{exc.strerror or exc}") from None
        except Timeout:
            raise StoreError(
                f"{name}:{quantization} is being pulled or removed by another localchat process"
            ) from None
        try:
            yield
        finally:
            lock.release()

    # reading ---------------------------------------------------------------------------------
    def _repair_command(self, path: Path, name: str, quantization: str) -> str:
        try:
            recorded = (md.read_manifest(path) or {}).get("repair")
        except (ModelConfigError, OSError):
            recorded = None
        return recorded if isinstance(recorded, str) and recorded else (
            f"localchat pull {name} --quant {quantization}")

    def _model_at(self, path: Path, hashes: bool = False) -> StoredModel | None:
        """The model at `path` (damaged ones too, with their problems); None when `path` is
        not a model directory at all."""
        try:
            if not path.is_dir():
                return None
            problems = md.check_files(path, hashes=hashes)
            config: dict[str, Any] = {}
            try:
                config = md.validate_config(md.read_config(path), md.CONFIG_FILE)
            except LocalchatError as exc:
                if not any(p.path == md.CONFIG_FILE for p in problems):
                    problems.insert(0, md.FileProblem(md.CONFIG_FILE, "damaged",
                                                      str(exc).rpartition(": ")[2]))
                try:
                    config = md.read_config(path)
                except LocalchatError:
                    config = {}
            targets, libraries, size = (md.library_targets(path), md.library_files(path),
                                        dir_size(path))
        except OSError as exc:  # an unreadable model never breaks the listing of the others
            problems = [md.FileProblem(".", "unreadable", exc.strerror or str(exc))]
            config, targets, libraries, size = {}, (), (), 0
        manifest: dict[str, Any] = {}
        try:
            manifest = md.read_manifest(path) or {}
        except (LocalchatError, OSError):
            pass
        name = str(config.get("name") or manifest.get("name")
                   or path.parent.name.replace("--", "/"))
        quantization = str(config.get("quantization") or manifest.get("quantization")
                           or path.name)
        return StoredModel(
            name=name, quantization=quantization, path=path, targets=targets,
            size_bytes=size, config=config, libraries=libraries, problems=tuple(problems),
            repair=self._repair_command(path, name, quantization),
        )

    def verify(self, model: StoredModel) -> StoredModel:
        """`model` checked again, hashes included (what `pull` and `doctor --verify` do)."""
        return self._model_at(model.path, hashes=True) or model

    def models(self) -> list[StoredModel]:
        """Every model in the store, damaged ones included (see `StoredModel.problems`),
        sorted by name then quantization; unfinished pulls (hidden folders) are not listed."""
        found: list[StoredModel] = []
        try:
            name_dirs = sorted(self.models_dir.iterdir()) if self.models_dir.is_dir() else []
        except OSError:
            return found
        for name_dir in name_dirs:
            if name_dir.name.startswith("."):
                continue
            try:
                if not name_dir.is_dir():
                    continue
                quant_dirs = sorted(name_dir.iterdir())
            except OSError as exc:
                found.append(StoredModel(
                    name=name_dir.name.replace("--", "/"), quantization="?", path=name_dir,
                    targets=(), size_bytes=0, config={},
                    problems=(md.FileProblem(".", "unreadable", exc.strerror or str(exc)),),
                    repair=f"sudo chmod -R a+rX {name_dir}"))
                continue
            for quant_dir in quant_dirs:
                if quant_dir.name.startswith("."):
                    continue
                model = self._model_at(quant_dir)
                if model is not None:
                    found.append(model)
        return sorted(found, key=lambda m: (m.name.lower(), m.quantization))

    def get(self, name: str, quantization: str) -> StoredModel | None:
        """The model `name` at `quantization`, or None if it is not in the store."""
        return self._model_at(self.model_dir(name, quantization))

    def find_all(self, name: str) -> list[StoredModel]:
        """Every stored quantization of `name` (a bare name; `name:quant` is cut at the colon)."""
        bare = name.strip().rpartition(":")[0] if ":" in name else name.strip()
        key = safe_name(bare).lower()
        return [m for m in self.models() if safe_name(m.name).lower() == key]

    def find(self, ref: str, quantization: str | None = None) -> list[StoredModel]:
        """The stored models `ref` names: `name:quant` (or a name plus `quantization`) that one,
        a bare `name` its default quantization (see `default_quantization`); [] when none."""
        name, _, quant = ref.strip().rpartition(":") if ":" in ref else (ref.strip(), "", "")
        quant = quant or quantization or ""
        matches = self.find_all(name)
        if quant:
            return [m for m in matches if m.quantization == quant]
        default = self._default_among(matches)
        return [default] if default is not None else []

    def _default_file(self, name: str) -> Path:
        return self.models_dir / _DEFAULTS / safe_name(name)

    def _default_among(self, matches: list[StoredModel]) -> StoredModel | None:
        """Which of one name's stored quantizations a bare name means: the recorded default
        when it is still stored, else the only one, else the most recently pulled."""
        if not matches:
            return None
        if len(matches) == 1:
            return matches[0]
        try:
            recorded = self._default_file(matches[0].name).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError, StoreError):
            recorded = ""
        for m in matches:
            if m.quantization == recorded:
                return m
        return max(matches, key=lambda m: (str(m.config.get("pulled_at") or ""),
                                           m.path.stat().st_mtime if m.path.exists() else 0.0))

    def default_quantization(self, name: str) -> str | None:
        """The quantization a bare `name` means, or None when the name is not stored."""
        model = self._default_among(self.find_all(name))
        return model.quantization if model is not None else None

    def display_ref(self, model: StoredModel, stored: list[StoredModel] | None = None) -> str:
        """The name users run `model` by, as a server lists it: the bare name for its name's
        default quantization, `name:quant` for the others. `stored`: the store's models, when
        the caller has listed them already (saves listing them again)."""
        key = model.name.lower()
        same = ([m for m in stored if m.name.lower() == key] if stored is not None
                else self.find_all(model.name))
        default = self._default_among(same)
        return model.name if default is not None and default.path == model.path else model.ref

    def set_default(self, name: str, quantization: str) -> None:
        """Record `quantization` as what a bare `name` means (the model need not exist yet)."""
        path = self._default_file(name)
        path.parent.mkdir(mode=md.DIR_MODE, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(quantization + "\n", encoding="utf-8")
        os.chmod(tmp, md.FILE_MODE)
        os.replace(tmp, path)

    def resolve(self, name_or_path: str | Path, quantization: str | None = None) -> Path:
        """The model directory for a store reference (`name` is its default quantization,
        `name:quant` that one) or a path to a model directory.

        Raises ModelNotFoundError with close matches when nothing fits.
        """
        path = Path(name_or_path).expanduser()
        if md.is_model_dir(path):
            return path.resolve()
        ref = str(name_or_path)
        try:
            matches = self.find(ref, quantization)
        except StoreError:
            matches = []
        if len(matches) == 1:
            return _healthy(matches[0]).path
        if path.exists():
            raise ModelNotFoundError(f"{path} is not a model directory (no {md.CONFIG_FILE})")
        raise self.not_found(ref)

    def not_found(self, ref: str) -> ModelNotFoundError:
        """The error for a reference nothing in the store matches: close stored names, and the
        `pull` that gets it only when the name is one `pull` knows (a recipe)."""
        from localchat.recipes import close_matches, known_recipe_names

        stored = self.models()
        name, _, quant = ref.rpartition(":") if ":" in ref else (ref, "", "")
        others = [m.ref for m in stored if m.name.lower() == name.lower()]
        if others:
            return ModelNotFoundError(
                f"no model {ref!r} in the store; {name} is stored as {', '.join(others)}. Get "
                f"{quant} with `localchat pull {name} --quant {quant}`.", suggestions=others)
        recipes = known_recipe_names()
        near = close_matches(ref, {m.name for m in stored} | {m.ref for m in stored}
                             | set(recipes))
        hint = f" Did you mean: {', '.join(near)}?" if near else ""
        pull = (f" Get it with `localchat pull {name}`." if name in recipes
                else " `localchat list --available` shows the models `localchat pull` knows.")
        return ModelNotFoundError(
            f"no model {ref!r} in the store ({self.models_dir}).{hint}{pull}",
            suggestions=near,
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

    def stale_leftovers(self) -> list[Path]:
        """Hidden staging/trash folders of killed pulls, any model's; never a live pull's (whose
        model lock is held)."""
        out: list[Path] = []
        try:
            name_dirs = [d for d in self.models_dir.iterdir()
                         if not d.name.startswith(".") and d.is_dir()]
        except OSError:
            return out
        for name_dir in name_dirs:
            try:
                entries = [e for e in name_dir.iterdir() if e.name.startswith(".")]
            except OSError:
                continue
            for entry in entries:
                bare = entry.name.lstrip(".")
                for prefix in (_STAGING, _TRASH):
                    if bare.startswith(prefix[1:]):
                        quant = bare[len(prefix) - 1:].partition(".")[0].rpartition("-")[0]
                        if quant and not self._held(name_dir.name, quant):
                            out.append(entry)
                        break
        return out

    def _held(self, name: str, quantization: str) -> bool:
        """Whether another process holds a model's lock (so its leftovers are a live pull's)."""
        try:
            with self.lock(name, quantization, timeout=0):
                return False
        except StoreError:
            return True

    def remove_stale_leftovers(self) -> list[tuple[Path, int]]:
        """Delete what `stale_leftovers` finds; returns each folder and the bytes it held."""
        removed = []
        for entry in self.stale_leftovers():
            size = dir_size(entry)
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                removed.append((entry, size))
        return removed

    @contextmanager
    def staging(self, name: str, quantization: str, *, replace: bool = False,
                repair: str | None = None) -> Iterator[Path]:
        """Yield an empty temporary directory; on success it becomes the model directory.

        The model's lock is held throughout. The directory must contain localchat-config.json
        when the block ends; on any exception (Ctrl-C included) it is deleted and the store is
        unchanged. Without `replace`, an existing model makes this raise StoreError.
        """
        final = self.model_dir(name, quantization)
        with self.lock(name, quantization):
            if final.exists() and not replace:
                raise StoreError(f"{name}:{quantization} is already in the store at {final}")
            final.parent.mkdir(mode=md.DIR_MODE, parents=True, exist_ok=True)
            self._clean_leftovers(final.parent, quantization)
            tmp = Path(tempfile.mkdtemp(prefix=f"{_STAGING}{final.name}-", dir=final.parent))
            try:
                yield tmp
                if not md.is_model_dir(tmp):
                    raise StoreError(f"refusing to register {name}:{quantization}: "
                                     f"no {md.CONFIG_FILE} was written")
                md.write_manifest(tmp, name=name, quantization=quantization,
                                  repair=repair or f"localchat pull {name} --quant {quantization}")
                md.share_modes(tmp)
                self._commit(tmp, final)
                self._keep_a_default(name, quantization)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise

    def _keep_a_default(self, name: str, quantization: str) -> None:
        """The first quantization of a name becomes its default (kept while it is stored)."""
        try:
            recorded = self._default_file(name).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            recorded = ""
        if not recorded or not md.is_model_dir(self.model_dir(name, recorded)):
            self.set_default(name, quantization)

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
            if not md.is_model_dir(model):
                raise ModelNotFoundError(f"no model {name}:{quantization} in the store")
            suffix = Path(library).suffix if Path(library).suffix in md.LIB_SUFFIXES else ".so"
            return md.install_library(model, library, f"{safe_name(library_name)}{suffix}")

    def copy(self, source: str, destination: str) -> StoredModel:
        """Store the model `source` names (see `find`) again as `destination` (`name`, or
        `name:quant` with the source's own quantization), as Ollama's `cp` does: both are then
        listed and run. Files are hard-linked where the filesystem allows (the store never
        writes a model file in place), else copied; the copy's config carries its new name.

        ModelNotFoundError when nothing is stored as `source`; StoreError for an invalid
        destination name, another quantization, or a destination that is already stored."""
        try:
            matches = self.find(source)
        except StoreError:
            matches = []
        if not matches:
            raise ModelNotFoundError(f"no model {source!r} in the store")
        model = _healthy(matches[0])
        name, _, quant = destination.strip().rpartition(":") if ":" in destination else (
            destination.strip(), "", "")
        safe_name(name)  # an invalid name is a StoreError before anything is written
        quant = quant or model.quantization
        if quant != model.quantization:
            raise StoreError(f"cannot copy {model.ref} to {name}:{quant}: a copy keeps its "
                             f"quantization ({model.quantization})")
        if any(m.quantization == quant for m in self.find_all(name)):
            raise StoreError(f"{name}:{quant} is already in the store")
        with self.lock(model.name, model.quantization), \
                self.staging(name, quant, repair=model.repair) as tmp:
            _link_tree(model.path, tmp)
            md.update_config(tmp, {"name": name})
        copied = self.get(name, quant)
        if copied is None:  # staging committed it: only a concurrent removal gets here
            raise StoreError(f"{name}:{quant} disappeared while it was being copied")
        return copied

    def remove(self, ref: str, quantization: str | None = None, *,
               every_quantization: bool = False) -> list[StoredModel]:
        """Delete what `ref` names (see `find`; every quantization of the name with
        `every_quantization`); returns the removed models."""
        matches = self.find_all(ref) if every_quantization else self.find(ref, quantization)
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
                self._default_file(model.name).unlink(missing_ok=True)
            except OSError:
                pass
        for name in {m.name for m in matches}:  # a removed default passes to what a name now means
            left = self._default_among(self.find_all(name))
            if left is not None:
                self._keep_a_default(name, left.quantization)
        return matches


def _link_tree(source: Path, target: Path) -> None:
    """The files of model directory `source` under the empty directory `target`: hard links,
    or copies where linking is refused (another filesystem, a file of another user); hidden
    files and the manifest (written afresh for the copy) are left out."""
    for root, dirs, files in os.walk(source, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel = Path(root).relative_to(source)
        (target / rel).mkdir(mode=md.DIR_MODE, parents=True, exist_ok=True)
        for name in files:
            if name.startswith(".") or (rel == Path(".") and name == md.MANIFEST_FILE):
                continue
            src, dst = Path(root, name), target / rel / name
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)


def _healthy(model: StoredModel) -> StoredModel:
    """`model`, unless it is damaged: then the one-line error naming the file and the repair.
    A bad library alone does not stop a run: the runtime never loads it and builds it again."""
    problems = [p for p in model.problems if not p.path.startswith(md.LIB_DIR + "/")]
    if problems:
        raise ModelConfigError(md.damage_message(model.ref, problems, model.repair))
    return model


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
