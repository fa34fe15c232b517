"""gpt-oss replies in OpenAI's harmony format: the HarmonySplitter keeps the `analysis` channel
as thinking and the `final` (and `commentary`) channels as answer, never shows the headers, and
keeps tool calls (`to=functions.f`) apart.

Real parts only: a small byte-level BPE `tokenizers` tokenizer trained here, with the harmony
markers added as special tokens, loaded through localchat's HFTokenizer; each reply is encoded
to ids and fed token by token through the engine's TextStream (incremental detokenizer and
stop strings) into the splitter, as the scheduler does.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from localchat.engine.detokenizer import TextStream
from localchat.engine.engine import Engine
from localchat.engine.harmony import HARMONY_MARKERS, HarmonySplitter, HarmonyTokens
from localchat.engine.reasoning import ReasoningSplitter, ThinkTags, model_thinks
from localchat.engine.tokenizer import HFTokenizer

CORPUS = [
    "User asks 2+2. Simple. We answer.",
    "2 + 2 = 4. The weather in Paris is sunny.",
    "Let me check the weather for you.",
    '{"city": "Paris"} {"city":"Paris"} functions.get_weather json assistant',
    "analysis final commentary to= café naïve",
]
RETURN_AND_CALL = ("<|return|>", "<|call|>")  # generation_config's stop tokens


def _train(path: Path, specials: list[str]) -> HFTokenizer:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 3, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(path))
    return HFTokenizer(path)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return _train(tmp_path_factory.mktemp("harmony") / "tokenizer.json",
                  ["<|endoftext|>", *HARMONY_MARKERS])


@pytest.fixture(scope="module")
def tokens(tokenizer: HFTokenizer) -> HarmonyTokens:
    found = HarmonyTokens.of(tokenizer)
    assert found is not None
    return found


def ids_of(tokenizer: HFTokenizer, *texts: str) -> list[int]:
    """Ids of the texts encoded one after another (special tokens recognised in each)."""
    return [i for text in texts for i in tokenizer.encode(text)]


def run(
    tokenizer: HFTokenizer,
    tokens: HarmonyTokens,
    ids: list[int],
    *,
    stop_ids: tuple[str, ...] = RETURN_AND_CALL,
    stop_strings: tuple[str, ...] = (),
    **kwargs: object,
) -> tuple[HarmonySplitter, list[tuple[str, str]], tuple[str, str]]:
    """Drive a splitter as the scheduler does; (splitter, (thinking, answer) of each push,
    what finish added)."""
    stops = {tokenizer.token_to_id(t) for t in stop_ids}
    splitter = HarmonySplitter(tokens, **kwargs)  # type: ignore[arg-type]
    stream = TextStream(tokenizer, stop_strings)
    steps = []
    for token in ids:
        if token in stops:  # the engine ends the reply on a stop token; it is never pushed
            break
        piece = stream.add(token)
        steps.append(splitter.push(piece.text, token))
        if piece.stopped:
            break
    tail = stream.finish()
    thinking, answer = splitter.push(tail, None) if tail else ("", "")
    more_thinking, more_answer = splitter.finish()
    return splitter, steps, (thinking + more_thinking, answer + more_answer)


def joined(steps: list[tuple[str, str]], end: tuple[str, str]) -> tuple[str, str]:
    return ("".join(t for t, _ in steps) + end[0], "".join(a for _, a in steps) + end[1])


ANALYSIS_THEN_FINAL = (
    "<|channel|>analysis<|message|>User asks 2+2. Simple.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
)


def test_the_vocabulary_decides(tokenizer: HFTokenizer, tmp_path: Path) -> None:
    assert model_thinks(None, tokenizer)
    assert not ThinkTags.of(tokenizer).by_id
    plain = _train(tmp_path / "plain.json", ["<|endoftext|>", "<|start|>", "<|end|>"])
    assert HarmonyTokens.of(plain) is None  # no <|channel|> / <|message|>: not harmony
    assert not model_thinks(None, plain)
    assert HarmonyTokens.of(object()) is None
    found = HarmonyTokens.of(tokenizer)
    assert found is not None
    assert {m for _, m, _ in found.markers} == set(HARMONY_MARKERS)
    for token_id, marker, text in found.markers:  # the detokenizer shows the markers
        assert tokenizer.token_to_id(marker) == token_id and text == marker


def test_analysis_then_final(tokenizer: HFTokenizer, tokens: HarmonyTokens) -> None:
    ids = ids_of(tokenizer, ANALYSIS_THEN_FINAL)
    splitter, steps, end = run(tokenizer, tokens, ids)
    assert joined(steps, end) == ("User asks 2+2. Simple.", "2 + 2 = 4.")
    assert end == ("", "")  # all decided as it streamed
    assert len(ids) > 20  # several tokens per piece of text: pieces cut across tokens
    # the thinking is all out when `<|end|>` comes, before any answer
    end_at = ids.index(tokenizer.token_to_id("<|end|>"))
    assert "".join(t for t, _ in steps[: end_at + 1]) == "User asks 2+2. Simple."
    assert not any(a for _, a in steps[: end_at + 1])
    # thinking tokens: `<|channel|>analysis<|message|>` ... `<|end|>`
    assert splitter.thinking_tokens == end_at + 1
    assert splitter.thought and not splitter.calls


def test_the_stop_token_may_reach_the_splitter(
    tokenizer: HFTokenizer, tokens: HarmonyTokens
) -> None:
    ids = ids_of(tokenizer, ANALYSIS_THEN_FINAL)
    _, steps, end = run(tokenizer, tokens, ids, stop_ids=())
    assert joined(steps, end) == ("User asks 2+2. Simple.", "2 + 2 = 4.")


def test_final_only(tokenizer: HFTokenizer, tokens: HarmonyTokens) -> None:
    ids = ids_of(tokenizer, "<|channel|>final<|message|>The weather in Paris is sunny.<|return|>")
    splitter, steps, end = run(tokenizer, tokens, ids)
    assert joined(steps, end) == ("", "The weather in Paris is sunny.")
    assert end == ("", "")
    assert splitter.thinking_tokens == 0 and not splitter.thought


def test_analysis_cut_at_the_token_limit(tokenizer: HFTokenizer, tokens: HarmonyTokens) -> None:
    ids = ids_of(tokenizer, ANALYSIS_THEN_FINAL)
    cut = ids.index(tokenizer.token_to_id("<|end|>")) - 2  # inside the analysis body
    splitter, steps, end = run(tokenizer, tokens, ids[:cut])
    thinking, answer = joined(steps, end)
    assert answer == ""
    assert thinking and "User asks 2+2. Simple.".startswith(thinking)
    assert splitter.thinking_tokens == cut  # all of them while it is open


def test_cut_inside_a_header_shows_nothing(tokenizer: HFTokenizer, tokens: HarmonyTokens) -> None:
    ids = ids_of(tokenizer, "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant")
    _, steps, end = run(tokenizer, tokens, ids)
    assert joined(steps, end) == ("Simple.", "")
    ids = ids_of(tokenizer, "<|channel|>anal")
    assert joined(*run(tokenizer, tokens, ids)[1:]) == ("", "")


def test_headers_between_channels_are_dropped(
    tokenizer: HFTokenizer, tokens: HarmonyTokens
) -> None:
    # `<|end|><|start|>assistant` between the channels, or only `<|end|>`, or neither
    for between in ("<|end|><|start|>assistant", "<|end|>", ""):
        ids = ids_of(tokenizer, "<|channel|>analysis<|message|>We answer. ", between,
                     "<|channel|>final<|message|>2 + 2 = 4.")
        _, steps, end = run(tokenizer, tokens, ids)
        assert joined(steps, end) == ("We answer.", "2 + 2 = 4."), between


def test_a_reply_without_channels_is_answer(
    tokenizer: HFTokenizer, tokens: HarmonyTokens
) -> None:
    text = "The weather in Paris is sunny."
    splitter, steps, end = run(tokenizer, tokens, ids_of(tokenizer, text))
    assert joined(steps, end) == ("", text)
    assert "".join(a for _, a in steps).startswith("The weather")  # streamed, not held
    # a short one is answer at the end
    assert joined(*run(tokenizer, tokens, ids_of(tokenizer, "to"))[1:]) == ("", "to")
    assert splitter.thinking_tokens == 0


def test_tool_calls(tokenizer: HFTokenizer, tokens: HarmonyTokens) -> None:
    call = ('<|channel|>analysis<|message|>Need the weather.<|end|>'
            '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
            '<|message|>{"city":"Paris"}<|call|>')
    splitter, steps, end = run(tokenizer, tokens, ids_of(tokenizer, call))
    assert joined(steps, end) == ("Need the weather.", "")
    [got] = splitter.calls
    assert (got.recipient, got.channel, got.constrain) == ("functions.get_weather",
                                                           "commentary", "json")
    assert got.arguments == '{"city":"Paris"}'
    # the recipient may come before the channel (and the reply may start with it)
    call = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
    splitter, steps, end = run(tokenizer, tokens, ids_of(tokenizer, call))
    assert joined(steps, end) == ("", "")
    assert [(c.recipient, c.channel, c.arguments) for c in splitter.calls] == [
        ("functions.get_weather", "commentary", '{"city": "Paris"}')]
    # calls_as_answer: the body is answer text (the header still hidden)
    _, steps, end = run(tokenizer, tokens, ids_of(tokenizer, call), calls_as_answer=True)
    assert joined(steps, end) == ("", '{"city": "Paris"}')


def test_commentary_without_recipient_is_answer(
    tokenizer: HFTokenizer, tokens: HarmonyTokens
) -> None:
    reply = ("<|channel|>commentary<|message|>Let me check the weather for you.<|end|>"
             "<|start|>assistant<|channel|>final<|message|>The weather in Paris is sunny.")
    _, steps, end = run(tokenizer, tokens, ids_of(tokenizer, reply))
    assert joined(steps, end) == (
        "", "Let me check the weather for you.\n\nThe weather in Paris is sunny.")


def test_markers_spelled_in_plain_tokens_are_text(
    tokenizer: HFTokenizer, tokens: HarmonyTokens
) -> None:
    # "<|end|>" written as ordinary tokens ("<|", "end", ...) does not end the message
    ids = ids_of(tokenizer, "<|channel|>final<|message|>Use <|", "end|> here.")
    assert tokenizer.token_to_id("<|end|>") not in ids
    _, steps, end = run(tokenizer, tokens, ids)
    assert joined(steps, end) == ("", "Use <|end|> here.")


def test_multibyte_text_and_a_lagging_marker(
    tokenizer: HFTokenizer, tokens: HarmonyTokens
) -> None:
    reply = "<|channel|>analysis<|message|>café naïve 🙂<|end|><|channel|>final<|message|>naïve"
    ids = ids_of(tokenizer, reply)
    assert joined(*run(tokenizer, tokens, ids)[1:]) == ("café naïve 🙂", "naïve")
    # a stop string that starts like `<|end|>` holds the marker's text back a token or more
    _, steps, end = run(tokenizer, tokens, ids, stop_strings=("<|end|>!",))
    assert joined(steps, end) == ("café naïve 🙂", "naïve")


def test_a_prompt_that_opens_the_final_channel(
    tokenizer: HFTokenizer, tokens: HarmonyTokens
) -> None:
    prompt = "<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>"
    _, steps, end = run(tokenizer, tokens, ids_of(tokenizer, "2 + 2 = 4."), prompt=prompt)
    assert joined(steps, end) == ("", "2 + 2 = 4.")


def test_the_engine_picks_the_splitter(tokenizer: HFTokenizer, tokens: HarmonyTokens) -> None:
    engine = SimpleNamespace(thinks=model_thinks(None, tokenizer), harmony_tokens=tokens,
                             think_tags=ThinkTags.of(tokenizer))
    prompt = "<|start|>user<|message|>Hi<|end|><|start|>assistant"
    assert isinstance(Engine.splitter_for(engine, prompt), HarmonySplitter)  # type: ignore[arg-type]
    engine.harmony_tokens = None
    assert isinstance(Engine.splitter_for(engine, prompt), ReasoningSplitter)  # type: ignore[arg-type]
    engine.thinks = False
    assert Engine.splitter_for(engine, prompt) is None  # type: ignore[arg-type]


def test_a_header_that_runs_on_is_text(tokenizer: HFTokenizer, tokens: HarmonyTokens) -> None:
    # no `<|message|>`: past a few words (or a line break) the "header" was the body
    text = "The weather in Paris is sunny."
    for reply in (f"<|channel|>final {text}",
                  f"<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant {text}"):
        splitter, steps, end = run(tokenizer, tokens, ids_of(tokenizer, reply))
        assert joined(steps, end)[1] == text


def test_a_harmony_template_ends_the_reply_on_return_and_call_not_end() -> None:
    """gpt-oss's template ends every message with <|end|> (Phi-3's end-of-turn token): for a
    harmony template only <|return|> and <|call|> end the reply, or the thinking would."""
    from localchat.engine.templates import JinjaTemplate

    source = ("{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>"
              "{{ m.content }}<|end|>{% endfor %}<|start|>assistant")
    harmony = JinjaTemplate(source, name="harmony")
    assert set(harmony.stop_token_strings) == set(RETURN_AND_CALL)
    phi = JinjaTemplate("{% for m in messages %}<|user|>{{ m.content }}<|end|>{% endfor %}",
                        name="phi")
    assert "<|end|>" in phi.stop_token_strings
