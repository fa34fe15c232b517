"""Benchmark: localchat (q4f32_1, q0f32 or --quant) beside llama.cpp on this CPU, per model shape.

    python bench/bench_engine.py [--shape smollm2|1b|rwkv3b] [--threads 1,2] [--skip-llama-cpp]
                                 [--skip-agreement] [--batches 1,4,16]
                                 [--quant q4f32_1,q4f32_asym,q0f32]

Shapes:

* `smollm2` (default): the real SmolLM2-135M-Instruct, ours converted from its HF folder, llama.cpp
  on its Q4_1 GGUF; also each 4-bit mode's top-1 agreement with q0f32 over 128 greedy steps
  (q0f32 greedy, q4 teacher-forced on those tokens);
* `1b`: a Llama of 1B shape (hidden 2048, 16 layers, MLP 8192, 32/8 heads, vocab 49 152, tied
  embeddings) with random weights, written once as an F16 GGUF with SmolLM2's tokenizer; llama.cpp
  quantizes its copy to Q4_1 (every tensor), ours imports the same file (`gguf_to_hf_folder`, what
  `localchat pull FILE.gguf` runs) and converts it to q4f32_1. Files are cached in the test cache
  (tests/fixtures.cache_dir()) so a second run starts at once;
* `rwkv3b`: runs bench/bench_rwkv.py (RWKV-4 World 3B shape, random weights; decode as a fraction
  of the roofline it measures itself).

For each engine and thread count: prefill tok/s on a 451-token prompt, decode tok/s over 128
tokens, peak RSS, compile and load time, ratios to llama.cpp at the same thread count; the read
bandwidth of a compiled streaming sum over 1 GiB (`localchat.engine.membw`, the probe `localchat
bench` uses too), sampled before and after each run (this VM's bandwidth follows its neighbours'
load), and decode as a fraction of that roofline: weight bytes read per token x tok/s /
bandwidth (the layers' 4-bit weights, 20 bytes per 32 in q4f32_1, q4f32_asym and Q4_1, and the
LM head: 4-bit in q4f32_1 and in the 1b shape's all-Q4_1 file, 8-bit (34 bytes per 32) in
q4f32_asym and in SmolLM2's GGUF, Q8_0). Ours also decodes 1, 4 and 16 sequences at once
(`Model.decode` on a list of sequences; tok/s summed over the sequences). Each configuration runs
in its own process so peak RSS is its own.
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
AGREE_STEPS = 128
BATCH_PROMPT = 16  # tokens prefilled per sequence before the batched decode
BATCH_STEPS = 32  # decode steps of the batched measurement
TEXT = (
    "The history of the lighthouse begins with fires lit on hilltops to guide ships home. "
    "Over centuries these became towers of stone, then of iron, with lamps of oil and "
    "later electricity, lenses that bent light into beams seen for miles across the sea. "
) * 20
AGREE_PROMPT = (
    "<|im_start|>user\nWrite a short story about a lighthouse keeper who finds a message in a "
    "bottle.<|im_end|>\n<|im_start|>assistant\n"
)

SMOLLM2 = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
}
LLAMA_1B = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 49152,
}
Q4_BYTES_PER_WEIGHT = 20 / 32  # q4f32_1: 16 bytes of nibbles + a float32 scale; Q4_1: + 2 f16
Q8_BYTES_PER_WEIGHT = 34 / 32  # 32 int8 + a float16 scale (Q8_0; the asymmetric modes' head)


def weights_read_per_token(cfg: dict) -> tuple[int, int]:
    """Weights a decode step reads: (every layer's projections, the (tied) LM head)."""
    h, f, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = h // cfg["num_attention_heads"]
    qkv = h * (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * head_dim
    per_layer = qkv + h * h + 3 * h * f
    return layers * per_layer, cfg["vocab_size"] * h


def bytes_read_per_token(cfg: dict, engine: str, shape: str) -> float:
    """Weight bytes a decode step of `engine` ("llama.cpp" or a quantization) reads."""
    layers, head = weights_read_per_token(cfg)
    head_8bit = engine.endswith("_asym") or (engine == "llama.cpp" and shape == "smollm2")
    return (layers * Q4_BYTES_PER_WEIGHT
            + head * (Q8_BYTES_PER_WEIGHT if head_8bit else Q4_BYTES_PER_WEIGHT))


def _peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: getrusage's maxrss would carry over the parent's peak
    across fork + exec, and the parent holds the bandwidth probe's 2 GiB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- the 1B-shape model files --------------------------------------------------------------------
def _bench_dir() -> Path:
    from fixtures import cache_dir

    out = cache_dir() / "bench-llama-1b"
    out.mkdir(parents=True, exist_ok=True)
    return out


def llama_1b_gguf() -> Path:
    """The F16 GGUF of the 1B shape (random weights, SmolLM2's tokenizer), written once."""
    import gguf
    import numpy as np

    from fixtures import smollm2_gguf

    path = _bench_dir() / "llama-1b-f16.gguf"
    if path.exists():
        return path
    cfg = LLAMA_1B
    h, f, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = h // heads
    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_block_count(layers)
    w.add_context_length(2048)
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    src = gguf.GGUFReader(str(smollm2_gguf()))
    for key, field in src.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub)
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    w.add_tensor("token_embd.weight", rand(cfg["vocab_size"], h))
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", rand(heads * head_dim, h))
        w.add_tensor(f"blk.{i}.attn_k.weight", rand(kv * head_dim, h))
        w.add_tensor(f"blk.{i}.attn_v.weight", rand(kv * head_dim, h))
        w.add_tensor(f"blk.{i}.attn_output.weight", rand(h, heads * head_dim))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", rand(f, h))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand(f, h))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand(h, f))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)
    return path


def llama_1b_q4_1() -> Path:
    """llama.cpp's Q4_1 copy of the 1B GGUF (every tensor Q4_1, as ours are all 4-bit)."""
    import ctypes

    import llama_cpp

    path = _bench_dir() / "llama-1b-q4_1.gguf"
    if path.exists():
        return path
    src = llama_1b_gguf()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1
    params.nthread = os.cpu_count() or 1
    params.pure = True
    tmp = path.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed ({rc})")
    tmp.rename(path)
    return path


def llama_1b_model_dir(quant: str) -> Path:
    """Ours: the same GGUF imported (as `localchat pull FILE.gguf` does) and converted."""
    import shutil

    from localchat.engine.build.convert import convert_model
    from localchat.engine.build.gguf import gguf_to_hf_folder

    out = _bench_dir() / f"localchat-{quant}"
    if (out / "localchat-config.json").exists():
        return out
    hf = _bench_dir() / "hf"
    if not (hf / "config.json").exists():
        gguf_to_hf_folder(llama_1b_gguf(), hf, dtype="float16")
    if out.exists():
        shutil.rmtree(out)
    convert_model(hf, out, quant)
    return out


# -- children ------------------------------------------------------------------------------------
def run_localchat(shape: str, quant: str) -> dict:
    import shutil
    import tempfile
    import time

    from localchat.engine.build.convert import convert_model
    from localchat.engine.runtime import Model

    from fixtures import smollm2_hf_dir

    def load(model_dir: Path) -> tuple[object, float, float]:
        first = Model(model_dir, "cpu")
        compile_s = first.compile_seconds
        del first
        start = time.perf_counter()
        model = Model(
            model_dir, "cpu", max_total_tokens=2048, prefill_chunk_size=512, max_batch_size=16
        )
        return model, compile_s, time.perf_counter() - start

    if shape == "1b":
        model, compile_s, load_s = load(llama_1b_model_dir(quant))
        return _measure(model, compile_s, load_s, batches=True)
    # A fresh model directory, so the first load compiles (timed) and the second loads the
    # cached library (timed separately).
    scratch = Path(tempfile.mkdtemp(prefix="bench-"))
    try:
        convert_model(smollm2_hf_dir(), scratch / "m", quant)
        model, compile_s, load_s = load(scratch / "m")
        return _measure(model, compile_s, load_s, batches=quant.startswith("q4"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _measure(model, compile_s: float, load_s: float, batches: bool) -> dict:
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
    model.remove(seq)
    result = {
        "prefill_tok_s": len(ids) / prefill_s,
        "decode_tok_s": DECODE_TOKENS / decode_s,
        "peak_rss_mb": _peak_rss_mb(),
        "compile_s": compile_s,
        "load_s": load_s,
    }
    if batches:
        result["batched"] = {}
        for count in BATCH_SIZES:
            seqs = [model.new_sequence() for _ in range(count)]
            toks = []
            for i, s in enumerate(seqs):  # different prompts, so rows differ
                toks.append(int(np.argmax(model.prefill(s, ids[i : i + BATCH_PROMPT]))))
            model.decode(seqs, toks)  # warm
            start = time.perf_counter()
            for _ in range(BATCH_STEPS):
                out = model.decode(seqs, toks)
                toks = [int(np.argmax(row)) for row in out]
            result["batched"][str(count)] = count * BATCH_STEPS / (time.perf_counter() - start)
            for s in seqs:
                model.remove(s)
    return result


def run_llama_cpp(shape: str, threads: int) -> dict:
    import time

    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    from fixtures import smollm2_gguf

    path = llama_1b_q4_1() if shape == "1b" else smollm2_gguf()
    start = time.perf_counter()
    llm = Llama(
        model_path=str(path),
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


def top1_agreement(quants: list[str], steps: int = AGREE_STEPS) -> dict[str, float]:
    """For each of `quants`, the fraction of `steps` greedy steps of q0f32 on the real SmolLM2 at
    which it, fed the same tokens, picks the same top-1 token."""
    import numpy as np

    from localchat.engine.runtime import Model

    from fixtures import converted, smollm2_hf_dir
    from model_oracle import run_teacher_forced

    src = smollm2_hf_dir()
    ref = Model(converted(src, "q0f32"), "cpu")
    prompt = ref.tokenizer.encode(AGREE_PROMPT)
    seq = ref.new_sequence()
    tokens = [int(np.argmax(ref.prefill(seq, prompt)))]
    for _ in range(steps - 1):
        tokens.append(int(np.argmax(ref.decode([seq], [tokens[-1]])[0])))
    del ref
    agreement = {}
    for quant in quants:
        ours = run_teacher_forced(Model(converted(src, quant), "cpu"), prompt, tokens)
        agreement[quant] = float(np.mean([int(np.argmax(o) == t) for o, t in zip(ours, tokens)]))
    return agreement


BATCH_SIZES = (1, 4, 16)


def child(args: list[str], threads: int) -> dict:
    env = dict(os.environ, TVM_NUM_THREADS=str(threads))
    out = subprocess.run(
        [sys.executable, __file__, *args, "--threads", str(threads)],
        capture_output=True,
        text=True,
        env=env,
    )
    if out.returncode != 0:
        raise SystemExit(f"{args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    global BATCH_SIZES
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=("smollm2", "1b", "rwkv3b"), default="smollm2")
    parser.add_argument(
        "--threads", default=None, help="comma-separated (default: all CPUs; 1b: 1,2)"
    )
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--skip-agreement", action="store_true")
    parser.add_argument("--quant", default=None, help="ours: comma-separated modes")
    parser.add_argument("--batches", default="1,4,16", help="sequences decoded at once")
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    BATCH_SIZES = tuple(int(b) for b in args.batches.split(","))
    if args.child:
        if args.child == "llama.cpp":
            result = run_llama_cpp(args.shape, int(args.threads))
        elif args.child == "agree":
            result = {"agreement": top1_agreement(args.quant.split(","))}
        else:
            result = run_localchat(args.shape, args.child)
        print(json.dumps(result))
        return
    if args.shape == "rwkv3b":
        bench = Path(__file__).resolve().parent / "bench_rwkv.py"
        raise SystemExit(subprocess.call([sys.executable, str(bench), "--quant", "q4f32_1"]))

    default_threads = "1,2" if args.shape == "1b" else str(os.cpu_count() or 2)
    thread_list = [int(t) for t in (args.threads or default_threads).split(",")]
    quants = (args.quant or ("q4f32_1" if args.shape == "1b" else "q4f32_1,q0f32")).split(",")
    cfg = LLAMA_1B if args.shape == "1b" else SMOLLM2
    if args.shape == "1b":  # build the files here, so no child times the building
        llama_1b_gguf()
        if not args.skip_llama_cpp:
            llama_1b_q4_1()
        for quant in quants:
            llama_1b_model_dir(quant)

    from localchat.engine.membw import ReadBandwidth

    bw = ReadBandwidth(1 << 30)
    readers = [q for q in quants if q.startswith("q4")]
    readers += [] if args.skip_llama_cpp else ["llama.cpp"]

    def timed(name: str, child_args: list[str], threads: int) -> dict:
        before = bw.sample()
        result = child(child_args, threads)
        result["read_gb_s"] = (before + bw.sample()) / 2
        result["name"] = name
        return result

    title = "SmolLM2-135M-Instruct" if args.shape == "smollm2" else "Llama 1B shape, random weights"
    print(
        f"{title}: prompt {PROMPT_TOKENS} tok, decode {DECODE_TOKENS} tok; weights read per "
        "token: "
        + ", ".join(f"{e} {bytes_read_per_token(cfg, e, args.shape) / 1e6:.0f} MB" for e in readers)
    )
    header = (
        f"{'engine':<22}{'thr':>4}{'prefill tok/s':>14}{'decode tok/s':>14}{'read GB/s':>10}"
        f"{'of roof':>8}{'peak RSS MB':>12}{'compile s':>10}{'load s':>7}{'prefill x':>10}"
        f"{'decode x':>9}"
    )
    print(header)
    print("-" * len(header))
    batched = []
    for threads in thread_list:
        rows = []
        if not args.skip_llama_cpp:
            rows.append(
                timed("llama.cpp Q4_1", ["--child", "llama.cpp", "--shape", args.shape], threads)
            )
        for quant in quants:
            rows.append(
                timed(
                    f"localchat {quant}",
                    ["--child", quant, "--shape", args.shape, "--batches", args.batches],
                    threads,
                )
            )
            rows[-1]["quant"] = quant
        peer = rows[0] if not args.skip_llama_cpp else None
        for r in rows:
            px = f"{r['prefill_tok_s'] / peer['prefill_tok_s']:.2f}" if peer else "-"
            dx = f"{r['decode_tok_s'] / peer['decode_tok_s']:.2f}" if peer else "-"
            roof = "-"
            if "q0" not in r["name"]:
                read = bytes_read_per_token(cfg, r.get("quant", "llama.cpp"), args.shape)
                roof = f"{read * r['decode_tok_s'] / (r['read_gb_s'] * 1e9):.0%}"
            print(
                f"{r['name']:<22}{threads:>4}{r['prefill_tok_s']:>14.1f}{r['decode_tok_s']:>14.1f}"
                f"{r['read_gb_s']:>10.1f}{roof:>8}{r['peak_rss_mb']:>12.0f}{r['compile_s']:>10.1f}"
                f"{r['load_s']:>7.2f}{px:>10}{dx:>9}"
            )
            if "batched" in r:
                batched.append((r["name"], threads, r["batched"]))
        sys.stdout.flush()
    if batched:
        print(f"\nbatched decode (tok/s summed over the sequences, {BATCH_STEPS} steps)")
        print(f"{'engine':<22}{'thr':>4}" + "".join(f"{f'{b} seq':>10}" for b in BATCH_SIZES))
        for name, threads, by_count in batched:
            cells = "".join(f"{by_count[str(b)]:>10.1f}" for b in BATCH_SIZES)
            print(f"{name:<22}{threads:>4}{cells}")
    q4 = [q for q in quants if q.startswith("q4")]
    if args.shape == "smollm2" and not args.skip_agreement and q4:
        agree = child(["--child", "agree", "--shape", args.shape, "--quant", ",".join(q4)],
                      thread_list[-1])["agreement"]
        print()
        for quant, value in agree.items():
            print(f"{quant} top-1 agreement with q0f32 over {AGREE_STEPS} greedy steps: "
                  f"{value:.1%}")


if __name__ == "__main__":
    main()
