"""The model-directory format: `localchat-config.json` (schema, format version, reading and
writing), the compiled-library file names under `lib/`, and the one cache of compiled libraries.

A model directory holds::

    localchat-config.json      this module's schema (below)
    tensor-cache.json, *.bin   weight shards in TVM's tensor-cache format
    tokenizer files            tokenizer.json / tokenizer.model / the RWKV World vocabulary, ...
    lib/<target>-<key>.so      compiled libraries, one per target (`library_file_name`)
    localchat-manifest.json    every other file's size and sha256 (`write_manifest`), written
                               when the directory is built and updated when a library is added

`run` checks the manifest's sizes on every load (`check_files`, cheap); `pull` on an existing
model and `doctor --verify` check the hashes too. A compiled library is never trusted by name
alone: its hash is recorded (in the manifest, or in a `<file>.sha256` record beside it in a
library cache) and a library that fails it is rebuilt, never loaded (`trusted_library`).

Compiled libraries are named by a hash of everything that shapes them, so one file serves every
model with the same architecture config, quantization and target. They are compiled into
`library_cache_dir()` and linked into the model's `lib/` when it is writable.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localchat.errors import ModelConfigError
from localchat.paths import cache_dir, user_cache_dir

CONFIG_FILE = "localchat-config.json"
MANIFEST_FILE = "localchat-manifest.json"
MANIFEST_VERSION = 1
RECORD_SUFFIX = ".sha256"  # `<library>.sha256` beside a library in a cache: its hash record
FILE_MODE, DIR_MODE = 0o644, 0o755  # a shared store: readable by every user of the machine
FORMAT_VERSION = 4  # the newest format this localchat reads (`format_for` says which it writes)
# Quantizations whose stored layout changed, and the first format with the current one: a
# directory of an older format holds the old layout and is refused (convert it again).
# q4f32_k: float32 scales and mins per group -> Q4_K's super-blocks (format 2); its embedding
# and LM head 8-bit -> Q6_K where their rows are whole super-blocks (format 3); sc and m a byte
# each -> packed in 6 bits, 16 bytes a super-block (format 4).
LAYOUT_FORMATS = {"q4f32_k": 4}
LIB_DIR = "lib"
LIB_SUFFIXES = (".so", ".dylib", ".dll", ".tar", ".wasm")
LIBRARY_SUFFIX = ".so"
# Keys every model directory's config has, and their JSON types. Others are optional: name,
# template, eos_token_ids, bos_token_id, vocab_size, source, `embedding` (an embedding model's
# pooling, `EmbeddingSettings`), and what `pull` records.
REQUIRED_KEYS: dict[str, type | tuple[type, ...]] = {
    "architecture": str,
    "quantization": str,
    "model_config": dict,
    "context_window_size": int,
    "prefill_chunk_size": int,
    "param_names": list,
}
# `<target key>-<16 hex library key>`: the stem `library_file_name` gives a library
_LIBRARY_STEM = re.compile(r"^(?P<target>.+)-(?P<key>[0-9a-f]{16})$")


# -- localchat-config.json -------------------------------------------------------------------
def is_model_dir(path: Path | str) -> bool:
    """Whether `path` is a directory holding a localchat-config.json."""
    return (Path(path) / CONFIG_FILE).is_file()


def read_config(model_dir: Path | str) -> dict[str, Any]:
    """The raw localchat-config.json of a model directory (a JSON object), unvalidated."""
    path = Path(model_dir) / CONFIG_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelConfigError(f"{model_dir}: not a localchat model directory "
                               f"(no {CONFIG_FILE})") from None
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path} is not a JSON object")
    return data


def validate_config(data: dict[str, Any], where: Path | str = CONFIG_FILE) -> dict[str, Any]:
    """`data` when it has every required key with the right type and a known format version."""
    version = data.get("format", FORMAT_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or version > FORMAT_VERSION:
        raise ModelConfigError(
            f"{where}: format version {version!r} is newer than this localchat reads "
            f"({FORMAT_VERSION}); upgrade localchat"
        )
    for key, kind in REQUIRED_KEYS.items():
        value = data.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ModelConfigError(f"{where}: {key!r} is missing or not a {_type_name(kind)}")
    if version < LAYOUT_FORMATS.get(data["quantization"], 1):
        raise ModelConfigError(
            f"{where}: its {data['quantization']} weights are in the layout of an older "
            f"localchat (format {version}); convert the model again")
    if not data["param_names"]:
        raise ModelConfigError(f"{where}: lists no parameters")
    return data


def load_config(model_dir: Path | str) -> dict[str, Any]:
    """The validated localchat-config.json of a model directory (what the runtime loads).

    Checks first that every file the manifest lists is there with its size (libraries aside:
    the runtime verifies and rebuilds those); a damaged model raises one line naming the file
    and the command that repairs it."""
    problems = [p for p in check_files(model_dir) if not p.path.startswith(LIB_DIR + "/")]
    if problems:
        raise ModelConfigError(damage_message(model_dir, problems))
    try:
        return validate_config(read_config(model_dir), Path(model_dir) / CONFIG_FILE)
    except ModelConfigError as exc:
        if not (Path(model_dir) / MANIFEST_FILE).is_file():
            raise
        raise ModelConfigError(f"{exc}; repair it with `{repair_command(model_dir)}`") from None


def format_for(quantization: str) -> int:
    """The format a new model directory of `quantization` is written in: 1, or the format its
    layout changed in (`LAYOUT_FORMATS`), so older versions read what they can and refuse the
    rest ("upgrade localchat")."""
    return LAYOUT_FORMATS.get(quantization, 1)


def write_config(model_dir: Path | str, data: dict[str, Any]) -> Path:
    """Write the config atomically (temporary file, fsync, rename), stamping the format."""
    data = {**data, "format": data.get("format", format_for(str(data.get("quantization"))))}
    return write_json_atomic(Path(model_dir) / CONFIG_FILE, data)


def update_config(model_dir: Path | str, changes: dict[str, Any]) -> dict[str, Any]:
    """Merge `changes` into a model directory's config and write it back; returns the result."""
    data = {**read_config(model_dir), **changes}
    write_config(model_dir, data)
    return data


