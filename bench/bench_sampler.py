"""Time per sampling call on 49 152 and 65 536 vocabularies, against a SmolLM2 decode step.

    python bench/bench_sampler.py [--calls 500] [--step-ms 15] [--real]

Logits: "model-like" are normal with std 4 (the spread of SmolLM2-135M-Instruct's logits, whose
max sits ~5 std above the mean), "flat" are normal with std 0.5 (the worst case for top-p: the
nucleus holds most of the vocabulary). `--real` adds rows with SmolLM2's own logits from a short
greedy generation (needs transformers and the test fixture model). The sampler keeps its token
history across calls, with a 500-token prompt, so penalties touch a realistic number of ids.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

from localchat.engine.generation_config import GenerationConfig
from localchat.engine.sampler import Sampler

CASES = {
    "greedy": GenerationConfig(temperature=0.0),
    "temperature + top_p": GenerationConfig(temperature=0.7, top_p=0.95, seed=0),
    "top_k": GenerationConfig(temperature=0.8, top_k=40, seed=0),
    "all penalties": GenerationConfig(
        temperature=0.8,
        top_k=40,
        top_p=0.95,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={11: -5.0, 42: 2.0},
        seed=0,
    ),
}


def synthetic_logits(vocab: int, std: float, rows: int, seed: int = 0) -> np.ndarray:
    """`rows` logits vectors, normal with the given spread."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, vocab)) * std).astype(np.float32)


def smollm2_logits(steps: int = 32) -> np.ndarray:
    """SmolLM2-135M-Instruct's logits over a short greedy reply (49 152 entries each)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import fixtures

    folder = fixtures.smollm2_hf_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return torch.stack(out.logits)[:, 0].float().numpy()


def time_case(config: GenerationConfig, logits: np.ndarray, calls: int) -> tuple[float, float]:
    """Mean and 99th-percentile milliseconds per `Sampler.sample` call."""
    vocab = logits.shape[1]
    prompt = np.random.default_rng(1).integers(0, vocab, 500)
    sampler = Sampler(config, vocab, prompt_ids=prompt)
    for row in logits[:8]:  # warm-up
        sampler.sample(row)
    times = []
    for i in range(calls):
        row = logits[i % logits.shape[0]]
        start = time.perf_counter()
        sampler.sample(row)
        times.append(time.perf_counter() - start)
    times.sort()
    return statistics.fmean(times) * 1e3, times[int(0.99 * (len(times) - 1))] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="timed calls per row")
    parser.add_argument("--step-ms", type=float, default=15.0, help="decode step to compare with")
    parser.add_argument("--real", action="store_true", help="add rows with SmolLM2's logits")
    args = parser.parse_args()

    inputs: list[tuple[str, np.ndarray]] = []
    for vocab in (49152, 65536):
        inputs.append((f"{vocab} model-like", synthetic_logits(vocab, 4.0, 64)))
        inputs.append((f"{vocab} flat", synthetic_logits(vocab, 0.5, 64)))
    if args.real:
        inputs.insert(0, ("49152 SmolLM2 real", smollm2_logits()))

    print(f"numpy {np.__version__}, {platform.machine()}, {args.calls} calls per row")
    header = f"| {'logits':<20} | {'case':<20} | {'mean ms':>8} | {'p99 ms':>7} | {'share':>6} |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for label, logits in inputs:
        for case, config in CASES.items():
            mean, p99 = time_case(config, logits, args.calls)
            share = 100.0 * mean / args.step_ms
            print(f"| {label:<20} | {case:<20} | {mean:8.3f} | {p99:7.3f} | {share:5.1f}% |")
    print(f"share = mean time / a {args.step_ms:g} ms SmolLM2 decode step (target: under 15%)")


if __name__ == "__main__":
    main()
