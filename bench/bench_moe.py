"""Benchmark: a mixture-of-experts model of Qwen3-30B-A3B's dims on the CPU (random weights).

    python bench/bench_moe.py [--layers 8] [--quant q4f32_1] [--prompt 128] [--decode 32]
                              [--experts 128] [--top 8]

The model is Qwen3-30B-A3B's shape (hidden 2048, 32/4 heads of 128, 128 experts of width 768,
8 per token, vocabulary 151 936, untied head) with `--layers` layers (48 in the real model: the
figures are then for that many layers), random weights written once as an HF folder (float16,
the experts in transformers 5's fused layout) in the test cache, converted to `--quant` and
compiled. Printed: compile + load time, prefill tok/s on a `--prompt`-token prompt, decode
tok/s over `--decode` steps (one sequence, then 4 at once), and decode as a fraction of the read
roofline counting only the bytes a token reads: the attention's and router's weights, the
`top / experts` share of the experts' (the active ones), the norms and the LM head, against the
bandwidth of `localchat.engine.membw` sampled before and after. Routing with random weights
spreads tokens over experts about evenly, as trained routers roughly do.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SHAPE = {
    "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "moe_intermediate_size": 768, "intermediate_size": 6144, "vocab_size": 151936,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
}


def source(layers: int, experts: int, top: int) -> Path:
    """The random HF folder (written once into the test cache)."""
    from safetensors.numpy import save_file

    from fixtures import cache_dir

    out = cache_dir() / "bench" / f"qwen3-30b-a3b-shape-{layers}l-{experts}e-{top}k"
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    h, f, d = SHAPE["hidden_size"], SHAPE["moe_intermediate_size"], SHAPE["head_dim"]
    nq, nkv, vocab = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], SHAPE["vocab_size"]
    rng = np.random.default_rng(0)

    def rand(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float16)

    tensors = {"model.embed_tokens.weight": rand(vocab, h), "lm_head.weight": rand(vocab, h),
               "model.norm.weight": np.ones(h, np.float16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": rand(nq * d, h),
            p + "self_attn.k_proj.weight": rand(nkv * d, h),
            p + "self_attn.v_proj.weight": rand(nkv * d, h),
            p + "self_attn.o_proj.weight": rand(h, nq * d),
            p + "self_attn.q_norm.weight": np.ones(d, np.float16),
            p + "self_attn.k_norm.weight": np.ones(d, np.float16),
            p + "input_layernorm.weight": np.ones(h, np.float16),
            p + "post_attention_layernorm.weight": np.ones(h, np.float16),
            p + "mlp.gate.weight": rand(experts, h, scale=0.5),
            p + "mlp.experts.gate_up_proj": rand(experts, 2 * f, h),
            p + "mlp.experts.down_proj": rand(experts, h, f),
        })
    save_file(tensors, str(out / "model.safetensors"))
    config = {**SHAPE, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
              "num_hidden_layers": layers, "num_experts": experts, "num_experts_per_tok": top,
              "norm_topk_prob": True, "tie_word_embeddings": False, "torch_dtype": "float16",
              "bos_token_id": 1, "eos_token_id": 2}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def active_bytes(model_dir: Path, experts: int, top: int) -> int:
    """Weight bytes one decode step reads: all but the embedding table, experts at top/experts."""
    records = json.loads((model_dir / "tensor-cache.json").read_text())["records"]
    total = 0.0
    for shard in records:
        for r in shard["records"]:
            name, n = r["name"], int(r["nbytes"])
            if name.startswith("model.embed_tokens."):
                continue
            total += n * top / experts if ".experts." in name else n
    return int(total)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--quant", default="q4f32_1")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=32)
    args = parser.parse_args()

    from localchat.engine.membw import ReadBandwidth
    from localchat.engine.runtime import Model

    from fixtures import converted

    src = source(args.layers, args.experts, args.top)
    t0 = time.perf_counter()
    model_dir = converted(src, args.quant)
    model = Model(model_dir, "cpu")
    ready = time.perf_counter() - t0
    probe = ReadBandwidth()
    bw_before = probe.sample()
    probe.release()
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(3, SHAPE["vocab_size"], args.prompt)]

    seq = model.new_sequence()
    model.prefill(seq, prompt[:8])  # warm-up (first-call allocations)
    model.remove(seq)
    seq = model.new_sequence()
    t = time.perf_counter()
    logits = model.prefill(seq, prompt)
    prefill = args.prompt / (time.perf_counter() - t)
    tok = int(np.argmax(logits))
    t = time.perf_counter()
    for _ in range(args.decode):
        tok = int(np.argmax(model.decode([seq], [tok])[0]))
    decode = args.decode / (time.perf_counter() - t)
    model.remove(seq)

    seqs = [model.new_sequence() for _ in range(4)]
    for s in seqs:
        model.prefill(s, prompt[:16])
    toks = [5, 6, 7, 8]
    t = time.perf_counter()
    for _ in range(args.decode // 2):
        toks = [int(np.argmax(row)) for row in model.decode(seqs, toks)]
    decode4 = 4 * (args.decode // 2) / (time.perf_counter() - t)
    bw_after = probe.sample()
    bw = max(bw_before, bw_after)
    per_token = active_bytes(model_dir, args.experts, args.top)
    print(f"Qwen3-30B-A3B shape, {args.layers} of 48 layers, {args.experts} experts, top "
          f"{args.top}, {args.quant}, random weights")
    print(f"  compile+convert+load   {ready:8.1f} s (cached after the first run)")
    print(f"  prefill ({args.prompt} tokens)  {prefill:8.1f} tok/s")
    print(f"  decode (1 sequence)    {decode:8.2f} tok/s")
    print(f"  decode (4 sequences)   {decode4:8.2f} tok/s (summed)")
    print(f"  bytes read per token   {per_token / 1e6:8.1f} MB (active experts, attention, head)")
    print(f"  read bandwidth         {bw_before:.1f} / {bw_after:.1f} GB/s (before / after)")
    print(f"  decode vs roofline     {per_token * decode / (bw * 1e9):8.1%}")


if __name__ == "__main__":
    main()