def write_json_atomic(path: Path, data: Any) -> Path:
    """Write JSON to `path` through a temporary sibling file and a rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _type_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {str: "string", int: "integer", dict: "JSON object", list: "list"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


# -- embedding models: pooling and normalization --------------------------------------------
EMBEDDING_KEY = "embedding"  # present exactly in an embedding model's config
POOLING_MODES = ("mean", "cls", "last", "max")


@dataclass(frozen=True)
class EmbeddingSettings:
    """How an embedding model turns token states into one vector, recorded at convert time
    from its sentence-transformers files: the pooling ("mean" over the text's tokens, "cls" its
    first token, "last" its last token, "max" per dimension), whether the vector is scaled to
    unit length, the most tokens of a text (longer ones are truncated or refused), and the
    vector's size."""

    pooling: str
    normalize: bool
    max_tokens: int
    dimensions: int

    def to_dict(self) -> dict[str, Any]:
        return {"pooling": self.pooling, "normalize": self.normalize,
                "max_tokens": self.max_tokens, "dimensions": self.dimensions}


def embedding_settings(meta: dict[str, Any]) -> EmbeddingSettings | None:
    """The embedding settings of a model's config (None: a chat model), checked."""
    data = meta.get(EMBEDDING_KEY)
    if data is None:
        return None
    where = f"{CONFIG_FILE}: {EMBEDDING_KEY}"
    if not isinstance(data, dict):
        raise ModelConfigError(f"{where} is not a JSON object")
    pooling, normalize = data.get("pooling"), data.get("normalize")
    if pooling not in POOLING_MODES:
        raise ModelConfigError(f"{where}.pooling must be one of {', '.join(POOLING_MODES)}, "
                               f"not {pooling!r}")
    if not isinstance(normalize, bool):
        raise ModelConfigError(f"{where}.normalize must be true or false")
    sizes = {k: data.get(k) for k in ("max_tokens", "dimensions")}
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelConfigError(f"{where}.{key} must be a positive integer, not {value!r}")
    return EmbeddingSettings(pooling, normalize, sizes["max_tokens"], sizes["dimensions"])


# -- the manifest: every file's size and sha256 -----------------------------------------------
@dataclass(frozen=True)
class FileProblem:
    """One file of a model directory that is not what its manifest says."""

    path: str  # relative to the model directory, e.g. "params_shard_0.bin" or "lib/x.so"
    kind: str  # missing, truncated, wrong size, altered, unreadable, garbage
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.path} is {self.kind}" + (f" ({self.detail})" if self.detail else "")


