"""Streaming detokenization on real tokenizers, and stop strings that are never emitted."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from localchat.engine.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopStringMatcher,
    TextStream,
)
from localchat.engine.tokenizer import HFTokenizer

import fixtures

MULTILINGUAL = (
    "Hello, world! Ça va? Grüße aus Köln. Привет, как дела? 你好，世界。こんにちは、猫🐈が好き。"
    " नमस्ते दुनिया. مرحبا بالعالم. 🙂🚀👩‍👩‍👧 ẞ € 𝔘𝔫𝔦𝔠𝔬𝔡𝔢\n\n  indented\tcode() {}"
)


@pytest.fixture(scope="module")
def smollm2() -> HFTokenizer:
    return HFTokenizer(fixtures.smollm2_hf_dir() / "tokenizer.json")


@pytest.fixture(scope="module")
def byte_fallback(tmp_path_factory) -> HFTokenizer:
    """A small SentencePiece-style BPE built here: Llama's normalizer and decoder, byte fallback
    for every character outside its ASCII alphabet (so CJK and emoji are <0xNN> tokens)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-()":
        vocab.setdefault(ch, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("o", "k")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    path = tmp_path_factory.mktemp("byte-fallback") / "tokenizer.json"
    tok.save(str(path))
    return HFTokenizer(Path(path))


@pytest.fixture(scope="module")
def rwkv_world():
    """The RWKV World tokenizer (byte-level trie over the rwkv package's vocabulary)."""
    from localchat.engine.tokenizer_world import WorldTokenizer

    return WorldTokenizer(fixtures.rwkv_package_dir() / "rwkv" / "rwkv_vocab_v20230424.txt")


class RecordingTokenizer:
    """A real tokenizer that also records how many ids each decode call gets."""

    def __init__(self, inner: HFTokenizer) -> None:
        self.inner = inner
        self.window_sizes: list[int] = []

    def decode(self, ids: Sequence[int]) -> str:
        self.window_sizes.append(len(ids))
        return self.inner.decode(ids)


def _stream(tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("which", ["smollm2", "byte_fallback", "rwkv_world"])
def test_pieces_add_up_to_the_full_decode_token_by_token(which, request):
    tokenizer = request.getfixturevalue(which)
    ids = tokenizer.encode(MULTILINGUAL)
    full = tokenizer.decode(ids)
    assert full == MULTILINGUAL.lstrip() if which == "byte_fallback" else MULTILINGUAL
    detok = IncrementalDetokenizer(tokenizer)
    streamed = ""
    for token in ids:
        piece = detok.add(token)
        assert REPLACEMENT_CHAR not in piece
        streamed += piece
        # What was shown is never taken back.
        assert full.startswith(streamed)
    streamed += detok.flush()
    assert streamed == full == detok.text


def test_a_character_split_across_tokens_is_held_back_then_emitted_whole(smollm2):
    ids = smollm2.encode("a🐈")
    assert len(ids) > 2  # the emoji's four bytes span several byte-level tokens
    pieces = _stream(smollm2, ids)
    assert pieces[0] == "a"
    assert "" in pieces[1:-1]
    assert "".join(pieces) == "a🐈" and "🐈" in pieces


def test_byte_fallback_bytes_become_one_character(byte_fallback):
    ids = byte_fallback.encode("ok 猫")
    pieces = _stream(byte_fallback, ids)
    assert "".join(pieces) == "ok 猫"
    assert " 猫" in pieces or "猫" in pieces
    assert all(REPLACEMENT_CHAR not in p for p in pieces)


def test_sentencepiece_spaces_survive_window_starts(byte_fallback):
    # "▁" alone decodes to "" at a window's start but to " " after text.
    for text in ("a  b", "the  the   ok", "x ▁y", "ok  猫  ok"):
        ids = byte_fallback.encode(text)
        assert "".join(_stream(byte_fallback, ids)) == byte_fallback.decode(ids)


def test_random_ids_add_up_to_the_full_decode(smollm2):
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = rng.integers(0, smollm2.vocab_size, 40).tolist()
        assert "".join(_stream(smollm2, ids)) == smollm2.decode(ids)


def test_invalid_utf8_at_the_end_comes_out_in_flush(smollm2):
    ids = smollm2.encode("ok🐈")
    ids = ids[:-1]  # cut the emoji's last byte
    detok = IncrementalDetokenizer(smollm2)
    shown = "".join(detok.add(i) for i in ids)
    assert shown == "ok"
    tail = detok.flush()
    assert tail.endswith(REPLACEMENT_CHAR)
    assert shown + tail == smollm2.decode(ids)


def test_a_long_run_of_invalid_bytes_is_not_held_forever(byte_fallback):
    continuation = byte_fallback.token_to_id("<0x80>")
    detok = IncrementalDetokenizer(byte_fallback, max_pending=4)
    pieces = [detok.add(continuation) for _ in range(12)]
    assert sum(1 for p in pieces if p) >= 2
    assert "".join(pieces) + detok.flush() == byte_fallback.decode([continuation] * 12)


def test_each_step_decodes_a_short_window(smollm2):
    recording = RecordingTokenizer(smollm2)
    ids = smollm2.encode(MULTILINGUAL * 20)
    assert len(ids) > 1000
    pieces = _stream(recording, ids)
    assert "".join(pieces) == smollm2.decode(ids)
    assert max(recording.window_sizes) <= 12
    assert len(recording.window_sizes) <= 2 * (len(ids) + 1)


# --- stop strings -------------------------------------------------------------------------------


def _push_all(matcher: StopStringMatcher, pieces: list[str]) -> str:
    return "".join(matcher.push(p) for p in pieces) + matcher.flush()


def test_stop_string_split_across_pieces_is_cut_and_text_before_kept():
    matcher = StopStringMatcher(["<|im_end|>"])
    assert matcher.push("Hello wor") == "Hello wor"
    assert matcher.push("ld<|") == "ld"  # "<|" may start the stop string: held
    assert matcher.push("im_end|> and more") == ""
    assert matcher.stopped == "<|im_end|>"
    assert matcher.push("ignored") == "" and matcher.flush() == ""


def test_held_text_is_released_when_it_turns_out_not_to_be_a_stop():
    matcher = StopStringMatcher(["\n\nUser:"])
    assert matcher.push("Fine.\n") == "Fine."
    assert matcher.push("\nUs") == ""
    assert matcher.push("e it") == "\n\nUse it"
    assert matcher.push("\n") == ""
    assert matcher.flush() == "\n"
    assert matcher.stopped is None


def test_character_by_character_with_several_stops_earliest_wins():
    text = "abc STOP2 def STOP1 ghi"
    matcher = StopStringMatcher(["STOP1", "STOP2", "xyz"])
    assert _push_all(matcher, list(text)) == "abc "
    assert matcher.stopped == "STOP2"


def test_stop_at_the_very_start_and_overlapping_prefixes():
    assert _push_all(StopStringMatcher(["##"]), ["##", "x"]) == ""
    matcher = StopStringMatcher(["aab"])
    assert _push_all(matcher, ["a", "a", "a", "b", "c"]) == "a"
    assert matcher.stopped == "aab"


def test_no_stops_passes_everything_through():
    assert _push_all(StopStringMatcher([]), ["a", "b"]) == "ab"


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("The answer is 42.\n\nUser: what next?", "\n\nUser:", "The answer is 42."),
        ("chat — 猫 🐈 and a dog", "🐈", "chat — 猫 "),
        ("Привет, мир! Пока.", "мир", "Привет, "),
        ("no stop string here at all", "<|im_end|>", "no stop string here at all"),
    ],
)
def test_text_stream_on_real_tokens(smollm2, text, stop, expected):
    stream = TextStream(smollm2, [stop])
    shown = ""
    for token in smollm2.encode(text):
        piece = stream.add(token)
        shown += piece.text
        if piece.stopped:
            break
    shown += stream.finish()
    assert shown == expected
    assert stream.stopped == (stop in text)


def test_byte_fallback_runs_do_not_fall_back_to_full_decodes(byte_fallback):
    # The ByteFallback decoder renders an unfinished run of byte tokens as U+FFFDs, which
    # changes text that an earlier, shorter window had shown complete ("ü" then "���").
    recording = RecordingTokenizer(byte_fallback)
    text = "Grüße, 你好世界 " * 40
    ids = byte_fallback.encode(text)
    assert "".join(_stream(recording, ids)) == byte_fallback.decode(ids)
    assert max(recording.window_sizes) <= 12
