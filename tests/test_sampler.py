"""Sampling: each filter and penalty against a hand computation, seeds, batches, validation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from localchat.engine.generation_config import MODEL_DEFAULTS, GenerationConfig
from localchat.engine.sampler import Sampler, sample_batch
from localchat.errors import GenerationError

# A hand-made distribution: probabilities 0.45, 0.30, 0.15, 0.07, 0.03 on tokens 4, 1, 3, 0, 2.
HAND_P = np.array([0.07, 0.30, 0.03, 0.15, 0.45])
HAND_LOGITS = np.log(HAND_P).astype(np.float32) + 3.0  # any shift gives the same softmax


def _probs(**config) -> np.ndarray:
    return Sampler(GenerationConfig(**config), HAND_P.size).probabilities(HAND_LOGITS)


def _renormalized(keep: list[int], p: np.ndarray = HAND_P) -> np.ndarray:
    out = np.zeros_like(p)
    out[keep] = p[keep] / p[keep].sum()
    return out


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_greedy_is_argmax():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((8, 49152)).astype(np.float32)
    for row in logits:
        assert Sampler(GenerationConfig(temperature=0), 49152).sample(row) == int(row.argmax())
    samplers = [Sampler(GenerationConfig(temperature=0), 49152) for _ in range(8)]
    assert sample_batch(samplers, logits) == [int(i) for i in logits.argmax(axis=1)]


def test_temperature_scales_the_softmax():
    assert np.allclose(_probs(temperature=1.0), HAND_P, atol=1e-6)
    assert np.allclose(_probs(temperature=0.5), _softmax(np.log(HAND_P) / 0.5), atol=1e-6)
    assert np.allclose(_probs(temperature=2.0), _softmax(np.log(HAND_P) / 2.0), atol=1e-6)


@pytest.mark.parametrize(("top_k", "keep"), [(1, [4]), (2, [4, 1]), (3, [4, 1, 3]), (5, None)])
def test_top_k_keeps_the_k_most_likely(top_k, keep):
    expected = HAND_P if keep is None else _renormalized(keep)
    assert np.allclose(_probs(temperature=1.0, top_k=top_k), expected, atol=1e-6)


@pytest.mark.parametrize(
    ("top_p", "keep"),
    [(0.40, [4]), (0.70, [4, 1]), (0.85, [4, 1, 3]), (0.95, [4, 1, 3, 0]), (1.0, None)],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, keep):
    expected = HAND_P if keep is None else _renormalized(keep)
    assert np.allclose(_probs(temperature=1.0, top_p=top_p), expected, atol=1e-6)


@pytest.mark.parametrize(
    ("min_p", "keep"), [(0.9, [4]), (0.5, [4, 1]), (0.2, [4, 1, 3]), (0.1, [4, 1, 3, 0])]
)
def test_min_p_keeps_tokens_near_the_top_one(min_p, keep):
    # Threshold min_p * 0.45: 0.405, 0.225, 0.09, 0.045.
    assert np.allclose(_probs(temperature=1.0, min_p=min_p), _renormalized(keep), atol=1e-6)


def test_top_p_applies_to_the_top_k_distribution():
    # As in HF: after top_k=3 the mass is 0.9, renormalized 0.5, 0.333, 0.167; top_p=0.8 then
    # keeps 2 tokens, where on the full distribution (0.45, 0.75, 0.9) it would keep 3.
    assert np.allclose(_probs(temperature=1.0, top_p=0.8), _renormalized([4, 1, 3]), atol=1e-6)
    both = _probs(temperature=1.0, top_k=3, top_p=0.8)
    assert np.allclose(both, _renormalized([4, 1]), atol=1e-6)


def test_top_p_on_a_large_flat_vocabulary_matches_a_full_sort():
    # The nucleus here holds thousands of tokens, more than the first partial look takes.
    rng = np.random.default_rng(1)
    logits = rng.standard_normal(20000).astype(np.float32)
    p = _softmax(logits.astype(np.float64))
    order = np.argsort(-p)
    n = int(np.searchsorted(np.cumsum(p[order]), 0.9)) + 1
    assert n > 5000
    got = Sampler(GenerationConfig(temperature=1.0, top_p=0.9), 20000).probabilities(logits)
    assert set(np.flatnonzero(got)) == set(order[:n].tolist())
    assert np.allclose(got[order[:n]], p[order[:n]] / p[order[:n]].sum(), rtol=1e-4)


def test_draws_follow_the_distribution():
    sampler = Sampler(GenerationConfig(temperature=1.0, seed=7), HAND_P.size)
    draws = np.array([sampler.sample(HAND_LOGITS) for _ in range(20000)])
    freq = np.bincount(draws, minlength=HAND_P.size) / draws.size
    assert np.abs(freq - HAND_P).max() < 0.015


def test_draws_on_a_large_vocabulary_follow_the_distribution():
    # Mass on a few far-apart ids of a 65 536 vocabulary: exercises the blockwise draw.
    vocab = 65536
    logits = np.full(vocab, -30.0, dtype=np.float32)
    heavy = {5: 0.5, 40000: 0.3, 65535: 0.2}
    for token, prob in heavy.items():
        logits[token] = math.log(prob)
    sampler = Sampler(GenerationConfig(temperature=1.0, seed=3), vocab)
    draws = [sampler.sample(logits) for _ in range(3000)]
    assert set(draws) <= set(heavy)
    for token, prob in heavy.items():
        assert abs(draws.count(token) / len(draws) - prob) < 0.04


def test_same_seed_same_tokens_and_different_seed_different_tokens():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((40, 49152)).astype(np.float32)
    config = GenerationConfig(temperature=1.0, top_p=0.95, repetition_penalty=1.1, seed=1234)

    def run(cfg: GenerationConfig) -> list[int]:
        sampler = Sampler(cfg, 49152, prompt_ids=[1, 2, 3])
        return [sampler.sample(row) for row in logits]

    assert run(config) == run(config)
    assert run(config) != run(config.replace(seed=4321))


def test_batch_sampling_equals_one_by_one():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 1000)).astype(np.float32) * 3
    configs = [
        GenerationConfig(temperature=0),
        GenerationConfig(temperature=0.8, top_k=20, seed=1),
        GenerationConfig(temperature=1.0, min_p=0.1, seed=2, presence_penalty=1.0),
        GenerationConfig(temperature=0.0, logit_bias={7: 100}),
    ]
    batched = [Sampler(c, 1000) for c in configs]
    single = [Sampler(c, 1000) for c in configs]
    for _ in range(5):
        expected = [s.sample(row) for s, row in zip(single, logits, strict=True)]
        assert sample_batch(batched, logits) == expected
    assert expected[3] == 7


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = np.array([2.0, -1.0, 0.5, 3.0, -2.0], dtype=np.float32)
    sampler = Sampler(GenerationConfig(repetition_penalty=2.0), 5, prompt_ids=[0, 1, 1])
    sampler.accept(4)
    assert np.allclose(sampler.adjust_logits(logits), [1.0, -2.0, 0.5, 3.0, -4.0])


def test_presence_and_frequency_penalties_count_reply_tokens_only():
    logits = np.array([1.0, 1.0, 1.0, 1.0], dtype=np.float32)
    config = GenerationConfig(presence_penalty=0.5, frequency_penalty=0.25)
    sampler = Sampler(config, 4, prompt_ids=[0, 0, 0])
    for token in (2, 2, 3):
        sampler.accept(token)
    # token 2: 1 - 0.5 - 2 * 0.25 = 0.0; token 3: 1 - 0.5 - 0.25 = 0.25; prompt token 0 untouched.
    assert np.allclose(sampler.adjust_logits(logits), [1.0, 1.0, 0.0, 0.25])


def test_penalties_change_what_greedy_picks():
    logits = np.array([5.0, 4.0, 0.0], dtype=np.float32)
    sampler = Sampler(GenerationConfig(temperature=0, frequency_penalty=0.6), 3)
    # Token 0 scores 5, 4.4, 3.8 (< 4: token 1 wins), then 3.8 against token 1 at 3.4.
    assert [sampler.sample(logits) for _ in range(4)] == [0, 0, 1, 0]


def test_logit_bias_adds_and_minus_infinity_bans():
    logits = np.zeros(4, dtype=np.float32)
    sampler = Sampler(GenerationConfig(logit_bias={1: 2.5, 3: -math.inf}), 4)
    assert np.allclose(sampler.adjust_logits(logits)[:3], [0.0, 2.5, 0.0])
    assert sampler.adjust_logits(logits)[3] == -math.inf
    banned = Sampler(GenerationConfig(temperature=1.0, seed=0, logit_bias={4: -math.inf}), 5)
    assert 4 not in {banned.sample(HAND_LOGITS) for _ in range(200)}


def test_logit_bias_keys_from_json_are_token_ids():
    assert GenerationConfig(logit_bias={"17": 1.0}).logit_bias == {17: 1.0}


def test_bad_logits_are_clear_errors():
    nan = np.array([0.0, np.nan, 1.0], dtype=np.float32)
    with pytest.raises(GenerationError, match="NaN"):
        Sampler(GenerationConfig(temperature=1.0), 3).sample(nan)
    with pytest.raises(GenerationError, match="NaN"):
        Sampler(GenerationConfig(temperature=0), 3).sample(nan)
    banned = GenerationConfig(temperature=1.0, logit_bias={0: -math.inf, 1: -math.inf})
    with pytest.raises(GenerationError, match="every token is excluded"):
        Sampler(banned, 2).sample(np.zeros(2, dtype=np.float32))
    with pytest.raises(GenerationError, match="vocabulary has 3"):
        Sampler(GenerationConfig(), 3).sample(np.zeros(4, dtype=np.float32))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": math.nan}, "temperature must be finite"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2.0, 2.0\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2.0, 2.0\]"),
        ({"logit_bias": {5: 150.0}}, r"logit_bias\[5\] must be in \[-100.0, 100.0\]"),
        ({"logit_bias": {-1: 1.0}}, "non-negative integers"),
        ({"logit_bias": {1000: 1.0}}, "token id 1000 is outside the vocabulary"),
        ({"seed": -1}, "seed must be >= 0"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"stop": ["ok", ""]}, "stop strings must be non-empty"),
        ({"stop_token_ids": [2000]}, "token id 2000 is outside the vocabulary"),
        ({"temprature": 1.0}, "unknown generation parameter"),
    ],
)
def test_validation_errors_name_the_value(changes, message):
    with pytest.raises(GenerationError, match=message):
        GenerationConfig().replace(**changes).validate(vocab_size=1000)


def test_validation_happens_before_sampling():
    with pytest.raises(GenerationError, match="top_p"):
        Sampler(GenerationConfig(top_p=2.0), 10)


def test_no_silent_clamp():
    config = GenerationConfig(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=1)
    assert config.validate() is config
    assert (config.temperature, config.top_p, config.max_tokens) == (0.0, 1.0, 1)


def test_model_defaults_from_generation_config_json(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        '{"do_sample": true, "temperature": 0.6, "top_p": 0.9, "eos_token_id": 2}'
    )
    config = GenerationConfig.from_model_defaults(tmp_path, seed=5)
    assert (config.temperature, config.top_p, config.seed) == (0.6, 0.9, 5)
    (tmp_path / "generation_config.json").write_text('{"do_sample": false, "top_k": 20}')
    config = GenerationConfig.from_model_defaults(tmp_path)
    assert config.greedy and config.top_k == 20
    assert config.repetition_penalty == 1.1  # what the file leaves unset: Ollama's default
    missing = GenerationConfig.from_model_defaults(tmp_path / "missing")
    assert missing == GenerationConfig(**MODEL_DEFAULTS)
    assert (missing.temperature, missing.top_k, missing.top_p, missing.repetition_penalty,
            missing.repetition_window) == (0.8, 40, 0.9, 1.1, 64)


def test_repetition_penalty_looks_only_at_the_window():
    """With a window of 3, a token seen 4 tokens back is no longer penalized."""
    logits = np.full(10, 2.0, dtype=np.float32)
    config = GenerationConfig(temperature=0, repetition_penalty=2.0, repetition_window=3)
    sampler = Sampler(config, 10, prompt_ids=[1, 2, 3, 4])
    x = sampler.adjust_logits(logits)
    assert x[1] == 2.0 and x[2] == x[3] == x[4] == 1.0
    sampler.accept(5)
    x = sampler.adjust_logits(logits)
    assert x[2] == 2.0 and x[3] == x[4] == x[5] == 1.0
    whole = Sampler(GenerationConfig(temperature=0, repetition_penalty=2.0), 10, [1, 2, 3, 4])
    assert (whole.adjust_logits(logits)[1:5] == 1.0).all()  # 0 = the whole context
