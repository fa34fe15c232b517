"""Qwen3-Embedding behind a real `localchat serve`: OpenAI's client gets the vectors
sentence-transformers computes on the same weights, and Ollama's /api/embed the same ones."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import openai
import pytest
from serve_helpers import Server, start_server, stop_server

from encoder_fixtures import SENTENCES, build_qwen3_embedding
from fixtures import converted

MODEL = "tiny-qwen3-embed"
TEXTS = [SENTENCES[0], "hello", SENTENCES[2]]  # within the 40 tokens (else a 400)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose store holds the tiny Qwen3-Embedding at q0f32."""
    root = tmp_path_factory.mktemp("serve-qwen3-embed")
    home = root / "home"
    (home / "models" / MODEL).mkdir(parents=True)
    (home / "models" / MODEL / "q0f32").symlink_to(
        converted(build_qwen3_embedding(), "q0f32"), target_is_directory=True)
    srv = start_server(home, root / "server.log")
    yield srv
    stop_server(srv)


def cosines(got: object, reference: np.ndarray) -> np.ndarray:
    vectors = np.asarray(got, dtype=np.float32)
    assert vectors.shape == reference.shape
    return np.sum(vectors * reference, axis=1) / np.linalg.norm(vectors, axis=1) \
        / np.linalg.norm(reference, axis=1)


def test_openai_client_gets_sentence_transformers_vectors(server: Server) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(build_qwen3_embedding()), device="cpu").encode(TEXTS)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    out = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in out.data] == [0, 1, 2]
    assert cosines([d.embedding for d in out.data], reference).min() >= 0.9999
    # the client's default (base64) decodes to the same floats
    decoded = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.embedding for d in decoded.data] == [d.embedding for d in out.data]
    assert out.usage.prompt_tokens > len(TEXTS)  # every text's tokens, end-of-text included
    with server.client() as http:
        reply = http.post("/api/embed", json={"model": MODEL, "input": TEXTS})
    assert reply.status_code == 200, reply.text
    assert cosines(reply.json()["embeddings"], reference).min() >= 0.9999
