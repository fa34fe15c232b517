"""The compiled RWKV-4 engine against transformers and the `rwkv` package on the same weights,
and its recurrent state under the runtime's sequence operations."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from localchat.engine.models.rwkv4 import state_bytes
from localchat.engine.runtime import Model

from fixtures import converted as _converted
from fixtures import pth_folder, rwkv_package_dir
from model_oracle import (
    batched_and_alone,
    cuda_sources,
    rel_err,
    run_greedy,
    run_teacher_forced,
)
from rwkv_variants import BASE, build_variant

PROMPT = [int(t) for t in np.random.RandomState(7).randint(0, BASE["vocab_size"], 24)]
STEPS = 20


def converted(src: Path, quant: str) -> Path:
    """fixtures.converted, with compiled libraries dropped when the sources of RWKV-4's build
    changed (the library key covers them, so stale libraries would only pile up in the cache)."""
    import hashlib

    from localchat.engine.build.compile import build_sources

    out = _converted(src, quant)
    h = hashlib.sha256()
    for path in build_sources("rwkv4"):
        h.update(path.read_bytes())
    marker = out / f".kernels-{h.hexdigest()[:12]}"
    if not marker.exists():
        shutil.rmtree(out / "lib", ignore_errors=True)
        marker.touch()
    return out



def hf_greedy(src: Path, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """transformers' greedy continuation (state carried between calls, as in generation) and
    the logits before each generated token."""
    from transformers import RwkvForCausalLM

    hf = RwkvForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        logits = [out.logits[0, -1].numpy()]
        tokens = [int(logits[-1].argmax())]
        for _ in range(steps - 1):
            out = hf(torch.tensor([[tokens[-1]]]), state=out.state, use_cache=True)
            logits.append(out.logits[0, -1].numpy())
            tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def blink_greedy(pth: Path, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """The same from the `rwkv` package's reference model on the BlinkDL .pth (cpu fp32)."""
    os.environ["RWKV_JIT_ON"] = "0"
    os.environ["RWKV_CUDA_ON"] = "0"
    sys.path.insert(0, str(rwkv_package_dir()))
    try:
        from rwkv.model import RWKV
    finally:
        sys.path.remove(str(rwkv_package_dir()))
    ref = RWKV(model=str(pth), strategy="cpu fp32", verbose=False)
    with torch.no_grad():
        out, state = ref.forward(prompt, None)
        logits = [out.numpy().copy()]
        tokens = [int(logits[-1].argmax())]
        for _ in range(steps - 1):
            out, state = ref.forward([tokens[-1]], state)
            logits.append(out.numpy().copy())
            tokens.append(int(logits[-1].argmax()))
    return tokens, logits



@pytest.fixture(scope="module")
def q0f32_dir() -> Path:
    return converted(build_variant("rwkv4"), "q0f32")


@pytest.fixture(scope="module")
def model(q0f32_dir: Path) -> Model:
    return Model(q0f32_dir, "cpu", prefill_chunk_size=16)


@pytest.mark.parametrize("variant", ["rwkv4", "rwkv4-rescale"])
def test_q0f32_matches_transformers(variant: str, model: Model) -> None:
    src = build_variant(variant)
    ref_tokens, ref_logits = hf_greedy(src, PROMPT, STEPS)
    ours_model = model if variant == "rwkv4" else Model(converted(src, "q0f32"), "cpu")
    ours = run_teacher_forced(ours_model, PROMPT, ref_tokens)
    worst = max(rel_err(o, r) for o, r in zip(ours, ref_logits))
    assert worst <= 1e-4, f"max relative error {worst:.2e}"
    assert run_greedy(ours_model, PROMPT, STEPS) == ref_tokens
    assert len(set(ref_tokens)) > STEPS // 2  # the oracle does not just repeat itself


