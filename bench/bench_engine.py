"""Benchmark: localchat beside llama.cpp at its best on this CPU, per model shape.

    python bench/bench_engine.py [--shape smollm2|1b|3b|rwkv3b] [--layers N] [--threads 1,2]
                                 [--skip-llama-cpp] [--skip-agreement] [--batches 1,4,16]
                                 [--quant q4f32_1,q4f32_0,q4f32_asym,q0f32]
                                 [--peer Q4_0,Q4_K_M,Q4_1] [--long 4000 | --long 0]
                                 [--rounds N]

Shapes:

* `smollm2` (default): the real SmolLM2-135M-Instruct, ours converted from its HF folder, llama.cpp
  on its Q4_1 GGUF and on Q4_0 / Q4_K_M files requantized from it by `llama_model_quantize`
  (`--peer`; the only SmolLM2 file here is Q4_1); also each 4-bit mode's top-1 agreement
  with q0f32 over 128 greedy steps (q0f32 greedy, q4 teacher-forced on those tokens; q4f32_0
  on SmolLM2's Q4_0 GGUF, which llama.cpp requantizes from its Q4_1 one);
* `1b`: a Llama of 1B shape (hidden 2048, 16 layers, MLP 8192, 32/8 heads, vocab 49 152, tied
  embeddings) and `3b`: Llama 3.2 3B's dims (hidden 3072, 28 layers, MLP 8192, 24/8 heads, vocab
  128 256, tied), random weights, written once as an F16 GGUF with SmolLM2's tokenizer (the
  token list padded to the vocabulary); `--layers N` builds N layers instead (the table says so:
  its figures are then for N layers, not the whole model). The peer is llama.cpp at its best:
  its Q4_0, Q4_K_M and Q4_1 files (`--peer`), each made by `llama_cpp.llama_model_quantize` from
  that F16 file with llama.cpp's default tensor types (Q4_0's and Q4_1's output / tied embedding
  in Q6_K; Q4_K_M's mix of Q4_K and Q6_K). Ours: q4f32_1 converted from the F16 file (through
  `gguf_to_hf_folder`, what `localchat pull FILE.gguf` runs), q4f32_0 imported from llama.cpp's
  Q4_0 file (it holds it exactly), q4f32_k from its Q4_K_M file (its Q4_K blocks exactly) and
  q4f32_asym from its Q4_1 file. Files are cached in the test
  cache (tests/fixtures.cache_dir()) so a second run starts at once;
* `rwkv3b`: runs bench/bench_rwkv.py (RWKV-4 World 3B shape, random weights; decode as a fraction
  of the roofline it measures itself).

For each engine and thread count: prefill tok/s on a 451-token prompt, decode tok/s over 128
tokens, decode tok/s after a 4,000-token prompt (`--long`; 1b and 3b: 32 steps), peak RSS,
compile and load time, and ratios to the fastest peer row at the same thread count (each column
its own fastest: the peer named under the table); then each engine at its best thread count
against the peer at its best quantization and thread count. The read bandwidth of a compiled
streaming sum over 1 GiB (`localchat.engine.membw`, the probe `localchat bench` uses too) is
sampled before and after each run (this VM's bandwidth follows its neighbours' load), and decode
is given as a fraction of that roofline: weight bytes read per token x tok/s / bandwidth, the
bytes counted from the files themselves (the layers' matrices and the LM head, tied or not: a
GGUF's tensor sizes, our tensor cache's records). Ours also decodes 1, 4 and 16 sequences at once
(`Model.decode` on a list of sequences; tok/s summed over the sequences). Each configuration runs
in its own process so peak RSS is its own. `--rounds N` runs every configuration N times, the
rounds interleaved and each in a rotated order: the table gives each engine's medians (its
roofline fraction the median of each run's against the bandwidth around it), and a last section
each round's ratio of ours to that round's fastest peer (runs minutes apart, so at nearly the
same bandwidth), median and range: on this shared VM one run's ratio moves by +-20% with the
neighbours' load. llama-cpp-python's wheel here is built for AVX2
(no AVX-512): on a CPU without AVX-512 that is llama.cpp's best build; the table prints the
build's features.
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
LONG_PROMPT = 4000  # tokens before the long-context decode
LONG_DECODE = 32  # decode steps timed after them
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
LLAMA_3B = {  # Llama 3.2 3B
    "hidden_size": 3072,
    "num_hidden_layers": 28,
    "intermediate_size": 8192,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}
SHAPES = {"smollm2": SMOLLM2, "1b": LLAMA_1B, "3b": LLAMA_3B}
CONTEXT = 8192  # the synthetic shapes' context length (room for the long-context row)
PEERS = ("Q4_0", "Q4_K_M", "Q4_1")
# Ours: which file each mode is made from (the F16 file, or llama.cpp's file it holds exactly)
OURS_SOURCE = {"q4f32_0": "Q4_0", "q4f16_0": "Q4_0", "q4f32_asym": "Q4_1", "q4f16_asym": "Q4_1",
               "q4f32_k": "Q4_K_M"}


def shape_config(shape: str, layers: int | None) -> dict:
    """The shape's dimensions, with `layers` layers when given."""
    cfg = dict(SHAPES[shape])
    if layers:
        cfg["num_hidden_layers"] = layers
    return cfg


