"""Prefill GEMM speed on the CPU: Y[m, n] = X[m, k] @ W[n, k]^T, GFLOPS of localchat's kernels
beside torch's (oneDNN/MKL) on the same data, one table.

    python bench/bench_gemm.py [--shapes 4096x384x1536,...] [--threads 1,2] [--quant q0f32]
                               [--seconds 1]

Shapes are m x k x n (rows x reduction x outputs); the default: the all-MiniLM-L6-v2 encoder's
MLP at 32 texts x 128 tokens (up and down projections) and a 1B-class decoder's MLP up
projection on a 128-token prefill chunk. Columns:

* q0f32 / q0f16: `gemm_f` (kernels/gemm.py, the outer-product GEMM prefill's `matmul.linear_f`
  runs), `gemm_f_panels` (the same on weights laid out at convert time, as encoders store them),
  torch (float32; float16 weights are not a fast path in torch on CPUs, so the torch
  column is always float32);
* 4-bit modes (q4f32_1, q4f32_asym, ...): `gemm_q4` (what `matmul.linear_q4` runs), torch on the
  dequantized float32 weights.

Each thread count runs in its own process (TVM's thread pool reads TVM_NUM_THREADS once); every
kernel is checked against numpy before it is timed. Not a test: it prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DEFAULT_SHAPES = "4096x384x1536,4096x1536x384,128x2048x8192"


def _best(fn, seconds: float) -> float:
    """The best time of one call of `fn` over about `seconds` (after a warm-up call)."""
    fn()
    best, spent = float("inf"), 0.0
    while spent < seconds:
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return best


def child(args: argparse.Namespace) -> None:
    """Time every candidate at every shape with the thread count already in the environment;
    print one JSON object per shape."""
    import numpy as np
    import torch
    import tvm

    from localchat.engine.build.quantization import (
        dequantize_q4,
        get_quant_mode,
        quantize_q4,
        quantize_q4_asym,
    )
    from localchat.engine.device import cpu_target
    from localchat.engine.kernels import gemm

    torch.set_num_threads(args.threads)
    mode = get_quant_mode(args.quant)
    dt = mode.dtype
    target = cpu_target()
    dev = tvm.cpu()

    def build(func):
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        return tvm.compile(mod, target=target)["main"]

    if mode.quantized:
        asym = mode.asymmetric
        cands = {"gemm_q4": lambda k, n: gemm.gemm_q4(k, n, dt, False, asym)}
    else:
        cands = {"gemm_f": lambda k, n: gemm.gemm_f(k, n, dt, False),
                 "gemm_f_panels": lambda k, n: gemm.gemm_f_panels(k, n, dt, False)}
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        x = rng.standard_normal((m, k), dtype=np.float32)
        w = rng.standard_normal((n, k), dtype=np.float32) * 0.05
        if mode.quantized:
            words, scale = quantize_q4_asym(w) if mode.asymmetric else quantize_q4(w, dt)
            w = dequantize_q4(words, scale, k, mode.asymmetric)
            weights = [words, scale]
        else:
            weights = [w.astype(dt)]
            w = weights[0].astype(np.float32)
        xs = x.astype(dt)
        ref = xs.astype(np.float32) @ w.T
        row = {"shape": shape, "threads": args.threads}
        y = tvm.runtime.tensor(np.zeros((m, n), dt), dev)
        for name, make in cands.items():
            # the encoders' layout, made at convert time: not timed
            laid = [gemm.weight_panels(weights[0])] if name.endswith("_panels") else weights
            targs = [tvm.runtime.tensor(a, dev) for a in [xs, *laid]]
            f = build(make(k, n))
            f(*targs, y)
            err = np.abs(y.numpy().astype(np.float32) - ref).max() / (np.abs(ref).max() + 1e-30)
            if err > (1e-2 if dt == "float16" else 1e-4):
                raise SystemExit(f"{name} {shape}: relative error {err:.2e}")
            took = _best(lambda f=f, a=targs, y=y: f(*a, y), args.seconds)
            row[name] = 2 * m * n * k / took / 1e9
        tx, tw = torch.from_numpy(x), torch.from_numpy(np.ascontiguousarray(w))
        row["torch"] = 2 * m * n * k / _best(lambda a=tx, b=tw: a @ b.T, args.seconds) / 1e9
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="m x k x n, comma-separated")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--quant", default="q0f32")
    ap.add_argument("--seconds", type=float, default=1.0, help="timing per kernel and shape")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        args.threads = args.child
        child(args)
        return
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        env = dict(os.environ, TVM_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
        cmd = [sys.executable, __file__, "--child", str(threads), "--shapes", args.shapes,
               "--quant", args.quant, "--seconds", str(args.seconds)]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    names = [key for key in rows[0] if key not in ("shape", "threads")]
    print(f"GEMM GFLOPS (best call), {args.quant}, m x k x n")
    print(f"{'shape':<16}{'threads':>8}" + "".join(f"{name:>14}" for name in names))
    for row in rows:
        print(f"{row['shape']:<16}{row['threads']:>8}"
              + "".join(f"{row[name]:>14.1f}" for name in names))


if __name__ == "__main__":
    sys.exit(main())
