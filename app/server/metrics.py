"""Prometheus text metrics of the server: requests by route and status, tokens in and out,
time-to-first-token and inter-token latency histograms, per model the engine's own timings of
each reply (`ReplyStats`: the last reply's prefill and decode speed and time to first token as
gauges, and the seconds spent prefilling and decoding as counters, so that
`rate(localchat_generation_tokens_total[5m]) / rate(localchat_decode_seconds_total[5m])` is the
decode speed over time), and (read at scrape time from each loaded engine) queue depth, running
sequences, KV cache use and the prefix cache's hits.

Names follow Prometheus' conventions: a `localchat_` prefix, base units (seconds) in the name,
`_total` on counters and only on counters, rates spelt `_tokens_per_second`."""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from localchat import ReplyStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """Cumulative-bucket histogram."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> Iterable[str]:
        sep = "," if labels else ""
        total = 0
        for bound, n in zip(self.buckets, self.counts):
            total += n
            yield f'{name}_bucket{{{labels}{sep}le="{bound}"}} {total}'
        yield f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}'
        braces = f"{{{labels}}}" if labels else ""
        yield f"{name}_sum{braces} {self.sum}"
        yield f"{name}_count{braces} {self.count}"


class Metrics:
    """Counters and histograms, updated from the event loop and read by /metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str, int], int] = defaultdict(int)
        self.prompt_tokens: dict[str, int] = defaultdict(int)
        self.completion_tokens: dict[str, int] = defaultdict(int)
        self.cancelled: dict[str, int] = defaultdict(int)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        # per model, from the engine's ReplyStats: the last reply's rates, and time counters
        self.last_prefill_tok_s: dict[str, float] = {}
        self.last_decode_tok_s: dict[str, float] = {}
        self.last_ttft_s: dict[str, float] = {}
        self.prefill_seconds: dict[str, float] = defaultdict(float)
        self.decode_seconds: dict[str, float] = defaultdict(float)

    def request_done(self, method: str, route: str, status: int) -> None:
        with self._lock:
            self.requests[(method, route, status)] += 1

    def reply_done(
        self, model: str, prompt_tokens: int, completion_tokens: int, cancelled: bool,
        stats: ReplyStats | None = None,
    ) -> None:
        """Count a finished reply; with its `stats`, record its engine-side timings too (a
        speed that was not measured, 0, leaves the last one in place)."""
        with self._lock:
            self.prompt_tokens[model] += prompt_tokens
            self.completion_tokens[model] += completion_tokens
            if cancelled:
                self.cancelled[model] += 1
            if stats is None:
                return
            if stats.prefill_tok_s > 0:
                self.last_prefill_tok_s[model] = stats.prefill_tok_s
                self.prefill_seconds[model] += stats.prompt_tokens / stats.prefill_tok_s
            if stats.decode_tok_s > 0:
                self.last_decode_tok_s[model] = stats.decode_tok_s
                # the decode speed counts the tokens after the first (which prefill produced)
                self.decode_seconds[model] += (stats.completion_tokens - 1) / stats.decode_tok_s
            if stats.ttft_s > 0:
                self.last_ttft_s[model] = stats.ttft_s

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        with self._lock:
            self.itl.observe(seconds)

    def render(self, models: Iterable[Any]) -> str:
        """The Prometheus text exposition; `models` are the loaded models (LoadedModel)."""
        out: list[str] = []

        def head(name: str, kind: str, text: str) -> None:
            out.append(f"# HELP {name} {text}")
            out.append(f"# TYPE {name} {kind}")

        with self._lock:
            head("localchat_requests_total", "counter", "HTTP requests by route and status.")
            for (method, route, status), n in sorted(self.requests.items()):
                out.append(
                    f'localchat_requests_total{{method="{method}",route="{route}",'
                    f'status="{status}"}} {n}'
                )
            head("localchat_prompt_tokens_total", "counter", "Prompt tokens prefilled.")
            for model, n in sorted(self.prompt_tokens.items()):
                out.append(f'localchat_prompt_tokens_total{{model="{_esc(model)}"}} {n}')
            head("localchat_generation_tokens_total", "counter", "Tokens generated.")
            for model, n in sorted(self.completion_tokens.items()):
                out.append(f'localchat_generation_tokens_total{{model="{_esc(model)}"}} {n}')
            head(
                "localchat_cancelled_requests_total",
                "counter",
                "Replies cancelled because their client went away.",
            )
            for model, n in sorted(self.cancelled.items()):
                out.append(f'localchat_cancelled_requests_total{{model="{_esc(model)}"}} {n}')
            head(
                "localchat_time_to_first_token_seconds",
                "histogram",
                "From request arrival to the first generated token.",
            )
            out.extend(self.ttft.lines("localchat_time_to_first_token_seconds"))
            head(
                "localchat_inter_token_latency_seconds",
                "histogram",
                "Time between consecutive tokens of a reply.",
            )
            out.extend(self.itl.lines("localchat_inter_token_latency_seconds"))
            for name, kind, text, values in (
                ("localchat_prefill_seconds_total", "counter",
                 "Engine time spent prefilling prompts.", self.prefill_seconds),
                ("localchat_decode_seconds_total", "counter",
                 "Engine time spent decoding tokens after each reply's first.",
                 self.decode_seconds),
                ("localchat_last_prefill_tokens_per_second", "gauge",
                 "Prefill speed of the model's last reply (prompt tokens / prefill time).",
                 self.last_prefill_tok_s),
                ("localchat_last_decode_tokens_per_second", "gauge",
                 "Decode speed of the model's last reply (tokens after the first / their time).",
                 self.last_decode_tok_s),
                ("localchat_last_time_to_first_token_seconds", "gauge",
                 "Time to first token of the model's last reply, in the engine.",
                 self.last_ttft_s),
            ):
                head(name, kind, text)
                for model, value in sorted(values.items()):
                    out.append(f'{name}{{model="{_esc(model)}"}} {value}')
        gauges = {
            "localchat_queue_depth": "Requests waiting for a sequence slot.",
            "localchat_running_sequences": "Requests being prefilled or decoded.",
            "localchat_kv_cache_used_tokens": "Tokens held in the KV cache / state.",
            "localchat_kv_cache_capacity_tokens": "Tokens the KV cache can hold.",
            "localchat_kv_cache_usage_ratio": "Used over capacity.",
            "localchat_prefix_cache_tokens": "Tokens kept by the prefix cache (freed on demand).",
            "localchat_prefix_cache_hits_total": "Prompts that reused a cached prefix.",
            "localchat_prefix_cache_reused_tokens_total": "Prompt tokens not prefilled again.",
        }
        rows: dict[str, list[str]] = {name: [] for name in gauges}
        for loaded in models:
            engine = loaded.engine
            label = f'{{model="{_esc(loaded.ref)}"}}'
            try:
                waiting, running = engine.scheduler.counts()
                cached = engine.scheduler.cached_tokens()
                used = engine.scheduler.held_tokens() - cached  # the cache yields on demand
                capacity = int(engine.model.max_total_tokens)
                cache = engine.scheduler.cache
                hits, reused = (cache.stats.hits, cache.stats.reused_tokens) if cache else (0, 0)
            except Exception:  # noqa: BLE001 - an engine closing under us: skip it
                continue
            rows["localchat_queue_depth"].append(f"localchat_queue_depth{label} {waiting}")
            rows["localchat_running_sequences"].append(
                f"localchat_running_sequences{label} {running}"
            )
            rows["localchat_kv_cache_used_tokens"].append(
                f"localchat_kv_cache_used_tokens{label} {used}"
            )
            rows["localchat_kv_cache_capacity_tokens"].append(
                f"localchat_kv_cache_capacity_tokens{label} {capacity}"
            )
            ratio = used / capacity if capacity else 0.0
            rows["localchat_kv_cache_usage_ratio"].append(
                f"localchat_kv_cache_usage_ratio{label} {ratio}"
            )
            for name, value in (
                ("localchat_prefix_cache_tokens", cached),
                ("localchat_prefix_cache_hits_total", hits),
                ("localchat_prefix_cache_reused_tokens_total", reused),
            ):
                rows[name].append(f"{name}{label} {value}")
        for name, text in gauges.items():
            head(name, "counter" if name.endswith("_total") else "gauge", text)
            out.extend(rows[name])
        return "\n".join(out) + "\n"


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
