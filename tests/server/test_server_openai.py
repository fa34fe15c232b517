"""The OpenAI API of `localchat serve`, through the official `openai` client and raw httpx SSE."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serve_helpers import MODEL, MODEL_REF, Server

QUESTION = [{"role": "user", "content": "Name three colours."}]
NO_EOS = {"2": -100}  # SmolLM2's only stop token: banned, so replies run to max_tokens


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def sse_events(response: httpx.Response) -> list[object]:
    """The `data:` payloads of an SSE response, parsed; "[DONE]" kept as a string."""
    out: list[object] = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def greedy(client: openai.OpenAI, messages: list, max_tokens: int = 12, **kw: object):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_tokens=max_tokens, **kw)


def test_models_list_and_get(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]  # the name it was served by: its default quantization
    assert client.models.retrieve(MODEL_REF).id == MODEL_REF  # either spelling, as asked
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found"


def test_health(server: Server) -> None:
    # while the --model loaded at start was loading, /health said 503
    loading = [h for h in server.health_seen if h["http"] == 503]
    assert loading and loading[0] == {"status": "loading", "loading": [MODEL], "http": 503}
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "models": [MODEL]}


def test_chat_usage_is_exact(client: openai.OpenAI, server: Server) -> None:
    reply = greedy(client, QUESTION, max_tokens=6, logit_bias=NO_EOS)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    counted = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": QUESTION})
    assert reply.usage.prompt_tokens == counted.json()["count"] > 5
    assert reply.usage.completion_tokens == 6
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 6
    # max_completion_tokens is the same limit under its newer name
    newer = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                           max_completion_tokens=6, logit_bias=NO_EOS)
    assert newer.choices[0].message.content == choice.message.content
    assert newer.usage.completion_tokens == 6


def test_stream_equals_non_stream_and_sse_shape(client: openai.OpenAI, server: Server) -> None:
    whole = greedy(client, QUESTION, max_tokens=10)
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 10,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"]
                if ch["finish_reason"] is not None]
    assert finishes == [whole.choices[0].finish_reason]
    usage_chunks = [c for c in chunks if "usage" in c]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == whole.usage.model_dump(exclude_none=True) | chunks[-1]["usage"]
    assert chunks[-1]["usage"]["completion_tokens"] == whole.usage.completion_tokens
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert text == whole.choices[0].message.content
    # the official client reads the same stream
    streamed = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                              max_tokens=10, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text


def test_stop_strings_are_never_in_the_output(client: openai.OpenAI) -> None:
    full = greedy(client, QUESTION, max_tokens=16, logit_bias=NO_EOS).choices[0].message.content
    words = full.split()
    assert len(words) >= 4, full
    stop = words[2]
    cut = full[: full.index(stop)]
    reply = greedy(client, QUESTION, max_tokens=16, logit_bias=NO_EOS, stop=[stop, "zzzz"])
    assert reply.choices[0].message.content == cut
    assert stop not in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    streamed = greedy(client, QUESTION, max_tokens=16, logit_bias=NO_EOS, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == cut


def test_seed_determinism_and_sampling_extensions(client: openai.OpenAI) -> None:
    def sample(seed: int, **kw: object) -> str:
        return client.chat.completions.create(
            model=MODEL, messages=QUESTION, temperature=1.0, top_p=0.95, seed=seed,
            max_tokens=10, logit_bias=NO_EOS, **kw).choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1
    ext = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
    assert sample(11, extra_body=ext) == sample(11, extra_body=ext)
    assert sample(11, presence_penalty=0.5, frequency_penalty=0.5) == \
        sample(11, presence_penalty=0.5, frequency_penalty=0.5)


def test_system_and_text_parts(client: openai.OpenAI) -> None:
    parts = [{"role": "system", "content": "Answer briefly."},
             {"role": "user", "content": [{"type": "text", "text": "Name three colours."}]}]
    plain = [{"role": "system", "content": "Answer briefly."}, QUESTION[0]]
    a = greedy(client, parts, max_tokens=6).choices[0].message.content
    b = greedy(client, plain, max_tokens=6).choices[0].message.content
    assert a == b and a


def test_n_choices(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=1.0,
                                           seed=3, n=3, max_tokens=5, logit_bias=NO_EOS)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens == 15
    seeded = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=1.0,
                                            seed=3, max_tokens=5, logit_bias=NO_EOS)
    assert reply.choices[0].message.content == seeded.choices[0].message.content
    streamed = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=1.0,
                                              seed=3, n=3, max_tokens=5, logit_bias=NO_EOS,
                                              stream=True)
    texts = ["", "", ""]
    for chunk in streamed:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == [c.message.content for c in reply.choices]


def test_logprobs(client: openai.OpenAI) -> None:
    reply = greedy(client, QUESTION, max_tokens=5, logit_bias=NO_EOS, logprobs=True,
                   top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token  # greedy: the best token is chosen
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    streamed = greedy(client, QUESTION, max_tokens=5, logit_bias=NO_EOS, logprobs=True,
                      top_logprobs=1, stream=True)
    lps = [t.logprob for c in streamed for ch in c.choices if ch.logprobs
           for t in ch.logprobs.content]
    assert lps == pytest.approx([t.logprob for t in content])


def test_completions(client: openai.OpenAI, server: Server) -> None:
    prompt = "The capital of France is"
    one = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6,
                                    logit_bias=NO_EOS)
    text = one.choices[0].text
    assert one.object == "text_completion" and text and one.choices[0].finish_reason == "length"
    assert one.usage.completion_tokens == 6
    ids = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": prompt}).json()
    assert one.usage.prompt_tokens == ids["count"]
    echoed = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6,
                                       logit_bias=NO_EOS, echo=True)
    assert echoed.choices[0].text == prompt + text
    many = client.completions.create(model=MODEL, prompt=[prompt, "Two plus two is"],
                                     temperature=0, max_tokens=6, n=2, logit_bias=NO_EOS)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == text
    assert many.usage.completion_tokens == 24
    streamed = client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                         max_tokens=6, logit_bias=NO_EOS, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text
    with_lp = client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                        max_tokens=4, logit_bias=NO_EOS, logprobs=2)
    lp = with_lp.choices[0].logprobs
    assert "".join(lp.tokens) == with_lp.choices[0].text and len(lp.top_logprobs[0]) == 2


def test_tokenize_detokenize(server: Server) -> None:
    r = httpx.post(f"{server.url}/tokenize",
                   json={"model": MODEL, "prompt": "hello world", "add_special_tokens": False})
    assert r.status_code == 200
    tokens = r.json()["tokens"]
    assert r.json()["max_model_len"] > 0
    back = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": tokens})
    assert back.json() == {"prompt": "hello world"}
