"""`localchat serve`'s command line: the verb module registers it and maps options to the
server's settings (without starting a server)."""

from __future__ import annotations

import argparse

import pytest

from localchat.cli import serve
from localchat.errors import InvalidRequestError
from localchat.server.cli import config_from_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="localchat")
    serve.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_defaults_bind_loopback() -> None:
    args = parse()
    assert args.handler is serve.cmd_serve
    config = config_from_args(args)
    assert (config.host, config.port) == ("127.0.0.1", 11434)  # Ollama's
    assert config.api_key is None and config.cors_origins == [] and config.models == []


def test_options() -> None:
    config = config_from_args(parse(
        "--host", "0.0.0.0", "--port", "9000", "--model", "a", "--model", "b:q4f32_1",
        "--api-key", "k", "--cors-origin", "http://x", "--max-concurrency", "4",
        "--max-queue", "2", "--max-models", "2", "--max-body-bytes", "1000"))
    assert config.models == ["a", "b:q4f32_1"]
    assert (config.api_key, config.cors_origins) == ("k", ["http://x"])
    assert (config.max_concurrency, config.max_queue, config.max_loaded) == (4, 2, 2)
    assert config.max_body_bytes == 1000 and config.port == 9000


def test_bad_numbers() -> None:
    with pytest.raises(InvalidRequestError, match="--max-concurrency"):
        config_from_args(parse("--max-concurrency", "0"))
