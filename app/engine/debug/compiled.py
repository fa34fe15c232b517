"""The compiled side of `localchat debug`: a debug build of a model directory (its usual graph
plus every probe of `models/probes.py` as outputs), compiled once per model shape and target
into the library cache, and run on one prompt."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from localchat import model_dir as md
from localchat.errors import InvalidRequestError

Log = Callable[[str], None]
DEBUG_DIR = "debug"  # under the library cache
STATE_PREFIX = "state."


def rows(name: str, tokens: int) -> int:
    """The rows of a probe's value: one per token, or one for a state (`state.*`: a recurrent
    layer's state after the prompt)."""
    return 1 if name.startswith(STATE_PREFIX) else tokens


@dataclass
class ProbeValue:
    """One probed tensor of one prompt: its block (-1: none), name, and value [tokens, ...]."""

    layer: int
    name: str
    value: np.ndarray


@dataclass
class ForwardTrace:
    """What a forward over the prompt produced: logits at every position [n, vocab] and every
    probe, in the order the model computed them."""

    logits: np.ndarray
    probes: list[ProbeValue]


def _debug_library(model_dir: Path, meta: dict[str, Any], target: Any,
                   log: Log | None) -> tuple[Path, list[dict[str, Any]]]:
    """The debug library of this model for `target` and its probes' names (compiled on first
    use; cached beside the normal libraries under debug/)."""

    from localchat.engine.build.compile import library_key, target_key, write_library
    from localchat.engine.build.quantization import get_quant_mode
    from localchat.engine.models import get_architecture

    arch = get_architecture(meta["architecture"])
    config = arch.config_from_dict(meta["model_config"])
    mode = get_quant_mode(meta["quantization"])
    key = hashlib.sha256(
        f"debug-1:{library_key(arch, config, mode, target)}".encode()).hexdigest()[:16]
    folder = md.writable_library_cache_dir() / DEBUG_DIR
    lib = folder / f"{target_key(target)}-{key}{md.LIBRARY_SUFFIX}"
    names_file = lib.with_suffix(".json")
    if lib.is_file() and names_file.is_file():
        return lib, json.loads(names_file.read_text())
    model = arch.build(config, mode, target)
    if not hasattr(model, "get_debug_spec"):
        raise InvalidRequestError(f"architecture {arch.name!r} has no debug build yet")
    if log:
        log(f"compiling a debug build of {arch.name} ({mode.name}) for {target_key(target)}: "
            f"once per model shape, about as long as its first compile")
    start = time.perf_counter()
    write_library(lambda: model.export_tvm(spec=model.get_debug_spec())[0], target, lib)
    names = model.debug_probes
    names_file.write_text(json.dumps(names))
    if log:
        log(f"compiled the debug build in {time.perf_counter() - start:.1f} s")
    return lib, names


def run_compiled(model_dir: Path, token_ids: list[int], device: str = "cpu",
                 log: Log | None = None) -> ForwardTrace:
    """Run the debug build of `model_dir` over `token_ids` (one sequence, one chunk)."""
    import tvm
    from tvm import relax
    from tvm.runtime import ShapeTuple

    from localchat.engine.build.compile import quiet_native_output
    from localchat.engine.device import select_device
    from localchat.engine.models import get_architecture
    from localchat.engine.runtime import PAGE_SIZE, RNN_HISTORY, load_params

    meta = md.load_config(model_dir)
    n = len(token_ids)
    chunk = int(meta["prefill_chunk_size"])
    if not 0 < n <= chunk:
        raise InvalidRequestError(f"the prompt has {n} tokens; the debug run takes 1 to {chunk} "
                                  f"(the model's prefill chunk)", "prompt")
    dev_info = select_device(device)
    lib, names = _debug_library(model_dir, meta, dev_info.target, log)
    with quiet_native_output():
        vm = relax.VirtualMachine(tvm.runtime.load_module(str(lib)), dev_info.tvm_device)
    dev = dev_info.tvm_device
    params = load_params(model_dir, meta["param_names"], dev)
    if get_architecture(meta["architecture"]).state == "rnn":
        state = vm["create_rnn_state"](ShapeTuple([1]), ShapeTuple([RNN_HISTORY]))
    else:
        state = vm["create_paged_kv_cache"](ShapeTuple([1]), ShapeTuple([max(n, PAGE_SIZE)]),
                                            ShapeTuple([chunk]), ShapeTuple([PAGE_SIZE]),
                                            ShapeTuple([0]))
    g = tvm.get_global_func
    g("vm.builtin.kv_state_add_sequence")(state, 0)
    g("vm.builtin.kv_state_begin_forward")(state, ShapeTuple([0]), ShapeTuple([n]))
    embeds = vm["embed"](tvm.runtime.tensor(np.asarray(token_ids, np.int32), dev), params)
    out = vm["debug_prefill"](embeds, state, params)
    g("vm.builtin.kv_state_end_forward")(state)
    values = out[0]
    logits = values[0].numpy().reshape(n, -1)
    probes = [ProbeValue(int(spec["layer"]), str(spec["name"]),
                         values[i + 1].numpy().reshape(rows(str(spec["name"]), n), -1))
              for i, spec in enumerate(names)]
    return ForwardTrace(logits, probes)
