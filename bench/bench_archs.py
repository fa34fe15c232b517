"""Benchmark: each dense architecture of issue 24 at a 1B-class shape, beside a Llama of the same
weight bytes, at q4f32_1 on this CPU (not a test).

    python bench/bench_archs.py [--layers N] [--archs qwen3,gemma3,...] [--quant q4f32_1]

Every model has the dims of bench_engine.py's `1b` Llama (hidden 2048, MLP 8192, 32/8 heads of
64, 16 layers, tied embeddings) with random weights (transformers' config classes, saved in
float16 into the test cache), and differs only in what its architecture changes: Qwen3's q/k
norms, Gemma's GELU-tanh, sandwich norms, soft-caps (2) or q/k norms and 5:1 local/global layers
(3), OLMo 2's post-norms and q/k norms over the projection, SmolLM3's layers without rope, Phi-3's
partial rotary (0.75) and LongRoPE. The vocabulary is Llama's 49 152, except Gemma's 262 144
(Gemma 3's real one; Gemma 2's is 256 000): each Gemma row has its own Llama of that vocabulary,
so every row's Llama holds the same weight bytes. `--layers N` builds N layers instead (the
table says so: its figures are then for N layers, not the whole model).

Per row: prefill tok/s on a 451-token prompt, decode tok/s over 64 tokens, the same for its
Llama, and the ratios; the Gemma rows also time the LM head alone (the GEMV over the vocabulary,
as one decode step's share). Each model runs in its own process, one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

PROMPT_TOKENS = 451
DECODE_TOKENS = 64
BASE: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
}
GEMMA_VOCAB = 262144
# the architecture's config class and what it changes over BASE
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", {}),
    "gemma2": ("Gemma2Config", {"vocab_size": GEMMA_VOCAB, "query_pre_attn_scalar": 64,
                                "sliding_window": 4096}),
    "gemma3": ("Gemma3TextConfig", {"vocab_size": GEMMA_VOCAB, "query_pre_attn_scalar": 64,
                                    "sliding_window": 512}),
    "olmo2": ("Olmo2Config", {}),
    "smollm3": ("SmolLM3Config", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "phi3": ("Phi3Config", {
        "original_max_position_embeddings": 4096, "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.75,
                            "short_factor": [1.0 + 0.01 * i for i in range(24)],
                            "long_factor": [1.0 + 0.5 * i for i in range(24)]}}),
}


def source(arch: str, vocab: int, layers: int | None) -> Path:
    """The random HF folder of `arch` (vocabulary `vocab`), built once into the test cache."""
    import torch
    import transformers
    from disk_guard import require_free

    from fixtures import cache_dir

    cls_name, extra = ARCHS[arch]
    cfg = {**BASE, **extra, "vocab_size": vocab}
    if layers:
        cfg["num_hidden_layers"] = layers
    if arch == "smollm3":  # every 4th layer without rope, as the real model
        cfg["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(cfg["num_hidden_layers"])]
    out = cache_dir() / "bench-archs" / f"{arch}-v{vocab}-l{cfg['num_hidden_layers']}"
    if (out / "config.json").exists():
        return out
    config = getattr(transformers, cls_name)(**cfg)
    model_cls = getattr(transformers, cls_name.replace("TextConfig", "Config")
                        .replace("Config", "ForCausalLM"))
    torch.manual_seed(0)
    model = model_cls._from_config(config, dtype=torch.float16).eval()
    # the float16 folder and its 4-bit conversion beside it
    require_free(out.parent, int(model.num_parameters() * 2 * 1.5), f"the {arch} benchmark model")
    tmp = out.with_name(out.name + ".part")
    model.save_pretrained(tmp)
    tmp.rename(out)
    return out


def model_dir(arch: str, vocab: int, layers: int | None, quant: str) -> Path:
    """`arch` converted to `quant` (a window of 2048: the prompt and decode fit)."""
    from localchat.engine.build.convert import convert_model

    src = source(arch, vocab, layers)
    out = src.with_name(f"{src.name}-{quant}")
    if not (out / "localchat-config.json").exists():
        convert_model(src, out, quant, context_window_size=2048)
    return out


def run(arch: str, vocab: int, layers: int | None, quant: str) -> dict[str, float]:
    """Prefill and decode tok/s of one model (in this process), and its LM head's share."""
    import time

    import numpy as np

    from localchat.engine.runtime import Model

    model = Model(model_dir(arch, vocab, layers, quant), "cpu", max_total_tokens=2048)
    ids = [int(t) for t in np.random.RandomState(0).randint(3, 1000, PROMPT_TOKENS)]
    warm = model.new_sequence()
    model.prefill(warm, ids[:32])
    model.remove(warm)
    seq = model.new_sequence()
    start = time.perf_counter()
    tok = int(np.argmax(model.prefill(seq, ids)))
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        tok = int(np.argmax(model.decode([seq], [tok])[0]))
    decode_s = time.perf_counter() - start
    model.remove(seq)
    return {"prefill_tok_s": PROMPT_TOKENS / prefill_s, "decode_tok_s": DECODE_TOKENS / decode_s,
            "compile_s": model.compile_seconds}


