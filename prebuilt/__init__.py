"""The index of ready-made artifacts (pre-quantized weights, compiled libraries) and its matcher.

`pull` asks `find_prebuilt` for artifacts that fit a recipe, a quantization, a target and the
installed TVM version, and builds locally whatever is not found. The format is documented in
`prebuilt/README.md`; the packaged index is `index.toml` next to this file, and
`LOCALCHAT_PREBUILT_INDEX` (paths separated by os.pathsep) adds more index files.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from localchat.errors import RecipeError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

INDEX_FORMAT = 1
MODEL_FORMAT = 1  # version of the model-directory layout that prebuilt weights must have
INDEX_ENV = "LOCALCHAT_PREBUILT_INDEX"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class PrebuiltWeights:
    """A hub repo holding a ready model directory (localchat-config.json + tensor cache)."""

    model: str
    quantization: str
    repo: str
    revision: str
    model_format: int = MODEL_FORMAT


@dataclass(frozen=True)
class PrebuiltLibrary:
    """One compiled library in a hub repo, for one (model, quantization, target, TVM version)."""

    model: str
    quantization: str
    target: str
    tvm: str
    repo: str
    revision: str
    path: str
    sha256: str
    size: int | None = None


@dataclass(frozen=True)
class PrebuiltMatch:
    """What the index offers for one request; either part may be missing."""

    weights: PrebuiltWeights | None = None
    library: PrebuiltLibrary | None = None

    def __bool__(self) -> bool:
        return self.weights is not None or self.library is not None


@dataclass
class PrebuiltIndex:
    """All artifacts of one or more index files."""

    weights: list[PrebuiltWeights] = field(default_factory=list)
    libraries: list[PrebuiltLibrary] = field(default_factory=list)

    def extend(self, other: PrebuiltIndex) -> None:
        """Add the entries of another index (later entries lose ties to earlier ones)."""
        self.weights.extend(other.weights)
        self.libraries.extend(other.libraries)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "prebuilt index") -> PrebuiltIndex:
        """Parse and validate an index given as parsed TOML/JSON."""
        problems = validate_index(data, where)
        if problems:
            raise RecipeError("; ".join(problems))
        return cls(
            weights=[PrebuiltWeights(**entry) for entry in data.get("weights", [])],
            libraries=[PrebuiltLibrary(**entry) for entry in data.get("library", [])],
        )

    @classmethod
    def load(cls, path: Path) -> PrebuiltIndex:
        """Read one index file."""
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise RecipeError(f"cannot read prebuilt index {path}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise RecipeError(f"{path}: invalid TOML: {exc}") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def default(cls) -> PrebuiltIndex:
        """The packaged index plus any files named by LOCALCHAT_PREBUILT_INDEX."""
        index = cls.load(packaged_index_path())
        for extra in os.environ.get(INDEX_ENV, "").split(os.pathsep):
            if extra.strip():
                index.extend(cls.load(Path(extra.strip())))
        return index


_WEIGHT_KEYS = {"model": str, "quantization": str, "repo": str, "revision": str,
                "model_format": int}
_LIBRARY_KEYS = {"model": str, "quantization": str, "target": str, "tvm": str, "repo": str,
                 "revision": str, "path": str, "sha256": str, "size": int}
_OPTIONAL = {"model_format", "size"}


def _check_entries(entries: Any, spec: Mapping[str, type], label: str, where: str) -> list[str]:
    if not isinstance(entries, list):
        return [f"{where}: {label} must be an array of tables"]
    problems: list[str] = []
    for i, entry in enumerate(entries):
        at = f"{where}: {label}[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{at} must be a table")
            continue
        for key in sorted(set(spec) - _OPTIONAL - set(entry)):
            problems.append(f"{at} is missing {key}")
        for key, value in entry.items():
            if key not in spec:
                problems.append(f"{at} has unknown key {key}")
            elif not isinstance(value, spec[key]) or isinstance(value, bool):
                problems.append(f"{at}.{key} has the wrong type")
            elif isinstance(value, str) and not value.strip():
                problems.append(f"{at}.{key} must not be empty")
        if isinstance(entry.get("repo"), str) and not _REPO.match(entry["repo"]):
            problems.append(f"{at}.repo is not an org/name repo id")
        if isinstance(entry.get("sha256"), str) and not _SHA256.match(entry["sha256"]):
            problems.append(f"{at}.sha256 must be 64 lowercase hex digits")
        path = entry.get("path")
        if isinstance(path, str) and (path.startswith("/") or ".." in path.split("/")):
            problems.append(f"{at}.path must be relative inside the repo")
    return problems


def validate_index(data: Mapping[str, Any], where: str = "prebuilt index") -> list[str]:
    """Every schema violation of a parsed index (empty when valid)."""
    problems: list[str] = []
    if data.get("format") != INDEX_FORMAT:
        problems.append(f"{where}: format must be {INDEX_FORMAT}")
    for key in data:
        if key not in ("format", "weights", "library"):
            problems.append(f"{where}: unknown key {key}")
    problems += _check_entries(data.get("weights", []), _WEIGHT_KEYS, "weights", where)
    problems += _check_entries(data.get("library", []), _LIBRARY_KEYS, "library", where)
    return problems


def packaged_index_path() -> Path:
    """The index shipped with localchat."""
    return Path(str(resources.files("localchat.prebuilt"))) / "index.toml"


def _first(items: Iterable[Any]) -> Any:
    return next(iter(items), None)


def find_prebuilt(
    recipe: Any,
    quantization: str,
    target_key: str | None,
    tvm_version: str | None,
    index: PrebuiltIndex | None = None,
    *,
    model_format: int = MODEL_FORMAT,
) -> PrebuiltMatch:
    """Ready artifacts for this recipe (or recipe name) and quantization.

    Weights match on (model, quantization, model format). A library additionally needs the
    exact target key and the exact TVM version: a library built by another TVM is never used.
    Pass `target_key=None` when nothing will be compiled (no library is then matched).
    """
    name = recipe if isinstance(recipe, str) else recipe.name
    index = index if index is not None else PrebuiltIndex.default()
    weights = _first(
        w for w in index.weights
        if w.model == name and w.quantization == quantization and w.model_format == model_format
    )
    library = None
    if target_key and tvm_version:
        library = _first(
            lib for lib in index.libraries
            if lib.model == name and lib.quantization == quantization
            and lib.target == target_key and lib.tvm == tvm_version
        )
    return PrebuiltMatch(weights=weights, library=library)


def index_to_toml(weights: Sequence[PrebuiltWeights], libraries: Sequence[PrebuiltLibrary]) -> str:
    """Write index entries as TOML text (for tools that publish artifacts, and for tests)."""

    def value(v: Any) -> str:
        return str(v) if isinstance(v, int) else '"' + str(v).replace('"', '\\"') + '"'

    lines = [f"format = {INDEX_FORMAT}", ""]
    for table, entries in (("weights", weights), ("library", libraries)):
        for entry in entries:
            lines.append(f"[[{table}]]")
            for key, v in vars(entry).items():
                if v is not None:
                    lines.append(f"{key} = {value(v)}")
            lines.append("")
    return "\n".join(lines)
