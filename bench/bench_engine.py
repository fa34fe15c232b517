"""Benchmark: SmolLM2-135M-Instruct on this CPU, localchat (q4f32_1, q0f32) beside llama.cpp.

Prints prefill tok/s on a 451-token prompt, decode tok/s over 128 tokens, peak RSS, compile and
load time, and our figures as ratios of llama-cpp-python's on the same GGUF in the same run.
Each configuration runs in its own process so peak RSS is its own.

    python bench/bench_engine.py [--threads 2] [--skip-llama-cpp]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

PROMPT_TOKENS = 451
DECODE_TOKENS = 128
TEXT = (
    "The history of the lighthouse begins with fires lit on hilltops to guide ships home. "
    "Over centuries these became towers of stone, then of iron, with lamps of oil and "
    "later electricity, lenses that bent light into beams seen for miles across the sea. "
) * 20


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_localchat(quant: str) -> dict:
    import shutil
    import tempfile
    import time

    from localchat.engine.convert import convert_model
    from localchat.engine.runtime import Model

    from fixtures import smollm2_hf_dir

    src = smollm2_hf_dir()
    # A fresh model directory, so the first load compiles (timed) and the second loads the
    # cached library (timed separately).
    scratch = Path(tempfile.mkdtemp(prefix="bench-"))
    try:
        convert_model(src, scratch / "m", quant)
        start = time.perf_counter()
        first = Model(scratch / "m", "cpu")
        compile_s = first.compile_seconds
        del first
        start = time.perf_counter()
        model = Model(scratch / "m", "cpu", max_total_tokens=1024, prefill_chunk_size=512)
        load_s = time.perf_counter() - start
        return _measure(model, compile_s, load_s)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _measure(model, compile_s: float, load_s: float) -> dict:
    import time

    import numpy as np

    ids = model.tokenizer.encode(TEXT)[:PROMPT_TOKENS]
    warm = model.new_sequence()
    model.prefill(warm, ids[:32])
    model.remove(warm)
    seq = model.new_sequence()
    start = time.perf_counter()
    logits = model.prefill(seq, ids)
    prefill_s = time.perf_counter() - start
    tok = int(np.argmax(logits))
    start = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        tok = int(np.argmax(model.decode([seq], [tok])[0]))
    decode_s = time.perf_counter() - start
    return {
        "prefill_tok_s": len(ids) / prefill_s,
        "decode_tok_s": DECODE_TOKENS / decode_s,
        "peak_rss_mb": _peak_rss_mb(),
        "compile_s": compile_s,
        "load_s": load_s,
    }


def run_llama_cpp(threads: int) -> dict:
    import time

    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    from fixtures import smollm2_gguf

    start = time.perf_counter()
    llm = Llama(
        model_path=str(smollm2_gguf()),
        n_ctx=1024,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    load_s = time.perf_counter() - start
    n_vocab = llm.n_vocab()
    ids = llm.tokenize(TEXT.encode(), add_bos=False)[:PROMPT_TOKENS]
    llm.eval(ids[:32])
    llm.reset()
    start = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        # Greedy on the raw logits, as ours does (llm.sample runs a Python sampler chain).
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        tok = int(np.argmax(np.ctypeslib.as_array(logits, shape=(n_vocab,))))
        llm.eval([tok])
    decode_s = time.perf_counter() - start
    return {
        "prefill_tok_s": len(ids) / prefill_s,
        "decode_tok_s": DECODE_TOKENS / decode_s,
        "peak_rss_mb": _peak_rss_mb(),
        "compile_s": 0.0,
        "load_s": load_s,
    }


def child(name: str, threads: int) -> dict:
    env = dict(os.environ, TVM_NUM_THREADS=str(threads))
    out = subprocess.run(
        [sys.executable, __file__, "--child", name, "--threads", str(threads)],
        capture_output=True,
        text=True,
        env=env,
    )
    if out.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    if args.child:
        result = (
            run_llama_cpp(args.threads) if args.child == "llama.cpp" else run_localchat(args.child)
        )
        print(json.dumps(result))
        return

    rows = {}
    if not args.skip_llama_cpp:
        rows["llama.cpp Q4_1"] = child("llama.cpp", args.threads)
    for quant in ("q4f32_1", "q0f32"):
        rows[f"localchat {quant}"] = child(quant, args.threads)
    peer = rows.get("llama.cpp Q4_1")
    print(
        f"SmolLM2-135M-Instruct, {args.threads} threads, prompt {PROMPT_TOKENS} tok, "
        f"decode {DECODE_TOKENS} tok"
    )
    header = (
        f"{'engine':<20}{'prefill tok/s':>14}{'decode tok/s':>14}{'peak RSS MB':>13}"
        f"{'compile s':>11}{'load s':>8}{'prefill x':>11}{'decode x':>10}"
    )
    print(header)
    print("-" * len(header))
    for name, r in rows.items():
        px = f"{r['prefill_tok_s'] / peer['prefill_tok_s']:.2f}" if peer else "-"
        dx = f"{r['decode_tok_s'] / peer['decode_tok_s']:.2f}" if peer else "-"
        print(
            f"{name:<20}{r['prefill_tok_s']:>14.1f}{r['decode_tok_s']:>14.1f}"
            f"{r['peak_rss_mb']:>13.0f}{r['compile_s']:>11.1f}{r['load_s']:>8.2f}"
            f"{px:>11}{dx:>10}"
        )


if __name__ == "__main__":
    main()
