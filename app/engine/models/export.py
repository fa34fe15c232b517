"""The one declaration of what a compiled model library exports, for every architecture.

A decoder library has the same five functions over packed parameters, which the runtime calls by
name (engine/runtime.py): `embed` (token ids -> embeddings), `prefill` (one sequence's chunk ->
last logits), `decode` (one token), `batch_prefill` and `batch_decode` (several sequences at
once), plus the constructor of its state (`create_paged_kv_cache` for a KV cache,
`create_rnn_state` for recurrent state). An architecture's module only says which state it has.
A text encoder (`encoder_spec`) exports one function, `encode`, and keeps no state.
"""

from __future__ import annotations

from typing import Any

from tvm.relax.frontend import nn

_PACKED = {"$": {"param_mode": "packed", "effect_mode": "none"}}
_NO_PARAMS = {"$": {"param_mode": "none", "effect_mode": "none"}}

# The state constructors' integer arguments, by state kind.
STATE_CONSTRUCTORS: dict[str, tuple[str, tuple[str, ...]]] = {
    "kv": ("create_paged_kv_cache", ("max_batch_size", "max_total_seq_len",
                                     "prefill_chunk_size", "page_size",
                                     "support_sliding_window")),
    "rnn": ("create_rnn_state", ("max_batch_size", "max_history")),
}
_STATE_ARGUMENT = {"kv": "paged_kv_cache", "rnn": "rnn_state"}


def model_spec(model: nn.Module, *, hidden_size: int, dtype: str, state: str,
               state_type: type) -> nn.spec.ModuleSpec:
    """The export spec of `model`: the five functions over embeddings of `hidden_size` in
    `dtype`, each taking and returning the state (of `state_type`, kind "kv" or "rnn"), and the
    state's constructor."""
    h, dt = hidden_size, dtype
    arg = _STATE_ARGUMENT[state]
    obj = nn.spec.Object(object_type=state_type)
    constructor, ints = STATE_CONSTRUCTORS[state]
    spec: dict[str, Any] = {
        "embed": {"input_ids": nn.spec.Tensor(["seq_len"], "int32"), **_PACKED},
        "prefill": {"input_embed": nn.spec.Tensor(["seq_len", h], dt), arg: obj, **_PACKED},
        "decode": {"input_embed": nn.spec.Tensor([1, h], dt), arg: obj, **_PACKED},
        "batch_prefill": {
            "input_embeds": nn.spec.Tensor(["seq_len", h], dt),
            "logit_positions": nn.spec.Tensor(["batch_size"], "int32"),
            arg: obj,
            **_PACKED,
        },
        "batch_decode": {
            "input_embeds": nn.spec.Tensor(["batch_size", h], dt), arg: obj, **_PACKED,
        },
        constructor: {**{name: int for name in ints}, **_NO_PARAMS},
    }
    return nn.spec.ModuleSpec.from_raw(spec, model)


def encoder_spec(model: nn.Module) -> nn.spec.ModuleSpec:
    """The export spec of a text encoder (state "encoder"): one function, `encode(input_ids [n],
    positions [n], starts [texts + 1])`, over a packed batch of texts (text t is tokens
    starts[t] to starts[t + 1]; positions count from 0 in each), returning every token's last
    hidden state."""
    spec: dict[str, Any] = {
        "encode": {
            "input_ids": nn.spec.Tensor(["seq_len"], "int32"),
            "positions": nn.spec.Tensor(["seq_len"], "int32"),
            "starts": nn.spec.Tensor(["texts_plus_one"], "int32"),
            **_PACKED,
        },
    }
    return nn.spec.ModuleSpec.from_raw(spec, model)
