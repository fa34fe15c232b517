"""The chat engine on SmolLM2-135M-Instruct: per-turn prompt tokens of a conversation, the share
of a decode step spent sampling, batched throughput, and how fast a cancel lands.

    python bench/bench_chat.py [--model DIR | --quant q0f32] [--tokens 64] [--device cpu]

Without --model, the test fixture (tests/fixtures.py) is converted to --quant and cached.
"""

from __future__ import annotations

import argparse
import platform
import sys
import threading
import time
from pathlib import Path

from localchat.engine.engine import Engine
from localchat.engine.generation_config import GenerationConfig
from localchat.engine.runtime import Model
from localchat.engine.stream import TokenEvent

SAMPLING = {
    "greedy": GenerationConfig(temperature=0.0),
    "temperature + top_p": GenerationConfig(temperature=0.7, top_p=0.95, seed=0),
    "top_k + min_p": GenerationConfig(temperature=0.8, top_k=40, min_p=0.05, seed=0),
    "all penalties": GenerationConfig(
        temperature=0.8,
        top_k=40,
        top_p=0.95,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=0,
    ),
}
TURNS = ["What is the capital of France?", "And of Germany?", "Which of the two is bigger?"]
STORY = "Write a long story about a dragon who loves tea."


def model_dir(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import fixtures

    return fixtures.converted(fixtures.smollm2_hf_dir(), args.quant)


def bench_turns(engine: Engine) -> None:
    print("\nthree-turn conversation (greedy, 16 tokens per reply)")
    print(f"  {'turn':<5} {'prefilled':>9} {'reused':>7} {'from scratch':>12} {'ttft ms':>8}")
    with engine.conversation() as chat:
        for i, turn in enumerate(TURNS, 1):
            full = engine.count_tokens([*chat.messages, {"role": "user", "content": turn}])
            s = chat.send(turn, temperature=0.0, max_tokens=16).result().stats
            print(
                f"  {i:<5} {s.prompt_tokens:>9} {s.reused_tokens:>7} {full:>12} "
                f"{s.ttft_s * 1000:>8.1f}"
            )


def bench_sampling(engine: Engine, tokens: int) -> None:
    print(f"\nsampling share of a decode step ({tokens} tokens, batch 1)")
    print(f"  {'sampler':<22} {'step ms':>8} {'sample ms':>9} {'share':>6} {'tok/s':>6}")
    for name, cfg in SAMPLING.items():
        sched = engine.scheduler
        sched.decode_steps, sched.decode_seconds, sched.sampling_seconds = 0, 0.0, 0.0
        reply = engine.chat(
            [{"role": "user", "content": STORY}], cfg.replace(max_tokens=tokens)
        ).result()
        steps = max(sched.decode_steps, 1)
        step_ms = (sched.decode_seconds + sched.sampling_seconds) / steps * 1000
        sample_ms = sched.sampling_seconds / steps * 1000
        share = sched.sampling_seconds / (sched.decode_seconds + sched.sampling_seconds)
        print(
            f"  {name:<22} {step_ms:>8.2f} {sample_ms:>9.3f} {share:>6.1%} "
            f"{reply.stats.decode_tok_s:>6.1f}"
        )


def bench_batch(engine: Engine, tokens: int) -> None:
    print(f"\nconcurrent conversations ({tokens} tokens each, greedy)")
    print(f"  {'batch':<6} {'aggregate tok/s':>15} {'per reply tok/s':>15}")
    for batch in (1, 2, 4):
        chats = [engine.conversation() for _ in range(batch)]
        cfg = GenerationConfig(temperature=0.0, max_tokens=tokens)
        start = time.perf_counter()
        streams = [c.send(f"{STORY} Story {i}.", cfg) for i, c in enumerate(chats)]
        replies = [s.result() for s in streams]
        elapsed = time.perf_counter() - start
        produced = sum(r.stats.completion_tokens for r in replies)
        per = sum(r.stats.decode_tok_s for r in replies) / batch
        print(f"  {batch:<6} {produced / elapsed:>15.1f} {per:>15.1f}")
        for c in chats:
            c.close()


def cancel_now(stream, marks: list[float]) -> None:
    marks.append(time.perf_counter())
    stream.cancel()


def bench_cancel(engine: Engine) -> None:
    latencies = []
    for _ in range(5):
        stream = engine.chat([{"role": "user", "content": STORY}], temperature=0.0, max_tokens=400)
        marks: list[float] = []
        seen = 0
        for event in stream:
            if isinstance(event, TokenEvent):
                seen += 1
                if seen == 4:
                    threading.Thread(target=cancel_now, args=(stream, marks)).start()
        latencies.append(time.perf_counter() - marks[0])
    print(
        f"\ncancel from another thread -> finish event: "
        f"median {sorted(latencies)[2] * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a localchat model directory")
    parser.add_argument("--quant", default="q0f32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    path = model_dir(args)
    print(f"{path.name} on {args.device} ({platform.processor() or platform.machine()})")
    with Engine(Model(path, args.device)) as engine:
        bench_turns(engine)
        bench_sampling(engine, args.tokens)
        bench_batch(engine, args.tokens)
        bench_cancel(engine)


if __name__ == "__main__":
    main()
