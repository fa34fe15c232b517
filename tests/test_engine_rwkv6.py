"""The compiled RWKV-6 ("Finch") engine against the `rwkv` package's generic `RWKV` (its v6 path,
cpu fp32) on the same BlinkDL `.pth` (tiny random checkpoints, bfloat16 as published), its
recurrent state under the runtime's sequence operations, `.pth` version detection,
`localchat convert FILE.pth` and `localchat debug` against the `.pth`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from localchat.cli import main
from localchat.engine.models import rwkv7_pth
from localchat.engine.models.rwkv4_pth import prepare_pth_source
from localchat.engine.models.rwkv6 import Rwkv6Config, state_bytes
from localchat.engine.runtime import Model
from localchat.errors import UnsupportedModelError

from fixtures import converted, pth_folder, rwkv_package_dir
from model_oracle import (
    batched_and_alone,
    cuda_sources,
    rel_err,
    run_greedy,
    run_teacher_forced,
)
from rwkv6_variants import BASE, build_variant, reference_greedy

PROMPT = [int(t) for t in np.random.RandomState(6).randint(0, BASE["vocab_size"], 24)]
STEPS = 24
ENGLISH = "The quick brown fox jumps over the lazy dog, and then it"
MIXED = "Hello 世界! Привет, мир. こんにちは 🌍 — café"


def source_folder(variant: str) -> Path:
    """The converter folder of a variant's `.pth`, in the test cache."""
    return pth_folder(build_variant(variant) / "model.pth")


@pytest.fixture(scope="module")
def pth() -> Path:
    return build_variant("rwkv6-world") / "model.pth"


@pytest.fixture(scope="module")
def reference(pth: Path) -> tuple[list[int], np.ndarray]:
    return reference_greedy(pth, PROMPT, STEPS)


@pytest.fixture(scope="module")
def q0f32_dir() -> Path:
    return converted(source_folder("rwkv6-world"), "q0f32")


@pytest.fixture(scope="module")
def model(q0f32_dir: Path) -> Model:
    return Model(q0f32_dir, "cpu", prefill_chunk_size=16)


def test_the_checkpoint_is_read_as_rwkv6(pth: Path) -> None:
    cfg = json.loads((source_folder("rwkv6-world") / "config.json").read_text())
    assert cfg["architectures"] == ["Rwkv6ForCausalLM"]
    parsed = Rwkv6Config.from_hf(cfg)
    assert (parsed.hidden_size, parsed.num_heads, parsed.head_size) == (96, 3, 32)
    assert (parsed.mix_low_rank_dim, parsed.decay_low_rank_dim) == (16, 24)
    assert parsed.intermediate_size == 344 and parsed.vocab_size == 65536
    weights = torch.load(pth)
    assert rwkv7_pth.checkpoint_version(list(weights)) == 6
    assert weights["emb.weight"].dtype == torch.bfloat16  # as BlinkDL publishes


def test_q0f32_greedy_equals_the_rwkv_package(model: Model, reference) -> None:
    ref_tokens, ref_logits = reference
    ours = run_teacher_forced(model, PROMPT, ref_tokens)
    worst = max(rel_err(o, r) for o, r in zip(ours, ref_logits))
    assert worst <= 1e-5, f"max relative error {worst:.2e}"
    assert run_greedy(model, PROMPT, STEPS) == ref_tokens
    assert len(set(ref_tokens)) > STEPS // 2  # the oracle does not just repeat itself


# (tensor, value): each switches one term of the time-mix or channel-mix off
ABLATIONS = {
    "mix LoRA": ("blocks.1.att.time_maa_w1", 0.0),
    "decay LoRA": ("blocks.0.att.time_decay_w1", 0.0),
    "bonus u": ("blocks.1.att.time_faaaa", 0.0),
    "channel-mix receptance shift": ("blocks.0.ffn.time_maa_r", 0.0),
}


