"""The RWKV World tokenizer against the reference TRIE_TOKENIZER of the `rwkv` package."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from types import ModuleType

import pytest

from localchat.engine.tokenizer import load_tokenizer
from localchat.engine.tokenizer_world import END_OF_TEXT, WorldTokenizer, read_world_vocab
from localchat.errors import ModelConfigError

from fixtures import rwkv_package_dir

VOCAB_NAME = "rwkv_vocab_v20230424.txt"

SAMPLES = {
    "english": (
        "The quick brown fox jumps over the lazy dog. It's 3:45 p.m. on Tuesday, and "
        '"tokenizers" (greedy, longest-match) don\'t care about word boundaries!\n\n'
        "Hello, World! e.g. i.e. U.S.A. -- 1,234,567.89 $100 50% #hashtag @user "
    ),
    "chinese": "我们今天去公园散步，天气非常好。人工智能正在改变世界！中华人民共和国成立于1949年。",
    "japanese": "こんにちは、世界。東京は日本の首都です。カタカナとひらがなを混ぜて書きます。",
    "russian": "Съешь же ещё этих мягких французских булок, да выпей чаю. Привет, мир!",
    "mixed": "Korean 한국어 텍스트, Arabic مرحبا بالعالم, Hindi नमस्ते दुनिया, Greek Καλημέρα.",
    "code": (
        "def fib(n: int) -> int:\n    if n < 2:\n        return n\n"
        "    return fib(n - 1) + fib(n - 2)\n"
        '\n\nint main(void) {\n\tprintf("%d\\n", 42);\r\n\treturn 0;\r\n}\n'
        '<div class="x">&nbsp;</div> {"key": [1, 2, 3]} SELECT * FROM t WHERE a <> b;\n'
        "################################################################################\n"
        "--------------------------------------------------------------------------------\n"
    ),
    "emoji": "Emoji 😀😂🤖 👩‍👩‍👧‍👦 👍🏽 🇯🇵🇺🇸 ❤️ ✨🔥 and text after 🎉.",
}


def _load_reference() -> ModuleType:
    path = rwkv_package_dir() / "rwkv" / "rwkv_tokenizer.py"
    spec = importlib.util.spec_from_file_location("rwkv_reference_tokenizer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def vocab_path() -> Path:
    return rwkv_package_dir() / "rwkv" / VOCAB_NAME


@pytest.fixture(scope="module")
def reference(vocab_path: Path):
    return _load_reference().TRIE_TOKENIZER(str(vocab_path))


@pytest.fixture(scope="module")
def tok(vocab_path: Path) -> WorldTokenizer:
    return WorldTokenizer(vocab_path)


def _whitespace_runs(rng: random.Random) -> str:
    parts = []
    for n in list(range(1, 140)) + [200, 255, 256, 257, 300]:
        parts.append("word" + " " * n + "next" + "\n" * (n % 9) + "\t" * (n % 5) + "x")
    pieces = [" ", "  ", "\n", "\n\n", "\t", "\r\n", "a", " the", "\n   ", "  \n", "."]
    parts.append("".join(rng.choice(pieces) for _ in range(5000)))
    return "".join(parts)


def _random_unicode(rng: random.Random, n: int) -> str:
    ranges = [
        (0x20, 0x7E),
        (0x00, 0x1F),
        (0xA0, 0x24F),
        (0x400, 0x4FF),
        (0x3040, 0x30FF),
        (0x4E00, 0x9FFF),
        (0xAC00, 0xD7A3),
        (0x1F300, 0x1FAFF),
        (0x10000, 0x10FFFF),
    ]
    chars = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


def _token_soup(rng: random.Random, reference, n: int) -> str:
    """Random vocabulary tokens and their cut-off pieces glued together: greedy's edge cases."""
    texts = [t.decode("utf-8") for t in reference.idx2token.values() if _is_utf8(t)]
    out = []
    for _ in range(n):
        text = rng.choice(texts)
        if len(text) > 1 and rng.random() < 0.3:
            cut = rng.randint(1, len(text) - 1)
            text = text[:cut] if rng.random() < 0.5 else text[cut:]
        out.append(text)
    return "".join(out)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.fixture(scope="module")
def corpus(reference) -> dict[str, str]:
    rng = random.Random(20230424)
    texts = dict(SAMPLES)
    texts["all_samples_repeated"] = "\n".join(SAMPLES.values()) * 20
    texts["whitespace_runs"] = _whitespace_runs(rng)
    texts["random_unicode"] = _random_unicode(rng, 30_000)
    texts["token_soup"] = _token_soup(rng, reference, 30_000)
    texts["empty"] = ""
    return texts


def test_encode_equals_reference_id_for_id(tok: WorldTokenizer, reference, corpus) -> None:
    for name, text in corpus.items():
        assert tok.encode(text) == reference.encode(text), name


