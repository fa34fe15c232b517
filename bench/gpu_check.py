"""The GPU path, run for real: tiny random models of every architecture, compiled here for a
CUDA GPU on another machine, then run there on a runtime-only TVM and compared with their
references (transformers float32, or the `rwkv` package for BlinkDL's RWKV-6/7).

    python bench/gpu_check.py prepare .gpu/check --arch sm_90   # here: full apache-tvm
    python bench/gpu_check.py run .gpu/check --json out.json    # there: TVM_USE_RUNTIME_LIB=1

(`bench/gpu_bundle.sh pack` / `run` carry a runtime-only TVM to a GPU machine without one.)

`prepare` converts each model (`localchat convert --device cuda:sm_90` does the same), keeps
the reference's greedy tokens and logits beside it, and notes a model the GPU path refuses.
`prepare --speed F16.gguf` also converts a large model (bench_engine.py's `1b` shape) at
q4f16_1 and q0f16 and keeps only the weights' layout: `run` writes random weights of that
layout there (the files are too big to carry) and times a 451-token prefill and decode steps,
with decode's weight bytes per second beside the GPU's copy bandwidth measured in the same run;
`prepare --speed-moe` does the same for gpt-oss-20b's widths (`GPT_OSS_SHAPE`) at q4f32_mx and
q4f16_1. The modes that hold a GGUF's or OpenAI's blocks (`TWIN_QUANTS`) are also run on this
CPU at `prepare`, and `run` holds the GPU's logits and greedy tokens against that run's.
`run` needs only TVM's runtime and numpy: per model and mode it prints the top-1 agreement of
our teacher-forced logits with the reference, the largest logit error relative to the
reference's largest logit, whether the greedy run equals the reference (asked of q0f32, as on
the CPU), how far a batched run is from the same sequence alone, and the time of a decode step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

STEPS = 24
QUANTS = ("q0f32", "q0f16", "q4f16_1")
SPEED_QUANTS = ("q4f16_1", "q0f16")
SPEED_PROMPT, SPEED_STEPS = 451, 64
# name -> (builder module, variant); transformers' tiny models of tests/*_variants.py
HF_CASES = {
    "llama": ("llama_variants", "llama-odd"),
    "qwen2": ("llama_variants", "qwen2-odd"),
    "qwen3": ("llama_variants", "qwen3-odd"),
    "gemma2": ("llama_variants", "gemma2-odd"),
    "gemma3": ("llama_variants", "gemma3-odd"),
    "olmo2": ("llama_variants", "olmo2-odd"),
    "smollm3": ("llama_variants", "smollm3-odd"),
    "phi3": ("llama_variants", "phi3-odd"),
    "mistral": ("llama_variants", "mistral-odd"),
    "qwen3-moe": ("moe_variants", "qwen3-moe-gpu"),
    "olmoe": ("moe_variants", "olmoe-gpu"),
    "mixtral": ("moe_variants", "mixtral-gpu"),
    "gpt-oss": ("moe_variants", "gpt-oss-gpu"),
    "gpt-oss-mx": ("moe_variants", "gpt-oss-mxfp4"),  # experts MXFP4: q4f32_mx holds them
    # gpt-oss-20b's own head of 64 (+ 16 sink lanes), the width its q4f32_mx default runs at
    "gpt-oss-mx64": ("moe_variants", "gpt-oss-mx64-gpu"),
    "rwkv4": ("rwkv_variants", "rwkv4-odd"),
}
# the MoE variants with heads of 32: TVM's float32 GPU prefill has no tiling for their 36
MOE_GPU = {"qwen3-moe-gpu": ("qwen3-moe", {"head_dim": 32}),
           "olmoe-gpu": ("olmoe", {"hidden_size": 128}),
           "mixtral-gpu": ("mixtral", {"head_dim": 32}),
           # gpt-oss's sinks pad the cache's head by 16: 32 + 16 has a tiling, 36 + 16 not
           "gpt-oss-gpu": ("gpt-oss", {"head_dim": 32}),
           "gpt-oss-mx64-gpu": ("gpt-oss-mxfp4", {"head_dim": 64})}
# modes beyond --quants for some models: the modes that hold a GGUF's or OpenAI's blocks exactly
EXTRA_QUANTS = {"llama": ("q4f32_k", "q4f32_0"), "gpt-oss-mx": ("q4f32_mx",),
                "gpt-oss-mx64": ("q4f32_mx",)}
# modes whose GPU run is also held against the CPU's run of the same converted weights (logits
# and greedy tokens): the oracle for a quantized mode, where transformers' floats are not
TWIN_QUANTS = ("q4f32_k", "q4f32_0", "q4f32_mx")
# gpt-oss-20b's widths (2 of its 24 layers, 8 of its 32 experts, a 32,000-token vocabulary) for
# `prepare --speed-moe`: the real shapes' kernels compiled and timed
GPT_OSS_SHAPE = {"hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
                 "num_key_value_heads": 8, "head_dim": 64, "num_hidden_layers": 2,
                 "num_local_experts": 8, "num_experts_per_tok": 4, "sliding_window": 128,
                 "layer_types": ["sliding_attention", "full_attention"], "vocab_size": 32000,
                 "max_position_embeddings": 8192}
# Gemma 3 again with its window wider than prompt + reply: the window's part in a fault
WIDE_WINDOW = {"gemma3-wide": ("gemma3-odd", {"sliding_window": 64})}
PTH_CASES = {"rwkv6": "rwkv6_variants", "rwkv7": "rwkv7_variants"}


def _prompt(vocab: int) -> list[int]:
    return [int(t) for t in np.random.RandomState(11).randint(3, min(vocab, 300), 20)]


def _hf_reference(folder: Path, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """transformers' float32 greedy continuation of `prompt` and the logits before each token."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=STEPS, min_new_tokens=STEPS,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), np.stack([lg[0].numpy() for lg in out.logits])


