"""Phi-3.5 / Phi-4-mini LongRoPE past the original context: a tiny random Phi-3 whose
`original_max_position_embeddings` (16) is shorter than the test's prompt, converted with a
context window beyond it, runs the long factors and the attention factor and gives
transformers' greedy tokens (transformers switches to the long factors for such a sequence)."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

from fixtures import _engine_digest, cache_dir, one_builder_at_a_time
from model_oracle import rel_err, run_greedy, run_teacher_forced

ORIGINAL = 16
WINDOW = 64  # the served context: past ORIGINAL, so the long factors are compiled in
CONFIG = {
    "vocab_size": 503,
    "hidden_size": 96,
    "intermediate_size": 344,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 512,  # 32 x the original: attention factor 1.5
    "original_max_position_embeddings": ORIGINAL,
    "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.05 * i for i in range(18)],
        "long_factor": [1.5 + 2.0 * i for i in range(18)],
    },
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PROMPT = [int(t) for t in np.random.RandomState(5).randint(3, 500, 22)]  # > ORIGINAL
STEPS = 8


@cache
@one_builder_at_a_time
def source() -> Path:
    """The saved random Phi-3 (seeded; rebuilt only when transformers or the config change)."""
    import transformers

    digest = hashlib.sha256(json.dumps([CONFIG, transformers.__version__], sort_keys=True)
                            .encode()).hexdigest()[:10]
    out = cache_dir() / "variants" / f"phi3-longrope-{digest}"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(99)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**CONFIG)).eval()
    with torch.no_grad():  # a head aligned with the embeddings: peaked, trained-like logits
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".phi3-longrope-"))
    model.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


@cache
@one_builder_at_a_time
def ours():
    """Our q0f32 build of it, converted for a WINDOW-token context."""
    from localchat.engine.build.convert import convert_model
    from localchat.engine.runtime import Model

    out = cache_dir() / "converted" / f"{source().name}-q0f32-w{WINDOW}-{_engine_digest()}"
    if not (out / "localchat-config.json").exists():
        convert_model(source(), out, "q0f32", context_window_size=WINDOW)
    return Model(out, "cpu")


def _reference(short_only: bool = False) -> tuple[list[int], list[np.ndarray]]:
    """transformers' greedy continuation of PROMPT and its logits; `short_only` pins the short
    factors (what a model capped at the original context would compute)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(source(), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    if short_only:
        rotary = hf.model.rotary_emb
        rotary.long_inv_freq = rotary.original_inv_freq.clone()
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=STEPS, min_new_tokens=STEPS,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(PROMPT):].tolist(), [lg[0].numpy() for lg in out.logits]


def test_window_chooses_the_factors() -> None:
    """Within the original context the short factors, past it the long ones; the attention
    factor from max / original either way; the stored config says which."""
    from localchat.engine.models import phi3

    hf = {**json.loads((source() / "config.json").read_text())}
    cfg = phi3.config_from_hf(hf)
    assert cfg.context_window_size == ORIGINAL
    assert cfg.rope_ext_factors == CONFIG["rope_parameters"]["short_factor"]
    assert cfg.rope_attention_factor == pytest.approx(1.5)
    cfg.context_window_size = WINDOW  # as convert sets a requested window
    stored = cfg.to_dict()
    assert stored["rope_ext_factors"] == CONFIG["rope_parameters"]["long_factor"]
    assert phi3.Phi3Config.from_dict(stored).for_window().rope_ext_factors == \
        CONFIG["rope_parameters"]["long_factor"]
    with pytest.raises(Exception, match="long_factor"):
        phi3.config_from_hf({**hf, "rope_parameters": {
            **CONFIG["rope_parameters"], "long_factor": [1.0] * 5}})


def test_long_factors_match_transformers_past_the_original_context() -> None:
    ref_tokens, ref_logits = _reference()
    _, short_logits = _reference(short_only=True)
    # the long factors matter here: the short ones move the logits far past the tolerance
    assert rel_err(short_logits[0], ref_logits[0]) > 20 * 1e-4
    model = ours()
    assert model.context_window_size == WINDOW
    got = run_teacher_forced(model, PROMPT, ref_tokens)
    worst = max(rel_err(o, r) for o, r in zip(got, ref_logits))
    assert worst <= 1e-4, f"max relative error {worst:.2e}"
    assert run_greedy(model, PROMPT, STEPS) == ref_tokens