def sha256_file(path: Path | str) -> str:
    """Hex sha256 of a file's content."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_record(path: Path | str) -> dict[str, Any]:
    """{"size", "sha256"} of one file, as the manifest and library records hold them."""
    return {"size": os.stat(path).st_size, "sha256": sha256_file(path)}


def _model_files(model_dir: Path) -> list[str]:
    """Relative paths of the regular files a manifest covers (hidden ones and itself aside)."""
    out = []
    for root, dirs, files in os.walk(model_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            rel = Path(root, name).relative_to(model_dir).as_posix()
            if not name.startswith(".") and rel != MANIFEST_FILE:
                out.append(rel)
    return out


def write_manifest(model_dir: Path | str, **extra: Any) -> Path:
    """Record every file of a model directory (size and sha256) in its manifest.

    `extra` adds keys, e.g. `repair`: the command that rebuilds this directory."""
    model_dir = Path(model_dir)
    previous = _read_manifest_quietly(model_dir)
    data = {key: value for key, value in previous.items() if key not in ("files", "format")}
    data.update(extra)
    data["format"] = MANIFEST_VERSION
    data["files"] = {rel: file_record(model_dir / rel) for rel in _model_files(model_dir)}
    return write_json_atomic(model_dir / MANIFEST_FILE, data)


def read_manifest(model_dir: Path | str) -> dict[str, Any] | None:
    """The manifest of a model directory; None when it has none (built before manifests)."""
    path = Path(model_dir) / MANIFEST_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"cannot read {path}: {exc}") from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("size"), int)
            and isinstance(v.get("sha256"), str) for v in files.values()):
        raise ModelConfigError(f"{path} is not a localchat manifest")
    return data


def _read_manifest_quietly(model_dir: Path) -> dict[str, Any]:
    try:
        return read_manifest(model_dir) or {}
    except ModelConfigError:
        return {}


def _update_manifest(model_dir: Path, rel: str, record: dict[str, Any] | None) -> None:
    """Set (or, with None, drop) one file's record in an existing manifest."""
    try:
        data = read_manifest(model_dir)
    except ModelConfigError:
        return
    if data is None:
        return
    if record is None:
        if data["files"].pop(rel, None) is None:
            return
    else:
        data["files"][rel] = record
    write_json_atomic(model_dir / MANIFEST_FILE, data)


def forget_files(model_dir: Path | str, paths: list[str]) -> None:
    """Delete these files of a model directory and drop their manifest records (a library that
    failed its hash, before it is rebuilt)."""
    for rel in paths:
        (Path(model_dir) / rel).unlink(missing_ok=True)
        _update_manifest(Path(model_dir), rel, None)


def check_files(model_dir: Path | str, *, hashes: bool = False) -> list[FileProblem]:
    """What differs from the manifest: missing, truncated, unreadable (and, with `hashes`,
    altered) files; a missing library is no damage (it is compiled when needed). A missing
    localchat-config.json always counts; a directory without a manifest (built before them) is
    checked for nothing else."""
    model_dir = Path(model_dir)
    try:
        manifest = read_manifest(model_dir)
    except ModelConfigError as exc:
        return [FileProblem(MANIFEST_FILE, "garbage", str(exc).rpartition(": ")[2])]
    if manifest is None:
        if not (model_dir / CONFIG_FILE).is_file():
            return [FileProblem(CONFIG_FILE, "missing")]
        return []
    problems = []
    files: dict[str, dict[str, Any]] = manifest["files"]
    if CONFIG_FILE not in files and not (model_dir / CONFIG_FILE).is_file():
        problems.append(FileProblem(CONFIG_FILE, "missing"))
    for rel, record in files.items():
        problem = _check_file(model_dir / rel, rel, record, hashes)
        # a library that is simply gone only means "not compiled": it is built when needed
        if problem is not None and not (problem.kind == "missing" and rel.startswith(LIB_DIR)):
            problems.append(problem)
    return problems


def _check_file(path: Path, rel: str, record: dict[str, Any], hashes: bool
                ) -> FileProblem | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return FileProblem(rel, "missing")
    except OSError as exc:
        return FileProblem(rel, "unreadable", exc.strerror or str(exc))
    if not os.path.isfile(path):
        return FileProblem(rel, "unreadable", "not a regular file")
    if st.st_size != record["size"]:
        kind = "truncated" if st.st_size < record["size"] else "wrong size"
        return FileProblem(rel, kind, f"{st.st_size} of {record['size']} bytes")
    if not os.access(path, os.R_OK):
        return FileProblem(rel, "unreadable", "permission denied")
    if hashes:
        try:
            digest = sha256_file(path)
        except OSError as exc:
            return FileProblem(rel, "unreadable", exc.strerror or str(exc))
        if digest != record["sha256"]:
            return FileProblem(rel, "altered", "sha256 differs from the manifest")
    return None


