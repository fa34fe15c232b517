"""Benchmark: a mixture-of-experts model of Qwen3-30B-A3B's or gpt-oss-20b's dims on the CPU
(random weights).

    python bench/bench_moe.py [--shape qwen3-30b-a3b|gpt-oss-20b] [--layers N] [--quant q4f32_1]
                              [--prompt 128] [--decode 32] [--experts E] [--top K]
                              [--peer Q4_0,Q4_K_M] [--rounds N] [--long N]
    python bench/bench_moe.py --shape gpt-oss-20b --layers 4 --peer MXFP4_MOE,Q4_K_M

Shapes (`--shape`; `--layers`, `--experts` and `--top` default to the shape's):

* `qwen3-30b-a3b` (default): Qwen3-30B-A3B's shape (hidden 2048, 32/4 heads of 128, 128 experts
  of width 768, 8 per token, vocabulary 151 936, untied head), 8 layers by default (48 in the
  real model), the experts in transformers 5's fused layout;
* `gpt-oss-20b`: gpt-oss-20b's (transformers' `GptOssConfig` with its 20b sizes: hidden 2880,
  64/8 heads of 64, 32 experts of width 2880, 4 per token, vocabulary 201 088, untied head;
  attention sinks, q/k/v/o biases, a window of 128 on every other layer from layer 0, a biased
  router and experts, the SwiGLU clamped at 7, YaRN rope of factor 32 over 4,096 positions,
  untruncated), 4 layers by default (24 in the real model), the experts in transformers'
  GptOss layout (gate/up [E, H, 2F] in alternate columns, down [E, F, H], their biases). Its
  token embedding and head are 580M parameters each, so one layer is already a 4 GB folder.

Both have a context of 4,096 positions (YaRN's frequencies do not depend on it). The random
weights are written once as an HF folder (float16; gpt-oss one shard a layer) in the test cache,
converted to `--quant` (any mode conversion knows, e.g. q4f32_1, or q4f32_mx once it exists) and
compiled. Printed: compile + load time, prefill tok/s on a `--prompt`-token prompt, decode
tok/s over `--decode` steps (one sequence, then 4 at once), and decode as a fraction of the read
roofline counting only the bytes a token reads: the attention's and router's weights, the
`top / experts` share of the experts' (the active ones, their biases too), the norms and the LM
head, against the bandwidth of `localchat.engine.membw` sampled before and after. Routing with
random weights spreads tokens over experts about evenly, as trained routers roughly do.

`--peer Q4_0,Q4_K_M` (for gpt-oss: `MXFP4_MOE,Q4_K_M`, MXFP4_MOE being the type llama.cpp's
gpt-oss files come in: experts MXFP4, the rest Q8_0; its K-quants fall back to Q5_0 / Q8_0 on
gpt-oss's 2880-wide rows) also times llama.cpp on the same weights: the HF folder written as its
`qwen3moe` or `gpt-oss` GGUF (bench/moe_gguf.py: F16, or Q8_0 where F16 and a 4-bit file would
not fit 10 GB of disk at once), each type quantized from it by `llama_model_quantize`, each
timed in a process of its own at 1 and 2 threads (`--peer-threads`) as bench/bench_engine.py
times its peer: prefill of the same prompt, then greedy decode steps. A table then gives ours
and each peer row: prefill and decode tok/s and decode against the same roofline (a GGUF's bytes
a token reads: all but the token embedding, the merged experts' tensors at top / experts), and
ours against the fastest peer row. The source GGUF is deleted after the last quantization, the
quantized files after the last round (so the source and one 4-bit file, then the 4-bit files, are
on the disk at once). `--rounds N` times ours and every peer row N times, interleaved (ours kept
loaded between its rounds): the table gives medians, then each round's ratio of ours to that
round's fastest peer row, median and range (this VM's bandwidth moves by tens of percent within
minutes, so one run's ratio is only as good as the bandwidths its rows happened to get).

`--long N` (default 0: none) adds a long-context decode row, as bench/bench_engine.py's `--long`:
ours and each peer row also prefill a fresh sequence of N prompt tokens (`prompt_ids(N)`, the same
for both) and time `LONG_DECODE` greedy decode steps after them ("long dec" in the table, and its
ratio to the fastest peer row beside the others'). N + `LONG_DECODE` must fit the context (4,096).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

LONG_DECODE = 32  # decode steps timed after the `--long` prompt
# (key, label) of the rates ours is set against the peer's; the long decode only with --long
METRICS = (("decode_tok_s", "decode"), ("prefill_tok_s", "prefill"),
           ("long_decode_tok_s", "long decode"))

SHAPE = {
    "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "moe_intermediate_size": 768, "intermediate_size": 6144, "vocab_size": 151936,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
}
# gpt-oss-20b's config.json as transformers' GptOssConfig writes it (the context 4096 as above;
# the experts' count, the layers and their layer_types are the benchmark's)
GPT_OSS_SHAPE = {
    "hidden_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "intermediate_size": 2880, "vocab_size": 201088, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "sliding_window": 128, "attention_bias": True,
    "swiglu_limit": 7.0, "swiglu_alpha": 1.702,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                        "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False},
}
# --shape: its config, name, real depth and routing; the benchmark's default depth
SHAPES = {
    "qwen3-30b-a3b": {"config": SHAPE, "name": "Qwen3-30B-A3B", "real_layers": 48,
                      "experts": 128, "top": 8, "layers": 8},
    "gpt-oss-20b": {"config": GPT_OSS_SHAPE, "name": "gpt-oss-20b", "real_layers": 24,
                    "experts": 32, "top": 4, "layers": 4},
}


def source(layers: int, experts: int, top: int, shape: str = "qwen3-30b-a3b") -> Path:
    """The random HF folder of `shape` (written once into the test cache)."""
    if shape == "gpt-oss-20b":
        return gpt_oss_source(layers, experts, top)
    from disk_guard import require_free
    from safetensors.numpy import save_file

    from fixtures import cache_dir

    out = cache_dir() / "bench" / f"qwen3-30b-a3b-shape-{layers}l-{experts}e-{top}k"
    if (out / "config.json").exists():
        return out
    h, f, d = SHAPE["hidden_size"], SHAPE["moe_intermediate_size"], SHAPE["head_dim"]
    nq, nkv, vocab = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], SHAPE["vocab_size"]
    params = 2 * vocab * h + layers * (2 * (nq + nkv) * d * h + 3 * experts * f * h)
    # the float16 folder and its 4-bit conversion beside it
    require_free(out.parent, int(params * 2 * 1.4), "the MoE benchmark model")
    out.mkdir(parents=True, exist_ok=True)
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


def gpt_oss_source(layers: int, experts: int, top: int) -> Path:
    """gpt-oss-20b's random HF folder (written once into the test cache): transformers' GptOss
    tensors and config.json, one safetensors shard for the embedding, head and final norm and
    one a layer (each written before the next is drawn)."""
    from disk_guard import require_free
    from safetensors.numpy import save_file

    from fixtures import cache_dir

    cfg = GPT_OSS_SHAPE
    out = cache_dir() / "bench" / f"gpt-oss-20b-shape-{layers}l-{experts}e-{top}k"
    if (out / "config.json").exists():
        return out
    h, f, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    params = 2 * vocab * h + layers * (2 * (nq + nkv) * d * h + 3 * experts * f * h)
    # the float16 folder and its 4-bit conversion beside it
    require_free(out.parent, int(params * 2 * 1.4), "the gpt-oss MoE benchmark model")
    shutil.rmtree(out, ignore_errors=True)  # a half-written folder of an interrupted run
    out.mkdir(parents=True)
    rng = np.random.default_rng(0)

    def rand(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float16)

    weight_map = {}

    def save(index: int, tensors: dict[str, np.ndarray]) -> None:
        shard = f"model-{index + 1:05d}-of-{layers + 1:05d}.safetensors"
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))

    save(0, {"model.embed_tokens.weight": rand(vocab, h), "lm_head.weight": rand(vocab, h),
             "model.norm.weight": np.ones(h, np.float16)})
    for i in range(layers):
        p = f"model.layers.{i}."
        save(i + 1, {
            p + "input_layernorm.weight": np.ones(h, np.float16),
            p + "post_attention_layernorm.weight": np.ones(h, np.float16),
            p + "self_attn.q_proj.weight": rand(nq * d, h),
            p + "self_attn.q_proj.bias": rand(nq * d),
            p + "self_attn.k_proj.weight": rand(nkv * d, h),
            p + "self_attn.k_proj.bias": rand(nkv * d),
            p + "self_attn.v_proj.weight": rand(nkv * d, h),
            p + "self_attn.v_proj.bias": rand(nkv * d),
            p + "self_attn.o_proj.weight": rand(h, nq * d),
            p + "self_attn.o_proj.bias": rand(h),
            p + "self_attn.sinks": rand(nq, scale=1.0),
            p + "mlp.router.weight": rand(experts, h, scale=0.5),
            p + "mlp.router.bias": rand(experts, scale=0.1),
            # [E, in, out]; gate_up's gate at even columns, up at odd
            p + "mlp.experts.gate_up_proj": rand(experts, h, 2 * f),
            p + "mlp.experts.gate_up_proj_bias": rand(experts, 2 * f),
            p + "mlp.experts.down_proj": rand(experts, f, h),
            p + "mlp.experts.down_proj_bias": rand(experts, h),
        })
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(p.stat().st_size for p in out.glob("*.safetensors"))},
         "weight_map": weight_map}, indent=2))
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    config = {**cfg, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
              "num_hidden_layers": layers, "num_local_experts": experts,
              "num_experts_per_tok": top, "layer_types": types, "hidden_act": "silu",
              "tie_word_embeddings": False, "dtype": "float16", "bos_token_id": 1,
              "eos_token_id": 2, "pad_token_id": 0}
    (out / "config.json").write_text(json.dumps(config, indent=2))  # last: the folder is whole
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


def prompt_ids(n: int, vocab: int = SHAPE["vocab_size"]) -> list[int]:
    """The benchmark's `n`-token prompt (random ids, the same for ours and the peer)."""
    rng = np.random.default_rng(1)
    return [int(t) for t in rng.integers(3, vocab, n)]


