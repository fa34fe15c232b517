"""What every route shares: the settings, the model pool and the metrics."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from localchat.errors import InvalidRequestError
from localchat.server.config import ServerConfig
from localchat.server.errors import APIError
from localchat.server.metrics import Metrics
from localchat.server.pool import ModelPool


@dataclass
class ServerState:
    config: ServerConfig
    pool: ModelPool
    metrics: Metrics


def state_of(request: Request) -> ServerState:
    return request.app.state.localchat


def is_json(content_type: str) -> bool:
    """Whether a Content-Type header names JSON (`application/json`, or a `+json` type)."""
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                            and media.endswith("+json"))


async def read_body(request: Request) -> bytes:
    """The JSON body of a request (the size limit is enforced by the guard middleware): empty
    is a 400, and a body not declared as JSON a 415, as OpenAI answers. Taking any body as JSON
    would also let a web page's plain form or text POST (which a browser sends to another
    origin without asking) drive the server."""
    body = await request.body()
    if not body.strip():
        raise InvalidRequestError("the request body is empty; send a JSON object")
    content_type = request.headers.get("content-type", "")
    if not is_json(content_type):
        said = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        raise APIError(415, f"unsupported content type: the request has {said}; send the "
                            f"JSON body with 'Content-Type: application/json'")
    return body
