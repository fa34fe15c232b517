"""The engine: model definitions, conversion, quantization, compilation and the runtime.

This package is also the facade the front ends (CLI, TUI, API server) use for what the engine
offers beyond the public API in `localchat` (`Engine`, `GenerationConfig`, the reply stream and
its events come from there). A front end imports these names from `localchat.engine`, never
from a module under it:

- threads (`engine/threads.py`): `add_threads_argument` (the `--threads N` option),
  `configure_threads` (set the CPU thread count before a model loads), `ensure_threads` (the
  same, falling back to `physical_cores()` instead of raising), `physical_cores`,
  `ThreadCountError` (a count that is not a positive whole number);
- devices (`engine/device.py`): `DEVICE_KINDS`, `backend_supported` (this TVM build has the
  backend), `device_present` (a device of that kind is there), `select_device` (`auto` or a
  kind -> a `Device` with its TVM target), `cross_compile_device` (`cuda:sm_90` -> a device to
  compile for where there is none);
- build steps (`engine/build/`): `convert_source` (an HF folder or .gguf file -> a model
  directory), `is_gguf`, `inspect_gguf` (the HF config a .gguf file amounts to, or the error
  saying why it cannot be imported), `gguf_default_quantization` (the mode that holds a .gguf
  file's weights exactly on the CPU), `read_hf_config` (an HF folder's config.json, or the
  error saying it is no model), `has_tokenizer`, `get_quant_mode` (a quantization mode by
  name, or the error listing the known ones), `library_stem` (the file stem of a model's
  library for a target), `target_key` (a target's short name) and `library_status` (whether
  each stored model has this device's library, cached between runs so `list` needs no TVM);
- `Model` (`engine/runtime.py`): a model directory loaded (compiled if needed) on a device;
- `run_benchmark` (`engine/benchmark.py`): `localchat bench`'s measurement, returning a
  `BenchResult`; `check_bench_options` (its options checked before a model is pulled);
- `debug_model` (`engine/debug/`): `localchat debug`'s layer-by-layer comparison with a
  reference, returning a `DebugReport`; `DEBUG_PROMPT` is its default prompt;
- `resolve_template` (`engine/templates.py`): the chat template to use (a name, else the
  model directory's own, else a default);
- structured output (`engine/grammar.py`): `normalize_response_format` (a `response_format`
  value in its canonical form, or the error), `json_schema_problem` (why a JSON Schema
  does not compile, or None) and `harmony_call_grammar` (the grammar that makes a gpt-oss reply
  one call to a given function).

Each name loads its module on first use (`__getattr__`, as in `localchat`), so importing this
package loads neither TVM nor numpy and `localchat --help` stays fast. A name is looked up in
its module on every access, so patching the defining module (in tests) reaches the front ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from localchat._lazy import lazy_getattr

if TYPE_CHECKING:
    from localchat.engine.benchmark import BenchResult, check_bench_options, run_benchmark
    from localchat.engine.build import (
        convert_source,
        gguf_default_quantization,
        inspect_gguf,
        is_gguf,
        library_stem,
    )
    from localchat.engine.build.compile import target_key
    from localchat.engine.build.convert import has_tokenizer, read_hf_config
    from localchat.engine.build.quantization import get_quant_mode
    from localchat.engine.debug import DEBUG_PROMPT, DebugReport, debug_model
    from localchat.engine.device import (
        DEVICE_KINDS,
        backend_supported,
        cross_compile_device,
        device_present,
        select_device,
    )
    from localchat.engine.grammar import (
        harmony_call_grammar,
        json_schema_problem,
        normalize_response_format,
    )
    from localchat.engine.runtime import Model
    from localchat.engine.templates import resolve_template
    from localchat.engine.threads import (
        ThreadCountError,
        add_threads_argument,
        configure_threads,
        ensure_threads,
        physical_cores,
    )

# name -> module that defines it, imported on first access
_LAZY = {
    "ThreadCountError": "localchat.engine.threads",
    "add_threads_argument": "localchat.engine.threads",
    "configure_threads": "localchat.engine.threads",
    "ensure_threads": "localchat.engine.threads",
    "physical_cores": "localchat.engine.threads",
    "DEVICE_KINDS": "localchat.engine.device",
    "backend_supported": "localchat.engine.device",
    "cross_compile_device": "localchat.engine.device",
    "device_present": "localchat.engine.device",
    "select_device": "localchat.engine.device",
    "convert_source": "localchat.engine.build",
    "gguf_default_quantization": "localchat.engine.build",
    "inspect_gguf": "localchat.engine.build",
    "is_gguf": "localchat.engine.build",
    "library_stem": "localchat.engine.build",
    "library_status": "localchat.engine.build.library_status",
    "target_key": "localchat.engine.build.compile",
    "has_tokenizer": "localchat.engine.build.convert",
    "read_hf_config": "localchat.engine.build.convert",
    "get_quant_mode": "localchat.engine.build.quantization",
    "Model": "localchat.engine.runtime",
    "BenchResult": "localchat.engine.benchmark",
    "run_benchmark": "localchat.engine.benchmark",
    "check_bench_options": "localchat.engine.benchmark",
    "resolve_template": "localchat.engine.templates",
    "debug_model": "localchat.engine.debug",
    "DEBUG_PROMPT": "localchat.engine.debug",
    "DebugReport": "localchat.engine.debug",
    "harmony_call_grammar": "localchat.engine.grammar",
    "json_schema_problem": "localchat.engine.grammar",
    "normalize_response_format": "localchat.engine.grammar",
}

__all__ = [
    "DEBUG_PROMPT",
    "DEVICE_KINDS",
    "DebugReport",
    "BenchResult",
    "Model",
    "ThreadCountError",
    "add_threads_argument",
    "backend_supported",
    "check_bench_options",
    "configure_threads",
    "convert_source",
    "cross_compile_device",
    "debug_model",
    "device_present",
    "ensure_threads",
    "get_quant_mode",
    "gguf_default_quantization",
    "harmony_call_grammar",
    "has_tokenizer",
    "inspect_gguf",
    "is_gguf",
    "json_schema_problem",
    "library_stem",
    "library_status",
    "normalize_response_format",
    "physical_cores",
    "read_hf_config",
    "resolve_template",
    "run_benchmark",
    "select_device",
    "target_key",
]


__getattr__ = lazy_getattr(__name__, _LAZY)