def _sources() -> dict[str, tuple[Path, Any]]:
    """name -> (the folder convert reads, a function of the prompt giving the reference)."""
    import importlib

    import moe_variants
    from fixtures import pth_folder

    for name, (base, change) in MOE_GPU.items():
        cls, cfg = moe_variants.VARIANTS[base]
        moe_variants.VARIANTS.setdefault(name, (cls, {**cfg, **change}))
    out: dict[str, tuple[Path, Any]] = {}
    for name, (module, variant) in HF_CASES.items():
        folder = importlib.import_module(module).build_variant(variant)
        out[name] = (folder, lambda prompt, f=folder: _hf_reference(f, prompt))
    import llama_variants

    for name, (variant, change) in WIDE_WINDOW.items():
        cls, cfg = llama_variants.ODD_VARIANTS[variant]
        llama_variants.ODD_VARIANTS.setdefault(name, (cls, {**cfg, **change}))
        folder = llama_variants.build_variant(name)
        out[name] = (folder, lambda prompt, f=folder: _hf_reference(f, prompt))
    for name, module in PTH_CASES.items():
        mod = importlib.import_module(module)
        # a small vocabulary: the World one's 65,536 rows make megabytes too many to carry
        mod.VARIANTS.setdefault(f"{name}-gpu", {"vocab_size": 1001})
        pth = mod.build_variant(f"{name}-gpu") / "model.pth"
        out[name] = (pth_folder(pth), lambda prompt, m=mod, p=pth: m.reference_greedy(
            p, prompt, STEPS))
    return out


def prepare(root: Path, arch: str, only: list[str] | None,
            quants: tuple[str, ...] = QUANTS) -> None:
    """Convert and cross-compile every model, with its reference, into `root`."""
    from localchat.engine.build.convert import convert_model, read_hf_config
    from localchat.engine.device import cross_compile_device

    device = cross_compile_device(f"cuda:{arch}")
    root.mkdir(parents=True, exist_ok=True)
    known = root / "cases.json"
    cases: dict[str, Any] = json.loads(known.read_text())["cases"] if known.exists() else {}
    for name, (folder, reference) in _sources().items():
        if only and name not in only:
            continue
        vocab = int(read_hf_config(folder).get("vocab_size", 300))
        prompt = _prompt(vocab)
        tokens, logits = reference(prompt)
        np.save(root / f"{name}-reference.npy", np.asarray(logits, dtype=np.float32))
        case: dict[str, Any] = {"prompt": prompt, "tokens": [int(t) for t in tokens],
                                "models": {}, "refused": {}, "cpu_tokens": {}}
        for quant in quants + EXTRA_QUANTS.get(name, ()):
            out = root / f"{name}-{quant}"
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.perf_counter()
            try:
                convert_model(folder, out, quant, compile_for=device)
            except Exception as exc:  # the GPU path refuses it: say why, go on
                case["refused"][quant] = str(exc).strip().splitlines()[-1]
                print(f"{name} {quant}: refused: {case['refused'][quant]}", flush=True)
                continue
            case["models"][quant] = out.name
            if quant in TWIN_QUANTS:
                case["cpu_tokens"][quant] = _cpu_twin(folder, root, name, quant, prompt, tokens)
            print(f"{name} {quant}: {time.perf_counter() - t0:.1f} s", flush=True)
        cases[name] = case
    (root / "cases.json").write_text(json.dumps({"arch": arch, "cases": cases}, indent=1))