def repair_command(model_dir: Path | str) -> str:
    """The command that rebuilds a model directory, as its manifest records it."""
    model_dir = Path(model_dir)
    command = _read_manifest_quietly(model_dir).get("repair")
    if isinstance(command, str) and command:
        return command
    return f"localchat convert SOURCE --output {model_dir} --force"


def damage_message(model_dir: Path | str, problems: list[FileProblem],
                   command: str | None = None) -> str:
    """One line: which file of a model is damaged, and the command that repairs it."""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return (f"model {model_dir} is damaged: {problems[0]}{more}; "
            f"repair it with `{command or repair_command(model_dir)}`")


def share_modes(root: Path | str) -> None:
    """Directories 0755, files 0644 under `root`: one store can serve every user."""
    root = Path(root)
    os.chmod(root, DIR_MODE)
    for base, dirs, files in os.walk(root):
        for d in dirs:
            os.chmod(os.path.join(base, d), DIR_MODE)
        for f in files:
            path = os.path.join(base, f)
            if not os.path.islink(path):
                os.chmod(path, FILE_MODE)


# -- compiled libraries ----------------------------------------------------------------------
def library_cache_dir() -> Path:
    """The one cache of compiled libraries, shared by every model (`<cache>/libs`)."""
    return cache_dir() / "libs"


# A further library cache, read and written beside a store's own: one folder that several
# stores (a CI machine's test runs, a lab's users) share, so a library is compiled once for all.
SHARED_LIBRARY_CACHE_ENV = "LOCALCHAT_SHARED_LIBRARY_CACHE"


def shared_library_cache_dir() -> Path | None:
    """The folder `LOCALCHAT_SHARED_LIBRARY_CACHE` names, or None when unset."""
    value = os.environ.get(SHARED_LIBRARY_CACHE_ENV, "").strip()
    return Path(value).expanduser() if value else None


def library_cache_dirs() -> list[Path]:
    """Every library cache a library may be found in: the store's, then the user's own (when
    LOCALCHAT_HOME points elsewhere, e.g. at a store another user owns), then the shared one."""
    shared = shared_library_cache_dir()
    dirs = [library_cache_dir(), user_cache_dir() / "libs", *([shared] if shared else [])]
    return [d for i, d in enumerate(dirs) if d not in dirs[:i]]


def copy_cached_library(library: Path, folder: Path) -> Path | None:
    """A copy of a cached `library` and its hash record in another library cache `folder` (a
    hard link where the disk allows, then a rename); None when that folder cannot take it."""
    dest = folder / library.name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _place_library(library, dest)
        write_library_record(dest)
    except OSError:
        return None
    return dest


def writable_library_cache_dir() -> Path:
    """Where a library compiled now goes: the first library cache this user may write (the
    store's, else the user's own cache, else a folder of theirs under the temp dir)."""
    fallback = Path(tempfile.gettempdir()) / f"localchat-{os.getuid()}" / "libs"
    for folder in [*library_cache_dirs(), fallback]:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK | os.X_OK):
            return folder
    raise ModelConfigError(f"no writable folder for compiled libraries ({library_cache_dir()})")


def read_library_record(library: Path) -> dict[str, Any] | None:
    """The hash record beside a library in a cache (`<file>.sha256`), or None."""
    try:
        data = json.loads(Path(f"{library}{RECORD_SUFFIX}").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("sha256"), str):
        return None
    return data


def write_library_record(library: Path) -> dict[str, Any]:
    """Record a library's size and hash beside it; returns the record."""
    record = file_record(library)
    write_json_atomic(Path(f"{library}{RECORD_SUFFIX}"), record)
    return record


def _matches(path: Path, record: dict[str, Any] | None) -> bool:
    if record is None:
        return False
    try:
        return (os.stat(path).st_size == record.get("size", os.stat(path).st_size)
                and sha256_file(path) == record["sha256"])
    except OSError:
        return False


def verified_cache_library(path: Path, log: Callable[[str], None] | None = None) -> bool:
    """Whether a library in a cache matches its record; one that does not is deleted (when
    this user may) so that it is compiled again."""
    try:
        if not path.is_file():
            return False
    except OSError:  # a shared cache this user may not read
        return False
    if _matches(path, read_library_record(path)):
        return True
    if log:
        log(f"{path.name} in {path.parent} fails its recorded sha256; building it again")
    for bad in (path, Path(f"{path}{RECORD_SUFFIX}")):
        try:
            bad.unlink()
        except OSError:
            pass
    return False


