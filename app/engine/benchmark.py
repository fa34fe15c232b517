"""`localchat bench`'s measurement: one model's prefill and decode speed on this machine, its
time to first token, memory and load time, and decode as a fraction of the memory-read roofline.

The model is driven directly (`Model.prefill` / `Model.decode`, greedy argmax on the logits):
what is timed is the compiled model and the Python loop around it, not a chat template, a
sampler or a detokenizer, so every model benches the same way. The prompt is `prompt_tokens`
ids drawn (with a fixed seed) from the model's own vocabulary, special tokens left out.

Steps: the read bandwidth is sampled (`membw.ReadBandwidth`) and its buffer freed, the peak RSS
is reset, the model loads (compiling its library first if needed: timed apart), a short
warm-up runs, the prompt is prefilled once (TTFT = that prefill and the first argmax), then for
each batch size B that many copies of the prompt's state (`Model.fork`: the KV pages are
shared) decode `gen_tokens` steps together (tok/s summed over the B sequences); the peak RSS is
read, and the bandwidth sampled again. The roofline uses the mean of the two samples.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localchat import model_dir as md
from localchat.errors import InvalidRequestError

DEFAULT_PROMPT_TOKENS = 512
DEFAULT_GEN_TOKENS = 128
DEFAULT_BATCHES = (1, 4, 16)
# The largest batch a bench decodes: the scheduler has no fixed cap, but each sequence adds
# its pages to the KV cache and a vocabulary of logits to every step; beyond this a bench
# measures the allocator more than the model.
MAX_BATCH_SIZE = 64
PROMPT_SEED = 0
PAGE_SLACK = 32  # KV positions per forked sequence beyond its tokens (copied partial pages)

Progress = Callable[[str], None]


@dataclass(frozen=True)
class DecodeRate:
    """Decode speed with `batch` sequences advanced together: tokens per second, summed."""

    batch: int
    tok_s: float


@dataclass(frozen=True)
class BenchResult:
    """What `run_benchmark` measured. Rates are tokens per second, times seconds, sizes bytes.

    bytes_per_token: the memory a decode step reads per token generated, at the first batch
        size listed in `decode`: every parameter as stored (an untied input embedding only one
        row: a lookup), plus each sequence's KV cache at its mean length over the run (or its
        recurrent state), divided by the batch. Activations, logits and the attention's
        scratch are left out, so it is a lower bound of the real traffic.
    roofline_fraction: bytes_per_token x that batch's tok/s over `bandwidth_gb_s`, the read
        bandwidth of a compiled streaming sum sampled before and after the run (None when the
        model runs on a GPU: the probe measures the host's memory).
    """

    model: str
    quantization: str
    device: str
    threads: int
    prompt_tokens: int
    gen_tokens: int
    prefill_tok_s: float
    ttft_s: float
    decode: tuple[DecodeRate, ...]
    peak_rss_bytes: int
    load_s: float
    compile_s: float
    bandwidth_gb_s: float | None
    bytes_per_token: float
    roofline_fraction: float | None
    weight_bytes_per_step: int
    state_bytes_per_sequence: float
    model_dir: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON-friendly values, in a stable key order."""
        return {
            "model": self.model,
            "quantization": self.quantization,
            "device": self.device,
            "threads": self.threads,
            "prompt_tokens": self.prompt_tokens,
            "gen_tokens": self.gen_tokens,
            "prefill_tok_s": self.prefill_tok_s,
            "ttft_s": self.ttft_s,
            "decode": [{"batch": d.batch, "tok_s": d.tok_s} for d in self.decode],
            "peak_rss_bytes": self.peak_rss_bytes,
            "load_s": self.load_s,
            "compile_s": self.compile_s,
            "bandwidth_gb_s": self.bandwidth_gb_s,
            "bytes_per_token": self.bytes_per_token,
            "roofline_fraction": self.roofline_fraction,
            "weight_bytes_per_step": self.weight_bytes_per_step,
            "state_bytes_per_sequence": self.state_bytes_per_sequence,
            "model_dir": self.model_dir,
        }


def check_bench_options(prompt_tokens: int, gen_tokens: int,
                        batches: Iterable[int]) -> tuple[int, ...]:
    """The batch sizes (duplicates dropped, order kept) once every option is valid; else an
    InvalidRequestError naming the option."""
    for name, value in (("prompt_tokens", prompt_tokens), ("gen_tokens", gen_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequestError(f"{name} must be a whole number, 1 or more, not {value!r}",
                                      name)
    sizes = tuple(dict.fromkeys(batches))
    if not sizes:
        raise InvalidRequestError("at least one batch size is needed", "batch")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_BATCH_SIZE:
            raise InvalidRequestError(
                f"batch sizes must be whole numbers from 1 to {MAX_BATCH_SIZE} (the most "
                f"sequences a bench decodes together), not {size!r}", "batch")
    return sizes


def synthetic_prompt(vocab_size: int, count: int, exclude: Iterable[int] = (),
                     seed: int = PROMPT_SEED) -> list[int]:
    """`count` token ids drawn from [0, vocab_size) with a fixed seed, `exclude` left out
    (special tokens: an EOS in the prompt would change nothing timed, but no model sees one
    mid-text)."""
    import numpy as np

    banned = {int(t) for t in exclude if 0 <= int(t) < vocab_size}
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(banned, dtype=np.int64))
    if allowed.size == 0:
        allowed = np.arange(vocab_size)
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.choice(allowed, size=count)]


def run_benchmark(
    ref: str | Path,
    *,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    gen_tokens: int = DEFAULT_GEN_TOKENS,
    batches: Sequence[int] = DEFAULT_BATCHES,
    device: str = "auto",
    threads: int | None = None,
    progress: Progress | None = None,
    bandwidth_bytes: int | None = None,
) -> BenchResult:
    """Bench the model `ref` (a store name, `name:quant` or a model directory); see the module
    docstring for what is measured. `threads` sets the CPU thread count (None: the usual
    default) and must be set before this process first runs a kernel; `progress` gets a line
    per step. Bad options raise InvalidRequestError before anything loads."""
    from localchat.engine.engine import resolve_model_dir
    from localchat.engine.threads import configure_threads

    say = progress or (lambda _line: None)
    sizes = check_bench_options(prompt_tokens, gen_tokens, batches)
    thread_count = configure_threads(threads)
    model_dir = resolve_model_dir(ref)
    meta = md.load_config(model_dir)
    window = int(meta["context_window_size"])
    if prompt_tokens + gen_tokens + 1 > window:
        raise InvalidRequestError(
            f"prompt_tokens + gen_tokens ({prompt_tokens} + {gen_tokens}, and one warm-up step) "
            f"must fit the model's context window of {window} tokens", "prompt_tokens")

    import numpy as np

    from localchat.engine.build.compile import target_key
    from localchat.engine.device import select_device
    from localchat.engine.membw import DEFAULT_BYTES, ReadBandwidth
    from localchat.engine.runtime import PAGE_SIZE, Model

    dev = select_device(device)
    on_cpu = dev.kind == "cpu"
    probe = None
    bandwidth: list[float] = []
    if on_cpu:
        say("measuring the memory read bandwidth")
        probe = ReadBandwidth(bandwidth_bytes or DEFAULT_BYTES)
        bandwidth.append(probe.sample())
        probe.release()  # its buffer is not the model's memory: freed before the peak is reset
    reset_peak_rss()

    largest = max(sizes)
    say(f"loading {model_dir}")
    started = time.perf_counter()
    model = Model(
        model_dir,
        dev,
        max_batch_size=largest + 1,  # + the prompt's sequence the batches fork
        # The prompt once (forks share its pages), then each fork's own tokens.
        max_total_tokens=prompt_tokens + largest * (gen_tokens + 2 + PAGE_SLACK) + PAGE_SIZE,
        log=say,
    )
    compile_s = model.compile_seconds
    load_s = time.perf_counter() - started - compile_s

    vocab = int(meta.get("vocab_size") or model.config.vocab_size)
    specials = [*model.eos_token_ids, *([meta["bos_token_id"]] if meta.get("bos_token_id")
                                        is not None else [])]
    prompt = synthetic_prompt(vocab, prompt_tokens, specials)

    say("warming up")
    warm = model.new_sequence()
    token = int(np.argmax(model.prefill(warm, prompt[: min(prompt_tokens, 16)])))
    model.decode([warm], [token])
    model.remove(warm)

    say(f"prefill {prompt_tokens} tokens")
    root = model.new_sequence()
    t0 = time.perf_counter()
    logits = model.prefill(root, prompt)
    prefill_s = time.perf_counter() - t0
    first = int(np.argmax(logits))
    ttft_s = time.perf_counter() - t0

    rates = []
    for size in sizes:
        say(f"decode {gen_tokens} steps, batch {size}")
        rates.append(DecodeRate(size, _decode_rate(model, root, first, size, gen_tokens)))
    peak = peak_rss_bytes()
    model.remove(root)

    if probe is not None:
        say("measuring the memory read bandwidth again")
        bandwidth.append(probe.sample())
        probe.release()

    # What a decode step reads: the weights once for the whole batch, each sequence's KV cache
    # (its mean length over the run: prompt, warm-up step, half the steps) or its state.
    weights = weight_bytes_per_step(meta["param_names"], model.params)
    mean_tokens = prompt_tokens + 1 + (gen_tokens + 1) / 2
    state_dtype = model.mode.state_dtype(model.state_kind)
    state = float(model.arch.cache_bytes(model.config, state_dtype, 1, mean_tokens))
    head = rates[0]
    per_token = (weights + head.batch * state) / head.batch
    bw = sum(bandwidth) / len(bandwidth) if bandwidth else None
    fraction = per_token * head.tok_s / (bw * 1e9) if bw else None
    return BenchResult(
        model=_model_name(meta, model_dir),
        quantization=str(meta["quantization"]),
        device=f"{dev.kind} ({target_key(dev.target)})",
        threads=thread_count,
        prompt_tokens=prompt_tokens,
        gen_tokens=gen_tokens,
        prefill_tok_s=prompt_tokens / prefill_s,
        ttft_s=ttft_s,
        decode=tuple(rates),
        peak_rss_bytes=peak,
        load_s=load_s,
        compile_s=compile_s,
        bandwidth_gb_s=bw,
        bytes_per_token=per_token,
        roofline_fraction=fraction,
        weight_bytes_per_step=weights,
        state_bytes_per_sequence=state,
        model_dir=str(model_dir),
    )


def _decode_rate(model: Any, root: Any, first: int, size: int, steps: int) -> float:
    """Tokens per second, summed, of `size` copies of `root` decoding `steps` steps together
    (greedy; the copies start from the same token, which changes nothing timed)."""
    import numpy as np

    seqs = [model.fork(root) for _ in range(size)]
    try:
        tokens = [first] * size
        out = model.decode(seqs, tokens)  # warm-up: this batch shape's first call
        tokens = [int(t) for t in np.argmax(out, axis=1)]
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model.decode(seqs, tokens)
            tokens = [int(t) for t in np.argmax(out, axis=1)]
        return size * steps / (time.perf_counter() - t0)
    finally:
        for seq in seqs:
            model.remove(seq)


def weight_bytes_per_step(names: Sequence[str], params: Sequence[Any]) -> int:
    """Bytes of the parameters one decode step reads: all of them as stored, except that an
    input embedding with a separate LM head is read one row (a lookup) rather than whole."""
    import numpy as np

    def size(p: Any) -> int:
        return int(np.prod(p.shape)) * np.dtype(p.dtype).itemsize

    has_head = any(n.rpartition(".")[0].endswith("head") for n in names)
    total = 0
    for name, p in zip(names, params):
        if has_head and "embed" in name.rpartition(".")[0] and len(p.shape) >= 1 and p.shape[0]:
            total += size(p) // int(p.shape[0])
        else:
            total += size(p)
    return total


def _model_name(meta: dict[str, Any], path: Path) -> str:
    """The store name of a model, else its folder's (as `Engine.name` does)."""
    if meta.get("name"):
        return str(meta["name"])
    if path.name == meta.get("quantization") and path.parent.name:
        return path.parent.name
    return path.name


def peak_rss_bytes() -> int:
    """This process's peak resident memory since start or the last `reset_peak_rss()` (Linux
    VmHWM; elsewhere getrusage's maximum, which cannot be reset)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS: bytes, Linux: KiB


def reset_peak_rss() -> bool:
    """Start the peak resident memory afresh from the current size (Linux: writing 5 to
    /proc/self/clear_refs); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


__all__ = [
    "DEFAULT_BATCHES",
    "DEFAULT_GEN_TOKENS",
    "DEFAULT_PROMPT_TOKENS",
    "MAX_BATCH_SIZE",
    "BenchResult",
    "DecodeRate",
    "check_bench_options",
    "run_benchmark",
    "synthetic_prompt",
    "weight_bytes_per_step",
]
