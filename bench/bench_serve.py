"""Benchmark: `localchat serve` under 1, 4 and 16 concurrent streaming clients, beside
llama-cpp-python's OpenAI server on the same GGUF (SmolLM2-135M-Instruct).

One load generator (asyncio) sends N concurrent streaming chat requests of 128 output
tokens each (EOS banned with logit_bias so every reply has the same length) and reports the
aggregate output tok/s, p50 and p95 time to first token and p50 inter-token latency. The client
reads the streams over plain HTTP/1.1 connections (`--client raw`, the default): on a small
machine the load generator's CPU is taken from the server it measures, and httpx (`--client
httpx`) spends about twice as much per chunk. Both servers get the same client. Each row is the
best of --repeat rounds (at least 7 at 1 stream) after a warm-up at its width (the machine
may be shared).

The single-stream baseline is the engine in-process (what `localchat run` does). Its replies
are interleaved with the 1-stream rounds (one `run` reply, then one served stream, a pause
between), so a noisy neighbour slows both sides of the ratio alike; the table's ratio is best
over best, and the median of the per-round ratios is printed under it. Targets: at 16 streams
>= 4x llama-cpp-python's aggregate throughput; at 1 stream within 10% of `run`.

    python bench/bench_serve.py [--quant q4f32_1] [--streams 1 4 16] [--threads 2]
                                [--repeat 3] [--client raw|httpx] [--skip-llama-cpp]

llama-cpp-python's server needs its `server` extra (pip install 'llama-cpp-python[server]');
without it its rows print "-".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

OUTPUT_TOKENS = 128
PROMPTS = ["Tell me a story about a lighthouse keeper.", "Explain how rain forms.",
           "Describe a walk through a busy market.", "Write about the history of bread."]
EOS = 2  # SmolLM2's end-of-text token
SETTLE_S = 0.5  # pause between a `run` reply and a served round
SOLO_ROUNDS = 7  # at least this many rounds at 1 stream (short, and the noisiest ratio)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 1800) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200 and \
                    httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not start")


def request_body(model: str, prompt: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": OUTPUT_TOKENS, "temperature": 0, "stream": True,
            "logit_bias": {str(EOS): -100}}


def content_stamps(lines: list[bytes], stamps: list[float]) -> None:
    """A time stamp for each SSE chunk among `lines` that carries content."""
    for line in lines:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            if choice.get("delta", {}).get("content"):
                stamps.append(time.perf_counter())


async def httpx_stream(client: httpx.AsyncClient, url: str, model: str, prompt: str) -> dict:
    start = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", f"{url}/v1/chat/completions",
                             json=request_body(model, prompt)) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            content_stamps([line.encode()], stamps)
    return {"start": start, "stamps": stamps}


async def raw_stream(client: None, url: str, model: str, prompt: str) -> dict:
    """One streamed request on its own HTTP/1.1 connection, chunked or not."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    payload = json.dumps(request_body(model, prompt)).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s:%d\r\n"
                 b"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                 % (host.encode(), port, len(payload), payload))
    await writer.drain()
    status = await reader.readline()
    if status.split()[1:2] != [b"200"]:
        raise RuntimeError(f"HTTP status {status.decode(errors='replace').strip()}")
    chunked = False
    while (header := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = header.partition(b":")
        chunked |= name.strip().lower() == b"transfer-encoding" and b"chunked" in value.lower()
    stamps: list[float] = []
    rest = b""
    while True:
        if chunked:
            size = int((await reader.readline()).split(b";")[0], 16)
            data = (await reader.readexactly(size + 2))[:-2] if size else b""
        else:
            data = await reader.read(65536)
        if not data:
            break
        *lines, rest = (rest + data).split(b"\n")
        content_stamps(lines, stamps)
    writer.close()
    return {"start": start, "stamps": stamps}


async def load(url: str, model: str, streams: int, repeat: int, client_kind: str,
               baseline: RunBaseline | None = None) -> dict:
    """`streams` concurrent streams, warmed up at that width, then the best of `repeat`
    rounds (the machine is shared: the best round is the one least disturbed). With a
    `baseline`, one `run` reply precedes each round and the round records it."""
    limits = httpx.Limits(max_connections=streams + 4)
    stream = raw_stream if client_kind == "raw" else httpx_stream
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        c = client if client_kind == "httpx" else None
        await asyncio.gather(*(stream(c, url, model, "Hi") for _ in range(streams)))
        rounds = []
        for _ in range(repeat):
            run_tok_s = None
            if baseline is not None:
                run_tok_s = baseline.reply()
                # TVM's idle workers spin for a while before they sleep (both the run's and,
                # below, the server's): a pause keeps them off the other side's measurement.
                await asyncio.sleep(SETTLE_S)
            t0 = time.perf_counter()
            runs = await asyncio.gather(*(stream(c, url, model, PROMPTS[i % len(PROMPTS)])
                                          for i in range(streams)))
            rounds.append({**_summary(streams, runs, time.perf_counter() - t0),
                           "run_tok_s": run_tok_s})
            if baseline is not None:
                await asyncio.sleep(SETTLE_S)
    best = max(rounds, key=lambda r: r["tok_s"])
    if baseline is not None:
        best["run_tok_s"] = max(r["run_tok_s"] for r in rounds)
        best["round_ratios"] = [r["tok_s"] / r["run_tok_s"] for r in rounds]
    return best


def run_async(coro: Any) -> Any:
    """Run a coroutine on uvloop where it is installed (a lighter load generator)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _summary(streams: int, runs: list[dict], wall: float) -> dict:
    tokens = sum(len(r["stamps"]) for r in runs)
    ttfts = sorted(r["stamps"][0] - r["start"] for r in runs if r["stamps"])
    gaps = sorted(b - a for r in runs for a, b in zip(r["stamps"], r["stamps"][1:]))
    return {"streams": streams, "tok_s": tokens / wall,
            "ttft_p50": _pct(ttfts, 50), "ttft_p95": _pct(ttfts, 95),
            "itl_p50": _pct(gaps, 50)}


def _pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


class RunBaseline:
    """`localchat run`'s path: the engine in this process, one reply at a time, counted as
    the load generator counts a stream (tokens over the wall time, prompt included)."""

    def __init__(self, model_dir: Path) -> None:
        from localchat import Engine

        self.engine = Engine.open(model_dir, device="cpu", options={"temperature": 0})
        self.reply()  # warm-up: the first reply pays for loading and first-touch costs

    def reply(self) -> float:
        """Output tok/s of one full-length reply to the first prompt."""
        from localchat import FinishEvent

        t0 = time.perf_counter()
        n = 0
        for event in self.engine.chat([{"role": "user", "content": PROMPTS[0]}],
                                      max_tokens=OUTPUT_TOKENS,
                                      logit_bias={EOS: float("-inf")}):
            if not isinstance(event, FinishEvent) and event.text:
                n += 1
        return n / (time.perf_counter() - t0)

    def close(self) -> None:
        self.engine.close()


def serve_localchat(model_dir: Path, max_streams: int) -> tuple[subprocess.Popen, str, str]:
    home = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    (home / "models" / "smollm2").mkdir(parents=True)
    (home / "models" / "smollm2" / model_dir.name).symlink_to(model_dir)
    port = free_port()
    env = {**os.environ, "LOCALCHAT_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-m", "localchat.server", "--port", str(port),
                             "--device", "cpu", "--model", "smollm2",
                             "--max-concurrency", str(max_streams)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}", "smollm2"


def serve_llama_cpp(gguf: Path, threads: int) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
                             "--n_threads", str(threads), "--chat_format", "chatml",
                             "--port", str(port), "--n_ctx", "4096",
                             # By default a new request interrupts the one streaming: with
                             # concurrent clients the interrupted streams never finish.
                             "--interrupt_requests", "False"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}", gguf.name


def measure(proc: subprocess.Popen, url: str, model: str, streams: list[int],
            repeat: int, client_kind: str, baseline: RunBaseline | None = None) -> list[dict]:
    """Rows for `streams` against a started server, which is stopped afterwards; `baseline`
    is interleaved with the 1-stream rounds."""
    try:
        # llama_cpp.server has no /health: it is ready once it lists its model.
        _wait_models(url, proc) if model.endswith(".gguf") else wait_ready(url, proc)
        return [run_async(load(url, model, n, max(repeat, SOLO_ROUNDS) if n == 1 else repeat,
                               client_kind, baseline if n == 1 else None)) for n in streams]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _wait_models(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("llama_cpp.server exited")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("llama_cpp.server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", default="q4f32_1")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="rounds per row (best kept)")
    parser.add_argument("--client", choices=["raw", "httpx"], default="raw",
                        help="the load generator's HTTP client (raw: plain HTTP/1.1, about "
                             "half httpx's CPU per chunk)")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    args = parser.parse_args()

    from fixtures import converted, smollm2_gguf, smollm2_hf_dir

    model_dir = converted(smollm2_hf_dir(), args.quant)
    baseline = RunBaseline(model_dir) if 1 in args.streams else None
    try:
        ours = measure(*serve_localchat(model_dir, max(args.streams)), args.streams,
                       args.repeat, args.client, baseline)
    finally:
        if baseline is not None:
            baseline.close()
    solo = next((row for row in ours if row["streams"] == 1), None)
    theirs: list[dict] | None = None
    if not args.skip_llama_cpp:
        try:
            import llama_cpp.server  # noqa: F401
        except ImportError:
            print("llama-cpp-python[server] is not installed: its rows print \"-\"")
        else:
            theirs = measure(*serve_llama_cpp(smollm2_gguf(), args.threads), args.streams,
                             args.repeat, args.client)

    print(f"\nSmolLM2-135M, {OUTPUT_TOKENS} output tokens per stream; localchat {args.quant}; "
          f"best of {args.repeat} rounds per row (1 stream: {max(args.repeat, SOLO_ROUNDS)}); "
          f"{args.client} client")
    head = f"{'streams':>7} | {'server':<16} | {'tok/s':>8} | {'TTFT p50':>9} | " \
           f"{'TTFT p95':>9} | {'ITL p50':>8} | ratio"
    print(head)
    print("-" * len(head))
    for i, row in enumerate(ours):
        peer = theirs[i] if theirs is not None else None
        ratio = f"{row['tok_s'] / peer['tok_s']:.2f}x llama.cpp" if peer else "- llama.cpp"
        if row["streams"] == 1:
            ratio += f", {row['tok_s'] / row['run_tok_s']:.2f}x run"
        print(_row(row["streams"], "localchat serve", row, ratio))
        print(_row(row["streams"], "llama_cpp.server", peer, ""))
    if solo is not None:
        ratios = ", ".join(f"{r:.2f}" for r in solo["round_ratios"])
        print(f"\n`localchat run` (in-process, interleaved with the 1-stream rounds): "
              f"{solo['run_tok_s']:.1f} tok/s at best; serve/run per round: {ratios} "
              f"(median {statistics.median(solo['round_ratios']):.2f})")


def _row(streams: int, name: str, r: dict | None, ratio: str) -> str:
    """One table row; a peer that did not run prints "-" in every column."""
    if r is None:
        return (f"{streams:>7} | {name:<16} | {'-':>8} | {'-':>9} | {'-':>9} | {'-':>8} | "
                f"{ratio}")
    return (f"{streams:>7} | {name:<16} | {r['tok_s']:>8.1f} | "
            f"{r['ttft_p50'] * 1000:>7.0f}ms | {r['ttft_p95'] * 1000:>7.0f}ms | "
            f"{r['itl_p50'] * 1000:>6.1f}ms | {ratio}")

if __name__ == "__main__":
    main()
