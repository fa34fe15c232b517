"""Gemma 2 and Gemma 3 (text): configurations of the shared decoder block of `llama`.

Both: GELU-tanh gate, RMSNorm weights used as (1 + w), norms before and after each branch,
embeddings times sqrt(hidden), attention scale query_pre_attn_scalar ** -0.5, a tied head, a
sliding window on the layers HF's `layer_types` marks "sliding_attention". Gemma 2 soft-caps
attention scores (50) and the final logits (30); Gemma 3 has per-head q/k norm instead and its
local and global layers rotate with their own theta (and scaling). The Gemma 3 checkpoints of 4B
and up are multimodal (`Gemma3ForConditionalGeneration`): their language model is read as the
text model (`text_config`, tensors under `language_model.`), the vision tower left out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from localchat.engine.models import Architecture, GgufMap, GgufSource, llama
from localchat.errors import UnsupportedModelError

SLIDING = "sliding_attention"


def _layer_types(hf: dict[str, Any], pattern: int) -> list[str]:
    """HF's layer_types, or the published pattern (every `pattern`-th layer global)."""
    types = hf.get("layer_types")
    if types:
        return list(types)
    n = int(hf["num_hidden_layers"])
    return [SLIDING if (i + 1) % pattern else "full_attention" for i in range(n)]


def _common(hf: dict[str, Any], pattern: int) -> llama.LlamaConfig:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"hidden_activation {act!r} is not supported "
                                    f"(Gemma uses gelu_pytorch_tanh)")
    # Llama's reader for the shared fields; Gemma's own options below
    base = llama.LlamaConfig.from_hf({**hf, "hidden_act": "silu",
                                      "tie_word_embeddings": hf.get("tie_word_embeddings", True)})
    types = _layer_types(hf, pattern)
    window = int(hf.get("sliding_window") or 0)
    return dataclasses.replace(
        base,
        hidden_act="gelu_tanh",
        norms="sandwich",
        norm_offset=1.0,
        embed_scale=math.sqrt(base.hidden_size),
        attn_scale=float(hf.get("query_pre_attn_scalar") or base.head_dim) ** -0.5,
        sliding_window=window,
        sliding_layers=[int(t == SLIDING) for t in types] if window else [],
    )


def gemma2_config(hf: dict[str, Any]) -> llama.LlamaConfig:
    """Read a Gemma 2 config.json (every other layer windowed, from the first)."""
    return dataclasses.replace(
        _common(hf, pattern=2),
        attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
    )


def _rope(params: dict[str, Any], default_theta: float) -> tuple[float, float]:
    """(theta, position scale) of one layer type's rope parameters (linear scaling only)."""
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", default_theta))
    if kind == "default":
        return theta, 1.0
    if kind == "linear":
        return theta, 1.0 / float(params["factor"])
    raise UnsupportedModelError(f"Gemma 3 rope type {kind!r} is not supported")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json: a Gemma3ForConditionalGeneration config's
    `text_config` over its top level (which holds the vision tower's and the processor's
    settings), a text model's config as it is."""
    if "text_config" not in hf:
        return hf
    top = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}
    return {**top, **(hf["text_config"] or {})}


# Where the language model of a Gemma3ForConditionalGeneration checkpoint keeps its tensors,
# (its `model.` prefix, its head): as published (and as transformers 5 saves it), then as some
# transformers 4.x releases save it; the vision tower and projector are never read
MULTIMODAL_LAYOUTS = (("language_model.model.", "language_model.lm_head."),
                      ("model.language_model.", "lm_head."))


