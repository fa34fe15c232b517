"""Probes: the intermediate tensors a debug build returns besides its logits, for `localchat
debug` (engine/debug/) to compare with a reference model layer by layer and operation by
operation.

A model calls `probe(name, x)` on a tensor it computes and `probe_layer(x)` on each block's
output, inside `layer(i)`. Outside `recording()` (every normal build) these calls do nothing
and leave the graph untouched; inside it (the debug function's trace) each call adds `x` to the
function's outputs. A probe's name is the path, relative to the reference's block
(`model.layers.N.` in HF's Llama, `rwkv.blocks.N.` in its RWKV), of the module whose output it
equals, with `:in` when it equals that module's input (the attention's output is
`self_attn.o_proj:in`): the reference side hooks exactly that module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from localchat.engine.models.export import STATE_CONSTRUCTORS

LAYER_OUTPUT = "output"  # the probe name of a block's output (the residual stream after it)
STATE_ARGUMENTS = {"kv": "paged_kv_cache", "rnn": "rnn_state"}  # the debug function's state


@dataclass
class ProbeRecord:
    """One probed tensor: its block (-1: outside the blocks), name and value in the graph."""

    layer: int
    name: str
    tensor: nn.Tensor


@dataclass
class Recorder:
    """The probes one traced function collects, in order."""

    records: list[ProbeRecord] = field(default_factory=list)
    layer: int = -1

    def names(self) -> list[dict[str, Any]]:
        """What each output of the debug function is (for the runner), in output order."""
        return [{"layer": r.layer, "name": r.name} for r in self.records]

    def outputs(self) -> list[nn.Tensor]:
        """The probed tensors, as float32 (a reference runs in float32)."""
        return [r.tensor if r.tensor.dtype == "float32" else r.tensor.astype("float32")
                for r in self.records]


_ACTIVE: list[Recorder] = []


@contextmanager
def recording() -> Iterator[Recorder]:
    """Collect every probe the forward traced inside this block calls."""
    rec = Recorder()
    _ACTIVE.append(rec)
    try:
        yield rec
    finally:
        _ACTIVE.remove(rec)


def active() -> bool:
    """Whether probes are being recorded (a model may skip work done only for them)."""
    return bool(_ACTIVE)


@contextmanager
def layer(layer_id: int) -> Iterator[None]:
    """Probes inside this block belong to block `layer_id`."""
    if not _ACTIVE:
        yield
        return
    rec = _ACTIVE[-1]
    before, rec.layer = rec.layer, layer_id
    try:
        yield
    finally:
        rec.layer = before


def probe(name: str, x: nn.Tensor) -> nn.Tensor:
    """Record `x` as operation `name` of the current block (when recording); returns `x`."""
    if _ACTIVE:
        rec = _ACTIVE[-1]
        rec.records.append(ProbeRecord(rec.layer, name, x))
    return x


def probe_split(names: tuple[str, ...], x: nn.Tensor, sizes: tuple[int, ...]) -> None:
    """Record the pieces of a fused projection (q/k/v, gate/up): `x`'s last axis split into
    `sizes`, one probe per name."""
    if not _ACTIVE:
        return
    bounds, total = [], 0
    for size in sizes[:-1]:
        total += size
        bounds.append(total)
    for name, piece in zip(names, op.split(x, bounds, axis=-1)):
        probe(name, piece)


def probe_layer(x: nn.Tensor) -> nn.Tensor:
    """Record `x` as the current block's output."""
    return probe(LAYER_OUTPUT, x)


def debug_spec(model: nn.Module, *, hidden_size: int, dtype: str, state: str,
               state_type: type) -> nn.spec.ModuleSpec:
    """The export spec of a debug build: `embed`, `debug_prefill` (one sequence's tokens ->
    logits at every position, then every probe, then the state) and the state's constructor
    (kind "kv" or "rnn", as in `export.model_spec`)."""
    packed = {"$": {"param_mode": "packed", "effect_mode": "none"}}
    constructor, ints = STATE_CONSTRUCTORS[state]
    spec: dict[str, Any] = {
        "embed": {"input_ids": nn.spec.Tensor(["seq_len"], "int32"), **packed},
        "debug_prefill": {"input_embed": nn.spec.Tensor(["seq_len", hidden_size], dtype),
                          STATE_ARGUMENTS[state]: nn.spec.Object(object_type=state_type),
                          **packed},
        constructor: {**{name: int for name in ints},
                      "$": {"param_mode": "none", "effect_mode": "none"}},
    }
    return nn.spec.ModuleSpec.from_raw(spec, model)
