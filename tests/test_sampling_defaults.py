"""Replies end by themselves under the default sampling parameters, on the model a new user gets
first: the real SmolLM2-135M-Instruct at q4f32_asym (which holds its Q4_1 GGUF's weights
exactly; here from the GGUF's float HF folder, whose generation_config sets no sampling). The
prompt ran for 6 minutes greedily on the re-quantized q4f32_1 ("I am a sea" until the window
filled); under the defaults it ends within tens of tokens."""

from __future__ import annotations

import pytest

from localchat import Engine, GenerationConfig
from localchat.engine.generation_config import MODEL_DEFAULTS

from fixtures import converted, smollm2_hf_dir

PROMPT = "Write a haiku about the sea."
CAP = 300  # tokens: far more than a haiku; a runaway reply hits it


@pytest.fixture(scope="module")
def engine():
    eng = Engine.open(converted(smollm2_hf_dir(), "q4f32_asym"), device="cpu")
    yield eng
    eng.close()


def test_the_engine_defaults_are_the_shared_ones(engine) -> None:
    """No sampling in the model's generation_config.json: Ollama's defaults, as every front end
    shows them."""
    assert engine.config == GenerationConfig(**MODEL_DEFAULTS)


def test_the_prompt_runs_away_greedily_on_the_degraded_mode() -> None:
    """The checks below can fail: greedy and without a repetition penalty, the q4f32_1 model the
    offline pull used to make loops until the cap."""
    eng = Engine.open(converted(smollm2_hf_dir(), "q4f32_1"), device="cpu")
    try:
        reply = eng.conversation().send(
            PROMPT, temperature=0, repetition_penalty=1.0, max_tokens=CAP).result()
    finally:
        eng.close()
    assert reply.finish_reason == "length", reply.text


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_a_repetition_prone_prompt_ends_by_itself_under_the_defaults(engine, seed: int) -> None:
    reply = engine.conversation().send(PROMPT, seed=seed, max_tokens=CAP).result()
    assert reply.finish_reason == "stop", reply.text
    assert reply.text.strip()


def test_greedy_with_the_default_penalty_ends_too(engine) -> None:
    reply = engine.conversation().send(PROMPT, temperature=0, max_tokens=CAP).result()
    assert reply.finish_reason == "stop", reply.text