@pytest.mark.parametrize("term", list(ABLATIONS))
def test_every_term_matters(term: str, pth: Path, reference, model: Model,
                            tmp_path: Path) -> None:
    """The random values are in a range where each term moves the logits far past the
    tolerance the reference comparison uses: the match above could not hold without it."""
    name, value = ABLATIONS[term]
    weights = torch.load(pth)
    weights[name] = torch.full_like(weights[name], value)
    torch.save(weights, tmp_path / "ablated.pth")
    folder = prepare_pth_source(tmp_path / "ablated.pth", tmp_path / "src")
    from localchat.engine.build.convert import convert_model

    ablated = Model(convert_model(folder, tmp_path / "model", "q0f32"), "cpu")  # same library
    seq = ablated.new_sequence()
    logits = ablated.prefill(seq, PROMPT)
    assert rel_err(logits, reference[1][0]) > 1e-2, term


def test_q4f32_top1_agreement(reference) -> None:
    ref_tokens, ref_logits = reference
    model = Model(converted(source_folder("rwkv6-world"), "q4f32_1"), "cpu")
    ours = run_teacher_forced(model, PROMPT, ref_tokens)
    agree = np.mean([int(o.argmax() == r.argmax()) for o, r in zip(ours, ref_logits)])
    assert agree >= 0.9, f"top-1 agreement {agree:.0%}"
    worst = max(rel_err(o, r) for o, r in zip(ours, ref_logits))
    assert worst > 1e-4  # it is the 4-bit model


def test_chunked_prefill_equals_token_by_token(model: Model) -> None:
    prompt = PROMPT + PROMPT[:16]  # 40 tokens: 3 chunks of 16
    seq = model.new_sequence()
    chunked = model.prefill(seq, prompt)
    after_chunked = model.decode([seq], [5])[0]
    model.remove(seq)
    seq = model.new_sequence()
    step = model.prefill(seq, prompt[:1])
    for tok in prompt[1:]:
        step = model.decode([seq], [tok])[0]
    after_step = model.decode([seq], [5])[0]
    model.remove(seq)
    assert rel_err(chunked, step) <= 1e-5
    assert rel_err(after_chunked, after_step) <= 1e-5


def test_batch_equals_each_alone(model: Model) -> None:
    for got, want in batched_and_alone(model, [PROMPT[:9], PROMPT[4:], PROMPT[2:3]]):
        assert max(rel_err(g, w) for g, w in zip(got, want)) <= 1e-5


def test_fork_continues_independently(model: Model) -> None:
    parent = model.new_sequence()
    model.prefill(parent, PROMPT[:12])
    child = model.fork(parent)
    from_parent = model.decode([parent], [PROMPT[12]])[0]
    from_child = model.decode([child], [PROMPT[13]])[0]
    for s in (parent, child):
        model.remove(s)
    for tokens, got in ((PROMPT[:13], from_parent), (PROMPT[:12] + [PROMPT[13]], from_child)):
        seq = model.new_sequence()
        want = model.prefill(seq, tokens)
        model.remove(seq)
        assert rel_err(got, want) <= 1e-5


def test_state_size_is_reported(model: Model) -> None:
    cfg = model.config
    heads = cfg.hidden_size // cfg.head_size
    per_seq = cfg.num_hidden_layers * (2 * cfg.hidden_size + heads * cfg.head_size ** 2) * 4
    assert model.kv_cache_bytes() == per_seq * model.max_batch_size == state_bytes(
        cfg, model.max_batch_size)


def test_debug_against_the_pth_has_no_divergent_layer(q0f32_dir: Path, pth: Path,
                                                       monkeypatch) -> None:
    from localchat.engine.debug import debug_model

    monkeypatch.syspath_prepend(str(rwkv_package_dir()))  # the `rwkv` package's reference
    report = debug_model(q0f32_dir, pth, token_ids=PROMPT[:19])
    assert report.first_divergent_layer is None and report.top1_agreement == 1.0
    assert report.logits.rel_err < 1e-5
    assert [row.layer for row in report.layers] == [0, 1]
    for row in report.layers:  # no block outputs from that reference: each layer's state
        assert row.rel_err is None and row.state_rel_err < 1e-5
    # a process that switched the `rwkv` package to RWKV-7 (RWKV_V7_ON=1) still gets its
    # generic class for this file, and keeps its switch
    monkeypatch.setenv("RWKV_V7_ON", "1")
    again = debug_model(q0f32_dir, pth, token_ids=PROMPT[:7])
    assert again.first_divergent_layer is None and again.logits.rel_err < 1e-5
    assert os.environ["RWKV_V7_ON"] == "1"


