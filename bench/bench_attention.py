"""Per-layer attention kernel times on the CPU: localchat.engine.kernels.attention vs TVM's.

    python bench/bench_attention.py [--threads N] [--heads 9,3] [--head-dim 64] [--quick]

Shape defaults to SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64, float32, page size 16).
Each row times one kernel call as the KV-cache runtime makes it for one layer:

* prefill N: ragged causal attention of N new tokens (a first prompt);
* prefill N after M: a chunk of N tokens with M cached: ragged + paged prefill + merge-state;
* decode at N: paged decode of one token with N tokens of context (the new one included).

TVM's thread pool reads TVM_NUM_THREADS on every parallel launch; unset, it asks the OS for the
CPU count each time (several microseconds). --threads sets it (default: all CPUs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--heads", default="9,3", help="query heads,KV heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30, help="for the per-model column")
    ap.add_argument("--quick", action="store_true", help="fewer repeats, skip TVM's slow prefill")
    args = ap.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)

    import numpy as np
    import tvm
    from tvm.relax.frontend.nn.llm import kv_cache as tvm_kv

    from localchat.engine.device import cpu_target
    from localchat.engine.kernels import attention as ours

    h_q, h_kv = (int(x) for x in args.heads.split(","))
    d = args.head_dim
    dtype = "float32"
    ps = 16
    dev = tvm.cpu()
    # this CPU less the features its OS hides (a VM may hide AVX-512 from a CPU model that has it)
    target = cpu_target(args.threads)
    rng = np.random.default_rng(0)
    sm_scale = d**-0.5

    def build(func):
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        return tvm.tirx.build(mod, target=target)

    kernels = {
        "ours": {
            "ragged": build(ours.attention_prefill_ragged_cpu(h_kv, h_q, d, d, dtype)),
            "paged": build(ours.attention_prefill_paged_cpu(h_kv, h_q, d, dtype, ps)),
            "decode": build(ours.attention_decode_paged_cpu(h_kv, h_q, d, dtype, ps)),
            "merge": build(ours.merge_state_inplace_cpu(h_q, d, dtype)),
        },
        "tvm": {
            "ragged": build(tvm_kv._attention_prefill_ragged_cpu(h_kv, h_q, d, d, dtype, {})),
            "paged": build(tvm_kv._attention_prefill_cpu(h_kv, h_q, d, dtype, False, {})),
            "decode": build(tvm_kv._attention_decode_cpu(h_kv, h_q, d, dtype, False, {})),
            "merge": build(tvm_kv._merge_state_inplace_cpu(dtype)),
        },
    }

    def tensor(a):
        return tvm.runtime.tensor(np.ascontiguousarray(a), dev)

    def i32(values):
        return tensor(np.asarray(values, dtype="int32"))

    def randn(*shape):
        return tensor(rng.standard_normal(shape).astype(dtype))

    def paged_inputs(kv_len: int):
        npg = (kv_len + ps - 1) // ps
        pages = randn(npg + 1, 2, h_kv, ps, d)
        values = i32(rng.permutation(npg + 1)[:npg])
        return pages, i32([0, npg]), values, i32([kv_len - (npg - 1) * ps])

    def calls(kind: str, which: str, n: int, cached: int):
        """One layer's kernel calls as (module, arguments), inputs prepared once."""
        k = kernels[which]
        if kind == "decode":
            pages, indptr, values, last = paged_inputs(n)
            q, out, lse = randn(1, h_q, d), randn(1, h_q, d), randn(1, h_q)
            zero = i32([0])
            return [
                (
                    k["decode"],
                    (q, pages, indptr, values, last, zero, zero, out, lse, 0, 1.0, 1e4, sm_scale),
                )
            ]
        q, kk, vv = randn(n, h_q, d), randn(n, h_kv, d), randn(n, h_kv, d)
        out, lse = randn(n, h_q, d), randn(n, h_q)
        indptr, pos, zero = i32([0, n]), i32(np.arange(n)), i32([0])
        result = [
            (
                k["ragged"],
                (q, indptr, kk, vv, indptr, pos, zero, out, lse, 1, 0, 1.0, 1e4, sm_scale),
            )
        ]
        if cached:
            pages, pindptr, values, last = paged_inputs(cached)
            out2, lse2 = randn(n, h_q, d), randn(n, h_q)
            result.append(
                (
                    k["paged"],
                    (
                        q,
                        indptr,
                        pages,
                        pindptr,
                        values,
                        last,
                        zero,
                        pos,
                        out2,
                        lse2,
                        0,
                        0,
                        1.0,
                        1e4,
                        sm_scale,
                    ),
                )
            )
            result.append((k["merge"], (out, lse, out2, lse2)))
        return result

    def timeit(calls_, budget_s: float) -> tuple[float, float]:
        """(best, median) over repeats of the summed time of the calls."""
        best = med = 0.0
        for mod, call_args in calls_:
            mod["main"](*call_args)  # warm up, and a first estimate
            one = mod.time_evaluator("main", dev, number=1, repeat=1)(*call_args).mean
            number = max(1, int(0.02 / max(one, 1e-7)))
            repeat = max(1, min(50, int(budget_s / max(number * one, 1e-7))))
            res = mod.time_evaluator("main", dev, number=number, repeat=repeat)(*call_args)
            best += min(res.results)
            med += statistics.median(res.results)
        return best, med

    cases = [
        ("prefill 256", "prefill", 256, 0),
        ("prefill 451", "prefill", 451, 0),
        ("prefill 256 after 451", "prefill", 256, 451),
        ("decode at 300", "decode", 300, 0),
        ("decode at 2000", "decode", 2000, 0),
    ]
    budget = 0.3 if args.quick else 1.5
    print(
        f"attention per layer, h_q={h_q} h_kv={h_kv} d={d} {dtype}, "
        f"TVM_NUM_THREADS={args.threads}, CPU={tvm.target.codegen.llvm_get_system_cpu()}"
    )
    print(
        f"{'case':<24}{'ours best':>12}{'ours median':>13}{'TVM best':>12}{'speedup':>9}"
        f"{f'ours x{args.layers}':>12}"
    )
    for label, kind, n, cached in cases:
        best, med = timeit(calls(kind, "ours", n, cached), budget)
        if args.quick and kind == "prefill":
            tvm_best = float("nan")
        else:
            tvm_best, _ = timeit(
                calls(kind, "tvm", n, cached), 0.0 if kind == "prefill" else budget
            )
        print(
            f"{label:<24}{_fmt(best):>12}{_fmt(med):>13}{_fmt(tvm_best):>12}"
            f"{_ratio(tvm_best / best):>9}{_fmt(best * args.layers):>12}"
        )
    sys.stdout.flush()


def _ratio(x: float) -> str:
    return "-" if x != x else f"{x:.0f}x"


def _fmt(seconds: float) -> str:
    if seconds != seconds:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    return f"{seconds * 1e3:.2f} ms"


if __name__ == "__main__":
    main()
