"""The prefix cache through `localchat serve`: a second request sharing a long system prompt
reuses it (usage counts the whole prompt, cached tokens shown apart), the same greedy reply as
without the reuse, and /metrics counts the hit."""

from __future__ import annotations

import re

import httpx
from serve_helpers import MODEL, Server

SYSTEM = " ".join(f"Rule {i}: answer politely and mention the number {i}." for i in range(20))


def metric(text: str, name: str) -> float:
    """Sum of a metric's samples (all label sets)."""
    values = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return sum(float(v) for v in values)


def ask(server: Server, question: str) -> dict:
    body = {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 6,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
    }
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_shared_system_prompt_is_reused(server: Server) -> None:
    before = metric(httpx.get(f"{server.url}/metrics").text, "localchat_prefix_cache_hits_total")
    first = ask(server, "What is 2+2? (prefix cache test)")
    second = ask(server, "What is 2+2? (prefix cache test)")
    counted = httpx.post(
        f"{server.url}/tokenize", json={"model": MODEL, "messages": first_messages()}
    ).json()["count"]
    for reply in (first, second):
        assert reply["usage"]["prompt_tokens"] == counted
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == counted - 1
    assert second["choices"][0]["message"] == first["choices"][0]["message"]
    after = metric(httpx.get(f"{server.url}/metrics").text, "localchat_prefix_cache_hits_total")
    assert after >= before + 1


def first_messages() -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is 2+2? (prefix cache test)"},
    ]