def test_rescale_is_applied_at_load_and_run_time() -> None:
    """The rescaled model's weights are divided per layer (so the run-time halving must be
    there for the logits above to match)."""
    from localchat.engine.build.convert import read_hf_config
    from localchat.engine.build.weights import open_weights
    from localchat.engine.models.rwkv4 import Rwkv4Config
    from localchat.engine.models.rwkv4_weights import hf_params

    src = build_variant("rwkv4-rescale")
    cfg = Rwkv4Config.from_hf(read_hf_config(src))
    assert cfg.rescale_every == 2 and cfg.num_hidden_layers == 4
    with open_weights(src) as w:
        ours = dict(hf_params(cfg, w.get, w.names))
        raw = w.get("rwkv.blocks.3.attention.output.weight")
    np.testing.assert_array_equal(ours["blocks.3.att.output.weight"] * 2, raw)


def test_q4f32_top1_agreement() -> None:
    src = build_variant("rwkv4")
    ref_tokens, ref_logits = hf_greedy(src, PROMPT, STEPS)
    model = Model(converted(src, "q4f32_1"), "cpu")
    ours = run_teacher_forced(model, PROMPT, ref_tokens)
    agree = np.mean([int(o.argmax() == r.argmax()) for o, r in zip(ours, ref_logits)])
    assert agree >= 0.9, f"top-1 agreement {agree:.0%}"


def test_q0f16_close_to_transformers() -> None:
    """float16 weights and activations; the WKV state and time_decay/time_first stay float32."""
    src = build_variant("rwkv4")
    ref_tokens, ref_logits = hf_greedy(src, PROMPT, STEPS)
    model = Model(converted(src, "q0f16"), "cpu")
    ours = run_teacher_forced(model, PROMPT, ref_tokens)
    worst = max(rel_err(o, r) for o, r in zip(ours, ref_logits))
    assert worst <= 5e-3, f"max relative error {worst:.2e}"
    assert [int(o.argmax()) for o in ours] == ref_tokens


def test_blinkdl_pth_matches_rwkv_package(q0f32_dir: Path) -> None:
    src = build_variant("rwkv4")
    pth = src / "blink" / "model.pth"
    ref_tokens, ref_logits = blink_greedy(pth, PROMPT, STEPS)
    folder = pth_folder(pth, "pth", rescale_every=0)
    out = converted(folder, "q0f32")
    # Same config as the HF-converted model, so the same compiled library serves it.
    if (q0f32_dir / "lib").is_dir():
        shutil.copytree(q0f32_dir / "lib", out / "lib", dirs_exist_ok=True)
    model = Model(out, "cpu")
    ours = run_teacher_forced(model, PROMPT, ref_tokens)
    worst = max(rel_err(o, r) for o, r in zip(ours, ref_logits))
    assert worst <= 1e-4, f"max relative error {worst:.2e}"
    assert run_greedy(model, PROMPT, STEPS) == ref_tokens


def test_prefill_in_parts_equals_prefill_of_all(model: Model) -> None:
    a, b = PROMPT[:11], PROMPT[11:]
    seq = model.new_sequence()
    model.prefill(seq, a)
    parts = model.prefill(seq, b)
    after_parts = model.decode([seq], [5])[0]
    model.remove(seq)
    whole_model = Model(model.model_dir, "cpu", prefill_chunk_size=64)  # one chunk
    seq = whole_model.new_sequence()
    whole = whole_model.prefill(seq, a + b)
    after_whole = whole_model.decode([seq], [5])[0]
    assert rel_err(parts, whole) <= 1e-5
    assert rel_err(after_parts, after_whole) <= 1e-5


def test_chunked_prefill_equals_token_by_token(model: Model) -> None:
    prompt = PROMPT + PROMPT[:16]  # 40 tokens: 3 chunks of 16
    seq = model.new_sequence()
    chunked = model.prefill(seq, prompt)
    model.remove(seq)
    seq = model.new_sequence()
    step = model.prefill(seq, prompt[:1])
    for tok in prompt[1:]:
        step = model.decode([seq], [tok])[0]
    model.remove(seq)
    assert rel_err(chunked, step) <= 1e-5


