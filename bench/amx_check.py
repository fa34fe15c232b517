"""Prefill on Intel AMX, run for real on an AMX machine (Sapphire Rapids or later) that has
neither TVM's compiler nor this machine's CPU: tiny models and the 1B shape compiled here for
`cpu:sapphirerapids` (AMX prefill) and for `cpu:icelake-server` (the same kernels less AMX: the
VNNI GEMV's rows for prefill), then run there on a runtime-only TVM.

    python bench/amx_check.py prepare .gpu/amx [--speed F16.gguf]   # here: full apache-tvm
    LOCALCHAT_NUM_THREADS=2 python bench/amx_check.py run .gpu/amx   # there (gpu_bundle.sh's TVM)

`run` prints per tiny model and mode: the AMX library's teacher-forced logits against
transformers (top-1, largest error relative to the largest logit), its whole-sequence prefill
against the VNNI library's and against its own token-by-token run, and whether its greedy
tokens equal the VNNI library's; then the 1B shape's prefill (451 tokens) and decode rates for
both libraries on random weights (q4f32_1 and q4f32_k), at the thread count the environment
gives.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from gpu_check import STEPS, _hf_reference, _prompt, _random_weights  # noqa: E402

CPUS = {"amx": "sapphirerapids", "vnni": "icelake-server"}
CASES = {"llama": "llama-odd", "qwen2": "qwen2-odd"}  # qwen2: q/k/v biases
QUANTS = ("q4f32_1", "q4f32_0", "q4f32_asym", "q4f32_k")  # every 4-bit layout AMX runs
SPEED_QUANTS = ("q4f32_1", "q4f32_k")
SPEED_PROMPT, SPEED_STEPS = 451, 32


def prepare(root: Path, gguf: Path | None) -> None:
    """Each tiny model in each mode for both CPUs, with transformers' reference; the 1B shape's
    libraries (weights removed) when `gguf` is given."""
    from localchat.engine.build import convert_source
    from localchat.engine.build.convert import convert_model, read_hf_config
    from localchat.engine.device import cross_compile_device

    import llama_variants

    root.mkdir(parents=True, exist_ok=True)
    cases: dict[str, Any] = {}
    for name, variant in CASES.items():
        folder = llama_variants.build_variant(variant)
        prompt = _prompt(int(read_hf_config(folder).get("vocab_size", 300)))
        tokens, logits = _hf_reference(folder, prompt)
        np.save(root / f"{name}-reference.npy", logits.astype(np.float32))
        cases[name] = {"prompt": prompt, "tokens": [int(t) for t in tokens]}
        for quant in QUANTS:
            for kind, cpu in CPUS.items():
                out = root / f"{name}-{quant}-{kind}"
                shutil.rmtree(out, ignore_errors=True)
                convert_model(folder, out, quant, compile_for=cross_compile_device(f"cpu:{cpu}"))
        print(f"{name}: prepared", flush=True)
    (root / "cases.json").write_text(json.dumps(cases))
    if gguf is not None:
        for quant in SPEED_QUANTS:
            for kind, cpu in CPUS.items():
                out = root / f"speed-{quant}-{kind}"
                shutil.rmtree(out, ignore_errors=True)
                convert_source(gguf, out, quant, scratch_dir=root,
                               compile_for=cross_compile_device(f"cpu:{cpu}"))
                for shard in out.glob("params_shard_*.bin"):
                    shard.unlink()  # `run` writes random ones of the same sizes there
                print(f"speed {quant} {kind}: prepared", flush=True)


def _whole(model: Any, ids: list[int]) -> np.ndarray:
    seq = model.new_sequence()
    out = model.prefill(seq, ids)
    model.remove(seq)
    return out


def run(root: Path) -> int:
    """The checks and the rates; 1 when a check fails."""
    from localchat.engine.runtime import Model

    from model_oracle import rel_err, run_greedy, run_teacher_forced

    failed = 0
    for name, case in json.loads((root / "cases.json").read_text()).items():
        reference = np.load(root / f"{name}-reference.npy")
        prompt, tokens = case["prompt"], case["tokens"]
        for quant in QUANTS:
            amx = Model(root / f"{name}-{quant}-amx", "cpu", max_batch_size=4)
            vnni = Model(root / f"{name}-{quant}-vnni", "cpu", max_batch_size=4)
            ours = np.stack(run_teacher_forced(amx, prompt, tokens))
            top1 = float(np.mean(ours.argmax(-1) == reference.argmax(-1)))
            ids = prompt + tokens
            whole = _whole(amx, ids)
            versus_vnni = rel_err(whole, _whole(vnni, ids))
            seq = amx.new_sequence()
            step = amx.prefill(seq, ids[:1])
            for tok in ids[1:]:
                step = amx.decode([seq], [tok])[0]
            amx.remove(seq)
            versus_steps = rel_err(whole, step)
            same = run_greedy(amx, prompt, STEPS) == run_greedy(vnni, prompt, STEPS)
            # the int8 rounding of x is the same; only float32 sums' order differs
            ok = versus_vnni < 1e-4 and versus_steps < 1e-4 and same
            failed += not ok
            print(f"{name:<6} {quant:<8} top-1 {top1:5.0%}  err {rel_err(ours, reference):.1e}  "
                  f"prefill vs VNNI {versus_vnni:.1e}  vs token by token {versus_steps:.1e}  "
                  f"greedy {'equal' if same else 'DIFFERS'}  {'ok' if ok else 'FAIL'}",
                  flush=True)
    for quant in SPEED_QUANTS:
        rates = {}
        for kind in CPUS:
            folder = root / f"speed-{quant}-{kind}"
            if not folder.is_dir():
                continue
            read = _random_weights(folder)
            model = Model(folder, "cpu", max_batch_size=1, max_total_tokens=1024)
            prompt = [int(t) for t in np.random.RandomState(3).randint(3, 40000, SPEED_PROMPT)]
            _whole(model, prompt[:64])  # warm
            best = {"prefill": 0.0, "decode": 0.0}
            for _ in range(2):
                seq = model.new_sequence()
                t0 = time.perf_counter()
                tok = int(np.argmax(model.prefill(seq, prompt)))
                best["prefill"] = max(best["prefill"], SPEED_PROMPT / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                for _ in range(SPEED_STEPS):
                    tok = int(np.argmax(model.decode([seq], [tok])[0]))
                best["decode"] = max(best["decode"], SPEED_STEPS / (time.perf_counter() - t0))
                model.remove(seq)
            rates[kind] = best
            print(f"1B {quant:<8} {kind:<5} ({CPUS[kind]}): {read / 1e6:5.0f} MB/token  prefill "
                  f"{best['prefill']:7.1f} tok/s  decode {best['decode']:6.1f} tok/s", flush=True)
            del model
        if len(rates) == 2:
            print(f"1B {quant} AMX / VNNI: prefill "
                  f"{rates['amx']['prefill'] / rates['vnni']['prefill']:.2f}x, decode "
                  f"{rates['amx']['decode'] / rates['vnni']['decode']:.2f}x", flush=True)
    print(f"{failed} failed", flush=True)
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("root", type=Path)
    a.add_argument("--speed", type=Path, default=None, help="an F16 .gguf of the 1B shape")
    b = sub.add_parser("run")
    b.add_argument("root", type=Path)
    args = p.parse_args()
    if args.cmd == "prepare":
        prepare(args.root, args.speed)
        return 0
    return run(args.root)


if __name__ == "__main__":
    sys.exit(main())
