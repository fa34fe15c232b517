"""Lazy names for the package facades (`localchat`, `localchat.engine`, `localchat.downloader`):
each name's module is imported on first use, so importing a facade stays cheap."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level `__getattr__` for `package` that resolves each of `names` (name -> the
    module defining it) in its module on every access, so a test that patches the defining
    module reaches every caller."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
