"""Issue 24's per-architecture checks through a real `localchat serve` and the official openai
client, for each new dense architecture (Qwen3, Gemma 2, Gemma 3, OLMo 2, SmolLM3, Phi-3): the
prefix cache reuses a repeated prompt (same reply), two requests at once equal each alone
(continuous batching), a JSON schema holds, and a tool is called through Qwen3's tool template.

The models are tests/test_odd_shapes.py's odd-shaped tiny ones (the same weights, configs and
compiled libraries) with a chat tokenizer and Qwen3's template (tests/arch_chat_fixtures.py);
their windows are short where the architecture has one (Gemma's 8-token sliding layers), so
prompt and reply run past it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from serve_helpers import Server, home_of, openai_client, start_server, stop_server

from arch_chat_fixtures import ARCHS, LONG_SYSTEM, SCHEMA, SYSTEM, TOOL, chat_model


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("serve-archs")
    home = home_of(root, {arch: chat_model(arch) for arch in ARCHS})
    server = start_server(home, root / "server.log", "--max-models", str(len(ARCHS)),
                          "--max-concurrency", "4")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def oai(srv: Server) -> openai.OpenAI:
    return openai_client(srv)


def chat(oai: openai.OpenAI, arch: str, question: str, system: str = SYSTEM,
         **kwargs: Any) -> Any:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return oai.chat.completions.create(model=arch, messages=messages,  # type: ignore[arg-type]
                                       temperature=0, **{"max_tokens": 10, **kwargs})


def reply_of(completion: Any) -> tuple[str | None, Any, str]:
    """What a reply says (content, thinking) and why it ended."""
    message = completion.choices[0].message
    return (message.content, (message.model_extra or {}).get("reasoning_content"),
            completion.choices[0].finish_reason)


def at_once(oai: openai.OpenAI, arch: str, questions: list[str]) -> list[Any]:
    """The replies to `questions` sent together (decoded in one batch)."""
    together: list[Any] = [None] * len(questions)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(questions))

    def ask(i: int) -> None:
        barrier.wait()
        try:
            together[i] = reply_of(chat(oai, arch, questions[i]))
        except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return together


QUESTIONS = ["Which side? Pick one.", "ka lo mi su"]


@pytest.mark.parametrize("arch", ARCHS)
def test_batching_and_prefix_cache(oai: openai.OpenAI, arch: str) -> None:
    # two requests at once (decoded together) give what each gives alone
    alone = [reply_of(chat(oai, arch, q)) for q in QUESTIONS]
    assert at_once(oai, arch, QUESTIONS) == alone
    first = chat(oai, arch, "hello", LONG_SYSTEM)
    again = chat(oai, arch, "hello", LONG_SYSTEM)
    # the second request found the prompt in the prefix cache (all but the last token)
    assert again.usage.prompt_tokens == first.usage.prompt_tokens > 64
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    assert reply_of(again) == reply_of(first)
    assert first.usage.prompt_tokens + first.usage.completion_tokens > 8  # past Gemma's window


def test_batching_beside_a_prefix_cache_entry_in_a_small_window(oai: openai.OpenAI) -> None:
    """Phi-3's 128-token window, a ~115-token prefix-cache entry and two requests at once: the
    cache's pages must cover part-filled last pages (once a 500, "No page can be allocated")."""
    arch = "phi3-odd"
    chat(oai, arch, "hello", LONG_SYSTEM)  # leaves a prefix-cache entry
    alone = [reply_of(chat(oai, arch, q)) for q in QUESTIONS]
    for _ in range(3):  # the requests must overlap to fail
        chat(oai, arch, "hello", LONG_SYSTEM)
        assert at_once(oai, arch, QUESTIONS) == alone


@pytest.mark.parametrize("arch", ARCHS)
def test_json_schema_and_tools(oai: openai.OpenAI, arch: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA,
                                                  "strict": True}}
    reply = chat(oai, arch, "Is it yes or no?", max_tokens=40, response_format=fmt)
    assert json.loads(reply.choices[0].message.content)["answer"] in ("yes", "no")
    called = chat(oai, arch, "Which side? Pick one.", max_tokens=40, tools=[TOOL],
                  tool_choice="required")
    assert called.choices[0].finish_reason == "tool_calls"
    calls = called.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["pick"]
    assert json.loads(calls[0].function.arguments)["side"] in ("left", "right")