def test_batch_equals_each_alone(model: Model) -> None:
    for got, want in batched_and_alone(model, [PROMPT[:9], PROMPT[4:]]):
        assert max(rel_err(g, w) for g, w in zip(got, want)) <= 1e-5


def test_batch_in_other_order_and_three_sequences(model: Model) -> None:
    """Sequence slots are not batch positions: a batch in any order and size gives each
    sequence its own continuation."""
    prompts = [PROMPT[:5], PROMPT[5:12], PROMPT[12:]]
    seqs = [model.new_sequence() for _ in prompts]
    for s, p in zip(seqs, prompts):
        model.prefill(s, p)
    logits = model.decode([seqs[2], seqs[0], seqs[1]], [1, 2, 3])
    for s in seqs:
        model.remove(s)
    for row, prompt, tok in zip(logits, [prompts[2], prompts[0], prompts[1]], [1, 2, 3]):
        seq = model.new_sequence()
        alone = model.prefill(seq, prompt + [tok])
        model.remove(seq)
        assert rel_err(row, alone) <= 1e-5


def test_fork_continues_independently(model: Model) -> None:
    parent = model.new_sequence()
    model.prefill(parent, PROMPT[:12])
    child = model.fork(parent)
    from_parent = model.decode([parent], [PROMPT[12]])[0]
    from_child = model.decode([child], [PROMPT[13]])[0]
    both = model.decode([parent, child], [7, 8])
    for s in (parent, child):
        model.remove(s)
    expect = {}
    for name, tokens in (("parent", PROMPT[:13] + [7]), ("child", PROMPT[:12] + [PROMPT[13], 8])):
        seq = model.new_sequence()
        expect[name + "1"] = model.prefill(seq, tokens[:-1])
        expect[name + "2"] = model.prefill(seq, tokens[-1:])
        model.remove(seq)
    assert rel_err(from_parent, expect["parent1"]) <= 1e-5
    assert rel_err(from_child, expect["child1"]) <= 1e-5
    assert rel_err(both[0], expect["parent2"]) <= 1e-5
    assert rel_err(both[1], expect["child2"]) <= 1e-5


def test_reset_forgets_the_state(model: Model) -> None:
    seq = model.new_sequence()
    fresh = model.prefill(seq, PROMPT[:6])
    model.prefill(seq, PROMPT[6:])
    model.reset(seq)
    again = model.prefill(seq, PROMPT[:6])
    model.remove(seq)
    assert rel_err(again, fresh) <= 1e-6


def test_state_size_is_reported(model: Model) -> None:
    cfg = model.config
    per_seq = cfg.num_hidden_layers * (2 * cfg.hidden_size + 3 * cfg.attention_hidden_size) * 4
    assert (
        model.kv_cache_bytes()
        == per_seq * model.max_batch_size
        == state_bytes(cfg, model.max_batch_size)
    )


def test_localchat_run_on_an_rwkv_model_dir() -> None:
    """`localchat run` chats with a converted RWKV folder with no --template: the checkpoint has
    no chat template, so conversion records the architecture's (rwkv_world)."""
    out = converted(build_variant("rwkv4-world"), "q4f32_1")
    assert (out / "rwkv_vocab_v20230424.txt").exists()
    assert json.loads((out / "localchat-config.json").read_text())["template"] == "rwkv_world"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "localchat.cli",
            "run",
            str(out),
            "Hello, RWKV!",
            "--json",
            "--max-tokens",
            "8",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["prompt_tokens"] > 0
    assert 1 <= len(result["token_ids"]) <= 8
    assert isinstance(result["text"], str)


WORLD_TURNS = ["Hello there!", "What is a recurrent network?", "Thanks."]
WORDS = " the a cat dog sat on mat red blue sky tree ran fast slow big small one two".split()


