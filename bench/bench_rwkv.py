"""RWKV-4 World 3B shape (hidden 2560, 32 layers, vocab 65 536) or, with `--arch rwkv7`, the
RWKV-7 World 2.9B shape (hidden 2560, 40 heads of 64, 32 layers, LoRA ranks 96/96/64/320), or
with `--arch rwkv6` the RWKV-6 World 3B shape (hidden 2560, 40 heads of 64, 32 layers, FFN 8960,
mix/decay LoRA ranks 32/64) with random weights on this CPU: decode tok/s, prefill tok/s, peak
RSS, and decode as a fraction of the memory roofline.

    python bench/bench_rwkv.py [--arch rwkv4|rwkv6|rwkv7] [--quant q4f32_1 q0f32] [--layers 32]
                               [--prompt 512] [--decode 32] [--chunks 64,128,256,512]
                               [--peer Q4_0,Q4_K_M,Q4_1] [--rounds N]

No checkpoint is written: the library is compiled (cached under the user cache dir, in a child
process so its memory does not count), then every parameter is generated with random values of
its final dtype (packed 4-bit words and scales for q4 modes) straight into a TVM tensor, and the
compiled functions are driven with the RNN state as `localchat.engine.runtime` drives them.

Decode runs in rounds with the memory bandwidth sampled before and after each (this VM's
bandwidth follows its neighbours' load and swings by tens of percent within minutes), and each
round's weight bytes per second is divided by the bandwidth measured around it; the table gives
the median over rounds. Weights read per decoded token are all parameters except the embedding
table (of which one row is read). Two roofs: the copy bandwidth (bytes read + written per second
copying 1 GiB with numpy, the better of one and two threads: the issue's definition) and the
read bandwidth of a compiled streaming sum (the ceiling for reading weights).

With `--layers N` < 32 the per-layer times are extrapolated to 32 layers (time(L) = a + b L
fitted from N and N/2 layers); the default runs the real depth.

`--peer` (rwkv7 only) adds llama.cpp (llama-cpp-python) in the same run: an F16 GGUF of the same
shape and depth(s) in llama.cpp's RWKV-7 layout with random weights (bench/rwkv7_gguf.py, written
to a temporary folder and deleted afterwards), quantized by `llama_model_quantize` to each named
type with llama.cpp's default tensor types, then timed in a child process the way ours is: the
same random prompt ids prefilled in one `Llama.eval` (n_batch 512), the same number of greedy
decode steps in rounds between bandwidth samples (each step `Llama.eval` of one token plus the
argmax of its logits, median step time), at 1 and 2 threads, the row giving the thread count of
the best decode. Its bytes read per token are the GGUF's tensor bytes less the token embedding,
plus one row of it; with `--layers N` < 32 it is extrapolated to 32 layers like ours.

`--rounds N` times every row N times, interleaved, each round in a rotated order (round r starts
at a different row, so no engine always runs first); llama.cpp's files are written once before
the first round and deleted after the last. Each round's rows are extrapolated as above (a peer
row keeping that round's best thread count); the table gives each row's medians over the rounds
(decode, ms/token, prefill, the roofline fractions; the bandwidth spreads over all rounds'
samples), then each round's ratio of each of our rows to that round's fastest llama.cpp row,
median and range (this VM's bandwidth moves by tens of percent within minutes, so one run's
ratio is only as good as the bandwidths its rows happened to get).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

# TVM's CPU thread pool uses half the logical CPUs on x86 unless told (one thread on 2 vCPUs);
# the runtime sets this too (runtime.py), the bench drives the VM itself.
os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))

WORLD_3B = {
    "hidden_size": 2560,
    "attention_hidden_size": 2560,
    "intermediate_size": 10240,
    "num_hidden_layers": 32,
    "vocab_size": 65536,
    "layer_norm_epsilon": 1e-5,
    "rescale_every": 6,
}
WORLD_2B9_V7 = {
    "hidden_size": 2560,
    "head_size": 64,
    "intermediate_size": 10240,
    "num_hidden_layers": 32,
    "vocab_size": 65536,
    "decay_low_rank_dim": 96,
    "a_low_rank_dim": 96,
    "v_low_rank_dim": 64,
    "gate_low_rank_dim": 320,
}
WORLD_3B_V6 = {
    "hidden_size": 2560,
    "head_size": 64,
    "intermediate_size": 8960,
    "num_hidden_layers": 32,
    "vocab_size": 65536,
    "mix_low_rank_dim": 32,
    "decay_low_rank_dim": 64,
}
ARCH = "rwkv4"  # --arch: which shape (set in main and in the child processes)


def lib_dir() -> Path:
    from platformdirs import user_cache_dir

    root = os.environ.get("LOCALCHAT_HOME")
    base = Path(root) / "cache" if root else Path(user_cache_dir("localchat"))
    # one folder per kernel version, so libraries of older kernels do not pile up in one place
    import hashlib

    engine = Path(__file__).resolve().parent.parent / "app" / "engine"
    h = hashlib.sha256()
    for f in sorted((engine / "models").glob("*.py")) + sorted(
        (engine / "kernels").glob("*.py")
    ):
        h.update(f.read_bytes())
    return base / "bench" / f"{ARCH}-{h.hexdigest()[:12]}"


def make_config(layers: int, chunk: int):
    if ARCH == "rwkv6":
        from localchat.engine.models.rwkv6 import Rwkv6Config

        return Rwkv6Config(**{**WORLD_3B_V6, "num_hidden_layers": layers},
                           prefill_chunk_size=chunk)
    if ARCH == "rwkv7":
        from localchat.engine.models.rwkv7 import Rwkv7Config

        return Rwkv7Config(**{**WORLD_2B9_V7, "num_hidden_layers": layers},
                           prefill_chunk_size=chunk)
    from localchat.engine.models.rwkv4 import Rwkv4Config

    return Rwkv4Config(**{**WORLD_3B, "num_hidden_layers": layers}, prefill_chunk_size=chunk)


def compile_lib(quant: str, layers: int) -> tuple[Path, float]:
    from localchat.engine.build.compile import compile_library
    from localchat.engine.build.quantization import get_quant_mode
    from localchat.engine.device import cpu_target
    from localchat.engine.models import get_architecture

    lib = compile_library(
        get_architecture(ARCH),
        make_config(layers, 512),
        get_quant_mode(quant),
        cpu_target(),
        lib_dir(),
    )
    return lib.path, lib.seconds


class Bandwidth:
    """Memory bandwidth probes, buffers allocated once so they can be sampled between decode
    rounds (this VM's bandwidth follows its neighbours' load, so a roofline fraction is only
    fair against bandwidth measured at the same moment)."""

    SIZE = 1 << 28  # float32 elements: 1 GiB

    def __init__(self) -> None:
        self.a = np.ones(self.SIZE, np.float32)
        self.b = np.empty_like(self.a)
        np.copyto(self.b, self.a)
        from localchat.engine.membw import ReadBandwidth

        self._reader = ReadBandwidth(self.a.nbytes)

    def copy(self) -> float:
        """Bytes moved (read + written) per second copying 1 GiB with numpy, the better of one
        and two threads."""
        best = 0.0
        for threads in (1, 2):
            bounds = [
                (i * self.SIZE // threads, (i + 1) * self.SIZE // threads) for i in range(threads)
            ]
            workers = [
                threading.Thread(target=np.copyto, args=(self.b[lo:hi], self.a[lo:hi]))
                for lo, hi in bounds
            ]
            t0 = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            best = max(best, 2 * self.a.nbytes / (time.perf_counter() - t0) / 1e9)
        return best

    def read(self) -> float:
        """Bytes read per second summing 1 GiB in a compiled kernel on all threads (the shared
        probe, `localchat.engine.membw`)."""
        return self._reader.sample(1)


def random_params(model, dev, seed: int = 0) -> tuple[list, int, int]:
    """Random tensors for every parameter; also (bytes in all, bytes of the embedding table)."""
    import tvm

    rng = np.random.default_rng(seed)
    params, total, emb = [], 0, 0
    for name, p in model.named_parameters():
        shape, dtype = tuple(int(d) for d in p.shape), str(p.dtype)
        if dtype == "uint32":
            value = rng.integers(0, 2**32, size=shape, dtype=np.uint32)
        elif name.endswith(".scale"):
            value = (rng.random(shape, dtype=np.float32) * 0.004 + 0.001).astype(dtype)
        elif name.endswith("time_decay"):
            value = -np.exp(rng.standard_normal(shape, dtype=np.float32))
        elif name.endswith(".w0"):  # RWKV-7 decay pre-activation: slow to fast channels
            value = rng.uniform(-7, 0, size=shape).astype(dtype)
        elif name.endswith("att.decay"):  # RWKV-6 decay pre-activation: slow to fast channels
            value = rng.uniform(-6, 0.5, size=shape).astype(dtype)
        elif "time_mix" in name or (".maa_" in name and not name.endswith(".weight")) or \
                name.rsplit(".", 1)[-1] in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            value = rng.random(shape, dtype=np.float32).astype(dtype)
        elif name.split(".")[-2].startswith("ln") if "." in name else False:
            value = np.ones(shape, dtype) if name.endswith("weight") else np.zeros(shape, dtype)
        else:
            value = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)
        params.append(tvm.runtime.tensor(value, dev))
        total += value.nbytes
        if name.startswith("embeddings."):
            emb += value.nbytes
        del value
    return params, total, emb


class Driver:
    """The runtime's calls on a VM and its RNN state, for one sequence."""

    def __init__(self, vm, params, dev) -> None:
        import tvm
        from tvm.runtime import ShapeTuple

        self.tvm, self.ShapeTuple = tvm, ShapeTuple
        self.vm, self.params, self.dev = vm, params, dev
        g = tvm.get_global_func
        self.add = g("vm.builtin.kv_state_add_sequence")
        self.remove = g("vm.builtin.kv_state_remove_sequence")
        self.begin = g("vm.builtin.kv_state_begin_forward")
        self.end = g("vm.builtin.kv_state_end_forward")
        self.state = vm["create_rnn_state"](ShapeTuple([4]), ShapeTuple([1]))
        self.f = {n: vm[n] for n in ("embed", "prefill", "decode")}

    def _embed(self, ids):
        t = self.tvm.runtime.tensor(np.asarray(ids, np.int32), self.dev)
        return self.f["embed"](t, self.params)

    def prefill(self, seq: int, ids: list[int], chunk: int) -> np.ndarray:
        out = None
        for i in range(0, len(ids), chunk):
            part = ids[i : i + chunk]
            self.begin(self.state, self.ShapeTuple([seq]), self.ShapeTuple([len(part)]))
            out = self.f["prefill"](self._embed(part), self.state, self.params)
            self.end(self.state)
        return out[0].numpy()

    def decode(self, seq: int, tok: int) -> np.ndarray:
        self.begin(self.state, self.ShapeTuple([seq]), self.ShapeTuple([1]))
        out = self.f["decode"](self._embed([tok]), self.state, self.params)
        self.end(self.state)
        return out[0].numpy()