def peer_child(path: Path, threads: int, prompt: int, decode: int, shape: str,
               long: int = 0) -> dict:
    """llama.cpp's timing of `path` at `threads` threads, in a process of its own."""
    out = subprocess.run(
        [sys.executable, __file__, "--peer-child", str(path), "--peer-threads", str(threads),
         "--prompt", str(prompt), "--decode", str(decode), "--shape", shape,
         "--long", str(long)],
        capture_output=True, text=True, env=dict(os.environ, TVM_NUM_THREADS=str(threads)))
    if out.returncode != 0:
        raise SystemExit(f"llama.cpp on {path.name} ({threads} threads) failed:\n"
                         f"{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def make_peers(src: Path, args: argparse.Namespace, work: Path) -> list[tuple[str, Path, int]]:
    """llama.cpp's files of the same weights in `work`: (type, path, bytes a token reads) for
    each --peer type; the source GGUF is deleted after the last quantization."""
    import moe_gguf
    from gguf_quantize import quantize

    dtype = moe_gguf.source_type(src, work)
    t = time.perf_counter()
    source = moe_gguf.write_gguf(src, work / f"{dtype}.gguf", dtype)
    print(f"  peer source GGUF       {dtype}, {source.stat().st_size / 1e9:.2f} GB written in "
          f"{time.perf_counter() - t:.0f} s", flush=True)
    peers = []
    for qtype in args.peer.split(","):
        t = time.perf_counter()
        path = quantize(source, work / f"{qtype}.gguf", qtype)
        print(f"  llama.cpp {qtype:<12} {path.stat().st_size / 1e9:.2f} GB, quantized in "
              f"{time.perf_counter() - t:.0f} s", flush=True)
        peers.append((qtype, path, moe_gguf.bytes_per_token(path, args.experts, args.top)))
    source.unlink()
    return peers


def time_peer(path: Path, qtype: str, per_token: int, threads: int,
              args: argparse.Namespace, probe) -> dict:
    """One llama.cpp row, the bandwidth sampled around it (the probe's buffer released while
    the peer runs)."""
    before = probe.sample()
    probe.release()
    r = peer_child(path, threads, args.prompt, args.decode, args.shape, args.long)
    r.update(name=f"llama.cpp {qtype}", threads=threads, bytes_per_token=per_token,
             bw=max(before, probe.sample()))
    probe.release()
    return r


def median_rows(runs: dict[str, list[dict]]) -> list[dict]:
    """Each engine's row: the median of its rates and bandwidths over the rounds, its roofline
    fraction the median of each run's."""
    import statistics

    rows = []
    for samples in runs.values():
        row = dict(samples[0])
        for key in ("prefill_tok_s", "decode_tok_s", "long_decode_tok_s", "bw"):
            if all(r.get(key) for r in samples):
                row[key] = statistics.median(r[key] for r in samples)
        row["roof"] = statistics.median(_roof(r) for r in samples)
        rows.append(row)
    return rows


def _roof(r: dict) -> float:
    return r["bytes_per_token"] * r["decode_tok_s"] / (r["bw"] * 1e9)


def print_paired(rounds: list[dict[str, dict]], ours: str) -> None:
    """Per round, ours against that round's fastest peer row: median and range."""
    import statistics

    cells = []
    for key, label in METRICS:
        if not all(r.get(key) for rnd in rounds for r in rnd.values()):
            continue  # no long decode without --long
        ratios = [rnd[ours][key] / max(r[key] for name, r in rnd.items() if name != ours)
                  for rnd in rounds]
        cells.append(f"{label} {statistics.median(ratios):.2f}x "
                     f"({min(ratios):.2f}-{max(ratios):.2f})")
    print(f"paired, per round ({len(rounds)} rounds): ours / the round's fastest llama.cpp row, "
          "median (min-max): " + "; ".join(cells))


def print_table(rows: list[dict]) -> None:
    """Ours and llama.cpp's rows side by side, then ours against the fastest peer row."""
    print(f"\n{'engine':<22}{'thr':>4}{'MB/tok':>8}{'prefill':>9}{'decode':>8}{'long dec':>9}"
          f"{'GB/s':>6}{'of roof':>8}  first tokens")
    for r in rows:
        roof = r.get("roof", _roof(r))
        first = " ".join(map(str, r.get("tokens", []))) + ("" if r.get("finite", True)
                                                           else " NON-FINITE LOGITS")
        longd = f"{r['long_decode_tok_s']:.2f}" if r.get("long_decode_tok_s") else "-"
        print(f"{r['name']:<22}{r['threads']:>4}{r['bytes_per_token'] / 1e6:>8.1f}"
              f"{r['prefill_tok_s']:>9.1f}{r['decode_tok_s']:>8.2f}{longd:>9}{r['bw']:>6.1f}"
              f"{roof:>8.1%}  {first}")
    ours, peers = rows[0], rows[1:]
    line = []
    for key, label in METRICS:
        if not ours.get(key) or not all(r.get(key) for r in peers):
            continue  # no long decode without --long
        top = max(peers, key=lambda r, k=key: r[k])
        line.append(f"{label} {ours[key] / top[key]:.2f}x ({top['name'].split()[-1]} "
                    f"{top['threads']}t {top[key]:.1f} tok/s)")
    print("ours / fastest llama.cpp row: " + "; ".join(line))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's (8, 4)")
    parser.add_argument("--experts", type=int, default=None, help="default: the shape's")
    parser.add_argument("--top", type=int, default=None, help="default: the shape's")
    parser.add_argument("--quant", default="q4f32_1",
                        help="our quantization mode, e.g. q4f32_1 (or q4f32_mx)")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--peer", default=None,
                        help="llama.cpp's quantizations to time beside ours, e.g. Q4_0,Q4_K_M "
                        "(gpt-oss: MXFP4_MOE,Q4_K_M)")
    parser.add_argument("--peer-threads", default="1,2", help="llama.cpp's thread counts")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time ours and every peer row this many times, interleaved; the "
                        "table gives medians, then each round's ratio")
    parser.add_argument("--long", type=int, default=0,
                        help="also time LONG_DECODE (32) greedy decode steps after a prompt of "
                        "this many tokens (default 0: none)")
    parser.add_argument("--peer-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    for key in ("layers", "experts", "top"):
        if getattr(args, key) is None:
            setattr(args, key, shape[key])
    vocab = shape["config"]["vocab_size"]
    if args.peer_child:  # one llama.cpp timing (run by peer_child)
        import moe_gguf

        result = moe_gguf.run_peer(Path(args.peer_child), int(args.peer_threads),
                                   prompt_ids(args.prompt, vocab), args.decode,
                                   prompt_ids(args.long, vocab) if args.long else None,
                                   LONG_DECODE)
        print(json.dumps(result))
        return

    from localchat.engine.membw import ReadBandwidth
    from localchat.engine.runtime import Model

    from fixtures import converted

    context = shape["config"]["max_position_embeddings"]
    if args.long and args.long + LONG_DECODE > context:
        parser.error(f"--long {args.long} and {LONG_DECODE} decode steps exceed the context "
                     f"of {context} tokens")
    src = source(args.layers, args.experts, args.top, args.shape)
    t0 = time.perf_counter()
    model_dir = converted(src, args.quant)
    # room in the KV cache for the long sequence, as bench_engine gives it (the default,
    # without --long, is the model's context window)
    model = Model(model_dir, "cpu", max_total_tokens=max(context, args.long + 2 * LONG_DECODE)
                  if args.long else None)
    ready = time.perf_counter() - t0
    probe = ReadBandwidth()
    bw_before = probe.sample()
    probe.release()
    prompt = prompt_ids(args.prompt, vocab)
    long_prompt = prompt_ids(args.long, vocab) if args.long else None

    first = time_ours(model, prompt, args.decode, long_prompt)
    bw_after = probe.sample()
    probe.release()
    bw = max(bw_before, bw_after)
    per_token = active_bytes(model_dir, args.experts, args.top)
    print(f"{shape['name']} shape, {args.layers} of {shape['real_layers']} layers, "
          f"{args.experts} experts, top {args.top}, {args.quant}, random weights")
    print(f"  compile+convert+load   {ready:8.1f} s (cached after the first run)")
    print(f"  prefill ({args.prompt} tokens)  {first['prefill_tok_s']:8.1f} tok/s")
    print(f"  decode (1 sequence)    {first['decode_tok_s']:8.2f} tok/s")
    print(f"  decode (4 sequences)   {first['decode4_tok_s']:8.2f} tok/s (summed)")
    if args.long:
        print(f"  long decode            {first['long_decode_tok_s']:8.2f} tok/s "
              f"({LONG_DECODE} steps after a {args.long}-token prompt)")
    print(f"  bytes read per token   {per_token / 1e6:8.1f} MB (active experts, attention, head)")
    print(f"  read bandwidth         {bw_before:.1f} / {bw_after:.1f} GB/s (before / after)")
    print(f"  decode vs roofline     {per_token * first['decode_tok_s'] / (bw * 1e9):8.1%}")
    if not args.peer:
        return
    sys.stdout.flush()
    threads = int(os.environ.get("TVM_NUM_THREADS") or os.cpu_count() or 1)
    name = f"localchat {args.quant}"
    first.update(name=name, threads=threads, bytes_per_token=per_token, bw=bw)
    work = src.parent / f"{src.name}-gguf"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        peers = make_peers(src, args, work)
        runs: dict[str, list[dict]] = {}
        rounds = []
        for rnd in range(max(1, args.rounds)):
            if rnd:  # ours again, between the peers' previous round and their next
                before = probe.sample()
                probe.release()
                again = time_ours(model, prompt, args.decode, long_prompt)
                again.update(name=name, threads=threads, bytes_per_token=per_token,
                             bw=max(before, probe.sample()))
                probe.release()
            row = first if rnd == 0 else again
            this = {name: row}
            runs.setdefault(name, []).append(row)
            for qtype, path, peer_bytes in peers:
                for n in (int(t) for t in args.peer_threads.split(",")):
                    r = time_peer(path, qtype, peer_bytes, n, args, probe)
                    this[f"{r['name']} {n}t"] = r
                    runs.setdefault(f"{r['name']} {n}t", []).append(r)
            rounds.append(this)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(median_rows(runs))
    if len(rounds) > 1:
        print_paired(rounds, name)


def time_ours(model, prompt: list[int], steps: int, long: list[int] | None = None) -> dict:
    """Our prefill of `prompt`, then `steps` greedy decode steps of one sequence and `steps / 2`
    of four at once (tok/s summed); with `long`, a fresh sequence prefilled with it, then
    `LONG_DECODE` greedy steps timed."""
    seq = model.new_sequence()
    # warm-up (first-call allocations), a decode step too: the first steps after a load
    # otherwise carry them into the decode rate
    model.decode([seq], [int(np.argmax(model.prefill(seq, prompt[:8])))])
    model.remove(seq)
    seq = model.new_sequence()
    t = time.perf_counter()
    logits = model.prefill(seq, prompt)
    prefill = len(prompt) / (time.perf_counter() - t)
    tok = int(np.argmax(logits))
    t = time.perf_counter()
    for _ in range(steps):
        tok = int(np.argmax(model.decode([seq], [tok])[0]))
    decode = steps / (time.perf_counter() - t)
    model.remove(seq)
    seqs = [model.new_sequence() for _ in range(4)]
    for s in seqs:
        model.prefill(s, prompt[:16])
    toks = [5, 6, 7, 8]
    t = time.perf_counter()
    for _ in range(steps // 2):
        toks = [int(np.argmax(row)) for row in model.decode(seqs, toks)]
    decode4 = 4 * (steps // 2) / (time.perf_counter() - t)
    for s in seqs:
        model.remove(s)
    result = {"prefill_tok_s": prefill, "decode_tok_s": decode, "decode4_tok_s": decode4}
    if long:
        seq = model.new_sequence()
        tok = int(np.argmax(model.prefill(seq, long)))  # in prefill chunks
        t = time.perf_counter()
        for _ in range(LONG_DECODE):
            tok = int(np.argmax(model.decode([seq], [tok])[0]))
        result["long_decode_tok_s"] = LONG_DECODE / (time.perf_counter() - t)
        model.remove(seq)
    return result


if __name__ == "__main__":
    main()