def _cpu_twin(folder: Path, root: Path, name: str, quant: str, prompt: list[int],
              tokens: list[int]) -> list[int]:
    """The CPU's run of `folder` in `quant` (converted for this machine, then removed): its
    teacher-forced logits saved beside the reference, its greedy tokens returned."""
    from localchat.engine.build.convert import convert_model
    from localchat.engine.runtime import Model

    from model_oracle import run_greedy, run_teacher_forced

    out = root / f".cpu-{name}-{quant}"
    shutil.rmtree(out, ignore_errors=True)
    convert_model(folder, out, quant, compile_for="cpu")
    model = Model(out, "cpu", max_batch_size=4)
    logits = np.stack(run_teacher_forced(model, prompt, tokens))
    np.save(root / f"{name}-{quant}-cpu.npy", logits.astype(np.float32))
    greedy = [int(t) for t in run_greedy(model, prompt, STEPS)]
    del model
    shutil.rmtree(out, ignore_errors=True)
    return greedy


def prepare_speed(root: Path, arch: str, gguf: Path) -> None:
    """The large model's directories at SPEED_QUANTS, compiled for `arch`, weights removed."""
    from localchat.engine.build import convert_source
    from localchat.engine.device import cross_compile_device

    device = cross_compile_device(f"cuda:{arch}")
    for quant in SPEED_QUANTS:
        out = root / f"speed-{quant}"
        shutil.rmtree(out, ignore_errors=True)
        convert_source(gguf, out, quant, scratch_dir=root, compile_for=device)
        for shard in out.glob("params_shard_*.bin"):
            shard.unlink()  # `run` writes random ones of the same sizes there
        print(f"speed {quant}: prepared", flush=True)


def prepare_speed_moe(root: Path, arch: str) -> None:
    """gpt-oss-20b's shapes (`GPT_OSS_SHAPE`) at q4f32_mx (MXFP4 experts) and q4f16_1,
    compiled for `arch`, weights removed (the random float model is built in a scratch folder
    here and deleted)."""
    import tempfile

    import torch
    import transformers

    from localchat.engine.build.convert import convert_model
    from localchat.engine.device import cross_compile_device

    device = cross_compile_device(f"cuda:{arch}")
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        config = transformers.GptOssConfig(**GPT_OSS_SHAPE)
        torch.manual_seed(0)
        model = transformers.GptOssForCausalLM(config).to(torch.bfloat16).eval()
        model.save_pretrained(scratch)
        del model
        for quant in ("q4f32_mx", "q4f16_1"):
            out = root / f"speed-gpt-oss-{quant}"
            shutil.rmtree(out, ignore_errors=True)
            convert_model(Path(scratch), out, quant, compile_for=device)
            for shard in out.glob("params_shard_*.bin"):
                shard.unlink()  # `run` writes random ones of the same sizes there
            print(f"speed gpt-oss {quant}: prepared", flush=True)


