"""CLI verbs for the local model store: pull, list, rm, show, doctor."""

from __future__ import annotations

import argparse


def add_store_commands(sub: argparse._SubParsersAction) -> None:
    """Register the store verbs on the `localchat` parser."""
