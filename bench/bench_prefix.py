"""Benchmark: the prefix cache on SmolLM2-135M-Instruct (q4f32_1 by default) on this CPU.

Two stateless chat requests share a system prompt of about 1,000 tokens and differ in the user
message. Prints the time to first token of the first request (nothing cached) and of the second
(the system prompt cached), with the cache on and off, the tokens each prefilled, and whether
the greedy replies are the same either way. Target: second <= 15% of first with the cache on.
Each round starts from a system prompt no earlier round used, so its first request misses;
the engine with the cache off sees the same prompts.

    python bench/bench_prefix.py [--rounds 3] [--quant q4f32_1] [--prefix-tokens 1000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

RULE = (
    "Rule {i}: when a question touches on topic number {i}, answer it briefly, politely and "
    "accurately, and say so when you are not sure."
)
QUESTIONS = ("What is the capital of France?", "Name three colours of the rainbow.")


def system_prompt(tokenizer, round_no: int, tokens: int) -> str:
    """A system prompt of about `tokens` tokens that no other round's shares a prefix with."""
    text = f"Session {round_no}. You are a careful assistant."
    i = 0
    while len(tokenizer.encode(text)) < tokens:
        text += " " + RULE.format(i=i)
        i += 1
    return text


def run(model, cached: bool, rounds: int, prefix_tokens: int) -> dict:
    from localchat import Engine, GenerationConfig

    cfg = GenerationConfig(temperature=0.0, max_tokens=8)
    rows: dict[str, list] = {"first": [], "second": [], "prefilled": [], "replies": []}
    with Engine(model, config=cfg, prefix_cache=cached) as engine:
        engine.chat([{"role": "user", "content": "Hi"}]).result()  # warm up
        for r in range(rounds):
            system = system_prompt(engine.tokenizer, r, prefix_tokens)
            replies = [
                engine.chat(
                    [{"role": "system", "content": system}, {"role": "user", "content": q}]
                ).result()
                for q in QUESTIONS
            ]
            rows["first"].append(replies[0].stats.ttft_s)
            rows["second"].append(replies[1].stats.ttft_s)
            rows["prefilled"].append(tuple(x.stats.prompt_tokens for x in replies))
            rows["replies"].append([x.token_ids for x in replies])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quant", default="q4f32_1")
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    args = parser.parse_args()

    from localchat.engine.runtime import Model

    from fixtures import converted, smollm2_hf_dir

    model = Model(converted(smollm2_hf_dir(), args.quant), "cpu", max_total_tokens=4096)
    results = {c: run(model, c, args.rounds, args.prefix_tokens) for c in (True, False)}

    print(
        f"SmolLM2-135M-Instruct {args.quant}, system prompt ~{args.prefix_tokens} tokens, "
        f"{args.rounds} rounds (median TTFT)"
    )
    print(
        f"{'cache':<6} {'1st TTFT s':>11} {'2nd TTFT s':>11} {'2nd/1st':>8} "
        f"{'1st prefill':>12} {'2nd prefill':>12}"
    )
    for cached, rows in results.items():
        first, second = statistics.median(rows["first"]), statistics.median(rows["second"])
        p1, p2 = rows["prefilled"][0]
        print(
            f"{'on' if cached else 'off':<6} {first:>11.3f} {second:>11.3f} "
            f"{second / first:>7.1%} {p1:>12} {p2:>12}"
        )
    same = results[True]["replies"] == results[False]["replies"]
    print(f"greedy replies identical with the cache on and off: {same}")


if __name__ == "__main__":
    main()