def _check(model_dir: Path, case: dict[str, Any], reference: np.ndarray, quant: str,
           device: str = "cuda"
           ) -> dict[str, Any]:
    from localchat.engine.runtime import Model

    from model_oracle import batched_and_alone, rel_err, run_greedy, run_teacher_forced

    model = Model(model_dir, device, max_batch_size=4)
    prompt, tokens = case["prompt"], case["tokens"]
    ours = np.stack(run_teacher_forced(model, prompt, tokens))
    top1 = float(np.mean(ours.argmax(-1) == reference.argmax(-1)))
    err = rel_err(ours, reference)
    # the prompt fed one token at a time (decode steps only): tells a prefill fault from a
    # decode one
    seq = model.new_sequence()
    stepwise = [model.prefill(seq, prompt[:1])]
    for tok in prompt[1:] + tokens[:-1]:
        stepwise.append(model.decode([seq], [tok])[0])
    model.remove(seq)
    stepwise = np.stack(stepwise[len(prompt) - 1:])
    step_top1 = float(np.mean(stepwise.argmax(-1) == reference.argmax(-1)))
    step_err = rel_err(stepwise, reference)
    # a sequence forked from another past a page (16 tokens): its attention runs over the
    # shared block and its own (two depths, merged), as the prefix cache's forks do
    parent = model.new_sequence()
    model.prefill(parent, prompt[:17])
    child = model.fork(parent)
    forked = [model.prefill(child, prompt[17:])]
    for tok in tokens[:8]:
        forked.append(model.decode([child], [tok])[0])
    model.remove(child)
    model.remove(parent)
    fork_err = rel_err(np.stack(forked), ours[:9])
    greedy = run_greedy(model, prompt, STEPS)
    pairs = batched_and_alone(model, [prompt, prompt[:7], prompt[3:16]], steps=4)
    batched = max(rel_err(np.stack(a), np.stack(b)) for a, b in pairs)
    seq = model.new_sequence()
    tok = int(np.argmax(model.prefill(seq, prompt)))
    t0 = time.perf_counter()
    for _ in range(32):
        tok = int(np.argmax(model.decode([seq], [tok])[0]))
    step_ms = (time.perf_counter() - t0) / 32 * 1e3
    model.remove(seq)
    twin = {}
    cpu_file = model_dir.parent / f"{model_dir.name.rsplit('-', 1)[0]}-{quant}-cpu.npy"
    if quant in case.get("cpu_tokens", {}) and cpu_file.exists():
        twin = {"cpu_rel_err": rel_err(ours, np.load(cpu_file)),
                "cpu_greedy_equal": greedy == case["cpu_tokens"][quant]}
    return {**twin, "top1": top1, "rel_err": err, "greedy_equal": greedy == tokens,
            "greedy_prefix": next((i for i, (a, b) in enumerate(zip(greedy, tokens)) if a != b),
                                  len(tokens)),
            "batched_vs_alone": batched, "decode_ms": step_ms,
            "stepwise_top1": step_top1, "stepwise_rel_err": step_err, "forked_vs_alone": fork_err}