def gguf_bytes_per_token(path: Path) -> int:
    """Weight bytes a decode step reads from a GGUF: every layer's matrices and the LM head
    (`output.weight`, or the tied token embedding)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    layers = sum(n for name, n in sizes.items()
                 if name.startswith("blk.") and name.endswith(".weight")
                 and len(next(t for t in reader.tensors if t.name == name).shape) == 2)
    return layers + sizes.get("output.weight", sizes["token_embd.weight"])


def model_dir_bytes_per_token(model_dir: Path) -> int:
    """Weight bytes a decode step of ours reads: every parameter but the token embedding when
    the model has its own LM head (then one row of it is read per token)."""
    records = json.loads((model_dir / "tensor-cache.json").read_text())["records"]
    params = {r["name"]: int(r["nbytes"]) for shard in records for r in shard["records"]}
    untied = any(name.startswith("lm_head.") for name in params)
    return sum(n for name, n in params.items()
               if not (untied and name.startswith("model.embed_tokens.")))


def _peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: getrusage's maxrss would carry over the parent's peak
    across fork + exec, and the parent holds the bandwidth probe's 2 GiB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- the synthetic model files -------------------------------------------------------------------
def _bench_dir(shape: str, layers: int | None) -> Path:
    from fixtures import cache_dir

    cfg = shape_config(shape, layers)
    out = cache_dir() / f"bench-llama-{shape}-L{cfg['num_hidden_layers']}-c{CONTEXT}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def llama_f16_gguf(shape: str, layers: int | None) -> Path:
    """The F16 GGUF of a synthetic shape (random weights, SmolLM2's tokenizer), written once."""
    import gguf
    import numpy as np
    from disk_guard import require_free

    from fixtures import smollm2_gguf

    path = _bench_dir(shape, layers) / "f16.gguf"
    if path.exists():
        return path
    cfg = shape_config(shape, layers)
    h, f, n_layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    head_dim = h // heads
    params = vocab * h + n_layers * (2 * h * h + 2 * h * kv * head_dim + 3 * h * f)
    # the F16 file, then llama.cpp's 4-bit files and our converted models beside it
    require_free(path.parent, 2 * params * 2, f"the {shape} benchmark model")
    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_block_count(n_layers)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    src = gguf.GGUFReader(str(smollm2_gguf()))
    for key, field in src.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        pad = vocab - len(src.fields["tokenizer.ggml.tokens"].data)
        if pad > 0 and key == "tokenizer.ggml.tokens":
            value = value + [f"[PAD{i}]" for i in range(pad)]
        elif pad > 0 and key == "tokenizer.ggml.token_type":
            value = value + [5] * pad  # unused
        w.add_key_value(key, value, vtype, sub)
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    w.add_tensor("token_embd.weight", rand(vocab, h))
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for i in range(n_layers):
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


def llama_quantized(shape: str, layers: int | None, qtype: str) -> Path:
    """llama.cpp's `qtype` copy ("Q4_0", "Q4_K_M", "Q4_1") of the F16 GGUF, with its default
    tensor types (as the files people download are made)."""
    import ctypes

    import llama_cpp

    path = _bench_dir(shape, layers) / f"{qtype}.gguf"
    if path.exists():
        return path
    src = llama_f16_gguf(shape, layers)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    params.nthread = os.cpu_count() or 1
    tmp = path.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {qtype} failed ({rc})")
    tmp.rename(path)
    return path


def llama_model_dir(shape: str, layers: int | None, quant: str) -> Path:
    """Ours: the F16 GGUF (or, for the modes that hold one exactly, llama.cpp's file of that
    type) imported as `localchat pull FILE.gguf` does, and converted to `quant`."""
    import shutil

    from localchat import model_dir as md
    from localchat.engine.build import convert_source

    out = _bench_dir(shape, layers) / f"localchat-{quant}"
    if md.is_model_dir(out) and md.read_config(out).get("format", 1) >= md.format_for(quant):
        return out  # (an older layout of the mode is converted again)
    if out.exists():
        shutil.rmtree(out)
    src = (llama_quantized(shape, layers, OURS_SOURCE[quant]) if quant in OURS_SOURCE
           else llama_f16_gguf(shape, layers))
    convert_source(src, out, quant, scratch_dir=_bench_dir(shape, layers),
                   context_window_size=CONTEXT)
    return out


def long_prompt(encode) -> list[int]:
    """`LONG_PROMPT` tokens of the benchmark text, repeated as needed."""
    ids = encode(TEXT)
    return (ids * (LONG_PROMPT // len(ids) + 1))[:LONG_PROMPT]


# -- children ------------------------------------------------------------------------------------
def run_localchat(shape: str, quant: str, layers: int | None, long: int) -> dict:
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
            model_dir, "cpu", max_total_tokens=max(2048, long + 2 * LONG_DECODE),
            prefill_chunk_size=512, max_batch_size=16,
        )
        return model, compile_s, time.perf_counter() - start

    if shape != "smollm2":
        model_dir = llama_model_dir(shape, layers, quant)
        model, compile_s, load_s = load(model_dir)
        result = _measure(model, compile_s, load_s, batches=True, long=long)
        result["bytes_per_token"] = model_dir_bytes_per_token(model_dir)
        return result
    # A fresh model directory, so the first load compiles (timed) and the second loads the
    # cached library (timed separately).
    scratch = Path(tempfile.mkdtemp(prefix="bench-"))
    try:
        convert_model(smollm2_hf_dir(), scratch / "m", quant)
        model, compile_s, load_s = load(scratch / "m")
        result = _measure(model, compile_s, load_s, batches=quant.startswith("q4"), long=long)
        result["bytes_per_token"] = model_dir_bytes_per_token(scratch / "m")
        return result
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _measure(model, compile_s: float, load_s: float, batches: bool, long: int) -> dict:
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
    if long:
        seq = model.new_sequence()
        tok = int(np.argmax(model.prefill(seq, long_prompt(model.tokenizer.encode)[:long])))
        start = time.perf_counter()
        for _ in range(LONG_DECODE):
            tok = int(np.argmax(model.decode([seq], [tok])[0]))
        result["long_decode_tok_s"] = LONG_DECODE / (time.perf_counter() - start)
        model.remove(seq)
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


def run_llama_cpp(shape: str, threads: int, qtype: str, layers: int | None, long: int) -> dict:
    import time

    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    if shape == "smollm2":
        path = smollm2_requantized(qtype)
    else:
        path = llama_quantized(shape, layers, qtype)
    start = time.perf_counter()
    llm = Llama(
        model_path=str(path),
        n_ctx=max(1024, long + 2 * LONG_DECODE),
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    load_s = time.perf_counter() - start
    n_vocab = llm.n_vocab()

    def encode(text: str) -> list[int]:
        return llm.tokenize(text.encode(), add_bos=False)

    def greedy(steps: int) -> float:
        """Seconds for `steps` greedy decode steps (argmax of the raw logits, as ours does:
        llm.sample runs a Python sampler chain)."""
        start = time.perf_counter()
        for _ in range(steps):
            logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            tok = int(np.argmax(np.ctypeslib.as_array(logits, shape=(n_vocab,))))
            llm.eval([tok])
        return time.perf_counter() - start

    ids = encode(TEXT)[:PROMPT_TOKENS]
    llm.eval(ids[:32])
    llm.reset()
    start = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - start
    decode_s = greedy(DECODE_TOKENS)
    result = {
        "prefill_tok_s": len(ids) / prefill_s,
        "decode_tok_s": DECODE_TOKENS / decode_s,
        "peak_rss_mb": _peak_rss_mb(),
        "compile_s": 0.0,
        "load_s": load_s,
        "bytes_per_token": gguf_bytes_per_token(path),
    }
    if long:
        llm.reset()
        llm.eval(long_prompt(encode)[:long])
        result["long_decode_tok_s"] = LONG_DECODE / greedy(LONG_DECODE)
    return result


def smollm2_requantized(qtype: str) -> Path:
    """llama.cpp's `qtype` file of the real SmolLM2 ("Q4_0", "Q4_K_M"; "Q4_1" is the wheel's
    own), requantized by `llama_model_quantize` from its Q4_1 GGUF (the one file of it here;
    the q0f32 reference holds that file's values)."""
    import ctypes

    import llama_cpp

    from fixtures import cache_dir, smollm2_gguf

    if qtype == "Q4_1":
        return smollm2_gguf()
    path = cache_dir() / "bench-smollm2" / f"SmolLM2-135M-Instruct.{qtype}.gguf"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    tmp = path.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(smollm2_gguf()).encode(), str(tmp).encode(),
                                        ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {qtype} failed ({rc})")
    tmp.rename(path)
    return path


def _agreement_model_dir(quant: str) -> Path:
    """Ours on the real SmolLM2 in `quant`: from its HF folder (the Q4_1 GGUF's values), or, for
    the modes holding llama.cpp's Q4_0, imported from its Q4_0 GGUF (`smollm2_requantized`)."""
    from localchat.engine.build import convert_source

    from fixtures import cache_dir, converted, smollm2_hf_dir

    if OURS_SOURCE.get(quant) != "Q4_0":
        return converted(smollm2_hf_dir(), quant)
    out = cache_dir() / "bench-smollm2" / f"localchat-{quant}"
    if not (out / "localchat-config.json").exists():
        convert_source(smollm2_requantized("Q4_0"), out, quant, scratch_dir=out.parent)
    return out


def top1_agreement(quants: list[str], steps: int = AGREE_STEPS) -> dict[str, float]:
    """For each of `quants`, the fraction of `steps` greedy steps of q0f32 on the real SmolLM2 at
    which it, fed the same tokens, picks the same top-1 token (the Q4_0 modes on its Q4_0 GGUF)."""
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
        ours = run_teacher_forced(Model(_agreement_model_dir(quant), "cpu"), prompt, tokens)
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


METRICS = ("prefill_tok_s", "decode_tok_s", "long_decode_tok_s")


def _roof(r: dict) -> float:
    """Decode as a fraction of the read roofline of the bandwidth sampled around the run."""
    return r["bytes_per_token"] * r["decode_tok_s"] / (r["read_gb_s"] * 1e9)


def _median_row(runs: list[dict]) -> dict:
    """One engine's row from its runs: the median of each rate, of the bandwidth and of the
    roofline fraction (each run against its own bandwidth); the rest from the first run."""
    import statistics

    row = dict(runs[0])
    for key in (*METRICS, "read_gb_s", "peak_rss_mb"):
        if all(r.get(key) for r in runs):
            row[key] = statistics.median(r[key] for r in runs)
    row["roof"] = statistics.median(_roof(r) for r in runs)
    return row


def _print_paired(paired: list[tuple[int, dict]], quants: list[str], rounds: int) -> None:
    """Per round, each of our modes against the fastest peer of the same round (the runs
    nearest in time, so nearest in bandwidth): the median ratio and its range."""
    import statistics

    print(f"\npaired, per round ({rounds} rounds): ours / the round's fastest llama.cpp row, "
          "median (min-max)")
    for quant in quants:
        for threads in sorted({t for t, _ in paired}):
            cells = []
            for key, label in zip(METRICS, ("prefill", "decode", "long decode"), strict=True):
                ratios = []
                for t, runs in paired:
                    peers = [r[key] for name, r in runs.items()
                             if t == threads and name.startswith("llama.cpp") and r.get(key)]
                    mine = runs.get(f"localchat {quant}", {}).get(key)
                    if peers and mine and t == threads:
                        ratios.append(mine / max(peers))
                if ratios:
                    cells.append(f"{label} {statistics.median(ratios):.2f}x "
                                 f"({min(ratios):.2f}-{max(ratios):.2f})")
            if cells:
                print(f"  {quant} {threads}t: " + "; ".join(cells))


def _ratio(value: float | None, best: float | None) -> str:
    return f"{value / best:.2f}" if value and best else "-"


def main() -> None:
    global BATCH_SIZES
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=("smollm2", "1b", "3b", "rwkv3b"), default="smollm2")
    parser.add_argument("--layers", type=int, default=None,
                        help="1b / 3b: build this many layers (the figures are then for them)")
    parser.add_argument(
        "--threads", default=None, help="comma-separated (default: all CPUs; 1b, 3b: 1,2)"
    )
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--skip-agreement", action="store_true")
    parser.add_argument("--quant", default=None, help="ours: comma-separated modes")
    parser.add_argument("--peer", default=",".join(PEERS),
                        help="llama.cpp's quantizations, comma-separated")
    parser.add_argument("--long", type=int, default=None,
                        help=f"tokens before the long-context decode row (default: {LONG_PROMPT} "
                        "for 1b and 3b, 0 (none) for smollm2)")
    parser.add_argument("--batches", default="1,4,16", help="sequences decoded at once")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every engine this many times, interleaved (each round in a "
                        "rotated order); the table gives medians and the ratios of each round "
                        "(this VM's bandwidth moves by tens of percent within minutes)")
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    BATCH_SIZES = tuple(int(b) for b in args.batches.split(","))
    synthetic = args.shape in ("1b", "3b")
    long = args.long if args.long is not None else (LONG_PROMPT if synthetic else 0)
    if args.child:
        if args.child.startswith("llama.cpp"):
            qtype = args.child.partition(":")[2]
            result = run_llama_cpp(args.shape, int(args.threads), qtype, args.layers, long)
        elif args.child == "agree":
            result = {"agreement": top1_agreement(args.quant.split(","))}
        else:
            result = run_localchat(args.shape, args.child, args.layers, long)
        print(json.dumps(result))
        return
    if args.shape == "rwkv3b":
        bench = Path(__file__).resolve().parent / "bench_rwkv.py"
        raise SystemExit(subprocess.call([sys.executable, str(bench), "--quant", "q4f32_1"]))

    default_threads = "1,2" if synthetic else str(os.cpu_count() or 2)
    thread_list = [int(t) for t in (args.threads or default_threads).split(",")]
    default_quants = "q4f32_1,q4f32_0" if synthetic else "q4f32_1,q0f32"
    quants = (args.quant or default_quants).split(",")
    peers = [] if args.skip_llama_cpp else args.peer.split(",")
    if synthetic:  # build the files here, so no child times the building
        llama_f16_gguf(args.shape, args.layers)
        for qtype in {*peers, *(OURS_SOURCE[q] for q in quants if q in OURS_SOURCE)}:
            llama_quantized(args.shape, args.layers, qtype)
        for quant in quants:
            llama_model_dir(args.shape, args.layers, quant)

    from localchat.engine.membw import ReadBandwidth

    bw = ReadBandwidth(1 << 30)
    layer_args = ["--layers", str(args.layers)] if args.layers else []
    common = ["--shape", args.shape, "--long", str(long), *layer_args]

    def timed(name: str, child_args: list[str], threads: int) -> dict:
        before = bw.sample()
        result = child([*child_args, *common], threads)
        result["read_gb_s"] = (before + bw.sample()) / 2
        result["name"] = name
        return result

    titles = {"smollm2": "SmolLM2-135M-Instruct", "1b": "Llama 1B shape, random weights",
              "3b": "Llama 3.2 3B shape, random weights"}
    title = titles[args.shape]
    if args.layers:
        title += (f" -- {args.layers} of {SHAPES[args.shape]['num_hidden_layers']} layers: the "
                  f"figures are for {args.layers} layers, not the whole model")
    print(f"{title}: prompt {PROMPT_TOKENS} tok, decode {DECODE_TOKENS} tok"
          + (f"; long: decode {LONG_DECODE} tok after a {long}-token prompt" if long else ""))
    try:
        import llama_cpp

        features = llama_cpp.llama_print_system_info().decode().strip()
        print(f"llama.cpp {llama_cpp.__version__} (llama-cpp-python) build: {features}")
    except ImportError:
        pass
    header = (
        f"{'engine':<24}{'thr':>4}{'MB/tok':>8}{'prefill':>9}{'decode':>8}{'long dec':>9}"
        f"{'GB/s':>6}{'of roof':>8}{'RSS MB':>8}{'comp s':>7}{'load s':>7}{'prefill x':>10}"
        f"{'decode x':>9}{'long x':>7}"
    )
    print("(tok/s; x: against the fastest llama.cpp row at the same thread count)")
    print(header)
    print("-" * len(header))
    batched, everything = [], []
    engines = [(f"llama.cpp {q}", ["--child", f"llama.cpp:{q}"]) for q in peers] + [
        (f"localchat {quant}", ["--child", quant, "--batches", args.batches]) for quant in quants]
    paired = []  # per thread count and round: ours / the round's fastest peer
    for threads in thread_list:
        samples: dict[str, list[dict]] = {name: [] for name, _ in engines}
        for rnd in range(max(1, args.rounds)):
            shift = rnd % len(engines)  # no engine always runs first, or always after another
            for name, child_args in engines[shift:] + engines[:shift]:
                samples[name].append(timed(name, child_args, threads))
            paired.append((threads, {name: runs[-1] for name, runs in samples.items()}))
        rows = [_median_row(runs) for runs in samples.values()]
        for r in rows:
            r["peer"] = r["name"].startswith("llama.cpp")
        peer_rows = [r for r in rows if r.get("peer")]
        tops = {key: max((r for r in peer_rows if r.get(key)), key=lambda r, k=key: r[k],
                         default=None)
                for key in ("prefill_tok_s", "decode_tok_s", "long_decode_tok_s")}
        for r in rows:
            r["threads"] = threads
            cells = [_ratio(r.get(key), top[key] if top else None) for key, top in tops.items()]
            roof = "-" if "q0" in r["name"] else f"{r['roof']:.0%}"
            longd = f"{r['long_decode_tok_s']:.1f}" if r.get("long_decode_tok_s") else "-"
            print(
                f"{r['name']:<24}{threads:>4}{r['bytes_per_token'] / 1e6:>8.0f}"
                f"{r['prefill_tok_s']:>9.1f}{r['decode_tok_s']:>8.1f}{longd:>9}"
                f"{r['read_gb_s']:>6.1f}{roof:>8}{r['peak_rss_mb']:>8.0f}{r['compile_s']:>7.1f}"
                f"{r['load_s']:>7.2f}{cells[0]:>10}{cells[1]:>9}{cells[2]:>7}"
            )
            if "batched" in r:
                batched.append((r["name"], threads, r["batched"]))
        if peer_rows:
            named = ", ".join(f"{what} {top['name'].split()[-1]}" for what, top in
                              zip(("prefill", "decode", "long decode"), tops.values()) if top)
            print(f"{'':<4}fastest peer at {threads} thread(s): {named}")
        everything += rows
        sys.stdout.flush()
    if batched:
        print(f"\nbatched decode (tok/s summed over the sequences, {BATCH_STEPS} steps)")
        print(f"{'engine':<24}{'thr':>4}" + "".join(f"{f'{b} seq':>10}" for b in BATCH_SIZES))
        for name, threads, by_count in batched:
            cells = "".join(f"{by_count[str(b)]:>10.1f}" for b in BATCH_SIZES)
            print(f"{name:<24}{threads:>4}{cells}")
    peer_all = [r for r in everything if r.get("peer")]
    if peer_all and len(everything) > len(peer_all):
        print("\neach at its best thread count, against llama.cpp at its best quantization and "
              "thread count")
        for key, label in (("prefill_tok_s", "prefill"), ("decode_tok_s", "decode"),
                           ("long_decode_tok_s", "long decode")):
            top = max((r for r in peer_all if r.get(key)), key=lambda r, k=key: r[k],
                      default=None)
            if top is None:
                continue
            line = [f"{label}: peer {top['name'].split()[-1]} {top['threads']}t {top[key]:.1f}"]
            for quant in quants:
                mine = [r for r in everything if r["name"] == f"localchat {quant}" and r.get(key)]
                if mine:
                    m = max(mine, key=lambda r: r[key])
                    line.append(f"{quant} {m['threads']}t {m[key]:.1f} ({m[key] / top[key]:.2f}x)")
            print("  " + "; ".join(line))
    if args.rounds > 1 and peers and len(engines) > len(peers):
        _print_paired(paired, quants, args.rounds)
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
