"""The engine API every front end uses: Engine.open by name or folder, ReplyStream with `for`
and `async for`, cancel from an event loop, and the errors a server maps to statuses."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from localchat import Engine, FinishEvent, GenerationConfig, TokenEvent
from localchat.engine.engine import resolve_model_dir
from localchat.errors import (
    ContextWindowError,
    EngineBusyError,
    InvalidRequestError,
    LocalchatError,
    ModelFailureError,
    ModelNotFoundError,
)

from fixtures import converted, smollm2_hf_dir

GREEDY = {"temperature": 0.0}
QUESTION = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return converted(smollm2_hf_dir(), "q0f32")


@pytest.fixture
def store_home(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A store holding the test model as `smollm2:q0f32` (a link to the cached conversion)."""
    home = tmp_path / "home"
    (home / "models" / "smollm2").mkdir(parents=True)
    (home / "models" / "smollm2" / "q0f32").symlink_to(model_dir, target_is_directory=True)
    monkeypatch.setenv("LOCALCHAT_HOME", str(home))
    return home


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    with Engine.open(model_dir, device="cpu", options=GREEDY) as eng:
        yield eng


def never_stop(engine: Engine) -> dict[int, float]:
    """A logit bias that bans every stop token, so a reply runs to max_tokens."""
    return {t: float("-inf") for t in engine.stop_token_ids}


# -- Engine.open -----------------------------------------------------------------------------
@pytest.mark.parametrize("ref", ["smollm2", "smollm2:q0f32"])
def test_open_by_store_name(store_home: Path, model_dir: Path, ref: str) -> None:
    assert resolve_model_dir(ref).resolve() == model_dir.resolve()
    with Engine.open(ref, device="cpu", options={**GREEDY, "max_tokens": 4}) as eng:
        assert eng.model.model_dir.resolve() == model_dir.resolve()
        assert eng.name == "smollm2"
        reply = eng.chat(QUESTION).result()
        assert reply.stats.completion_tokens >= 1


def test_open_by_directory(engine: Engine, model_dir: Path) -> None:
    assert engine.model.model_dir == model_dir
    assert engine.config.temperature == 0.0


def test_a_misspelt_name_suggests_the_stored_one(store_home: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="Did you mean: smollm2") as info:
        Engine.open("smolm2")
    assert "smollm2" in info.value.suggestions
    assert info.value.http_status == 404


def test_a_wrong_quantization_is_not_found(store_home: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        Engine.open("smollm2:q4f16_1")


def test_bad_options_fail_before_the_model_loads(store_home: Path) -> None:
    with pytest.raises(InvalidRequestError) as info:
        Engine.open("smollm2", options={"top_p": 2.0})
    assert info.value.param == "top_p"
    with pytest.raises(InvalidRequestError) as info:
        Engine.open("smollm2", context_window=1)
    assert info.value.param == "context_window"


def test_a_folder_that_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="not a model directory"):
        Engine.open(tmp_path)


# -- ReplyStream: for and async for ----------------------------------------------------------
def test_async_for_while_another_reply_streams_in_a_thread(engine: Engine) -> None:
    alone = engine.chat(QUESTION, max_tokens=24).result()
    other = [{"role": "user", "content": "Count to five."}]
    other_alone = engine.chat(other, max_tokens=24).result()
    threads_before = threading.active_count()
    threaded: dict[str, object] = {}

    def consume_in_thread() -> None:
        stream = engine.chat(other, max_tokens=24)
        threaded["text"] = "".join(e.text for e in stream)
        threaded["reply"] = stream.reply

    async def main() -> tuple[str, object, int]:
        worker = threading.Thread(target=consume_in_thread)
        worker.start()
        stream = engine.chat(QUESTION, max_tokens=24)
        pieces, events, threads_seen = [], [], 0
        async for event in stream:
            threads_seen = max(threads_seen, threading.active_count())
            events.append(event)
            pieces.append(event.text)
        await asyncio.get_running_loop().run_in_executor(None, worker.join)
        assert isinstance(events[-1], FinishEvent)
        assert all(isinstance(e, TokenEvent) for e in events[:-1])
        return "".join(pieces), stream.reply, threads_seen

    text, reply, threads_seen = asyncio.run(main())
    assert text == alone.text and reply.token_ids == alone.token_ids
    assert threaded["text"] == other_alone.text
    assert threaded["reply"].token_ids == other_alone.token_ids
    # the async stream took no thread of its own: only our worker was added
    assert threads_seen <= threads_before + 1


