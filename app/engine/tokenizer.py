"""The tokenizer interface the engine talks to, and loading the right one for a model directory."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from localchat.errors import ModelConfigError

WORLD_VOCAB_FILE = "rwkv_vocab_v20230424.txt"


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer, whichever kind it is."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with no special tokens added."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; invalid UTF-8 at the edges becomes U+FFFD."""
        ...

    def token_to_id(self, token: str) -> int | None:
        """Id of a token given by its exact string (special tokens included), or None."""
        ...


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from tokenizer.json."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _RustTokenizer

        self._tok = _RustTokenizer.from_file(str(path))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """The tokenizer stored in a model directory (or an HF folder)."""
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").exists():
        return HFTokenizer(model_dir / "tokenizer.json")
    if (model_dir / WORLD_VOCAB_FILE).exists():
        from localchat.engine.tokenizer_world import WorldTokenizer

        return WorldTokenizer(model_dir / WORLD_VOCAB_FILE)
    raise ModelConfigError(
        f"{model_dir}: no tokenizer found (expected tokenizer.json or {WORLD_VOCAB_FILE})"
    )


def read_json(path: Path) -> dict:
    """Read a JSON object file with a clear error when it is missing or malformed."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelConfigError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    return data