def _random_weights(model_dir: Path) -> int:
    """Random weights in place of the removed shards, record by record (floats small and
    finite, MXFP4 exponents near 1, packed integers any bits); the bytes a decode step reads
    (all but the embedding; of a MoE's experts, the chosen ones' share)."""
    rng = np.random.default_rng(0)
    shards = json.loads((model_dir / "tensor-cache.json").read_text())["records"]
    cfg = json.loads((model_dir / "localchat-config.json").read_text())["model_config"]
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    active = int(cfg.get("num_experts_per_tok") or 0) / experts if experts else 1.0
    # a tied head reads the whole embedding each step; an untied one reads a row of it
    untied = any(r["name"].startswith("lm_head.") for sh in shards for r in sh["records"])
    read = 0.0
    for shard in shards:
        buf = bytearray(int(shard["nbytes"]))
        for rec in shard["records"]:
            n, off, dtype = int(rec["nbytes"]), int(rec["byteOffset"]), rec["dtype"]
            if dtype.startswith("float"):
                vals = rng.standard_normal(n // np.dtype(dtype).itemsize) * 0.02
                data = vals.astype(dtype).tobytes()
            elif dtype == "uint8" and rec["name"].endswith("scale"):  # E8M0: 2^-8 .. 2^0
                data = rng.integers(119, 128, n, dtype=np.uint8).tobytes()
            else:
                data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
            buf[off:off + n] = data
            if not (untied and rec["name"].startswith("model.embed_tokens.")):
                read += n * (active if ".experts." in rec["name"] else 1.0)
        (model_dir / shard["dataPath"]).write_bytes(bytes(buf))
    return int(read)


def _copy_bandwidth() -> float:
    """The GPU's device-to-device copy rate in GB/s (bytes read plus written), through TVM."""
    import tvm

    dev = tvm.cuda(0)
    src = tvm.runtime.empty((1 << 28,), "float32", dev)  # 1 GiB
    dst = tvm.runtime.empty((1 << 28,), "float32", dev)
    src.copyto(dst)
    dev.sync()
    t0 = time.perf_counter()
    for _ in range(10):
        src.copyto(dst)
    dev.sync()
    return 10 * 2 * (1 << 30) / (time.perf_counter() - t0) / 1e9


def _kernel_profile(model: Any, prompt: list[int], quant: str) -> None:
    """The GPU kernels of one prefill and 8 decode steps by their total time (CUPTI through
    torch's profiler, which records every kernel of the process); skipped without torch."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return
    for what, steps in (("prefill", 0), ("decode", 8)):
        seq = model.new_sequence()
        tok = int(np.argmax(model.prefill(seq, prompt if steps == 0 else prompt[:16])))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            if steps == 0:
                model.remove(seq)
                seq = model.new_sequence()
                model.prefill(seq, prompt)
            for _ in range(steps):
                tok = int(np.argmax(model.decode([seq], [tok])[0]))
        model.remove(seq)
        events = [e for e in prof.events() if e.device_type.name == "CUDA"]
        total: dict[str, list[float]] = {}
        for e in events:
            entry = total.setdefault(e.name[:60], [0.0, 0])
            entry[0] += e.device_time_total if hasattr(e, "device_time_total") else \
                e.cuda_time_total
            entry[1] += 1
        whole = sum(t for t, _ in total.values())
        print(f"  {quant} {what}: {whole / 1e3:.1f} ms of kernels, {len(events)} launches",
              flush=True)
        for name, (t, n) in sorted(total.items(), key=lambda kv: -kv[1][0])[:10]:
            print(f"    {t / 1e3:8.2f} ms {n:5d}x  {name}", flush=True)


def run_speed(root: Path) -> list[dict[str, Any]]:
    """Prefill and decode rates of the large model on the GPU, beside its copy bandwidth."""
    from localchat.engine.runtime import Model

    rows = []
    bandwidth = _copy_bandwidth()
    print(f"\nGPU copy bandwidth: {bandwidth:.0f} GB/s (read + written)", flush=True)
    for folder in sorted(root.glob("speed-*")):
        quant = folder.name.removeprefix("speed-")
        vocab = json.loads((folder / "localchat-config.json").read_text())["model_config"][
            "vocab_size"]
        prompt = [int(t) for t in
                  np.random.RandomState(3).randint(3, min(vocab, 40000), SPEED_PROMPT)]
        read = _random_weights(folder)
        model = Model(folder, "cuda", max_batch_size=4, max_total_tokens=4096)
        seq = model.new_sequence()
        model.prefill(seq, prompt[:32])  # warm
        model.remove(seq)
        seq = model.new_sequence()
        t0 = time.perf_counter()
        tok = int(np.argmax(model.prefill(seq, prompt)))
        prefill = SPEED_PROMPT / (time.perf_counter() - t0)
        for _ in range(4):
            tok = int(np.argmax(model.decode([seq], [tok])[0]))
        t0 = time.perf_counter()
        for _ in range(SPEED_STEPS):
            tok = int(np.argmax(model.decode([seq], [tok])[0]))
        decode = SPEED_STEPS / (time.perf_counter() - t0)
        model.remove(seq)
        _kernel_profile(model, prompt, quant)
        row = {"quant": quant, "weight_mb": read / 1e6, "prefill": prefill, "decode": decode,
               "roofline": decode * read / 1e9 / (bandwidth / 2)}
        rows.append(row)
        print(f"{quant:<16} {read / 1e6:8.0f} MB/token  prefill {prefill:8.1f} tok/s  decode "
              f"{decode:7.1f} tok/s  {row['roofline']:.0%} of the read roofline", flush=True)
        del model
    return rows


def _check_case(root: Path, name: str, case: dict[str, Any]
                ) -> tuple[list[dict[str, Any]], list[str], int]:
    """One model's rows, printed lines and failures, in every mode prepared."""
    import io
    from contextlib import redirect_stderr

    reference = np.load(root / f"{name}-reference.npy")
    rows, lines, failed = [], [], 0
    for quant, why in case["refused"].items():
        rows.append({"model": name, "quant": quant, "refused": why})
        lines.append(f"{name:<11} {quant:<8} refused at compile: {why}")
    for quant, folder in case["models"].items():
        try:
            with redirect_stderr(io.StringIO()):
                r = _check(root / folder, case, reference, quant)
        except Exception as exc:
            failed += 1
            rows.append({"model": name, "quant": quant, "error": repr(exc)})
            lines.append(f"{name:<11} {quant:<8} ERROR {exc!r}\n{traceback.format_exc()}")
            continue
        # q0f32 must follow the reference token for token (as on the CPU), and a batched run
        # equal the run alone within rounding; the 4-bit modes' agreement with float32 is
        # reported (a tiny random model's is as low on the CPU: compare the CPU tests)
        exact = quant == "q0f32"
        ok = (r["greedy_equal"] and r["rel_err"] < 1e-3 if exact else True) \
            and max(r["batched_vs_alone"], r["forked_vs_alone"]) < (1e-3 if exact else 2e-2)
        # a mode held against the CPU's run of the same weights: the same tokens, and logits as
        # close as the CPU's VNNI kernels allow (they round activations to 8 bits: ~1e-2)
        if "cpu_rel_err" in r:
            ok = ok and r["cpu_greedy_equal"] and r["cpu_rel_err"] < 5e-2
        failed += not ok
        rows.append({"model": name, "quant": quant, **r, "ok": ok})
        greedy = "equal" if r["greedy_equal"] else f"to {r['greedy_prefix']}"
        lines.append(f"{name:<11} {quant:<8} {r['top1']:6.0%} {r['rel_err']:8.1e} {greedy:>10} "
                     f"{r['batched_vs_alone']:8.1e} {r['decode_ms']:8.2f}  "
                     f"{'ok' if ok else 'FAIL'}  (token by token: {r['stepwise_top1']:.0%}, "
                     f"{r['stepwise_rel_err']:.1e}; forked: {r['forked_vs_alone']:.1e}"
                     + (f"; CPU twin: {r['cpu_rel_err']:.1e}, greedy "
                        f"{'equal' if r['cpu_greedy_equal'] else 'DIFFERS'}"
                        if "cpu_rel_err" in r else "") + ")")
    return rows, lines, failed


def run(root: Path, json_out: Path | None, only: list[str] | None = None,
        jobs: int = 1) -> int:
    """Run every prepared model on the GPU and print the table; 1 when a check fails. With
    `jobs`, models run in that many processes at once (each load compiles its CUDA source)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from localchat.engine.device import device_present

    spec = json.loads((root / "cases.json").read_text())
    cases = [(n, c) for n, c in spec["cases"].items() if not only or n in only]
    rows: list[dict[str, Any]] = []
    failed = 0
    print(f"{'model':<11} {'mode':<8} {'top-1':>6} {'rel err':>8} {'greedy':>10} "
          f"{'batch':>8} {'ms/step':>8}  verdict", flush=True)
    # the workers start before this process touches CUDA (spawned: a fork would share it)
    with ProcessPoolExecutor(max(1, jobs), mp_context=multiprocessing.get_context("spawn")) \
            as pool:
        futures = [pool.submit(_check_case, root, n, c) for n, c in cases]
        for future in futures:
            case_rows, lines, case_failed = future.result()
            rows += case_rows
            failed += case_failed
            print("\n".join(lines), flush=True)
    if not device_present("cuda"):
        print("no CUDA device here (or TVM's CUDA runtime did not load)", flush=True)
        return 2
    try:
        speed = run_speed(root)
    except Exception as exc:
        print(f"speed: ERROR {exc!r}", flush=True)
        traceback.print_exc()
        speed = []
    if json_out:
        json_out.write_text(json.dumps({"checks": rows, "speed": speed}, indent=1))
    print(f"{failed} failed", flush=True)
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("root", type=Path)
    a.add_argument("--arch", default="sm_90")
    a.add_argument("--only", nargs="*", default=None)
    a.add_argument("--speed", type=Path, default=None, help="an F16 .gguf of the large shape")
    a.add_argument("--speed-only", action="store_true")
    a.add_argument("--speed-moe", action="store_true", help="gpt-oss-20b's shapes at q4f32_mx")
    a.add_argument("--quants", nargs="*", default=list(QUANTS))
    b = sub.add_parser("run")
    b.add_argument("root", type=Path)
    b.add_argument("--json", type=Path, default=None)
    b.add_argument("--only", nargs="*", default=None)
    b.add_argument("--jobs", type=int, default=1)
    args = p.parse_args()
    if args.cmd == "prepare":
        if not args.speed_only:
            prepare(args.root, args.arch, args.only, tuple(args.quants))
        if args.speed:
            prepare_speed(args.root, args.arch, args.speed)
        if args.speed_moe:
            prepare_speed_moe(args.root, args.arch)
        return 0
    return run(args.root, args.json, args.only, args.jobs)


if __name__ == "__main__":
    sys.exit(main())