def test_two_async_replies_interleave_in_one_loop(engine: Engine) -> None:
    alone = engine.chat(QUESTION, max_tokens=16).result()

    async def main() -> list[str]:
        streams = [engine.chat(QUESTION, max_tokens=16) for _ in range(2)]

        async def collect(stream) -> str:
            return "".join([piece async for piece in stream.atexts()])

        return list(await asyncio.gather(*(collect(s) for s in streams)))

    assert asyncio.run(main()) == [alone.text, alone.text]


def test_cancel_from_the_event_loop(engine: Engine) -> None:
    async def main():
        stream = engine.chat(QUESTION, max_tokens=200, logit_bias=never_stop(engine))
        seen = 0
        async for event in stream:
            if isinstance(event, TokenEvent):
                seen += 1
                if seen == 3:
                    stream.cancel()
        return stream.reply, seen

    reply, seen = asyncio.run(main())
    assert reply.finish_reason == "cancelled"
    # Tokens the scheduler made before the loop got to cancel() are still delivered; how many
    # depends on the machine's load, so the bound is loose: an ignored cancel would give 200.
    assert seen <= 50 and reply.stats.completion_tokens <= 50


def test_cancelling_the_consuming_task_cancels_the_reply(engine: Engine) -> None:
    async def main():
        stream = engine.chat(QUESTION, max_tokens=400, logit_bias=never_stop(engine))

        async def drain() -> None:
            async for _ in stream:
                pass

        with pytest.raises((asyncio.TimeoutError, TimeoutError)):
            await asyncio.wait_for(drain(), timeout=0.2)
        return stream

    stream = asyncio.run(main())
    assert stream.wait(timeout=30)
    assert stream.reply is not None and stream.reply.finish_reason == "cancelled"
    assert stream.reply.stats.completion_tokens < 400


def test_aresult_from_a_loop_equals_result(engine: Engine) -> None:
    alone = engine.chat(QUESTION, max_tokens=12).result()
    reply = asyncio.run(engine.chat(QUESTION, max_tokens=12).aresult())
    assert reply.token_ids == alone.token_ids


# -- errors a server maps to statuses ---------------------------------------------------------
def test_context_window_error_carries_token_counts(engine: Engine) -> None:
    long = [{"role": "user", "content": "word " * (engine.context_window + 10)}]
    with pytest.raises(ContextWindowError) as info:
        engine.chat(long, overflow="error")
    err = info.value
    assert err.http_status == 400 and err.code == "context_length_exceeded"
    assert err.context_window == engine.context_window
    assert err.prompt_tokens is not None and err.prompt_tokens > engine.context_window


def test_invalid_parameter_names_it(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError) as info:
        engine.chat(QUESTION, temperature=-1)
    assert info.value.param == "temperature" and info.value.http_status == 400
    assert info.value.to_dict() == {
        "message": str(info.value), "type": "invalid_request_error", "param": "temperature",
        "code": "invalid_parameter",
    }
    with pytest.raises(InvalidRequestError) as info:
        engine.chat(QUESTION, no_such_option=1)
    assert info.value.param == "no_such_option"


def test_a_full_queue_is_engine_busy(model_dir: Path) -> None:
    with Engine.open(model_dir, device="cpu", options=GREEDY, max_batch_size=1,
                     max_queue=1) as eng:
        running = eng.chat(QUESTION, max_tokens=200, logit_bias=never_stop(eng))
        for _ in range(2):  # wait until it holds the only slot
            next(running)
        waiting = eng.chat(QUESTION, max_tokens=4)
        with pytest.raises(EngineBusyError) as info:
            eng.chat(QUESTION, max_tokens=4)
        assert info.value.http_status == 503
        running.cancel()
        assert waiting.result().stats.completion_tokens >= 1


def test_error_classes_map_to_statuses() -> None:
    assert ModelFailureError("x").http_status == 500
    assert LocalchatError("x").http_status == 500
    assert issubclass(ContextWindowError, InvalidRequestError)
    assert GenerationConfig().validate() is not None
