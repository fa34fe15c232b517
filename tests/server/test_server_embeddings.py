"""The embedding routes against a real `localchat serve`: OpenAI's client (`embeddings.create`,
floats, base64, dimensions), Ollama's client (`embed`, `embeddings`), LangChain's
OpenAIEmbeddings, and the 400s between chat and embedding models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from serve_helpers import Server, start_server, stop_server

from encoder_fixtures import SENTENCES, build_encoder, tiny_chat_model
from fixtures import converted

EMBED, CHAT = "tiny-embed", "tiny-chat"
TEXTS = [SENTENCES[0], "hello", SENTENCES[2] + " " + SENTENCES[3]]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose store holds the tiny BERT embedding model and a tiny chat model."""
    root = tmp_path_factory.mktemp("serve-embed")
    home = root / "home"
    for name, source in ((EMBED, build_encoder("bert-mean")), (CHAT, tiny_chat_model())):
        (home / "models" / name).mkdir(parents=True)
        (home / "models" / name / "q0f32").symlink_to(converted(source, "q0f32"),
                                                      target_is_directory=True)
    srv = start_server(home, root / "server.log")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(build_encoder("bert-mean")), device="cpu").encode(TEXTS)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def close_to(vectors: object, reference: np.ndarray) -> bool:
    got = np.asarray(vectors, dtype=np.float32)
    cos = np.sum(got * reference, axis=1) / np.linalg.norm(got, axis=1) \
        / np.linalg.norm(reference, axis=1)
    return got.shape == reference.shape and bool(cos.min() >= 0.9999)


def test_openai_client_embeds_a_string_and_a_list(client: openai.OpenAI,
                                                  reference: np.ndarray) -> None:
    one = client.embeddings.create(model=EMBED, input=TEXTS[0], encoding_format="float")
    assert one.object == "list" and one.model == EMBED and len(one.data) == 1
    assert close_to([one.data[0].embedding], reference[:1])
    many = client.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    assert close_to([d.embedding for d in many.data], reference)
    assert many.usage.prompt_tokens == many.usage.total_tokens > one.usage.prompt_tokens > 0


def test_base64_carries_the_same_floats(client: openai.OpenAI) -> None:
    floats = client.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    # without encoding_format the client asks for base64 and decodes it itself
    decoded = client.embeddings.create(model=EMBED, input=TEXTS)
    assert [d.embedding for d in decoded.data] == [d.embedding for d in floats.data]


def test_dimensions_cut_and_renormalize(client: openai.OpenAI) -> None:
    out = client.embeddings.create(model=EMBED, input=TEXTS, dimensions=8,
                                   encoding_format="float")
    vectors = np.array([d.embedding for d in out.data])
    assert vectors.shape == (3, 8)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_token_arrays_embed_as_their_text(client: openai.OpenAI) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(build_encoder("bert-mean"))(TEXTS[0])["input_ids"]
    by_ids = client.embeddings.create(model=EMBED, input=[ids], encoding_format="float")
    by_text = client.embeddings.create(model=EMBED, input=TEXTS[0], encoding_format="float")
    assert np.allclose(by_ids.data[0].embedding, by_text.data[0].embedding, atol=1e-6)


def test_ollama_client_embed_and_legacy_embeddings(server: Server,
                                                   reference: np.ndarray) -> None:
    import ollama

    api = ollama.Client(host=server.url)
    out = api.embed(model=EMBED, input=TEXTS, keep_alive="5m")
    assert close_to(out.embeddings, reference)
    assert out.prompt_eval_count and out.prompt_eval_count > len(TEXTS)
    assert close_to(api.embed(model=EMBED, input=TEXTS[1]).embeddings, reference[1:2])
    assert len(api.embed(model=EMBED, input=TEXTS, dimensions=4).embeddings[0]) == 4
    legacy = api.embeddings(model=EMBED, prompt=TEXTS[0])
    assert close_to([legacy.embedding], reference[:1])


def test_ollama_truncate_false_refuses_a_long_text(server: Server) -> None:
    long_text = " ".join(SENTENCES * 3)
    with server.client() as http:
        cut = http.post("/api/embed", json={"model": EMBED, "input": long_text})
        refused = http.post("/api/embed", json={"model": EMBED, "input": long_text,
                                                "truncate": False})
    assert cut.status_code == 200 and len(cut.json()["embeddings"]) == 1
    assert refused.status_code == 400 and "at most" in refused.json()["error"]


def test_langchain_openai_embeddings(server: Server, reference: np.ndarray) -> None:
    from langchain_openai import OpenAIEmbeddings

    lc = OpenAIEmbeddings(model=EMBED, base_url=f"{server.url}/v1", api_key="unused",
                          check_embedding_ctx_length=False, max_retries=0)
    assert close_to(lc.embed_documents(TEXTS), reference)
    assert close_to([lc.embed_query(TEXTS[1])], reference[1:2])


def test_embedding_with_a_chat_model_is_a_400(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=CHAT, input="hello")
    assert "is a chat model" in str(err.value)
    with server.client() as http:
        r = http.post("/api/embed", json={"model": CHAT, "input": "hello"})
    assert r.status_code == 400 and "is a chat model" in r.json()["error"]


def test_chatting_with_an_embedding_model_is_a_400(client: openai.OpenAI,
                                                   server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=EMBED,
                                       messages=[{"role": "user", "content": "hi"}])
    assert "is an embedding model" in str(err.value)
    with pytest.raises(openai.BadRequestError, match="is an embedding model"):
        client.completions.create(model=EMBED, prompt="hi")
    with server.client() as http:
        r = http.post("/api/chat", json={"model": EMBED, "stream": False,
                                         "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "is an embedding model" in r.json()["error"]


@pytest.mark.parametrize("path, body, word", [
    ("/v1/embeddings", {"model": EMBED, "input": []}, "empty"),
    ("/v1/embeddings", {"model": EMBED, "input": ""}, "empty"),
    ("/v1/embeddings", {"model": EMBED, "input": ["a", ""]}, "empty"),
    ("/v1/embeddings", {"model": EMBED, "input": "a", "dimensions": 999}, "dimensions"),
    ("/v1/embeddings", {"model": EMBED, "input": "a", "encoding_format": "hex"},
     "encoding_format"),
    ("/v1/embeddings", {"model": EMBED}, "input"),
    ("/api/embed", {"model": EMBED, "input": []}, "empty"),
    ("/api/embeddings", {"model": EMBED, "prompt": ""}, "empty"),
])
def test_bad_requests_are_400s_with_an_error_body(server: Server, path: str, body: dict,
                                                  word: str) -> None:
    with server.client() as http:
        r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    message = error if path.startswith("/api/") else error["message"]
    if not path.startswith("/api/"):
        assert error["type"] == "invalid_request_error"
    assert word in message


def test_an_unknown_model_is_a_404(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": "nope", "input": "a"})
    assert r.status_code == 404


def test_the_server_log_has_no_traceback(server: Server) -> None:
    assert "Traceback" not in Path(server.log).read_text(errors="replace")
