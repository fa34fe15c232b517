"""The RWKV World tokenizer: greedy longest match over UTF-8 bytes, vocabulary rwkv_vocab_v20230424.

Encoding agrees id for id with the reference `TRIE_TOKENIZER` of the `rwkv` package. The vocabulary
is compiled into one regular expression shaped like a trie (each byte a literal, each deeper level
an optional or required group), so Python's C regex engine does the longest-match walk; text is
matched as its UTF-8 bytes seen through latin-1, one character per byte.
"""

from __future__ import annotations

import ast
import functools
import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from localchat.errors import ModelConfigError

END_OF_TEXT_ID = 0
END_OF_TEXT = "<|endoftext|>"
WORLD_VOCAB_SIZE = 65536  # embedding rows of RWKV World models; the file fills ids 1..65529
_UTF8_BYTE_CLASSES = ((0x00, 0x7F), (0x80, 0xBF), (0xC0, 0xDF), (0xE0, 0xEF), (0xF0, 0xFF))


def read_world_vocab(path: Path) -> dict[int, bytes]:
    """Token bytes by id from a World vocabulary file (`id <str or bytes literal> length` lines)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ModelConfigError(f"{path}: file not found") from None
    except UnicodeDecodeError as exc:
        raise ModelConfigError(f"{path}: not UTF-8 text ({exc})") from None
    vocab: dict[int, bytes] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            first, last = line.index(" "), line.rindex(" ")
            idx, length = int(line[:first]), int(line[last + 1 :])
            literal = ast.literal_eval(line[first + 1 : last])
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            raise ModelConfigError(f"{path}:{lineno}: malformed vocabulary line") from None
        token = literal.encode("utf-8") if isinstance(literal, str) else literal
        if not isinstance(token, bytes) or not token or len(token) != length:
            raise ModelConfigError(f"{path}:{lineno}: token is not {length} bytes of str or bytes")
        if idx <= END_OF_TEXT_ID or idx in vocab:
            raise ModelConfigError(f"{path}:{lineno}: id {idx} is reserved or repeated")
        vocab[idx] = token
    missing = {bytes([b]) for b in range(256)} - set(vocab.values())
    if missing:
        raise ModelConfigError(f"{path}: {len(missing)} single bytes have no token")
    if len(set(vocab.values())) != len(vocab):
        raise ModelConfigError(f"{path}: the same token appears under two ids")
    return vocab


class WorldTokenizer:
    """The RWKV World tokenizer, fitting the `Tokenizer` protocol plus byte-level access."""

    def __init__(self, vocab_path: Path) -> None:
        vocab = read_world_vocab(vocab_path)
        self._vocab_size = max(WORLD_VOCAB_SIZE, max(vocab) + 1)
        # id 0 (end of text) and the unused ids past the file decode to nothing.
        self._bytes_of: list[bytes] = [b""] * self._vocab_size
        for idx, token in vocab.items():
            self._bytes_of[idx] = token
        self._id_of: dict[str, int] = {t.decode("latin-1"): i for i, t in vocab.items()}
        self._tokens = tuple(sorted(self._id_of))
        self._pattern: re.Pattern[str] | None = None
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model's embedding has (65536 for RWKV World)."""
        return self._vocab_size

    def warm_up(self) -> None:
        """Compile the matcher now (1-2 s) rather than in the first `encode`."""
        self._matcher()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no end-of-text added); the first call compiles the matcher."""
        return self.encode_bytes(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> list[int]:
        """Token ids of raw bytes, which need not be valid UTF-8."""
        id_of = self._id_of
        return [id_of[t] for t in self._matcher().findall(data.decode("latin-1"))]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes of `ids` joined, for detokenizers that cut at character boundaries."""
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self._vocab_size):
            bad = next(i for i in ids if not 0 <= i < self._vocab_size)
            self._checked(bad)
        bytes_of = self._bytes_of
        return b"".join([bytes_of[i] for i in ids])

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token (empty for end-of-text and unused ids)."""
        return self._bytes_of[self._checked(token_id)]

    def token_to_id(self, token: str) -> int | None:
        """Id of a token given by its exact text, `<|endoftext|>` being id 0; None if absent."""
        if token == END_OF_TEXT:
            return END_OF_TEXT_ID
        return self._id_of.get(token.encode("utf-8").decode("latin-1"))

    def _checked(self, token_id: int) -> int:
        if not 0 <= token_id < self._vocab_size:
            raise ValueError(f"token id {token_id} outside 0..{self._vocab_size - 1}")
        return token_id

    def _matcher(self) -> re.Pattern[str]:
        if self._pattern is None:
            with self._lock:
                if self._pattern is None:
                    self._pattern = _compile_longest_match(self._tokens)
        return self._pattern


@functools.lru_cache(maxsize=2)
def _compile_longest_match(tokens: tuple[str, ...]) -> re.Pattern[str]:
    """A regex whose every match is the longest token starting at the current position.

    Built from the token trie: a child byte is a literal; the level below it is an optional group
    where the child ends a token and a required one where it does not. Children of a node start
    with distinct literals, so the engine enters at most one per level, tries deeper first and
    backs off to the last token end: exactly the reference's longest match, in linear time.
    Children are ordered by subtree size (a cheap proxy for how often they occur), since the
    engine scans the alternatives of a level in order.
    """
    root: dict = {}
    for token in tokens:
        node = root
        for char in token:
            node = node.setdefault(char, {})
        node[""] = True  # "" marks a token end; no token char is ""
    sizes: dict[int, int] = {}

    def size(node: dict) -> int:
        key = id(node)
        if key not in sizes:
            sizes[key] = 1 + sum(size(child) for char, child in node.items() if char)
        return sizes[key]

    def alternatives(node: dict) -> list[tuple[str, str]]:
        children = sorted(((c, n) for c, n in node.items() if c), key=lambda cn: -size(cn[1]))
        parts = []
        for char, child in children:
            below = "|".join(p for _, p in alternatives(child))
            if not below:
                parts.append((char, re.escape(char)))
            elif "" in child:
                parts.append((char, f"{re.escape(char)}(?:{below})?"))
            else:
                parts.append((char, f"{re.escape(char)}(?:{below})"))
        return parts

    # The root has a branch per byte value; a lookahead on the UTF-8 role of the first byte
    # (ASCII, continuation, lead of 2, 3 or 4) saves scanning past the others.
    roots = alternatives(root)
    groups = []
    for low, high in _UTF8_BYTE_CLASSES:
        members = [p for c, p in roots if low <= ord(c) <= high]
        if members:
            groups.append(f"(?=[\\x{low:02x}-\\x{high:02x}])(?:{'|'.join(members)})")
    return re.compile("|".join(groups), re.DOTALL)
