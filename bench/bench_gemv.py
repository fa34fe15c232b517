"""Decode GEMV times on the CPU: y[m, n] = x[m, k] @ W[n, k]^T, kernels of localchat.engine.kernels.

    python bench/bench_gemv.py [--threads N] [--quant q4f32_1] [--rows 1] [--shapes 576x1536,...]
                               [--extra NAME=FILE.py:FUNC ...] [--stream-mib 256] [--seconds 1.5]

Shapes are k x n (reduction x outputs); the default is Llama-like: SmolLM2-135M's hidden 576 and
MLP 1536, and a 1B-class model's 2048 and 8192. Any k works (e.g. 1000x344: 4-bit weights are
stored padded to whole groups of 32). Candidates, one column each:

* 4-bit modes: `gemv` (generic register unpacking), `gemv avx512` (table-lookup unpacking; only
  where the CPU has AVX-512F), `gemv vnni` (int8 activations, VNNI dot products; only where the
  CPU has AVX-512 VNNI; checked against float x with a tolerance for int8 rounding), `gemv avx2`
  (the same int8 route with AVX2's pmaddubsw; where the CPU has AVX2) and
  `linear_q4`, the Llama family's kernel as a model calls it (one
  row: it branches to the GEMV for the target; more rows: the blocked prefill kernel);
* float modes (q0*): `gemv_f` (RWKV's decode) and `linear_f` (what the Llama family runs);
* each --extra NAME=FILE.py:FUNC: FUNC(k, n, dtype) from that file, returning a PrimFunc with the
  same arguments (x, weights..., y); e.g. an older version of a kernel taken from git with
  `git show REV:app/engine/kernels/gemv.py > /tmp/old_gemv.py` and a two-line wrapper.

Every call reads a different copy of the weights (--stream-mib of copies in all), so weights come
from memory as in a real model rather than from the cache (--stream-mib 0: one copy, which the
cache holds when it fits); GB/s counts weight and scale bytes.
TVM's thread pool reads TVM_NUM_THREADS; --threads sets it (default: all CPUs).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

DEFAULT_SHAPES = "576x1536,1536x576,2048x8192,8192x2048"


def _load_extra(spec: str) -> tuple[str, Callable]:
    name, _, where = spec.partition("=")
    path, _, func = where.rpartition(":")
    if not name or not path or not func:
        raise SystemExit(f"--extra wants NAME=FILE.py:FUNC, got {spec!r}")
    mod_spec = importlib.util.spec_from_file_location(f"bench_extra_{name}", Path(path))
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return name, getattr(module, func)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quant", default="q4f32_1")
    ap.add_argument("--rows", type=int, default=1, help="rows of x (sequences decoded at once)")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="k x n, comma-separated")
    ap.add_argument("--extra", action="append", default=[], help="NAME=FILE.py:FUNC")
    ap.add_argument(
        "--stream-mib", type=int, default=256, help="MiB of weight copies cycled through (0: one)"
    )
    ap.add_argument("--seconds", type=float, default=1.5, help="timing per candidate and shape")
    ap.add_argument("--quick", action="store_true", help="--seconds 0.3")
    args = ap.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)

    import numpy as np
    import tvm

    from localchat.engine.build.quantization import dequantize_q4, get_quant_mode, quantize_q4
    from localchat.engine.device import cpu_target
    from localchat.engine.kernels import gemv, matmul
    from localchat.engine.kernels.common import has_avx2, has_avx512, has_avx512_vnni

    mode = get_quant_mode(args.quant)
    dtype = mode.dtype
    dev = tvm.cpu()
    # this CPU less the features its OS hides (a VM may hide AVX-512 from a CPU model that has it)
    target = cpu_target(args.threads)
    avx512 = has_avx512(target)
    vnni = has_avx512_vnni(target)
    candidates: dict[str, Callable] = {}
    if mode.quantized:
        candidates["gemv"] = lambda k, n, dt: gemv.gemv_q4(k, n, dt, avx512=False)
        if avx512:
            candidates["gemv avx512"] = lambda k, n, dt: gemv.gemv_q4(k, n, dt, avx512=True)
        if vnni:
            candidates["gemv vnni"] = lambda k, n, dt: gemv.gemv_q4(k, n, dt, avx512="vnni")
        if has_avx2(target):
            candidates["gemv avx2"] = lambda k, n, dt: gemv.gemv_q4(k, n, dt, avx512="avx2")
        candidates["linear_q4"] = lambda k, n, dt: matmul.linear_q4(k, n, dt, False)
    else:
        candidates["gemv_f"] = gemv.gemv_f
        candidates["linear_f"] = lambda k, n, dt: matmul.linear_f(k, n, dt, False)
    for spec in args.extra:
        name, make = _load_extra(spec)
        candidates[name] = make

    def build(func):
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        return tvm.compile(mod, target=target)["main"]

    budget = 0.3 if args.quick else args.seconds
    rng = np.random.default_rng(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    print(
        f"decode GEMV, {args.quant}, {args.rows} row(s), TVM_NUM_THREADS={args.threads}, "
        f"CPU={tvm.target.codegen.llvm_get_system_cpu()}, AVX-512F={avx512}; "
        "best (median) per call, GB/s of weights at the best"
    )
    print(f"{'k x n':<13}" + "".join(f"{name:>26}" for name in candidates))
    for k, n in shapes:
        w = rng.standard_normal((n, k), dtype=np.float32) * 0.05
        if mode.quantized:
            words, scale = quantize_q4(w, dtype)
            weights = [words, scale]
            w = dequantize_q4(words, scale, k)  # stored padded to whole groups when k % 32
        else:
            weights = [w.astype(dtype)]
        nbytes = sum(a.nbytes for a in weights)
        copies = max(1, args.stream_mib * (1 << 20) // nbytes)
        x_np = rng.standard_normal((args.rows, k)).astype(dtype)
        ref = x_np.astype(np.float64) @ w.T.astype(np.float64)
        x = tvm.runtime.tensor(x_np, dev)
        y = tvm.runtime.tensor(np.zeros((args.rows, n), dtype), dev)
        sets = [[tvm.runtime.tensor(a, dev) for a in weights] for _ in range(copies)]
        calls: dict[str, Callable[[int], None]] = {}
        for name, make in candidates.items():
            try:
                f = build(make(k, n, dtype))
            except ValueError as exc:  # a shape the kernel does not take
                print(f"  {name}: {exc}", file=sys.stderr)
                continue
            f(x, *sets[0], y)
            err = np.abs(y.numpy() - ref).max() / np.abs(ref).max()
            # against the dequantized weights; int8 activations (vnni) round x to ~1/254 of
            # each group's largest value
            tol = 2e-2 if "vnni" in name or "avx2" in name else 1e-4 if dtype == "float32" else 1e-2
            if err > tol:
                raise SystemExit(f"{name} {k}x{n}: relative error {err:.3g}")
            calls[name] = functools.partial(_call, f, x, sets, y)
        times = _time_interleaved(calls, budget * len(calls))
        cells = []
        for name in candidates:
            if name not in times:
                cells.append(f"{'n/a':>26}")
                continue
            best, med = times[name]
            cells.append(f"{_fmt(best) + ' (' + _fmt(med) + ')':>18}{nbytes / best / 1e9:>6.1f}GB")
        print(f"{f'{k}x{n}':<13}" + "".join(cells))
        sys.stdout.flush()


def _call(f, x, sets, y, i: int) -> None:
    f(x, *sets[i % len(sets)], y)


def _time_interleaved(
    calls: dict[str, Callable[[int], None]], budget: float
) -> dict[str, tuple[float, float]]:
    """Best and median seconds per call of each candidate, timed in alternating batches for
    about `budget` seconds in all, so that load from elsewhere hits every candidate alike."""
    batches: dict[str, int] = {}
    i = 0
    for name, call in calls.items():  # warm up, and size batches to ~0.1 ms: on a busy machine
        start, count = time.perf_counter(), 0  # some short batches still run undisturbed
        while time.perf_counter() - start < 0.02:
            call(i)
            i += 1
            count += 1
        batches[name] = max(1, count // 200)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    start = time.perf_counter()
    while min(map(len, samples.values()), default=5) < 5 or time.perf_counter() - start < budget:
        for name, call in calls.items():
            t0 = time.perf_counter()
            for _ in range(batches[name]):
                call(i)
                i += 1
            samples[name].append((time.perf_counter() - t0) / batches[name])
    return {name: (min(s), statistics.median(s)) for name, s in samples.items()}


def _fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f}us"
    return f"{seconds * 1e3:.2f}ms"


if __name__ == "__main__":
    main()
