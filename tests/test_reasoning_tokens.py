"""The splitter counts a reply's think-block tokens (OpenAI usage's reasoning_tokens): the
tokens up to the one that closes the block, the tags included; all of them while it is open;
none without a block. Tags as text cut across tokens, and tags as token ids."""

from __future__ import annotations

from localchat.engine.reasoning import ReasoningSplitter, ThinkTags


def count(pieces: list[str], ids: list[int] | None = None, **kwargs: object) -> int:
    splitter = ReasoningSplitter(**kwargs)  # type: ignore[arg-type]
    for i, piece in enumerate(pieces):
        splitter.push(piece, ids[i] if ids else i)
    splitter.finish()
    return splitter.thinking_tokens


def test_text_tags_cut_across_tokens() -> None:
    # "</think>" completed by the 6th token: the block is tokens 1..6
    assert count(["<th", "ink>", "a b", " c", "</", "think>", "\n\nYes", "."]) == 6
    assert count(["<think>", "x", "</think>", "y"]) == 3
    assert count(["Hello", " <think>", " not", " a", " block"]) == 0
    assert count(["<think>", "still", " thinking"]) == 3  # cut short: all thinking


def test_prompt_opened_block_counts_from_the_first_token() -> None:
    assert count(["a", " b", "</think>", "answer"], opened=True) == 3


def test_tag_ids_only() -> None:
    tags = ThinkTags(open_id=100, close_id=101)
    # "</think>" spelled in plain tokens (id 7) does not close the block; the tag id does
    pieces = ["<think>", "x", "</think>", "y", "</think>", "z"]
    assert count(pieces, [100, 5, 7, 6, 101, 8], tags=tags) == 5
