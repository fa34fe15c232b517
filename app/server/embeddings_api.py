"""The embedding routes: OpenAI's `/v1/embeddings`, Ollama's `/api/embed` and its older
`/api/embeddings`, all on an embedding model's `Engine.embed` (engine/embedding.py).

What each does with a text longer than the model takes: `/v1/embeddings` refuses it (400 with
the token counts, as OpenAI does); `/api/embed` cuts it unless `"truncate": false`, as Ollama
does; `/api/embeddings` cuts it. A chat model named on any of them, or an embedding model named
on a chat route, is a 400 saying which kind of model it is; an empty input is a 400.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from localchat.errors import InvalidRequestError
from localchat.server.ollama_api import keep_alive_seconds
from localchat.server.pool import LoadedModel
from localchat.server.state import ServerState, read_body, state_of

router = APIRouter()


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class EmbeddingRequest(_Request):
    """OpenAI's embeddings request (`user` and other fields are ignored)."""

    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


class OllamaEmbedRequest(_Request):
    """Ollama's /api/embed request (`options` are accepted and ignored: nothing samples)."""

    model: str = Field(min_length=1)
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = None
    keep_alive: float | str | None = None
    options: dict[str, Any] | None = None


class OllamaEmbeddingsRequest(_Request):
    """Ollama's older /api/embeddings request: one `prompt`, one vector."""

    model: str = Field(min_length=1)
    prompt: str
    keep_alive: float | str | None = None
    options: dict[str, Any] | None = None


async def _embed(state: ServerState, model: str, inputs: Any, *, dimensions: int | None,
                 truncate: bool, keep_alive: float | None = None) -> tuple[Any, LoadedModel, float]:
    """(the engine's Embeddings, the model, seconds spent loading it) for a request."""
    if (isinstance(inputs, list) and not inputs) or inputs == "":
        raise InvalidRequestError("input must not be empty", "input")
    started = time.perf_counter()
    loaded = await state.pool.acquire(model)
    load_seconds = time.perf_counter() - started
    try:
        result = await asyncio.to_thread(loaded.engine.embed, inputs, dimensions=dimensions,
                                         truncate=truncate)
    finally:
        await state.pool.release(loaded, keep_alive)
    return result, loaded, load_seconds


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    """A vector as OpenAI sends it: a list of floats, or base64 of its float32 bytes."""
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> JSONResponse:
    state = state_of(request)
    body = EmbeddingRequest.model_validate_json(await read_body(request))
    result, loaded, _ = await _embed(state, body.model, body.input, dimensions=body.dimensions,
                                     truncate=False)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(result.vectors)]
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return JSONResponse({"object": "list", "data": data, "model": loaded.ref, "usage": usage})


@router.post("/api/embed")
async def ollama_embed(request: Request) -> JSONResponse:
    state = state_of(request)
    started = time.perf_counter()
    body = OllamaEmbedRequest.model_validate_json(await read_body(request))
    result, loaded, load_seconds = await _embed(
        state, body.model, body.input, dimensions=body.dimensions, truncate=body.truncate,
        keep_alive=keep_alive_seconds(body.keep_alive))
    return JSONResponse({
        "model": body.model,
        "embeddings": result.vectors.tolist(),
        "total_duration": int((time.perf_counter() - started) * 1e9),
        "load_duration": int(load_seconds * 1e9),
        "prompt_eval_count": result.prompt_tokens,
    })


@router.post("/api/embeddings")
async def ollama_embeddings(request: Request) -> JSONResponse:
    state = state_of(request)
    body = OllamaEmbeddingsRequest.model_validate_json(await read_body(request))
    result, _, _ = await _embed(state, body.model, body.prompt, dimensions=None, truncate=True,
                                keep_alive=keep_alive_seconds(body.keep_alive))
    return JSONResponse({"embedding": result.vectors[0].tolist()})