ROUNDS = 4  # decode rounds per measurement, with bandwidth sampled before and after each


def measure(quant: str, layers: int, prompt_len: int, steps: int, chunks: list[int]) -> dict:
    import tvm
    from tvm import relax

    from localchat.engine.build.quantization import get_quant_mode
    from localchat.engine.device import cpu_target
    from localchat.engine.models import get_architecture

    proc = subprocess.run(
        [sys.executable, __file__, "--arch", ARCH, "--compile-only", quant, str(layers)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"compiling {quant} x{layers} failed:\n{proc.stderr[-3000:]}")
    path = Path(proc.stdout.strip().splitlines()[-1])
    dev = tvm.cpu()
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(path)), dev)
    model = get_architecture(ARCH).build(
        make_config(layers, 512), get_quant_mode(quant), cpu_target()
    )
    t0 = time.perf_counter()
    params, total_bytes, emb_bytes = random_params(model, dev)
    gen_s = time.perf_counter() - t0
    drv = Driver(vm, params, dev)
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(1, 65536, prompt_len)]
    result: dict = {
        "arch": ARCH,
        "quant": quant,
        "layers": layers,
        "weight_bytes": total_bytes,
        "decode_bytes_per_token": total_bytes - emb_bytes,
        "param_gen_s": gen_s,
        "prefill": {},
    }
    drv.add(drv.state, 0)
    drv.prefill(0, prompt[:8], 8)  # warm-up
    for chunk in chunks:
        drv.remove(drv.state, 0)
        drv.add(drv.state, 0)
        t0 = time.perf_counter()
        logits = drv.prefill(0, prompt, chunk)
        result["prefill"][chunk] = prompt_len / (time.perf_counter() - t0)
    tok = int(np.argmax(logits))
    drv.decode(0, tok)  # warm-up
    result["peak_rss_gb"] = peak_rss_bytes() / 1e9  # before the bandwidth buffers
    # decode in rounds, each between two bandwidth samples: the fraction of a round is its
    # weight bytes per second over the mean bandwidth sampled around it
    bw = Bandwidth()
    rounds = max(1, min(ROUNDS, steps))
    copy, read = [bw.copy()], [bw.read()]
    times, copy_frac, read_frac = [], [], []
    for r in range(rounds):
        part = []
        for _ in range(steps // rounds + (r < steps % rounds)):
            t0 = time.perf_counter()
            tok = int(np.argmax(drv.decode(0, tok)))
            part.append(time.perf_counter() - t0)
        copy.append(bw.copy())
        read.append(bw.read())
        rate = result["decode_bytes_per_token"] / float(np.median(part)) / 1e9
        copy_frac.append(rate / ((copy[-2] + copy[-1]) / 2))
        read_frac.append(rate / ((read[-2] + read[-1]) / 2))
        times += part
    result["decode_s"] = float(np.median(times))
    result["decode_tok_s"] = 1.0 / result["decode_s"]
    result["copy_gb_s"], result["read_gb_s"] = copy, read
    result["roofline_fraction"] = float(np.median(copy_frac))
    result["read_roofline_fraction"] = float(np.median(read_frac))
    return result


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM; ru_maxrss would include the parent's peak,
    which Linux carries across exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_child(args: list[str]) -> dict:
    """One measurement in a fresh process, so peak RSS is its own."""
    proc = subprocess.run(
        [sys.executable, __file__, "--arch", ARCH, "--measure", *args], capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"measurement {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


PEER_TYPES = ("Q4_0", "Q4_K_M", "Q4_1")  # llama.cpp's 4-bit files people download
PEER_THREADS = (1, 2)


def measure_peer(path: Path, qtype: str, layers: int, threads: int, prompt_len: int,
                 steps: int) -> dict:
    """llama.cpp on `path` as `measure` times ours: the same prompt ids, prefill in one eval,
    greedy decode steps in rounds between bandwidth samples, median step time."""
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(path),
        n_ctx=max(1024, prompt_len + steps + 16),
        n_batch=512,  # bench_engine's peer setting: the prompt goes in one batch
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    n_vocab = llm.n_vocab()

    def logits() -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(n_vocab,))

    rng = np.random.default_rng(1)  # the ids `measure` prefills
    prompt = [int(t) for t in rng.integers(1, 65536, prompt_len)]
    llm.eval(prompt[:8])  # warm-up
    llm.reset()  # the next eval clears the recurrent state from position 0
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill_s = time.perf_counter() - t0
    first = logits()
    if not np.isfinite(first).all():
        raise SystemExit(f"llama.cpp gave non-finite logits on {path.name}")
    tok = int(np.argmax(first))
    llm.eval([tok])  # warm-up
    tok = int(np.argmax(logits()))
    result: dict = {
        "quant": f"llama.cpp {qtype} ({threads} thread{'s' if threads > 1 else ''})",
        "peer": qtype,
        "threads": threads,
        "layers": layers,
        "prefill": {"512": prompt_len / prefill_s},
        "prefill_unit": "batch",
        "peak_rss_gb": peak_rss_bytes() / 1e9,  # before the bandwidth buffers, as ours
    }
    bw = Bandwidth()
    rounds = max(1, min(ROUNDS, steps))
    copy, read = [bw.copy()], [bw.read()]
    times, parts = [], []
    for r in range(rounds):
        part = []
        for _ in range(steps // rounds + (r < steps % rounds)):
            t0 = time.perf_counter()
            llm.eval([tok])
            tok = int(np.argmax(logits()))
            part.append(time.perf_counter() - t0)
        copy.append(bw.copy())
        read.append(bw.read())
        parts.append(float(np.median(part)))
        times += part
    result["decode_s"] = float(np.median(times))
    result["decode_tok_s"] = 1.0 / result["decode_s"]
    result["copy_gb_s"], result["read_gb_s"] = copy, read
    result["round_decode_s"] = parts  # the fractions need the bytes, which the parent reads
    return result


def _peer_fractions(res: dict) -> None:
    """Roofline fractions per round, as `measure` computes ours (median over rounds)."""
    copy, read = res["copy_gb_s"], res["read_gb_s"]
    copy_frac, read_frac = [], []
    for i, s in enumerate(res.pop("round_decode_s")):
        rate = res["decode_bytes_per_token"] / s / 1e9
        copy_frac.append(rate / ((copy[i] + copy[i + 1]) / 2))
        read_frac.append(rate / ((read[i] + read[i + 1]) / 2))
    res["roofline_fraction"] = float(np.median(copy_frac))
    res["read_roofline_fraction"] = float(np.median(read_frac))


def _depths(layers: int) -> list[int]:
    """The depths a row is timed at: the real 32 layers, or N/2 and N to extrapolate from."""
    return [layers] if layers == 32 else [layers // 2, layers]


def time_ours(quant: str, args: argparse.Namespace) -> dict:
    """One of our rows, one round: each depth in a fresh process, extrapolated to 32 layers."""
    depths = _depths(args.layers)
    runs = [
        run_child([quant, str(d), str(args.prompt), str(args.decode), args.chunks])
        for d in depths
    ]
    return _extrapolate(depths, runs, args.prompt)


def prepare_peers(args: argparse.Namespace) -> tuple[Path, dict[tuple[str, int], Path]]:
    """llama.cpp's files, written once before the rounds: an F16 GGUF of each depth in a new
    temporary folder, quantized to each --peer type (the F16 file deleted after); (the folder,
    {(type, depth): file}). The folder is removed here if this fails, else by `cleanup_peers`."""
    from gguf_quantize import quantize
    from rwkv7_gguf import write_rwkv7_gguf

    cfg = WORLD_2B9_V7
    depths = _depths(args.layers)
    h, ffn, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    ranks = (cfg["decay_low_rank_dim"], cfg["a_low_rank_dim"], cfg["v_low_rank_dim"],
             cfg["gate_low_rank_dim"])
    per_layer = 2 * (4 * h * h + 2 * h * ffn + 2 * h * sum(ranks))  # F16 matrices
    need = max(2 * 2 * h * vocab + per_layer * d for d in depths) * 1.5  # F16 + its copies
    tmp = Path(tempfile.mkdtemp(prefix="bench-rwkv7-gguf-", dir="/tmp"))
    try:
        free = shutil.disk_usage(tmp).free
        if free < need + 2e9:
            raise SystemExit(f"--peer needs ~{need / 1e9:.1f} GB free under /tmp, "
                             f"{free / 1e9:.1f} GB are")
        files: dict[tuple[str, int], Path] = {}
        for d in depths:
            f16 = write_rwkv7_gguf(tmp / f"f16-L{d}.gguf", hidden=h, layers=d,
                                   head_size=cfg["head_size"], ffn=ffn, vocab=vocab,
                                   lora_ranks=ranks, seed=0)
            for q in _peer_types(args):
                files[q, d] = quantize(f16, tmp / f"{q}-L{d}.gguf", q)
            f16.unlink()  # the quantized copies are all the peer runs need
        return tmp, files
    except BaseException:
        cleanup_peers(tmp)
        raise


def cleanup_peers(tmp: Path) -> None:
    """Delete llama.cpp's files (after the last round)."""
    shutil.rmtree(tmp, ignore_errors=True)


def _peer_types(args: argparse.Namespace) -> list[str]:
    """The --peer types, in the order given."""
    return [q for q in args.peer.split(",") if q]


def _peer_child(path: Path, qtype: str, layers: int, threads: int,
                args: argparse.Namespace) -> dict:
    """llama.cpp on one file at one thread count, in a fresh process, with its fractions."""
    from rwkv7_gguf import decode_bytes_per_token

    proc = subprocess.run(
        [sys.executable, __file__, "--arch", ARCH, "--measure-peer", str(path), qtype,
         str(layers), str(threads), str(args.prompt), str(args.decode)],
        capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"llama.cpp {qtype} x{layers} failed:\n{proc.stderr[-3000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r["decode_bytes_per_token"] = decode_bytes_per_token(path)
    _peer_fractions(r)
    return r


def time_peer(files: dict[tuple[str, int], Path], qtype: str, args: argparse.Namespace) -> dict:
    """One llama.cpp row, one round: the type at each thread count and depth, extrapolated like
    ours, the row the thread count of the best decode (its prefill cell the best prefill's)."""
    depths = _depths(args.layers)
    by_threads = []
    for threads in PEER_THREADS:
        runs = [_peer_child(files[qtype, d], qtype, d, threads, args) for d in depths]
        by_threads.append(_extrapolate(depths, runs, args.prompt))
    best = max(by_threads, key=lambda r: r["decode_tok_s"])
    best_pre = max(by_threads, key=lambda r: max(r["prefill"].values()))
    best["prefill_threads"] = best_pre["threads"]
    if best_pre is not best:  # the prefill cell says which thread count gave it
        best["prefill"] = best_pre["prefill"]
        best["prefill_unit"] = f"{best_pre['threads']} threads, batch"
    return best


def run_rounds(args: argparse.Namespace,
               files: dict[tuple[str, int], Path]) -> tuple[list[str], list[dict[str, dict]]]:
    """Every row (ours per --quant, llama.cpp's per --peer type) once a round, round r starting
    at row r (rotated) so no engine always runs first; (the row names in table order, each
    round's {name: result})."""
    engines = [(q, lambda q=q: time_ours(q, args)) for q in args.quant] + [
        (f"llama.cpp {q}", lambda q=q: time_peer(files, q, args)) for q in _peer_types(args)
    ]
    rounds = []
    for rnd in range(args.rounds):
        shift = rnd % len(engines)
        order = engines[shift:] + engines[:shift]
        if args.rounds > 1:
            print(f"# round {rnd + 1}/{args.rounds}: " + ", ".join(n for n, _ in order),
                  flush=True)
        rounds.append({name: timed() for name, timed in order})
    return [name for name, _ in engines], rounds


def median_row(samples: list[dict]) -> dict:
    """One row from its rounds: the median of decode tok/s, ms/token, each prefill rate, the
    roofline fractions and peak RSS, the bandwidth samples of all rounds (for their spread);
    a llama.cpp row names its thread counts by round where the rounds kept different ones."""
    if len(samples) == 1:
        return samples[0]
    row = dict(samples[0])
    for key in ("decode_tok_s", "decode_s", "roofline_fraction", "read_roofline_fraction",
                "peak_rss_gb"):
        row[key] = statistics.median(r[key] for r in samples)
    row["prefill"] = {c: statistics.median(r["prefill"][c] for r in samples)
                      for c in samples[0]["prefill"]}
    for key in ("copy_gb_s", "read_gb_s"):
        row[key] = [v for r in samples for v in r[key]]
    if "peer" in row:
        dec = [r["threads"] for r in samples]
        pre = [r["prefill_threads"] for r in samples]
        if len(set(dec)) > 1:
            row["quant"] = f"llama.cpp {row['peer']} ({_by_round(dec)} threads by round)"
        if pre == dec:
            row["prefill_unit"] = "batch"
        elif len(set(pre)) == 1:
            row["prefill_unit"] = f"{pre[0]} threads, batch"
        else:
            row["prefill_unit"] = f"{_by_round(pre)} threads by round, batch"
    row["rounds"] = len(samples)
    return row


def _by_round(values: list[int]) -> str:
    return "/".join(str(v) for v in values)


def _prefill_rate(res: dict) -> float:
    """A row's prefill tok/s: its best chunk (ours) or its one batch (llama.cpp)."""
    return max(res["prefill"].values())


def print_paired(rounds: list[dict[str, dict]], quants: list[str]) -> None:
    """Per round, each of our rows against that round's fastest llama.cpp row (decode and
    prefill each its own fastest): the median ratio and its range."""
    for quant in quants:
        cells = []
        for label, rate in (("decode", lambda r: r["decode_tok_s"]), ("prefill", _prefill_rate)):
            ratios = [rate(rnd[quant]) / max(rate(r) for r in rnd.values() if "peer" in r)
                      for rnd in rounds]
            cells.append(f"{label} {statistics.median(ratios):.2f}x "
                         f"({min(ratios):.2f}-{max(ratios):.2f})")
        print(f"# {quant} / the round's fastest llama.cpp row, per round ({len(rounds)} rounds), "
              "median (min-max): " + "; ".join(cells))


def peer_summary(rows: list[dict], peer_rows: list[dict], what: str = "") -> str:
    """Ours against the fastest llama.cpp row, decode and prefill each its own fastest."""
    top_dec = max(peer_rows, key=lambda r: r["decode_tok_s"])
    top_pre = max(peer_rows, key=_prefill_rate)
    pre_peer = _prefill_rate(top_pre)
    lines = []
    for res in rows:
        pre = _prefill_rate(res)
        lines.append(
            f"# {res['quant']} / fastest llama.cpp{what}: decode "
            f"{res['decode_tok_s'] / top_dec['decode_tok_s']:.2f}x ({top_dec['quant']}), "
            f"prefill {pre / pre_peer:.2f}x ({top_pre['quant']})"
        )
    return "\n".join(lines)


def _spread(rates: list[float]) -> str:
    return f"{np.median(rates):.1f} ({min(rates):.0f}-{max(rates):.0f})"


def _extrapolate(depths: list[int], runs: list[dict], prompt: int) -> dict:
    """The deeper run's result, with times extrapolated to 32 layers when two depths ran."""
    res = dict(runs[-1])
    if len(runs) == 2:  # linear in depth: time(L) = a + b L
        (l1, r1), (l2, r2) = (depths[0], runs[0]), (depths[1], runs[1])

        def at32(t1: float, t2: float, l1=l1, l2=l2) -> float:
            b = (t2 - t1) / (l2 - l1)
            return t1 + b * (32 - l1)

        res["decode_s"] = at32(r1["decode_s"], r2["decode_s"])
        res["decode_tok_s"] = 1 / res["decode_s"]
        res["prefill"] = {
            c: prompt
            / at32(prompt / r1["prefill"][c], prompt / r2["prefill"][c])
            for c in r2["prefill"]
        }
        per_layer = (r2["decode_bytes_per_token"] - r1["decode_bytes_per_token"]) / (l2 - l1)
        res["decode_bytes_per_token"] = r1["decode_bytes_per_token"] + per_layer * (32 - l1)
        res["extrapolated_from"] = depths
        # fractions of the extrapolated time at the deeper run's bandwidth
        rate = res["decode_tok_s"] * res["decode_bytes_per_token"] / 1e9
        res["roofline_fraction"] = rate / float(np.median(res["copy_gb_s"]))
        res["read_roofline_fraction"] = rate / float(np.median(res["read_gb_s"]))
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", choices=("rwkv4", "rwkv6", "rwkv7"), default="rwkv4",
                        help="rwkv4: the RWKV-4 World 3B shape; rwkv6: RWKV-6 World 3B; "
                        "rwkv7: RWKV-7 World 2.9B")
    parser.add_argument("--quant", nargs="+", default=["q4f32_1", "q0f32"])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode", type=int, default=32)
    # the models' own default chunk (512 for RWKV-4/6/7): what a user's prefill runs with
    parser.add_argument("--chunks", default="512", help="prefill chunk sizes to try, e.g. 64,512")
    parser.add_argument("--peer", default="",
                        help="rwkv7 only: llama.cpp in the same run on its own GGUF of the same "
                        "shape, quantized to these types (comma-separated: Q4_0,Q4_K_M,Q4_1)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every row this many times, interleaved (each round in a "
                        "rotated order); the table gives medians, then each round's ratio of "
                        "ours to its fastest llama.cpp row (this VM's bandwidth moves by tens "
                        "of percent within minutes)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--compile-only", nargs=2, metavar=("QUANT", "LAYERS"))
    parser.add_argument(
        "--measure", nargs=5, metavar=("QUANT", "LAYERS", "PROMPT", "DECODE", "CHUNKS")
    )
    parser.add_argument(
        "--measure-peer", nargs=6,
        metavar=("GGUF", "QTYPE", "LAYERS", "THREADS", "PROMPT", "DECODE"),
    )
    args = parser.parse_args()
    if args.peer and args.arch != "rwkv7":
        parser.error("--peer needs --arch rwkv7 (llama.cpp's RWKV-7 layout is the one written)")
    for qtype in filter(None, args.peer.split(",")):
        if qtype not in PEER_TYPES:
            parser.error(f"--peer: {qtype!r} is not one of {', '.join(PEER_TYPES)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    global ARCH
    ARCH = args.arch
    if args.compile_only:
        path, seconds = compile_lib(args.compile_only[0], int(args.compile_only[1]))
        print(f"compiled in {seconds:.1f} s" if seconds else "cached", file=sys.stderr)
        print(path)
        return
    if args.measure_peer:
        gguf_path, qtype, layers, threads, prompt, steps = args.measure_peer
        res = measure_peer(Path(gguf_path), qtype, int(layers), int(threads), int(prompt),
                           int(steps))
        print(json.dumps(res))
        return
    if args.measure:
        q, layers, prompt, steps, chunks = args.measure
        res = measure(q, int(layers), int(prompt), int(steps), [int(c) for c in chunks.split(",")])
        print(json.dumps(res))
        return

    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"TVM_NUM_THREADS={os.environ.get('TVM_NUM_THREADS', 'default')}"
    )
    tmp, files = prepare_peers(args) if args.peer else (None, {})
    try:
        names, rounds = run_rounds(args, files)
    finally:
        if tmp is not None:
            cleanup_peers(tmp)
    medians = [median_row([rnd[name] for rnd in rounds]) for name in names]
    rows = [r for r in medians if "peer" not in r]
    peer_rows = [r for r in medians if "peer" in r]
    print(
        "# roofline = weight bytes read per token / memory bandwidth, sampled between decode "
        "rounds: copy = numpy copy of 1 GiB (read + write, the issue's definition), "
        "read = compiled streaming sum"
    )
    if args.rounds > 1:
        print(f"# each cell the median over {args.rounds} rounds (GB/s: all rounds' samples)")
    print()
    print(
        f"| {ARCH} mode | decode tok/s | ms/token | GB read/token | copy GB/s | of copy roofline "
        f"| read GB/s | of read roofline | prefill {args.prompt} tok/s | peak RSS GB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for res in rows + peer_rows:
        unit = res.get("prefill_unit", "chunk")
        pre = ", ".join(f"{v:.1f} ({unit} {c})" for c, v in res["prefill"].items())
        extra = ""
        if "extrapolated_from" in res:
            extra = f" (from {res['extrapolated_from']} layers)"
        print(
            f"| {res['quant']}{extra} | {res['decode_tok_s']:.2f} | {res['decode_s'] * 1e3:.1f} "
            f"| {res['decode_bytes_per_token'] / 1e9:.2f} "
            f"| {_spread(res['copy_gb_s'])} | {res['roofline_fraction']:.0%} "
            f"| {_spread(res['read_gb_s'])} | {res['read_roofline_fraction']:.0%} "
            f"| {pre} | {res['peak_rss_gb']:.2f} |"
        )
    if peer_rows:
        print(peer_summary(rows, peer_rows, " (medians)" if args.rounds > 1 else ""))
        if args.rounds > 1:
            print_paired(rounds, args.quant)
    if args.json:
        out: dict = {"results": rows}
        if peer_rows:
            out["peers"] = peer_rows
        if args.rounds > 1:  # each round's rows, ours then llama.cpp's, in table order
            out["rounds"] = [[rnd[name] for name in names] for rnd in rounds]
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
