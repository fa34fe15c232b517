"""What every route shares: the settings, the model pool and the metrics."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from localchat.errors import InvalidRequestError
from localchat.server.config import ServerConfig
from localchat.server.metrics import Metrics
from localchat.server.pool import ModelPool


@dataclass
class ServerState:
    config: ServerConfig
    pool: ModelPool
    metrics: Metrics


def state_of(request: Request) -> ServerState:
    return request.app.state.localchat


async def read_body(request: Request) -> bytes:
    """The request body (the size limit is enforced by the guard middleware)."""
    body = await request.body()
    if not body.strip():
        raise InvalidRequestError("the request body is empty; send a JSON object")
    return body
