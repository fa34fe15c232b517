"""TVM's private (underscore) names that localchat uses, in one place, checked against the TVM
version they were read against.

TVM makes no promise about these names: a release may rename one, change its arguments or drop
it. Every use under `localchat` goes through this module, which imports them when it is
imported and raises `CompileError` naming the symbol and both versions when the installed TVM is
not the version they were checked with (`CHECKED_TVM`) or lacks one of them. Updating TVM means
reading each of them again in the new release, then changing `CHECKED_TVM`.
"""

from __future__ import annotations

import inspect
from importlib import import_module
from typing import Any

import tvm
from tvm.script.parser.core.parser import ScriptMacro

from localchat.errors import CompileError

__all__ = [
    "CHECKED_TVM",
    "PRIVATE_SYMBOLS",
    "attention_decode_cpu",
    "attention_prefill_cpu",
    "compact_kv_copy_cpu",
    "copy_single_page_cpu",
    "expr_of",
    "install_fast_macro_lookup",
    "kv_cache_debug_get_kv",
    "kv_cache_transpose_append",
    "kv_cache_transpose_append_mla",
    "load_private",
    "prepare_yarn_rope_scaling",
    "wrap_expr",
]

CHECKED_TVM = "0.27"  # the major.minor release every name below was read against

KV_CACHE = "tvm.relax.frontend.nn.llm.kv_cache"
# (module, name) of every private TVM symbol localchat uses
PRIVATE_SYMBOLS: tuple[tuple[str, str], ...] = (
    (KV_CACHE, "_prepare_yarn_rope_scaling"),
    (KV_CACHE, "_kv_cache_transpose_append"),
    (KV_CACHE, "_kv_cache_transpose_append_mla"),
    (KV_CACHE, "_attention_prefill_cpu"),
    (KV_CACHE, "_attention_decode_cpu"),
    (KV_CACHE, "_copy_single_page_cpu"),
    (KV_CACHE, "_kv_cache_debug_get_kv"),
    (KV_CACHE, "_compact_kv_copy_cpu"),
)


def _release(version: str) -> str:
    """The major.minor release of a version string: 0.27.0.post1 -> 0.27."""
    return ".".join(version.split(".")[:2])


def load_private(
    symbols: tuple[tuple[str, str], ...] = PRIVATE_SYMBOLS,
    version: str = tvm.__version__,
    checked: str = CHECKED_TVM,
) -> dict[str, Any]:
    """name -> object of each (module, name) in `symbols`, or CompileError naming the symbol and
    the versions when `version` is not the release `checked` or a symbol is missing."""
    if _release(version) != checked:
        names = ", ".join(f"{module}.{name}" for module, name in symbols)
        raise CompileError(
            f"localchat uses TVM's private {names}, checked with apache-tvm {checked}.x, but the "
            f"installed apache-tvm is {version}: install apache-tvm=={checked}.*, or check these "
            "names against the new release and update localchat.engine.kernels.tvm_private"
        )
    found: dict[str, Any] = {}
    for module, name in symbols:
        try:
            found[name] = getattr(import_module(module), name)
        except (ImportError, AttributeError):
            raise CompileError(
                f"apache-tvm {version} has no {module}.{name}, a private TVM name localchat uses "
                f"(checked with apache-tvm {checked}.x); reinstall apache-tvm=={checked}.*"
            ) from None
    return found


_found = load_private()

prepare_yarn_rope_scaling = _found["_prepare_yarn_rope_scaling"]
kv_cache_transpose_append = _found["_kv_cache_transpose_append"]
kv_cache_transpose_append_mla = _found["_kv_cache_transpose_append_mla"]
attention_prefill_cpu = _found["_attention_prefill_cpu"]
attention_decode_cpu = _found["_attention_decode_cpu"]
copy_single_page_cpu = _found["_copy_single_page_cpu"]
kv_cache_debug_get_kv = _found["_kv_cache_debug_get_kv"]
compact_kv_copy_cpu = _found["_compact_kv_copy_cpu"]


def wrap_expr(cls: type, expr: Any, name: str) -> Any:
    """An `nn.Object` subclass (`PagedKVCache`, an RNN state) around a Relax expression: TVM's
    constructor takes it through the private keywords `_expr` and `_name`."""
    try:
        return cls(_expr=expr, _name=name)
    except TypeError as err:
        raise CompileError(
            f"apache-tvm {tvm.__version__}: {cls.__qualname__}(_expr=, _name=), the private "
            f"constructor keywords localchat uses (checked with apache-tvm {CHECKED_TVM}.x), "
            f"failed: {err}"
        ) from None


def expr_of(tensor: Any) -> Any:
    """The Relax expression behind an `nn.Tensor` or `nn.Object` (TVM keeps it in the private
    attribute `_expr`, which its own kv_cache.py reads the same way)."""
    try:
        return tensor._expr
    except AttributeError:
        raise CompileError(
            f"apache-tvm {tvm.__version__}: {type(tensor).__qualname__} has no _expr, the private "
            f"attribute of TVM's nn.Tensor localchat reads (checked with apache-tvm "
            f"{CHECKED_TVM}.x)"
        ) from None


def _find_parser_by_frames(self: ScriptMacro) -> Any:
    """The parser expanding this macro: the nearest caller frame whose globals hold it (what
    TVM's `_find_parser_def` returns), found by following `f_back`."""
    frame = inspect.currentframe()
    while frame is not None:
        parser = frame.f_globals.get(ScriptMacro.parser_object_name)
        if parser is not None:
            return parser
        frame = frame.f_back
    raise RuntimeError(f"{ScriptMacro.parser_object_name} not available")


def install_fast_macro_lookup() -> None:
    """Make each TVMScript macro expansion find its parser without `inspect.getouterframes`.

    TVM 0.27's private `ScriptMacro._find_parser_def` walks the callers with
    `inspect.getouterframes`, which reads every frame's source lines (and searches `sys.modules`
    for each frame's module) only to look at `f_globals`: ~0.1 s per expansion under pytest, ~75%
    of parsing a 4-bit GEMV, which expands its macros dozens of times. The replacement visits the
    same frames in the same order and returns the same parser."""
    if not callable(getattr(ScriptMacro, "_find_parser_def", None)):
        raise CompileError(
            f"apache-tvm {tvm.__version__} has no ScriptMacro._find_parser_def, the private "
            f"method localchat replaces (checked with apache-tvm {CHECKED_TVM}.x)"
        )
    ScriptMacro._find_parser_def = _find_parser_by_frames
