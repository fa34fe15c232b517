"""The RWKV-7 G1 reasoning line thinks in `<think>…</think>`: its recipe's template
(`rwkv_world_think`) opens the block in the prompt, and the engine's reasoning split (as for
Qwen3) keeps the thinking apart from the answer. The model is the tiny random World-vocabulary
RWKV-7 of tests/rwkv7_variants.py; a Lark grammar forces its reply into `thinking </think>
answer` (the tags spelled by several World tokens, so they are found in the text)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from reasoning_fixtures import think_grammar

from localchat import Engine
from localchat.engine.templates import builtin_template
from localchat.recipes import all_recipes

from fixtures import converted, pth_folder
from rwkv7_variants import build_variant

HI = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    pth = build_variant("rwkv7-world") / "model.pth"
    folder = pth_folder(pth)
    with Engine.open(converted(folder, "q0f32"), device="cpu", template="rwkv_world_think",
                     options={"temperature": 0.0, "max_tokens": 40}) as engine:
        yield engine


def test_the_g1_recipes_think_and_the_world_ones_do_not() -> None:
    recipes = all_recipes()
    g1 = [r for name, r in recipes.items() if name.startswith("rwkv7-g1")]
    assert g1 and all(r.template == "rwkv_world_think" for r in g1)
    world = [r for name, r in recipes.items() if name.startswith(("rwkv7-world", "rwkv6-world"))]
    assert world and all(r.template == "rwkv_world" for r in world)
    assert builtin_template("rwkv_world_think").thinks
    assert not builtin_template("rwkv_world").thinks


def test_the_prompt_opens_the_block_unless_thinking_is_off() -> None:
    template = builtin_template("rwkv_world_think")
    history = [*HI, {"role": "assistant", "content": "Rayleigh."},
               {"role": "user", "content": "And at\n\nsunset?"}]
    plain = builtin_template("rwkv_world").render(history, add_generation_prompt=False)
    assert template.render(history) == plain + "Assistant: <think>"
    assert template.render(history, enable_thinking=False) == (
        plain + "Assistant: <think>\n</think>")
    assert template.render(history, add_generation_prompt=False) == plain


def test_a_reply_is_split_into_thinking_and_answer(engine: Engine) -> None:
    assert engine.thinks
    fmt = think_grammar(open_tag=False, ids=None)  # the prompt opened the block
    thinking, answer = "", ""
    stream = engine.chat(HI, response_format=fmt)
    for event in stream:
        thinking += event.reasoning
        answer += event.text
    reply = stream.result()
    full = engine.tokenizer.decode(reply.token_ids)
    want_thinking, close, want_answer = full.partition("</think>")
    assert close and "<think>" not in full
    assert reply.reasoning == want_thinking.strip() != ""
    assert reply.text == want_answer.lstrip() != ""
    assert (thinking, answer) == (reply.reasoning, reply.text)
    assert "<" not in reply.text and "<" not in reply.reasoning


def test_thinking_off_replies_are_all_answer(engine: Engine) -> None:
    fmt = {"type": "grammar", "grammar": "start: /[a-z]{2,6}( [a-z]{2,6}){1,2}/\n"}
    reply = engine.chat(HI, think=False, response_format=fmt).result()
    assert reply.text and not reply.reasoning