def trusted_library(model_dir: Path | str, file_name: str,
                    log: Callable[[str], None] | None = None) -> Path | None:
    """The library `file_name` for a model, from its lib/ or a library cache, that matches its
    recorded hash (the manifest's, else a cache record); None when no copy does. A copy in the
    model's lib/ that fails is removed when this user may, so that it is replaced."""
    model_dir = Path(model_dir)
    own = model_dir / LIB_DIR / file_name
    caches = [folder / file_name for folder in library_cache_dirs()]
    if own.is_file():
        record = _read_manifest_quietly(model_dir).get("files", {}).get(f"{LIB_DIR}/{file_name}")
        records = [record] if record else [read_library_record(c) for c in caches]
        if any(_matches(own, r) for r in records):
            return own
        if log:
            log(f"{LIB_DIR}/{file_name} of {model_dir} fails its recorded sha256; not loading it")
        try:
            own.unlink()
            _update_manifest(model_dir, f"{LIB_DIR}/{file_name}", None)
        except OSError:
            pass
    for cached in caches:
        if verified_cache_library(cached, log):
            return cached
    return None


def library_file_name(target_key: str, library_key: str) -> str:
    """The file name of a compiled library: `<target key>-<library key>.so`."""
    return f"{target_key}-{library_key}{LIBRARY_SUFFIX}"


def library_target(file_name: str) -> str:
    """The target key of a library file (`llvm-znver4-0123456789abcdef.so` -> `llvm-znver4`)."""
    stem = Path(file_name).stem
    match = _LIBRARY_STEM.match(stem)
    return match.group("target") if match else stem


def library_files(model_dir: Path | str) -> tuple[str, ...]:
    """File names of the compiled libraries in a model directory's lib/ folder."""
    lib = Path(model_dir) / LIB_DIR
    if not lib.is_dir():
        return ()
    return tuple(sorted(
        f.name for f in lib.iterdir()
        if f.is_file() and not f.name.startswith(".") and f.suffix in LIB_SUFFIXES
    ))


def library_targets(model_dir: Path | str) -> tuple[str, ...]:
    """Target keys of the compiled libraries in a model directory's lib/ folder."""
    return tuple(sorted({library_target(f) for f in library_files(model_dir)}))


def find_library(model_dir: Path | str, file_name: str) -> Path | None:
    """Where the library `file_name` of a model is (its lib/, else a library cache), whether
    or not it matches its hash (see `trusted_library`)."""
    for folder in (Path(model_dir) / LIB_DIR, *library_cache_dirs()):
        path = folder / file_name
        if path.is_file():
            return path
    return None


def _place_library(library: Path, dest: Path) -> None:
    """`library` at `dest`: a hard link, else a copy, then a rename (never half-written)."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".lib-", suffix=dest.suffix)
    os.close(fd)
    try:
        try:  # the caches and the store usually share a disk: no second copy
            os.unlink(tmp)
            os.link(library, tmp)
        except OSError:
            shutil.copyfile(library, tmp)
            os.chmod(tmp, FILE_MODE)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def install_library(model_dir: Path | str, library: Path | str, file_name: str | None = None,
                    ) -> Path:
    """Put `library` at `model_dir/lib/<file_name>` (a hard link or a copy, then a rename) and
    record its hash in the model's manifest."""
    library = Path(library)
    model_dir = Path(model_dir)
    lib_dir = model_dir / LIB_DIR
    lib_dir.mkdir(mode=DIR_MODE, exist_ok=True)
    dest = lib_dir / (file_name or library.name)
    if not (dest.exists() and library.resolve() == dest.resolve()):
        _place_library(library, dest)
    _update_manifest(model_dir, f"{LIB_DIR}/{dest.name}", file_record(dest))
    return dest


def remove_stale_libraries(model_dir: Path | str, keep: str) -> None:
    """Delete the model's other libraries for the same target as `keep` (older keys)."""
    target = library_target(keep)
    for old in library_files(model_dir):
        if old != keep and library_target(old) == target:
            (Path(model_dir) / LIB_DIR / old).unlink(missing_ok=True)
            _update_manifest(Path(model_dir), f"{LIB_DIR}/{old}", None)