def test_encode_bytes_equals_reference_on_invalid_utf8(tok: WorldTokenizer, reference) -> None:
    rng = random.Random(7)
    tokens = list(reference.idx2token.values())
    data = b"".join(rng.choice(tokens) for _ in range(20_000))
    data += bytes(rng.randrange(256) for _ in range(20_000))
    assert tok.encode_bytes(data) == reference.encodeBytes(data)


def test_decode_inverts_encode(tok: WorldTokenizer, corpus) -> None:
    for name, text in corpus.items():
        ids = tok.encode(text)
        assert tok.decode(ids) == text, name
        assert tok.decode_bytes(ids) == text.encode("utf-8"), name


def test_decode_of_split_multibyte_character_gives_replacement(tok: WorldTokenizer) -> None:
    euro = "€".encode()  # three bytes
    head, tail = tok.encode_bytes(euro[:2]), tok.encode_bytes(euro[2:])
    assert tok.decode(head + tail) == "€"
    assert tok.decode(head) == "\ufffd"
    assert tok.decode(tail) == "\ufffd"
    assert tok.decode(tok.encode("ok ") + head) == "ok \ufffd"
    assert tok.decode_bytes(head) == euro[:2]


def test_token_bytes_concatenate_to_decode_bytes(tok: WorldTokenizer) -> None:
    ids = tok.encode("Streaming 流式 детокенизация 😀")
    assert b"".join(tok.token_bytes(i) for i in ids) == tok.decode_bytes(ids)


def test_vocab_size_and_special_ids(tok: WorldTokenizer) -> None:
    assert tok.vocab_size == 65536
    assert tok.token_to_id(END_OF_TEXT) == 0
    assert tok.token_bytes(0) == b""
    assert tok.token_bytes(65535) == b""
    assert tok.decode([0]) == ""
    with pytest.raises(ValueError):
        tok.token_bytes(65536)
    with pytest.raises(ValueError):
        tok.decode([-1])


def test_token_to_id_matches_vocabulary(tok: WorldTokenizer, reference) -> None:
    assert tok.token_to_id("\n\n") == reference.token2idx[b"\n\n"]
    assert tok.token_to_id(" the") == reference.token2idx[b" the"]
    assert tok.token_to_id("\x00") == 1
    assert tok.token_to_id(" " * 128) == 65529
    assert tok.token_to_id("not a token at all, surely") is None
    for idx, token in list(reference.idx2token.items())[::997]:
        if _is_utf8(token):
            assert tok.token_to_id(token.decode("utf-8")) == idx


def test_load_tokenizer_picks_world_vocabulary(tmp_path: Path, vocab_path: Path) -> None:
    (tmp_path / VOCAB_NAME).write_bytes(vocab_path.read_bytes())
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, WorldTokenizer)
    assert loaded.decode(loaded.encode("Hi\n\n")) == "Hi\n\n"


def test_malformed_vocabulary_is_a_config_error(tmp_path: Path, vocab_path: Path) -> None:
    bad = tmp_path / VOCAB_NAME
    bad.write_text("1 __import__('os') 1\n", encoding="utf-8")
    with pytest.raises(ModelConfigError):
        read_world_vocab(bad)
    lines = vocab_path.read_text(encoding="utf-8").splitlines()
    bad.write_text("\n".join(lines[1:]) + "\n", encoding="utf-8")  # byte 0x00 missing
    with pytest.raises(ModelConfigError, match="single bytes"):
        read_world_vocab(bad)
    bad.write_text("1 'ab' 3\n", encoding="utf-8")
    with pytest.raises(ModelConfigError):
        read_world_vocab(bad)


def test_warm_up_builds_the_matcher_before_the_first_encode(vocab_path: Path) -> None:
    fresh = WorldTokenizer(vocab_path)
    assert fresh._pattern is None  # built lazily: constructing a tokenizer stays cheap
    fresh.warm_up()
    assert fresh._pattern is not None
    assert fresh.encode("Hello") == WorldTokenizer(vocab_path).encode("Hello")


def test_world_vocabulary_ships_with_the_install(tmp_path: Path, vocab_path: Path) -> None:
    """A lone .pth needs no vocabulary beside it and no network: the installed `rwkv` package
    (a dependency) carries the file, byte for byte the reference's."""
    import importlib.metadata

    from localchat.engine.models.rwkv7_pth import world_vocab

    shipped = [f for f in importlib.metadata.files("rwkv") or [] if f.name == VOCAB_NAME]
    assert shipped, "the installed rwkv distribution carries no World vocabulary"
    found = world_vocab(tmp_path / "RWKV-x070-World-0.1B.pth")
    assert found.read_bytes() == Path(shipped[0].locate()).read_bytes() == vocab_path.read_bytes()
