"""A reasoning model's thinking kept apart from its answer: the splitter on text cut at every
place, then the engine on a tiny Qwen3 (real compiled model, real tokenizer, Qwen3's real chat
template) whose reply is forced into a think block by a Lark grammar."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from reasoning_fixtures import CHAIN_ANSWER, CHAIN_THINKING, qwen3_think_model, think_grammar

from localchat import Engine
from localchat.engine.reasoning import ReasoningSplitter, ThinkTags, prompt_opens_thinking
from localchat.engine.stream import FinishEvent, TokenEvent
from localchat.engine.templates import JinjaTemplate, builtin_template
from localchat.errors import InvalidRequestError

# An R1-distill-style template: the generation prompt opens the think block itself.
R1_STYLE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- endif %}"
)
HI = [{"role": "user", "content": "hi"}]


def split_all(pieces: list[str], **kwargs: object) -> tuple[str, str]:
    splitter = ReasoningSplitter(**kwargs)  # type: ignore[arg-type]
    thinking, answer = "", ""
    for piece in pieces:
        t, a = splitter.push(piece)
        thinking, answer = thinking + t, answer + a
    t, a = splitter.finish()
    return thinking + t, answer + a


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 100])
def test_splitter_on_text_cut_anywhere(size: int) -> None:
    full = "<think>\nI weigh it: 2 < 3.\n</think>\n\nYes, it is."
    pieces = [full[i:i + size] for i in range(0, len(full), size)]
    assert split_all(pieces) == ("I weigh it: 2 < 3.", "Yes, it is.")
    opened = "Still </thin thinking\n</think>\n\nDone."
    pieces = [opened[i:i + size] for i in range(0, len(opened), size)]
    assert split_all(pieces, opened=True) == ("Still </thin thinking", "Done.")


def test_splitter_without_tags_is_all_answer() -> None:
    assert split_all(["  Hello", " <think> is", " a tag"]) == ("", "  Hello <think> is a tag")
    assert split_all(["<thi"]) == ("", "<thi")  # a partial tag at the end stays answer
    assert split_all(["cut short while thin", "king"], opened=True) == (
        "cut short while thinking", "")
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_splitter_by_id_counts_only_the_tag_tokens() -> None:
    splitter = ReasoningSplitter(ThinkTags(7, 8), opened=True)
    # "</think>" spelled by plain tokens (id 5) is thinking; the tag token (8) ends it
    assert splitter.push("a </think> b", 5) == ("a </think> b", "")
    assert splitter.push("</think>", 8) == ("", "")
    assert splitter.push("\n\nanswer", 5) == ("", "answer")


@pytest.fixture(scope="module")
def by_id() -> Iterator[Engine]:
    with Engine.open(qwen3_think_model(by_id=True), device="cpu",
                     options={"temperature": 0.0, "max_tokens": 40}) as engine:
        yield engine


@pytest.fixture(scope="module")
def by_text() -> Iterator[Engine]:
    with Engine.open(qwen3_think_model(by_id=False), device="cpu",
                     options={"temperature": 0.0, "max_tokens": 60}) as engine:
        yield engine


def streamed(stream: object) -> tuple[str, str, list[TokenEvent], FinishEvent]:
    """The thinking and answer as the events carry them, the token events and the finish."""
    thinking, answer, tokens = "", "", []
    finish = None
    for event in stream:  # type: ignore[attr-defined]
        thinking += event.reasoning
        answer += event.text
        if isinstance(event, TokenEvent):
            tokens.append(event)
        else:
            finish = event
    assert finish is not None
    return thinking, answer, tokens, finish


def expected_split(engine: Engine, token_ids: list[int], opened: bool = False) -> tuple[str, str]:
    """The split read off the decoded reply: what is between the tags, what follows."""
    full = engine.tokenizer.decode(token_ids)
    if not opened:
        assert full.startswith("<think>"), full
        full = full[len("<think>"):]
    thinking, close, answer = full.partition("</think>")
    assert close, full
    return thinking.strip(), answer.lstrip()


def test_tags_as_single_tokens(by_id: Engine) -> None:
    tags = by_id.think_tags
    assert tags.open_id is not None and tags.close_id is not None
    assert by_id.thinks and by_id.template.reads_enable_thinking
    fmt = think_grammar(ids=(tags.open_id, tags.close_id))
    thinking, answer, tokens, finish = streamed(by_id.chat(HI, response_format=fmt))
    reply = finish.reply
    ids = reply.token_ids
    assert ids[0] == tags.open_id and ids.count(tags.close_id) == 1
    assert (reply.reasoning, reply.text) == expected_split(by_id, ids)
    assert reply.reasoning and reply.text and (thinking, answer) == (reply.reasoning, reply.text)
    # each token's text is on one side: the thinking tokens carry no answer and back
    close_at = ids.index(tags.close_id)
    assert all(not e.text for e in tokens[:close_at + 1])
    assert all(not e.reasoning for e in tokens[close_at:])
    assert "<think>" not in reply.reasoning + reply.text


def test_tags_split_across_tokens(by_text: Engine) -> None:
    assert by_text.think_tags == ThinkTags() and by_text.thinks  # the template thinks
    thinking, answer, tokens, finish = streamed(by_text.chat(HI, response_format=think_grammar()))
    reply = finish.reply
    pieces = [by_text.tokenizer.decode([i]) for i in reply.token_ids]
    assert "</think>" not in pieces and "/" in pieces  # the tag is spelled by several tokens
    assert (reply.reasoning, reply.text) == expected_split(by_text, reply.token_ids)
    assert reply.reasoning and reply.text and (thinking, answer) == (reply.reasoning, reply.text)
    assert not any("<" in e.text or "<" in e.reasoning for e in tokens)  # no partial tag leaks


def test_prompt_opens_the_think_block(by_id: Engine) -> None:
    template = JinjaTemplate(R1_STYLE, special_tokens={"eos_token": "<|im_end|>"})
    engine = Engine(by_id.model, template=template, config=by_id.config, prefix_cache=False)
    try:
        tags = engine.think_tags
        fmt = think_grammar(open_tag=False, ids=(tags.open_id, tags.close_id))
        thinking, answer, _, finish = streamed(engine.chat(HI, response_format=fmt))
        reply = finish.reply
        assert reply.token_ids.count(tags.close_id) == 1 and tags.open_id not in reply.token_ids
        assert (reply.reasoning, reply.text) == expected_split(engine, reply.token_ids, True)
        assert reply.reasoning and (thinking, answer) == (reply.reasoning, reply.text)
    finally:
        engine.close()


def test_thinking_off_reaches_the_template(by_id: Engine) -> None:
    off = by_id.planner.render(HI, None, False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert by_id.planner.render(HI, None, None).endswith("<|im_start|>assistant\n")
    assert by_id.count_tokens(HI, think=False) > by_id.count_tokens(HI)
    fmt = {"type": "grammar", "grammar": "start: /[a-z]{2,6}( [a-z]{2,6}){1,2}/\n"}
    reply = by_id.chat(HI, think=False, response_format=fmt).result()
    assert reply.reasoning == "" and reply.text == by_id.tokenizer.decode(reply.token_ids)
    with pytest.raises(InvalidRequestError, match="think"):
        by_id.chat(HI, think="no")  # type: ignore[arg-type]


def test_a_model_without_thinking_is_unaffected(by_text: Engine) -> None:
    engine = Engine(by_text.model, template=builtin_template("chatml"), config=by_text.config,
                    prefix_cache=False)
    try:
        assert not engine.thinks
        reply = engine.chat(HI, response_format=think_grammar()).result()
        assert reply.reasoning == ""
        assert reply.text == by_text.tokenizer.decode(reply.token_ids)
        assert reply.text.startswith("<think>")
        with pytest.raises(InvalidRequestError, match="does not think"):
            engine.chat(HI, think=True)
        engine.chat(HI, think=False, max_tokens=2).result()  # off: nothing to switch, fine
    finally:
        engine.close()


def test_raw_completions_are_not_split(by_id: Engine) -> None:
    tags = by_id.think_tags
    fmt = think_grammar(ids=(tags.open_id, tags.close_id))
    reply = by_id.complete("hi", response_format=fmt).result()
    assert reply.reasoning == "" and reply.text.startswith("<think>")
    assert reply.text == by_id.tokenizer.decode(reply.token_ids)


def test_conversation_keeps_thinking_out_of_later_prompts(by_id: Engine) -> None:
    tags = by_id.think_tags
    fmt = think_grammar(ids=(tags.open_id, tags.close_id))
    with by_id.conversation() as chat:
        first = chat.send("hi", response_format=fmt).result()
        assert first.reasoning
        stored = chat.messages[-1]
        assert stored == {"role": "assistant", "content": first.text,
                          "reasoning_content": first.reasoning}
        second = chat.send("more", response_format=fmt).result()
        assert second.reasoning and chat.last_reply is second
        assert chat.messages[-1]["reasoning_content"] == second.reasoning
        # Qwen3's template drops earlier turns' thinking from the prompt it renders
        prompt = by_id.planner.render([*chat.messages, {"role": "user", "content": "go"}],
                                      None, None)
        assert first.text in prompt and second.text in prompt
        assert first.reasoning not in prompt and second.reasoning not in prompt


# -- the CLI ---------------------------------------------------------------------------------------
def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`localchat run ARGS` on the chain model (its reply: `<think>ka lo</think>mi su`)."""
    localchat = str(Path(sys.executable).with_name("localchat"))
    return subprocess.run([localchat, "run", str(qwen3_think_model(chain=True)), "hello",
                           "--temperature", "0", "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=300)


def test_cli_json_and_the_thinking_switch() -> None:
    default = run_cli("--json")
    assert default.returncode == 0, default.stderr
    out = json.loads(default.stdout)
    assert (out["reasoning"], out["text"]) == (CHAIN_THINKING, CHAIN_ANSWER)
    off = json.loads(run_cli("--json", "--no-think").stdout)
    on = json.loads(run_cli("--json", "--think").stdout)
    # --no-think reaches the template: its empty think block lengthens the prompt
    assert off["prompt_tokens"] > on["prompt_tokens"] == out["prompt_tokens"]
    both = run_cli("--think", "--no-think")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_cli_prints_thinking_apart_from_the_answer() -> None:
    result = run_cli()
    assert result.returncode == 0, result.stderr
    assert result.stdout == CHAIN_ANSWER + "\n"  # a pipe gets the answer alone
    assert CHAIN_THINKING in result.stderr  # the thinking goes to stderr off a terminal