def child(arch: str, vocab: int, layers: int | None, quant: str) -> dict[str, float]:
    args = [sys.executable, __file__, "--child", f"{arch}:{vocab}", "--quant", quant]
    if layers:
        args += ["--layers", str(layers)]
    out = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ))
    if out.returncode != 0:
        raise SystemExit(f"{arch} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def head_gemv_ms(vocab: int, rows: int = 1) -> float:
    """Milliseconds of the LM head alone: the decode GEMV of [rows, 2048] by a tied
    [vocab, 2048] embedding in q4f32_1's 4-bit layout (the kernel a q4 model's head runs)."""
    import time

    import numpy as np
    import tvm

    from localchat.engine.build.quantization import quantize_q4
    from localchat.engine.device import cpu_target
    from localchat.engine.kernels import gemv
    from localchat.engine.kernels.common import gemv_isa

    k = BASE["hidden_size"]
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((vocab, k), dtype=np.float32) * 0.02)
    words, scale = quantize_q4(w, "float32")
    target = cpu_target()
    # the head's kernel as the engine picks it: the int8 GEMV on AVX2/VNNI CPUs (`gemv_isa`)
    func = gemv.gemv_q4(k, vocab, "float32", gemv_isa(target))
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in
            (rng.standard_normal((rows, k), dtype=np.float32), words, scale)]
    y = tvm.runtime.tensor(np.zeros((rows, vocab), np.float32), dev)
    lib["main"](*args, y)
    start = time.perf_counter()
    for _ in range(20):
        lib["main"](*args, y)
    return (time.perf_counter() - start) / 20 * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--archs", default=",".join(a for a in ARCHS if a != "llama"))
    parser.add_argument("--quant", default="q4f32_1")
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    if args.child:
        arch, vocab = args.child.split(":")
        print(json.dumps(run(arch, int(vocab), args.layers, args.quant)))
        return
    archs = [a for a in args.archs.split(",") if a]
    layers = args.layers or BASE["num_hidden_layers"]
    results: dict[tuple[str, int], dict[str, float]] = {}
    for arch in archs:
        vocab = GEMMA_VOCAB if arch.startswith("gemma") else BASE["vocab_size"]
        for name in ("llama", arch):
            if (name, vocab) not in results:
                results[(name, vocab)] = child(name, vocab, args.layers, args.quant)
    print(f"\n{args.quant}, 1B-class shape with {layers} layers "
          f"(hidden 2048, MLP 8192, 32/8 heads), {PROMPT_TOKENS}-token prefill, "
          f"{DECODE_TOKENS}-token decode")
    print("| architecture | vocab | prefill tok/s | Llama prefill | ratio | decode tok/s "
          "| Llama decode | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for arch in archs:
        vocab = GEMMA_VOCAB if arch.startswith("gemma") else BASE["vocab_size"]
        ours, ref = results[(arch, vocab)], results[("llama", vocab)]
        print(f"| {arch} | {vocab} | {ours['prefill_tok_s']:.1f} | {ref['prefill_tok_s']:.1f} | "
              f"{ours['prefill_tok_s'] / ref['prefill_tok_s']:.2f} | "
              f"{ours['decode_tok_s']:.2f} | {ref['decode_tok_s']:.2f} | "
              f"{ours['decode_tok_s'] / ref['decode_tok_s']:.2f} |")
    if any(a.startswith("gemma") for a in archs):
        # the engine's thread count (the models ran with it); TVM's pool reads this at its first
        # parallel call, which in this process is the head's
        os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))
        big, small = head_gemv_ms(GEMMA_VOCAB), head_gemv_ms(BASE["vocab_size"])
        decode_ms = 1000 / results[("gemma3" if "gemma3" in archs else "gemma2",
                                    GEMMA_VOCAB)]["decode_tok_s"]
        mb = GEMMA_VOCAB * BASE["hidden_size"] * 5 / 8 / 1e6  # 4 bits + a float32 per 32
        print(f"\nLM head GEMV alone (q4, one row): {GEMMA_VOCAB} x 2048: {big:.2f} ms "
              f"({mb / big:.1f} GB/s of {mb:.0f} MB), {BASE['vocab_size']} x 2048: "
              f"{small:.2f} ms; Gemma's head is {big / decode_ms:.0%} of its decode step")


if __name__ == "__main__":
    main()
