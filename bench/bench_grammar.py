"""The cost of structured output: llguidance's token mask per step against a SmolLM2 decode step.

    python bench/bench_grammar.py [--model DIR] [--device cpu] [--tokens 48]

For each response format it walks a valid reply token by token through a fresh constraint and
times, per token, filling the bitmask (llguidance) plus applying it to a 49 152-entry logits row
(numpy), and the matcher's accept. The formats: JSON mode, a schema, a GBNF grammar, and a tool
call after free text. Then it runs real replies on the engine with and without the format and
reports the decode step (scheduler counters) and end-to-end tokens/s, so the mask's share of a
decode step is read off the table. `--model` defaults to the test fixture SmolLM2
(q4f32_1, converted on first use).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from localchat import Engine
from localchat.engine.grammar import TokenConstraint
from localchat.server.tools import Tool, call_format

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    "rating": {"type": "number", "minimum": 0, "maximum": 10}},
    "required": ["title", "year", "tags"], "additionalProperties": False}
SAMPLE = {"title": "The Long Walk Home Again", "year": 1987,
          "tags": ["drama", "road movie", "family"], "rating": 7.5}
WEATHER = Tool("get_weather", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}, {})
CALL = ('I will look it up. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}\n</tool_call>')
GRAMMAR = 'root ::= expr\nexpr ::= num (("+" | "-" | "*") num)*\nnum ::= [1-9] [0-9]*'
FORMATS = {
    "json_object": ({"type": "json_object"}, json.dumps(SAMPLE)),
    "json_schema": ({"type": "json_schema", "json_schema": {"schema": SCHEMA}},
                    json.dumps(SAMPLE)),
    "grammar": ({"type": "grammar", "grammar": GRAMMAR}, "12+345*6-78+9*10-11+12*13-14+150"),
    # tool_choice "auto": free text that may not hold the call's opening, then the call
    "tool_call": (call_format("tag", "auto", [WEATHER]), CALL),
}
PROMPT = [{"role": "user", "content": "Describe a film as JSON with title, year and tags."}]


def default_model() -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from fixtures import converted, smollm2_hf_dir

    return converted(smollm2_hf_dir(), "q4f32_1")


def mask_cost(engine: Engine, fmt: dict, text: str) -> tuple[float, float, float, int]:
    """(compile ms, mask fill+apply µs per token, accept µs per token, tokens walked)."""
    t0 = time.perf_counter()
    compiled = engine.grammars.compile(fmt)
    compile_ms = (time.perf_counter() - t0) * 1e3
    ids = engine.tokenizer.encode(text)
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 4, (len(ids), engine.vocab_size)).astype(np.float32)
    masks, accepts = [], []
    for _ in range(3):
        c = TokenConstraint(compiled, engine.vocab_size, engine.stop_token_ids)
        for row, token in zip(logits.copy(), ids, strict=True):
            t0 = time.perf_counter()
            c.apply(row)
            t1 = time.perf_counter()
            c.accept(token)
            t2 = time.perf_counter()
            masks.append(t1 - t0)
            accepts.append(t2 - t1)
    return compile_ms, statistics.median(masks) * 1e6, statistics.median(accepts) * 1e6, len(ids)


def decode_run(engine: Engine, fmt: dict | None, tokens: int) -> tuple[float, float]:
    """(ms per decode step incl. sampling, end-to-end decode tok/s) of one reply."""
    s = engine.scheduler
    steps0, dec0, samp0 = s.decode_steps, s.decode_seconds, s.sampling_seconds
    reply = engine.chat(PROMPT, response_format=fmt, max_tokens=tokens, temperature=0,
                        logit_bias={t: float("-inf") for t in engine.stop_token_ids}
                        if fmt is None else {}).result()
    steps = s.decode_steps - steps0
    step_ms = (s.decode_seconds - dec0 + s.sampling_seconds - samp0) / max(steps, 1) * 1e3
    return step_ms, reply.stats.decode_tok_s


def median_run(runs: list[tuple[float, float]]) -> tuple[float, float]:
    """The run with the median step time."""
    return sorted(runs)[len(runs) // 2]


def main() -> None:
    """Print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    with Engine.open(args.model or default_model(), device=args.device) as engine:
        engine.chat(PROMPT, max_tokens=4, temperature=0).result()  # warm up
        free_ms, free_tps = median_run([decode_run(engine, None, args.tokens) for _ in range(3)])
        print(f"model {engine.name}, vocab {engine.vocab_size}, device {args.device}")
        print(f"free text: decode step {free_ms:.2f} ms (model + sampling), {free_tps:.1f} tok/s")
        print()
        print(f"{'format':<12} {'compile ms':>10} {'mask µs/tok':>12} {'accept µs':>10} "
              f"{'mask/step':>10} {'step ms':>8} {'tok/s':>7}")
        for name, (fmt, text) in FORMATS.items():
            compile_ms, mask_us, accept_us, _n = mask_cost(engine, fmt, text)
            step_ms, tps = median_run([decode_run(engine, fmt, args.tokens) for _ in range(3)])
            share = (mask_us + accept_us) / 1e3 / free_ms
            print(f"{name:<12} {compile_ms:>10.1f} {mask_us:>12.1f} {accept_us:>10.1f} "
                  f"{share:>9.1%} {step_ms:>8.2f} {tps:>7.1f}")


if __name__ == "__main__":
    main()
