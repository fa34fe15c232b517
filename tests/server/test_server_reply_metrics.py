"""/metrics carries each reply's engine timings per model (its ReplyStats: prefill and decode
speed, time to first token, and the seconds behind them as counters), scraped from the real
server after a request made with the official OpenAI client; and every series follows
Prometheus' naming conventions."""

from __future__ import annotations

import re

import httpx
import openai
from serve_helpers import MODEL, Server

NO_EOS = {"2": -100}  # SmolLM2's <|im_end|>: the reply runs to max_tokens
# a sample line; label values are quoted and may hold braces (route="/v1/models/{id}")
SAMPLE = re.compile(r'^(localchat_[a-z_]+)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})? (\S+)$')


def scrape(server: Server) -> str:
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


def per_model(text: str, name: str) -> float:
    """The sample of `name` for the served model (0.0 when it has none yet)."""
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and m.group(1) == name and f'model="{MODEL}' in (m.group(2) or ""):
            return float(m.group(3))
    return 0.0


def test_a_reply_sets_the_speed_gauges_and_adds_its_seconds(server: Server) -> None:
    before = scrape(server)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a lighthouse at dusk."}],
        max_tokens=12, temperature=0, logit_bias=NO_EOS)
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    after = scrape(server)

    prefill = per_model(after, "localchat_last_prefill_tokens_per_second")
    decode = per_model(after, "localchat_last_decode_tokens_per_second")
    ttft = per_model(after, "localchat_last_time_to_first_token_seconds")
    assert prefill > 0 and decode > 0 and 0 < ttft < 60

    def added(name: str) -> float:
        return per_model(after, name) - per_model(before, name)

    prompt = added("localchat_prompt_tokens_total")
    generated = added("localchat_generation_tokens_total")
    assert prompt > 0 and generated == 12
    # the counters hold the time behind the gauges: tokens over their speed
    assert abs(added("localchat_prefill_seconds_total") - prompt / prefill) < 1e-6
    assert abs(added("localchat_decode_seconds_total") - (generated - 1) / decode) < 1e-6
    assert ttft >= prompt / prefill  # the first token comes after the prompt's prefill


def test_every_series_follows_the_prometheus_naming_conventions(server: Server) -> None:
    httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
               json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                     "max_tokens": 2, "temperature": 0})
    text = scrape(server)
    kinds: dict[str, str] = {}
    helped: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helped.add(line.split()[2])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert name not in kinds, f"{name} declared twice"
            kinds[name] = kind
    assert kinds and set(kinds) == helped
    for name, kind in kinds.items():
        assert re.fullmatch(r"localchat_[a-z][a-z0-9_]*", name), name
        assert (kind == "counter") == name.endswith("_total"), f"{name} is a {kind}"
        if kind == "histogram":
            assert name.endswith("_seconds"), name  # a base unit in the name
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        family = re.sub(r"_(bucket|sum|count)$", "", m.group(1))
        assert m.group(1) in kinds or kinds.get(family) == "histogram", line
        float(m.group(3))
    for name in ("localchat_last_prefill_tokens_per_second",
                 "localchat_last_decode_tokens_per_second",
                 "localchat_last_time_to_first_token_seconds"):
        assert kinds[name] == "gauge"
    for name in ("localchat_prefill_seconds_total", "localchat_decode_seconds_total",
                 "localchat_prompt_tokens_total", "localchat_generation_tokens_total"):
        assert kinds[name] == "counter"
