"""Which files of a hub repo a pull needs: config, tokenizer and one weight format, never code
(or, for a recipe that names one, that single file).

Pure functions over repo file listings, so the choice is easy to test and to explain.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

from localchat.errors import RemoteNotFoundError, WeightsError

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"

TOKENIZER_FILES = frozenset({
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
})
TOKENIZER_PATTERNS = ("*vocab*.txt", "*.tiktoken")

# Never fetched, whatever a recipe or repo says: code a model repo could make us run.
CODE_SUFFIXES = (
    ".py", ".pyc", ".pyo", ".pyd", ".so", ".dll", ".dylib", ".exe", ".sh", ".bat", ".ps1",
    ".ipynb", ".pkl", ".pickle", ".jar", ".wasm",
)
# Metadata of the repo itself, useless to a pull.
REPO_NOISE = frozenset({".gitattributes", "README.md", "LICENSE", "LICENSE.txt", "USE_POLICY.md"})


def is_safe_path(path: str) -> bool:
    """True for a relative path inside the repo (no `..`, no absolute or odd separators)."""
    if not path or path.startswith(("/", "~")) or "\\" in path or "\0" in path:
        return False
    parts = path.split("/")
    return all(part not in ("", ".", "..") for part in parts)


def is_code(path: str) -> bool:
    """True for files that are or carry executable code (never downloaded)."""
    return path.lower().endswith(CODE_SUFFIXES)


def _root(paths: Iterable[str]) -> list[str]:
    return [p for p in paths if "/" not in p and is_safe_path(p) and not is_code(p)]


def is_tokenizer_file(path: str) -> bool:
    """True for the tokenizer and chat-template files we read."""
    return path in TOKENIZER_FILES or any(fnmatch.fnmatch(path, pat) for pat in TOKENIZER_PATTERNS)


def weight_index_file(paths: Iterable[str]) -> str | None:
    """The weight index (shard map) to read before choosing weight files, if the repo has one.

    The safetensors index wins; the .bin index only counts when there are no safetensors.
    """
    root = _root(paths)
    if SAFETENSORS_INDEX in root:
        return SAFETENSORS_INDEX
    if not any(p.endswith(".safetensors") for p in root) and BIN_INDEX in root:
        return BIN_INDEX
    return None


def metadata_files(paths: Iterable[str]) -> list[str]:
    """The small files fetched first: config.json, generation config, tokenizer, weight index.

    config.json comes first so an unsupported model is refused before anything large.
    """
    paths = list(paths)
    root = _root(paths)
    if CONFIG_FILE not in root:
        raise WeightsError("the repo has no config.json at its root: not a transformers model")
    chosen = [CONFIG_FILE]
    if GENERATION_CONFIG_FILE in root:
        chosen.append(GENERATION_CONFIG_FILE)
    chosen += sorted(p for p in root if is_tokenizer_file(p))
    index = weight_index_file(root)
    if index:
        chosen.append(index)
    return chosen


def weight_files(
    paths: Iterable[str], index: Mapping[str, Any] | None = None
) -> tuple[str, list[str]]:
    """The weight format ("safetensors", "bin" or "pth") and its files, one format only.

    `index` is the parsed weight index named by `weight_index_file`, when there is one: its
    shards are exactly the files taken (so `consolidated.safetensors` duplicates are skipped).
    """
    root = _root(paths)
    present = set(root)
    index_name = weight_index_file(root)
    if index_name is not None:
        if index is None:
            raise WeightsError(f"{index_name} must be read before choosing the weight files")
        shard_map = index.get("weight_map")
        if not isinstance(shard_map, dict) or not shard_map:
            raise WeightsError(f"{index_name} has no weight_map")
        shards = sorted(set(shard_map.values()))
        missing = [s for s in shards if s not in present]
        if missing:
            raise WeightsError(f"{index_name} names shards the repo lacks: {', '.join(missing)}")
        fmt = "safetensors" if index_name == SAFETENSORS_INDEX else "bin"
        return fmt, shards
    safetensors = sorted(p for p in root if p.endswith(".safetensors"))
    if "model.safetensors" in safetensors:
        return "safetensors", ["model.safetensors"]
    if safetensors:
        hf_named = [p for p in safetensors if not p.startswith("consolidated")]
        return "safetensors", hf_named or safetensors
    bins = sorted(p for p in root if fnmatch.fnmatch(p, "pytorch_model*.bin"))
    if bins:
        return "bin", bins
    pth = sorted(p for p in root if p.endswith(".pth"))
    if pth:
        return "pth", pth
    raise WeightsError(
        "the repo has no weights localchat can read (safetensors, pytorch_model*.bin or .pth)"
    )


def source_file(paths: Iterable[str], wanted: str, where: str) -> str:
    """The one file a recipe's `source.file` names, checked against the repo's listing; when
    the repo lacks it, the error names the checkpoints it does hold (a renamed upload, say)."""
    paths = list(paths)
    if not is_safe_path(wanted) or is_code(wanted):
        raise WeightsError(f"{where}: refusing the source file {wanted!r}")
    if wanted in paths:
        return wanted
    suffix = wanted[wanted.rfind("."):] if "." in wanted else ""
    alike = sorted(p for p in paths if suffix and p.endswith(suffix))
    listed = f"; it holds: {', '.join(alike)}" if alike else ""
    raise RemoteNotFoundError(f"{where} has no file {wanted} (the recipe's source.file){listed}")


def prebuilt_files(paths: Iterable[str]) -> list[str]:
    """Every file of a prebuilt weights repo except code, libraries and repo noise."""
    return sorted(
        p for p in paths
        if is_safe_path(p) and not is_code(p) and p not in REPO_NOISE
        and not p.startswith(("lib/", ".")) and not p.endswith(".gitattributes")
    )
