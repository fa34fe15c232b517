"""An embedding model's pooling and normalization, read from its sentence-transformers files at
convert time (`modules.json`, the Pooling module's `config.json`, `sentence_bert_config.json`)
and recorded in the model's localchat config (`model_dir.EmbeddingSettings`).

Both spellings of sentence-transformers are read: the Pooling config's `pooling_mode` ("mean",
"cls", "lasttoken", ...) of version 6 and the `pooling_mode_*_tokens` flags before it. A folder
without `modules.json` is a plain transformers model: mean pooling, not normalized, as
sentence-transformers itself would load it. Modules localchat does not run (Dense, ...) are
refused rather than silently skipped: the vectors would differ from the model's.

A folder whose modules.json has a Pooling module is a sentence-transformers model
(`is_sentence_transformers`): convert then takes a chat architecture's embedding variant
(Qwen3 -> Qwen3-Embedding). Its `config_sentence_transformers.json` prompts (named prefixes of
the texts, e.g. Qwen3-Embedding's "query" instruction) and default prompt are recorded beside
the pooling (`read_prompts`), and the runtime prepends them as `SentenceTransformer.encode`
does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from localchat.errors import ModelConfigError, UnsupportedModelError
from localchat.model_dir import EmbeddingSettings

MODULES_FILE = "modules.json"
ST_CONFIG_FILE = "sentence_bert_config.json"
# files of a sentence-transformers repo a pull fetches besides the model's (the Pooling
# module's config.json is found through modules.json)
ST_PROMPTS_FILE = "config_sentence_transformers.json"
SENTENCE_TRANSFORMERS_FILES = (MODULES_FILE, ST_CONFIG_FILE, ST_PROMPTS_FILE)
# sentence-transformers' pooling names -> ours; the legacy flags -> the same
_POOLING = {"mean": "mean", "cls": "cls", "lasttoken": "last", "max": "max"}
_LEGACY = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
           "pooling_mode_lasttoken": "lasttoken", "pooling_mode_max_tokens": "max",
           "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
           "pooling_mode_weightedmean_tokens": "weightedmean"}
_HUGE = 1_000_000  # tokenizer_config's model_max_length when it means "no limit"


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"cannot read {path}: {exc}") from None


def _module_kind(entry: Any) -> str:
    """`Pooling` for "sentence_transformers.models.Pooling" and its version 6 spellings."""
    kind = entry.get("type", "") if isinstance(entry, dict) else ""
    return str(kind).rsplit(".", 1)[-1]


def pooling_modules(source_dir: Path) -> list[dict[str, Any]]:
    """The entries of a folder's modules.json ([] when it has none)."""
    path = Path(source_dir) / MODULES_FILE
    if not path.is_file():
        return []
    modules = _read(path)
    if not isinstance(modules, list):
        raise ModelConfigError(f"{path}: expected a list of modules")
    return modules


def pooling_files(source_dir: Path) -> list[str]:
    """The Pooling/Normalize modules' config files a folder's modules.json names (relative)."""
    return [f"{m['path']}/config.json" for m in pooling_modules(source_dir)
            if _module_kind(m) in ("Pooling", "Normalize") and _inside(m.get("path"))]


def _inside(rel: Any) -> bool:
    """Whether a module's path is a plain subfolder (never `..`, absolute or empty)."""
    if not isinstance(rel, str) or not rel or rel.startswith(("/", "\\")):
        return False
    return all(part not in ("", ".", "..") for part in rel.replace("\\", "/").split("/"))


def _pooling_mode(config: dict[str, Any], where: Path) -> str:
    mode: Any = config.get("pooling_mode")
    if mode is None:
        mode = [name for flag, name in _LEGACY.items() if config.get(flag)] or ["mean"]
    modes = [mode] if isinstance(mode, str) else list(mode)
    if len(modes) != 1:
        raise UnsupportedModelError(f"{where}: pooling by several modes at once ({modes}) is "
                                    f"not supported")
    if modes[0] not in _POOLING:
        raise UnsupportedModelError(f"{where}: pooling mode {modes[0]!r} is not supported "
                                    f"(supported: {', '.join(_POOLING)})")
    return _POOLING[modes[0]]


def _max_tokens(source_dir: Path, positions: int) -> int:
    """sentence-transformers' max_seq_length (its config, else the tokenizer's
    model_max_length), capped at the model's positions."""
    limit: Any = None
    st = source_dir / ST_CONFIG_FILE
    if st.is_file():
        limit = _read(st).get("max_seq_length")
    tok = source_dir / "tokenizer_config.json"
    if limit is None and tok.is_file():
        value = _read(tok).get("model_max_length")
        limit = value if isinstance(value, (int, float)) and value < _HUGE else None
    if isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit > 0:
        return min(int(limit), positions)
    return positions


def read_pooling(source_dir: Path, positions: int, dimensions: int) -> EmbeddingSettings:
    """The embedding settings of an HF folder (see the module's docstring); `positions` is the
    longest text the model takes, `dimensions` its hidden size."""
    source_dir = Path(source_dir)
    pooling, normalize = "mean", False
    for entry in pooling_modules(source_dir):
        kind = _module_kind(entry)
        if kind == "Transformer":
            if entry.get("path") not in ("", None, "."):
                raise UnsupportedModelError(f"{source_dir / MODULES_FILE}: the Transformer "
                                            f"module in a subfolder is not supported")
        elif kind == "Pooling":
            rel = entry.get("path")
            where = source_dir / (rel if _inside(rel) else "") / "config.json"
            config = _read(where) if _inside(rel) and where.is_file() else {}
            pooling = _pooling_mode(config, where)
            size = config.get("embedding_dimension") or config.get("word_embedding_dimension")
            if size and int(size) != dimensions:
                raise ModelConfigError(f"{where}: embedding dimension {size}, the model's "
                                       f"hidden size is {dimensions}")
        elif kind == "Normalize":
            normalize = True
        else:
            raise UnsupportedModelError(
                f"{source_dir / MODULES_FILE}: the sentence-transformers module "
                f"{entry.get('type')!r} is not supported (only Transformer, Pooling, Normalize)")
    return EmbeddingSettings(pooling, normalize, _max_tokens(source_dir, positions), dimensions)


def is_sentence_transformers(source_dir: Path) -> bool:
    """Whether a folder is a sentence-transformers model: its modules.json has a Pooling
    module (an unreadable modules.json is a ModelConfigError)."""
    return any(_module_kind(m) == "Pooling" for m in pooling_modules(Path(source_dir)))


def read_prompts(source_dir: Path) -> dict[str, Any]:
    """`config_sentence_transformers.json`'s prompts and default prompt, as recorded in the
    model's embedding settings: {"prompts": {name: text}, "default_prompt": name or None}; {}
    when the folder has no prompts."""
    path = Path(source_dir) / ST_PROMPTS_FILE
    if not path.is_file():
        return {}
    data = _read(path)
    prompts = data.get("prompts") if isinstance(data, dict) else None
    if not prompts:
        return {}
    if not isinstance(prompts, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise ModelConfigError(f"{path}: prompts must map names to strings")
    default = data.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ModelConfigError(f"{path}: default_prompt_name {default!r} is not one of the "
                               f"prompts ({', '.join(prompts)})")
    return {"prompts": dict(prompts), "default_prompt": default}