def gemma3_params(cfg: llama.LlamaConfig, get: Callable[[str], np.ndarray],
                  names: set[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Llama's parameter mapping, reading a multimodal checkpoint's language model under its
    own prefix (either layout) as a text checkpoint's `model.*` and `lm_head.*`."""
    layout = next(((body, head) for body, head in MULTIMODAL_LAYOUTS
                   if body + "embed_tokens.weight" in names), None)
    if layout is None:
        yield from llama.hf_params(cfg, get, names)
        return
    body, head = layout

    def source_name(name: str) -> str:
        if name.startswith("model."):
            return body + name[len("model."):]
        return head + name[len("lm_head."):] if name.startswith("lm_head.") else name

    inner = {("model." + n[len(body):]) if n.startswith(body)
             else ("lm_head." + n[len(head):]) if n.startswith(head) else n for n in names}
    yield from llama.hf_params(cfg, lambda name: get(source_name(name)), inner)


def gemma3_config(hf: dict[str, Any]) -> llama.LlamaConfig:
    """Read a Gemma 3 text config.json (five local layers to one global one), also the text
    model inside a Gemma3ForConditionalGeneration checkpoint (`text_config`)."""
    hf = text_config(hf)
    cfg = _common(hf, pattern=6)
    params = hf.get("rope_parameters") or {}
    if SLIDING in params:  # transformers 5: per layer type
        local = _rope(params[SLIDING], 10_000.0)
        glob = _rope(params.get("full_attention", {}), 1_000_000.0)
    else:  # older configs: rope_theta (+ rope_scaling) for global, rope_local_base_freq local
        local = (float(hf.get("rope_local_base_freq", 10_000.0)), 1.0)
        glob = _rope({"rope_theta": hf.get("rope_theta", 1_000_000.0),
                      **(hf.get("rope_scaling") or {})}, 1_000_000.0)
    types = _layer_types(hf, pattern=6)
    ropes = [local if t == SLIDING else glob for t in types]
    return dataclasses.replace(
        cfg,
        qk_norm="head",
        rope_theta=glob[0],
        rope_scaling={},
        layer_rope_theta=[theta for theta, _ in ropes],
        layer_rope_scale=[scale for _, scale in ropes],
    )


# -- llama.cpp's GGUF files (`gemma2`, `gemma3`) --------------------------------------------
# What llama.cpp does not store but fixes per architecture (its llama-model.cpp): the window
# pattern (every 2nd / 6th layer global), Gemma 3's local rope (theta 10k, no scaling), and the
# attention scale: head_dim ** -0.5, or (hidden / heads) ** -0.5 on the 27B models, which it
# knows by their layer count.
GGUF_PATTERN = {"gemma2": 2, "gemma3": 6}
GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GGUF_LOCAL_THETA = 10_000.0


def _gguf_common(gf: GgufSource, read: dict[str, Any], arch: str) -> dict[str, Any]:
    heads, hidden, layers = (read["num_attention_heads"], read["hidden_size"],
                             read["num_hidden_layers"])
    head_dim = int(gf.arch_key("attention.key_length") or hidden // heads)
    scalar = hidden // heads if layers == GGUF_27B_LAYERS[arch] else head_dim
    window = int(gf.arch_key("attention.sliding_window") or 0)
    pattern = GGUF_PATTERN[arch]
    types = [SLIDING if window and (i + 1) % pattern else "full_attention"
             for i in range(layers)]
    config: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "num_key_value_heads": int(gf.arch_key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "query_pre_attn_scalar": scalar,
        "tie_word_embeddings": gf.tensor_shape("output.weight") is None,
        "layer_types": types,
        "torch_dtype": "float32",
    }
    if window:
        config["sliding_window"] = window
    return config


def gemma2_gguf_config(gf: GgufSource, read: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 2 config.json from llama.cpp's `gemma2` metadata."""
    return {**_gguf_common(gf, read, "gemma2"), "architectures": ["Gemma2ForCausalLM"],
            "model_type": "gemma2",
            "attn_logit_softcapping": gf.arch_key("attn_logit_softcapping"),
            "final_logit_softcapping": gf.arch_key("final_logit_softcapping")}


def gemma3_gguf_config(gf: GgufSource, read: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 text config.json from llama.cpp's `gemma3` metadata (the 1B text model and the
    language model of the 4B+ multimodal ones, which llama.cpp files alike)."""
    if gf.arch_key("final_logit_softcapping"):
        raise UnsupportedModelError(f"{gf.path.name}: a `gemma3` GGUF with final logit "
                                    f"soft-capping is not supported")
    glob: dict[str, Any] = {"rope_type": "default", "rope_theta": read["rope_theta"]}
    kind = gf.arch_key("rope.scaling.type")
    if kind == "linear":
        glob.update(rope_type="linear", factor=float(gf.arch_key("rope.scaling.factor") or 1.0))
    elif kind and kind != "none":
        raise UnsupportedModelError(f"{gf.path.name}: Gemma 3 rope scaling {kind!r} is not "
                                    f"supported")
    return {**_gguf_common(gf, read, "gemma3"), "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": GGUF_LOCAL_THETA},
                                "full_attention": glob}}


def _gguf_map(config: Any, qk_norm: bool) -> GgufMap:
    """Gemma's tensor names; every norm weight is stored as 1 + w by llama.cpp's converter."""
    norms = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm",
             "post_ffw_norm": "post_feedforward_layernorm"}
    if qk_norm:
        norms.update(attn_q_norm="self_attn.q_norm", attn_k_norm="self_attn.k_norm")
    layer = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    return GgufMap(
        tensors=llama.GGUF_TENSORS,
        layer_tensors={**layer, **norms},
        config=config,
        config_keys=llama.GGUF_CONFIG_KEYS,
        # q/k rows stay in HF's order: llama.cpp rotates Gemma's heads by halves, as HF does
        shifted={"output_norm.weight": 1.0, **dict.fromkeys(norms, 1.0)},
    )


GGUF_GEMMA2 = _gguf_map(gemma2_gguf_config, qk_norm=False)
GGUF_GEMMA3 = _gguf_map(gemma3_gguf_config, qk_norm=True)


def architecture(name: str) -> Architecture:
    """The registry's view of this module: Llama's build and weights, Gemma's configs."""
    read = {"gemma2": gemma2_config, "gemma3": gemma3_config}[name]
    gguf = {"gemma2": GGUF_GEMMA2, "gemma3": GGUF_GEMMA3}[name]
    params = {"gemma2": llama.hf_params, "gemma3": gemma3_params}[name]
    return dataclasses.replace(llama.architecture(name), config_from_hf=read, gguf=gguf,
                               hf_params=params)
