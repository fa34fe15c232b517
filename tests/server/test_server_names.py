"""Names and content types on `localchat serve`: a model is listed by the name users run it by
(the bare name for its default quantization, `name:quant` for another), every endpoint takes
either spelling of the default and echoes the one it was sent, and a body not sent as JSON is
a 415 (malformed JSON a 400) in each API's error shape."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from serve_helpers import MODEL, MODEL_REF, Server

from localchat import model_dir as md
from localchat.store import Store

OTHER_QUANT = "q4f32_1"
OTHER_REF = f"{MODEL}:{OTHER_QUANT}"
QUESTION = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def second_quantization(server: Server, server_home: Path) -> Iterator[str]:
    """The test model stored a second time as `smollm2:q4f32_1` (the q0f32 files under another
    quantization's folder and config: listed and shown, never loaded), the default kept at
    q0f32; removed again when the module ends."""
    source = server_home / "models" / MODEL / "q0f32"
    out = server_home / "models" / MODEL / OTHER_QUANT
    out.mkdir()
    for item in source.iterdir():
        if item.is_file() and item.name not in (md.CONFIG_FILE, md.MANIFEST_FILE):
            (out / item.name).symlink_to(item.resolve())
    config = json.loads((source / md.CONFIG_FILE).read_text(encoding="utf-8"))
    (out / md.CONFIG_FILE).write_text(json.dumps({**config, "quantization": OTHER_QUANT}),
                                      encoding="utf-8")
    store = Store(server_home)
    store.set_default(MODEL, "q0f32")
    yield OTHER_REF
    shutil.rmtree(out)


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oll(server: Server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=120)


def test_the_default_is_listed_by_its_bare_name_and_another_quantization_as_name_quant(
        second_quantization: str, oai: openai.OpenAI, oll: ollama.Client) -> None:
    assert [m.id for m in oai.models.list().data] == [MODEL, OTHER_REF]
    tags = oll.list().models
    assert [m.model for m in tags] == [MODEL, OTHER_REF]
    assert [m.details.quantization_level for m in tags] == ["q0f32", OTHER_QUANT]
    assert len({m.digest for m in tags}) == 2
    assert oai.models.retrieve(OTHER_REF).id == OTHER_REF
    shown = oll.show(OTHER_REF)
    assert shown.details.quantization_level == OTHER_QUANT
    assert f"FROM {OTHER_REF}\n" in shown.modelfile
    assert f"FROM {MODEL}\n" in oll.show(MODEL_REF).modelfile  # the default's listed name
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve(f"{MODEL}:q0f16")  # a quantization that is not stored


def test_both_spellings_of_the_default_answer_with_the_name_sent(
        oai: openai.OpenAI, oll: ollama.Client) -> None:
    texts = set()
    for name in (MODEL, MODEL_REF):
        reply = oai.chat.completions.create(model=name, messages=QUESTION, temperature=0,
                                            max_tokens=4)
        assert reply.model == name
        texts.add(reply.choices[0].message.content)
        chunks = list(oai.chat.completions.create(model=name, messages=QUESTION, temperature=0,
                                                  max_tokens=4, stream=True))
        assert chunks and {c.model for c in chunks} == {name}
        done = oai.completions.create(model=name, prompt="The sky is", temperature=0,
                                      max_tokens=2)
        assert done.model == name
        chat = oll.chat(model=name, messages=QUESTION, options={"temperature": 0,
                                                                "num_predict": 4})
        assert chat.model == name
        texts.add(chat.message.content)
        parts = list(oll.chat(model=name, messages=QUESTION, stream=True,
                              options={"temperature": 0, "num_predict": 4}))
        assert {p.model for p in parts} == {name}
        assert oll.generate(model=name, prompt="The sky is", raw=True,
                            options={"num_predict": 2}).model == name
    assert len(texts) == 1  # one model behind both names
    assert [m.model for m in oll.ps().models] == [MODEL]  # loaded once, by its listed name


# (path, a valid body) for routes that read a JSON body; the bodies ask for little work
ROUTES = [
    ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 1}),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1}),
    ("/tokenize", {"model": MODEL, "prompt": "Hi"}),
    ("/api/chat", {"model": MODEL, "messages": QUESTION, "stream": False,
                   "options": {"num_predict": 1}}),
    ("/api/generate", {"model": MODEL, "prompt": "Hi", "stream": False,
                       "options": {"num_predict": 1}}),
    ("/api/show", {"model": MODEL}),
]
# text/plain as a browser's fetch sends a string, a form type as `curl -d` does, and none
NOT_JSON_TYPES = ["text/plain", "text/plain; charset=utf-8",
                  "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None]


def error_of(r: httpx.Response, path: str, status: int) -> str:
    """The message of an error response, checked for its status and its API's shape."""
    assert r.status_code == status, (path, r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    if path.startswith("/api/"):  # Ollama's: a string
        assert isinstance(error, str) and error
        return error
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    return error["message"]


@pytest.mark.parametrize("path,body", ROUTES, ids=[r[0] for r in ROUTES])
def test_a_body_not_sent_as_json_is_415_and_malformed_json_400(server: Server, path: str,
                                                               body: dict) -> None:
    data = json.dumps(body).encode()
    with server.client() as http:
        for content_type in NOT_JSON_TYPES:
            headers = {"content-type": content_type} if content_type else {}
            r = http.post(path, content=data, headers=headers)
            message = error_of(r, path, 415)
            assert "application/json" in message
            if not path.startswith("/api/"):
                assert r.json()["error"]["code"] == "unsupported_content_type"
        r = http.post(path, content=b'{"model": "' + MODEL.encode() + b'", ',
                      headers={"content-type": "application/json"})
        assert "JSON" in error_of(r, path, 400)
        r = http.post(path, content=data,
                      headers={"content-type": "application/json; charset=utf-8"})
        assert r.status_code == 200, r.text

