"""The prefix cache (issue 13 part 2): a prompt that shares a prefix with a sequence the engine
holds or recently held forks it and prefills only the rest; the same greedy replies with the
cache on and off; LRU eviction under a token budget; cache entries yield slots and room to
running requests; a conversation whose template rewrote an earlier turn rolls back to the
common prefix; RWKV keeps its state at each reply's end (a turn boundary).

Replies are compared by token ids: a prefill split at a different position (the cached prefix
is attended through the paged kernel, the rest through the ragged one) changes logits in the
last bits (~1e-5 here), not the greedy tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from localchat import Engine, GenerationConfig
from localchat.engine.prefix_cache import MIN_MATCH_TOKENS, PrefixCache, enabled_from_env
from localchat.engine.runtime import Model, Sequence

from fixtures import converted, smollm2_hf_dir
from model_oracle import rel_err

GREEDY = GenerationConfig(temperature=0.0, max_tokens=10)
SYSTEM = " ".join(f"Rule {i}: answer politely and mention the number {i}." for i in range(30))
# A ChatML variant that marks the newest user message: the text of an earlier turn changes
# when a new one is added, as templates that rewrite history do (llama-3's date line,
# reasoning models dropping earlier thoughts, Mistral moving the system prompt).
REWRITING_TEMPLATE = (
    "{%- for m in messages -%}"
    "<|im_start|>{{ m['role'] }}\n"
    "{%- if loop.last and m['role'] == 'user' %} (latest question){% endif %}\n"
    "{{ m['content'] }}<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)


def sys_and(*turns: str) -> list[dict[str, str]]:
    """The system prompt, then alternating user/assistant turns."""
    roles = ["user", "assistant"]
    return [{"role": "system", "content": SYSTEM}] + [
        {"role": roles[i % 2], "content": t} for i, t in enumerate(turns)
    ]


# -- the cache alone -------------------------------------------------------------------------
def seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, list(tokens))


N = MIN_MATCH_TOKENS  # entries below are a few times this long


def test_match_prefers_the_longest_usable_prefix_and_leaves_one_token() -> None:
    cache = PrefixCache(100 * N, fork_anywhere=True)
    a, b = seq(1, list(range(4 * N))), seq(2, [*range(3 * N), -1, -2])
    assert cache.add(a) == [] and cache.add(b) == []
    m = cache.match([*range(3 * N + 5), -7])
    assert m is not None and m.parent is a and m.tokens == 3 * N + 5
    whole = cache.match(list(range(4 * N)))  # all cached: one token is prefilled again
    assert whole is not None and whole.tokens == 4 * N - 1
    assert cache.match([*range(N - 1), -5, -5]) is None  # too short to bother
    assert cache.stats.hits == 2 and cache.stats.lookups == 3


def test_rnn_entries_match_only_whole() -> None:
    cache = PrefixCache(100 * N, fork_anywhere=False)
    a = seq(1, list(range(2 * N)))
    cache.add(a)
    assert cache.match([*range(2 * N - 1), -1, -2]) is None  # diverges inside the entry
    assert cache.match(list(range(2 * N))) is None  # nothing left to prefill
    m = cache.match(list(range(2 * N + 5)))
    assert m is not None and m.tokens == 2 * N
    # An RNN entry serves only its whole self: a longer one does not replace it.
    assert cache.add(seq(2, list(range(3 * N)))) == [] and len(cache) == 2
    assert cache.add(seq(3, list(range(2 * N)))) != []  # an identical one is not kept


def test_lru_eviction_under_the_budget_and_redundant_entries() -> None:
    cache = PrefixCache(5 * N, fork_anywhere=True)
    a, b, c = seq(1, [1] * 2 * N), seq(2, [2] * 2 * N), seq(3, [3] * 2 * N)
    cache.add(a)
    cache.add(b)
    assert cache.match([1] * (2 * N + 1)) is not None  # a is now the most recently used
    assert cache.add(c) == [b]
    assert cache.held_tokens <= 5 * N and a in cache and c in cache
    # A longer entry replaces one it extends; one covered by an entry is not kept.
    longer = seq(4, [1] * (2 * N + 10))
    assert cache.add(longer) == [a]
    shorter = seq(5, [1] * (2 * N - 10))
    assert cache.add(shorter) == [shorter]
    assert cache.add(seq(6, [9] * 6 * N))[0].seq_id == 6  # bigger than the whole budget
    assert cache.pop_lru(keep=c) is longer


def test_switch_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCALCHAT_PREFIX_CACHE", raising=False)
    assert enabled_from_env()
    for off in ("0", "off", "false"):
        monkeypatch.setenv("LOCALCHAT_PREFIX_CACHE", off)
        assert not enabled_from_env()
    monkeypatch.setenv("LOCALCHAT_PREFIX_CACHE", "1")
    assert enabled_from_env()


# -- SmolLM2-135M ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model() -> Model:
    return Model(converted(smollm2_hf_dir(), "q0f32"), "cpu", max_total_tokens=4096)


def test_forked_parent_removed_while_the_child_lives(model: Model) -> None:
    rng = np.random.RandomState(0)
    tokens = [int(t) for t in rng.randint(0, 49_000, 300)]
    whole = model.new_sequence()
    expect = model.prefill(whole, tokens)
    parent = model.new_sequence()
    model.prefill(parent, tokens[:250])
    child = model.fork(parent, 203)  # inside a page: that page is copied, the rest shared
    model.remove(parent)
    other = model.new_sequence()  # takes the freed pages
    model.prefill(other, [int(t) for t in rng.randint(0, 49_000, 100)])
    got = model.prefill(child, tokens[203:])
    assert rel_err(got, expect) < 1e-4 and got.argmax() == expect.argmax()
    nxt = int(expect.argmax())
    a, b = model.decode([whole, child], [nxt, nxt])
    assert rel_err(b, a) < 1e-4 and a.argmax() == b.argmax()
    model.popn(child, 100)
    assert len(child) == 201 and child.tokens == tokens[:201]
    again = model.prefill(child, tokens[201:])
    assert rel_err(again, expect) < 1e-4
    for s in (whole, child, other):
        model.remove(s)


@pytest.fixture(scope="module")
def on(model: Model) -> Iterator[Engine]:
    # A budget of about three entries: the engines of this module share the model's slots.
    with Engine(model, config=GREEDY, prefix_cache=True, prefix_cache_tokens=1200) as engine:
        yield engine


@pytest.fixture(scope="module")
def off(model: Model) -> Iterator[Engine]:
    with Engine(model, config=GREEDY, prefix_cache=False) as engine:
        yield engine


def test_env_switch_turns_the_engine_cache_off(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCALCHAT_PREFIX_CACHE", "0")
    with Engine(model, config=GREEDY) as engine:
        assert engine.scheduler.cache is None and not engine.planner.rollback
    monkeypatch.delenv("LOCALCHAT_PREFIX_CACHE")
    with Engine(model, config=GREEDY) as engine:
        assert engine.scheduler.cache is not None and engine.planner.rollback


def test_second_request_prefills_only_the_rest(on: Engine, off: Engine) -> None:
    first = on.chat(sys_and("What is 2+2?")).result()
    second = on.chat(sys_and("Name a colour.")).result()
    system_tokens = on.count_tokens([{"role": "system", "content": SYSTEM}])
    full = on.count_tokens(sys_and("Name a colour."))
    assert first.stats.reused_tokens == 0
    assert second.stats.reused_tokens >= system_tokens - 4  # up to the user header
    assert second.stats.reused_tokens + second.stats.prompt_tokens == full
    assert second.stats.prompt_tokens < 20
    for r, messages in ((first, sys_and("What is 2+2?")), (second, sys_and("Name a colour."))):
        plain = off.chat(messages).result()
        assert plain.stats.reused_tokens == 0
        assert r.token_ids == plain.token_ids


def test_resent_history_is_not_prefilled_again(on: Engine, off: Engine) -> None:
    first = on.chat(sys_and("Say hello.")).result()
    history = sys_and("Say hello.", first.text, "Now say goodbye.")
    second = on.chat(history).result()
    # Everything the first reply left in its sequence (prompt and fed reply) is reused.
    assert second.stats.reused_tokens == first.stats.context_tokens
    assert second.stats.prompt_tokens < 20
    assert second.token_ids == off.chat(history).result().token_ids


def test_identical_prompt_prefills_one_token(on: Engine, off: Engine) -> None:
    messages = sys_and("Count to three.")
    on.chat(messages).result()
    again = on.chat(messages).result()
    assert again.stats.prompt_tokens == 1
    assert again.token_ids == off.chat(messages).result().token_ids


def test_closed_conversation_feeds_a_stateless_request(on: Engine, off: Engine) -> None:
    """The TUI after an edit: it closes the conversation and sends the history statelessly."""
    with on.conversation(system=SYSTEM) as chat:
        reply = chat.send("Pick a number.").result()
    edited = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Pick a fruit."}]
    after = on.chat(edited).result()
    assert reply.stats.context_tokens > 0
    assert after.stats.reused_tokens > on.count_tokens(edited) - 12
    assert after.token_ids == off.chat(edited).result().token_ids


def test_rewritten_turn_rolls_back_to_the_common_prefix(model: Model, tmp_path: Path) -> None:
    template = tmp_path / "rewriting.jinja"
    template.write_text(REWRITING_TEMPLATE)
    turns = ["What is 2+2?", "And 3+3?", "And 4+4?"]
    replies = {}
    for cached in (True, False):
        with Engine(model, template=str(template), config=GREEDY, prefix_cache=cached) as eng:
            assert eng.planner.rollback is cached
            with eng.conversation(system=SYSTEM) as chat:
                replies[cached] = [chat.send(t).result() for t in turns]
            system_tokens = eng.count_tokens([{"role": "system", "content": SYSTEM}])
    for with_cache, without in zip(replies[True], replies[False], strict=True):
        assert with_cache.token_ids == without.token_ids
    for r in replies[False][1:]:
        assert r.stats.reused_tokens == 0  # the old behaviour: reset and prefill it all
    for r in replies[True][1:]:
        # The newest question moved: everything up to that user turn is kept (the count
        # includes the generation prompt's few tokens).
        assert r.stats.reused_tokens >= system_tokens - 4
        assert r.stats.prompt_tokens < 40


def test_cache_yields_slots_and_room_to_running_requests(model: Model) -> None:
    small = Model(model.model_dir, "cpu", max_batch_size=2, max_total_tokens=1024)
    with Engine(small, config=GREEDY, prefix_cache=True) as eng:
        for q in ("One?", "Two?"):
            eng.chat(sys_and(q)).result()
        assert len(eng.scheduler.cache) == 2  # both slots held by cache entries
        streams = [eng.chat([{"role": "user", "content": f"Say {w}."}]) for w in ("a", "b")]
        replies = [s.result() for s in streams]
        assert all(r.finish_reason in ("stop", "length") for r in replies)
        assert len(eng.scheduler.cache) == 0  # (too short to keep) and the entries gave way
        # A prompt that needs most of the room gets it: the entry that fills it is freed.
        eng.chat(sys_and("Three?")).result()
        kept = eng.scheduler.cached_tokens()
        long = [{"role": "user", "content": "word " * 700}]
        assert kept + eng.count_tokens(long) > small.max_total_tokens
        evictions = eng.scheduler.cache.stats.evictions
        reply = eng.chat(long, max_tokens=2).result()
        assert reply.finish_reason in ("stop", "length") and reply.stats.reused_tokens == 0
        assert eng.scheduler.cache.stats.evictions == evictions + 1
        assert eng.scheduler.held_tokens() <= small.max_total_tokens


def test_budget_bounds_what_the_cache_keeps(model: Model) -> None:
    with Engine(model, config=GREEDY, prefix_cache=True, prefix_cache_tokens=500) as eng:
        first = eng.chat(sys_and("One?")).result()
        assert eng.scheduler.cached_tokens() == first.stats.context_tokens
        eng.chat(
            [{"role": "system", "content": "Be brief. " * 60}, {"role": "user", "content": "Two?"}]
        ).result()
        assert eng.scheduler.cached_tokens() <= 500
        assert len(eng.scheduler.cache) == 1  # the older entry went
        again = eng.chat(sys_and("Three?")).result()
        assert again.stats.reused_tokens == 0


# -- RWKV: states at turn boundaries ---------------------------------------------------------
WORDS = " the a cat dog sat on mat red blue sky tree ran fast slow big small one two".split()


@pytest.fixture(scope="module")
def world_model() -> Model:
    from rwkv_variants import build_variant

    return Model(converted(build_variant("rwkv4-world"), "q0f32"), "cpu")


def test_rwkv_resent_history_reuses_the_state_at_the_turn_boundary(world_model: Model) -> None:
    replies: dict[bool, list] = {}
    for cached in (True, False):
        with Engine(world_model, config=GREEDY, prefix_cache=cached) as eng:
            # Replies drawn from space-led one-token words render back unchanged.
            bias = {eng.tokenizer.encode(" " + w)[0]: 60.0 for w in WORDS}
            system = [{"role": "system", "content": "You answer with words. " * 24}]
            first = eng.chat(
                [*system, {"role": "user", "content": "Hello"}], max_tokens=6, logit_bias=bias
            ).result()
            history = [
                *system,
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": first.text},
                {"role": "user", "content": "More"},
            ]
            second = eng.chat(history, max_tokens=6, logit_bias=bias).result()
            replies[cached] = [first, second]
            full = eng.count_tokens(history)
    first, second = replies[True]
    assert second.stats.reused_tokens == first.stats.context_tokens
    assert second.stats.reused_tokens + second.stats.prompt_tokens == full
    assert replies[False][1].stats.reused_tokens == 0
    for a, b in zip(replies[True], replies[False], strict=True):
        assert a.token_ids == b.token_ids


def test_rwkv_regenerate_and_a_reworded_reply_rerun_one_token(world_model: Model) -> None:
    """The state kept at the prompt's last token but one serves a regenerated reply (the same
    prompt) and a history whose last reply was edited."""
    system = [{"role": "system", "content": "You answer with words. " * 24}]
    messages = [*system, {"role": "user", "content": "Hello"}]
    out: dict[bool, list] = {}
    for cached in (True, False):
        with Engine(world_model, config=GREEDY, prefix_cache=cached) as eng:
            bias = {eng.tokenizer.encode(" " + w)[0]: 60.0 for w in WORDS}
            first = eng.chat(messages, max_tokens=6, logit_bias=bias).result()
            again = eng.chat(messages, max_tokens=6, logit_bias=bias).result()
            edited = [
                *messages,
                {"role": "assistant", "content": "Something else entirely."},
                {"role": "user", "content": "More"},
            ]
            after_edit = eng.chat(edited, max_tokens=6, logit_bias=bias).result()
            out[cached] = [first, again, after_edit]
            prompt = eng.count_tokens(messages)
    first, again, after_edit = out[True]
    assert again.stats.prompt_tokens == 1 and again.stats.reused_tokens == prompt - 1
    assert after_edit.stats.reused_tokens == prompt - 1
    for a, b in zip(out[True], out[False], strict=True):
        assert a.token_ids == b.token_ids
