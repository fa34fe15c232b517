"""Concurrency: requests share the engine's batched steps and each returns what it returns
alone; a client that goes away cancels its sequence and frees its slot (seen in /metrics)."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import openai
from serve_helpers import MODEL, Server

PROMPTS = ["Name three colours.", "What is the capital of France?", "Count to five.",
           "Say hello in Spanish."]
NO_EOS = {"2": -100}


def metric(text: str, name: str) -> float:
    """Sum of a metric's samples (all label sets)."""
    values = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return sum(float(v) for v in values)


def scrape(server: Server) -> str:
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


def wait_idle(server: Server, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(server)
        if metric(text, "localchat_running_sequences") == 0 and \
                metric(text, "localchat_kv_cache_used_tokens") == 0:
            return text
        assert time.monotonic() < deadline, text
        time.sleep(0.1)


def test_16_concurrent_streams_equal_their_solo_runs(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

    def solo(prompt: str) -> str:
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
            max_tokens=8, logit_bias=NO_EOS).choices[0].message.content

    alone = {p: solo(p) for p in PROMPTS}
    assert len(set(alone.values())) == len(PROMPTS)
    wait_idle(server)

    peak = [0.0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], metric(scrape(server), "localchat_running_sequences"))
            time.sleep(0.05)

    async def burst() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

        async def one(prompt: str) -> str:
            stream = await aclient.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
                max_tokens=8, logit_bias=NO_EOS, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream
                            if c.choices])

        try:
            return await asyncio.gather(*(one(PROMPTS[i % 4]) for i in range(16)))
        finally:
            await aclient.close()

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = asyncio.run(burst())
    finally:
        stop.set()
        watcher.join()
    assert results == [alone[PROMPTS[i % 4]] for i in range(16)]
    assert peak[0] > 1  # they ran together, not one after another
    wait_idle(server)


def test_a_disconnected_stream_frees_its_slot(server: Server) -> None:
    wait_idle(server)
    before = metric(scrape(server), "localchat_cancelled_requests_total")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
            "temperature": 0, "max_tokens": 2000, "logit_bias": NO_EOS, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      timeout=60) as r:
        assert r.status_code == 200
        lines: list[str] = []
        # `next`, not a `for` left with `break`: closing the line iterator closes the
        # connection (httpcore), which would race the scrape below
        stream = r.iter_lines()
        while len(lines) < 4:
            line = next(stream)
            if line:
                lines.append(line)
                assert '"error"' not in line, line
        text = scrape(server)
        assert metric(text, "localchat_running_sequences") == 1, text
    text = wait_idle(server, timeout=20)  # freed long before 2000 tokens
    assert metric(text, "localchat_cancelled_requests_total") == before + 1


def test_a_client_that_times_out_cancels_its_reply(server: Server) -> None:
    wait_idle(server)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
            "temperature": 0, "max_tokens": 2000, "logit_bias": NO_EOS}
    try:
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=1.5)
        raise AssertionError("2000 tokens cannot come back in 1.5 s")
    except httpx.ReadTimeout:
        pass
    wait_idle(server, timeout=20)


def test_metrics_count_requests_tokens_and_latency(server: Server) -> None:
    httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
               json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                     "max_tokens": 3, "temperature": 0})
    httpx.post(f"{server.url}/v1/chat/completions", json={"model": "nope", "messages": []})
    text = scrape(server)
    assert re.search(r'localchat_requests_total\{method="POST",route="/v1/chat/completions",'
                     r'status="200"\} [1-9]', text)
    assert re.search(r'localchat_requests_total\{method="POST",route="/v1/chat/completions",'
                     r'status="400"\} [1-9]', text)
    assert metric(text, "localchat_prompt_tokens_total") > 0
    assert metric(text, "localchat_generation_tokens_total") >= 3
    assert metric(text, "localchat_time_to_first_token_seconds_count") >= 1
    assert metric(text, "localchat_inter_token_latency_seconds_count") >= 2
    assert "# TYPE localchat_queue_depth gauge" in text
    assert metric(text, "localchat_kv_cache_capacity_tokens") > 0