def test_rwkv5_is_still_refused_naming_what_runs(tmp_path: Path, capsys) -> None:
    names = ["emb.weight", "blocks.0.att.time_faaaa", "blocks.0.att.ln_x.weight"]
    pth = tmp_path / "eagle.pth"
    torch.save({n: torch.zeros(2, 2, dtype=torch.bfloat16) for n in names}, pth)
    with pytest.raises(UnsupportedModelError, match="RWKV-5 checkpoint.*RWKV-6"):
        prepare_pth_source(pth, tmp_path / "out")
    assert main(["convert", str(pth), "-o", str(tmp_path / "model"), "--no-compile"]) != 0
    err = capsys.readouterr().err
    assert "RWKV-5" in err and "Traceback" not in err


def test_convert_a_world_pth_and_chat_tokens_equal_the_reference(tmp_path: Path,
                                                                 monkeypatch) -> None:
    """`localchat convert FILE.pth` with no vocabulary beside the file: the World tokenizer
    comes from elsewhere (here the `rwkv` package), the World template is recorded, and the
    greedy continuation of an English and a mixed-script prompt equals the reference's."""
    monkeypatch.syspath_prepend(str(rwkv_package_dir()))
    from localchat.engine.tokenizer import load_tokenizer

    pth = build_variant("rwkv6-world") / "model.pth"  # compiled as the shared model is
    assert not (pth.parent / "rwkv_vocab_v20230424.txt").exists()
    out = tmp_path / "model"
    assert main(["convert", str(pth), "-o", str(out), "--quant", "q0f32", "--no-compile"]) == 0
    meta = json.loads((out / "localchat-config.json").read_text())
    assert meta["architecture"] == "rwkv6" and meta["template"] == "rwkv_world"
    assert (out / "rwkv_vocab_v20230424.txt").is_file()
    model = Model(out, "cpu")  # compiled once into the library cache
    tok = load_tokenizer(out)
    for text in (ENGLISH, MIXED):
        ids = tok.encode(text)
        assert len(ids) > 5
        ref_tokens, _ = reference_greedy(pth, ids, STEPS)
        assert run_greedy(model, ids, STEPS) == ref_tokens


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_kernels_build() -> None:
    """The GPU variant of the scan (one block per head, a thread per state column) and the
    model around it build for CUDA (compile.py's GPU pipeline)."""
    sources = cuda_sources(source_folder("rwkv6-world"))
    assert sources and "wkv6_scan" in sources[0] and "__syncthreads" in sources[0]


def test_rwkv6_recipes_name_their_one_pth_and_its_date() -> None:
    """rwkv6-world-1.6b/3b/7b: one BlinkDL/rwkv-6-world `.pth` each, dated as its name says, of
    an architecture the registry runs (`rwkv-world-3b` stays the RWKV-4 repo)."""
    import re
    from datetime import datetime

    from localchat.engine.models import REGISTRY
    from localchat.recipes import all_recipes, catalogue

    recipes = all_recipes()
    names = sorted(n for n in recipes if n.startswith("rwkv6-"))
    assert names == ["rwkv6-world-1.6b", "rwkv6-world-3b", "rwkv6-world-7b"]
    tags = {"1.6b": "1B6", "3b": "3B", "7b": "7B"}
    for name in names:
        recipe = recipes[name]
        assert recipe.repo == "BlinkDL/rwkv-6-world" and recipe.template == "rwkv_world"
        assert recipe.file.startswith(f"RWKV-x060-World-{tags[name.rsplit('-', 1)[1]]}-v2.1-")
        stamp = re.search(r"-(\d{8})-ctx4096\.pth$", recipe.file)
        assert stamp and recipe.released == datetime.strptime(stamp.group(1), "%Y%m%d").date()
        assert any(recipe.architecture in e.model_types and e.name == "rwkv6" for e in REGISTRY)
    assert recipes["rwkv-world-3b"].repo == "RWKV/rwkv-4-world-3b"
    # the catalogue shows the newer lines first: RWKV-7, then RWKV-6, then RWKV-4
    order = [r.name for r in catalogue()]
    assert (order.index("rwkv7-world-2.9b") < order.index("rwkv6-world-7b")
            < order.index("rwkv6-world-1.6b") < order.index("rwkv-world-3b"))