def word_bias(engine) -> dict[int, float]:
    """A random model's reply drawn from space-led words (each one World token, the choice still
    the model's): text that renders back unchanged in the next turn, as a real model's does."""
    ids = [engine.tokenizer.encode(" " + w) for w in WORDS]
    assert all(len(i) == 1 for i in ids)
    return {i[0]: 60.0 for i in ids}


@pytest.fixture(scope="module")
def world_engine():
    from localchat.engine.engine import Engine
    from localchat.engine.generation_config import GenerationConfig

    model = Model(converted(build_variant("rwkv4-world"), "q0f32"), "cpu")
    with Engine(model, config=GenerationConfig(temperature=0.0)) as engine:
        yield engine


def test_multi_turn_feeds_only_the_new_turn(world_engine) -> None:
    """The recurrent state carries the conversation: each new turn prefills only its own
    tokens (rwkv_world template, World tokenizer)."""
    assert world_engine.template.name == "rwkv_world"
    assert world_engine.tokenizer._pattern is not None  # warmed up at load, not at the 1st reply
    with world_engine.conversation() as chat:
        stats = []
        for turn in WORLD_TURNS:
            history = chat.messages
            reply = chat.send(turn, max_tokens=6, logit_bias=word_bias(world_engine)).result()
            full = world_engine.count_tokens([*history, {"role": "user", "content": turn}])
            stats.append((reply.stats, full))
    assert stats[0][0].reused_tokens == 0
    for (prev, _), (s, full) in zip(stats, stats[1:], strict=False):
        assert s.reused_tokens == prev.context_tokens
        assert s.reused_tokens + s.prompt_tokens == full
        assert s.prompt_tokens < full
    # (That a carried state equals a fresh prefill is shown at the model level above; these
    # random models' replies hardly depend on earlier turns, so a reply comparison could not
    # tell the two apart.)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_kernels_build() -> None:
    """The GPU variants of the scan and RNN-state kernels (one thread per channel / element)
    build for CUDA through compile.py's GPU pipeline."""
    sources = cuda_sources(build_variant("rwkv4"))
    assert sources and "wkv_scan" in sources[0]


@pytest.mark.parametrize(
    "k,n,m", [(128, 64, 1), (2560, 48, 1), (2560, 40, 3), (8192, 24, 1), (8192, 16, 2)]
)
def test_gemv_kernels_match_numpy(k: int, n: int, m: int) -> None:
    """The decode kernels (4-bit: generic and AVX-512, short and long rows; float) against
    numpy on the dequantized weights."""
    import tvm

    from localchat.engine.build.quantization import dequantize_q4, quantize_q4
    from localchat.engine.device import cpu_target
    from localchat.engine.kernels import gemv
    from localchat.engine.kernels.common import has_avx512 as _has_avx512

    rng = np.random.default_rng(k + n + m)
    w = rng.standard_normal((n, k), dtype=np.float32) * 0.05
    words, scale = quantize_q4(w, "float32")
    x = rng.standard_normal((m, k), dtype=np.float32)
    target, dev = cpu_target(), tvm.cpu()

    def run(func, *args) -> np.ndarray:
        f = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
        y = tvm.runtime.tensor(np.zeros((m, n), np.float32), dev)
        f["main"](*[tvm.runtime.tensor(a, dev) for a in (x, *args)], y)
        return y.numpy()

    ref = x.astype(np.float64) @ dequantize_q4(words, scale).T.astype(np.float64)
    variants = [False] + ([True] if _has_avx512(target) else [])
    for avx512 in variants:
        got = run(gemv.gemv_q4(k, n, "float32", avx512), words, scale)
        assert rel_err(got, ref) <= 1e-5, f"q4 avx512={avx512}"
    got = run(gemv.gemv_f(k, n, "float32"), w)
    assert rel_err(got, x.astype(np.float64) @ w.T.astype(np.float64)) <= 1e-5
