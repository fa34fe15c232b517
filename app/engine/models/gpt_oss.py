"""gpt-oss (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b): the shared decoder block with
mixture-of-experts MLPs (`models.moe`) and what OpenAI's models add to it:

- attention sinks: a learned logit per layer and query head in every softmax's denominator
  (`LlamaConfig.attn_sinks`; the CPU kernels read it from a padded lane of q);
- q/k/v/o biases, sliding-window (128) and full attention alternating (`layer_types`);
- YaRN rope (factor 32 over 4,096 positions), its attention factor folded into the scale;
- experts with biases, a router with a bias (softmax over the top-k logits: the renormalized
  top k of the full softmax) and a clamped SwiGLU: gate clamped above and up on both sides at
  `swiglu_limit`, then gate * sigmoid(alpha * gate) * (up + 1).

transformers stores the experts transposed, [E, in, out], with each expert's gate and up
columns interleaved; OpenAI's checkpoints store them in MXFP4 (`*_blocks` of 32 FP4 values,
`*_scales` of E8M0 exponents, [E, out, in]), which conversion expands to float before our modes
quantize them (q4f32_mx finds the same MXFP4 codes and exponents again: held exactly).

llama.cpp's GGUF files (`general.architecture` "gpt-oss", `GGUF`) hold the experts [E, out, in]
with gate and up apart (`ffn_gate_exps`, `ffn_up_exps`, or one `ffn_gate_up_exps` of the gate
rows then the up rows), usually in ggml's MXFP4, which the `gguf` package dequantizes; their
q/k rows are in HF's order (llama.cpp runs gpt-oss with NEOX rope). What llama.cpp fixes rather
than stores is read as it assumes it: every other layer windowed from layer 0, the clamp at 7
and alpha 1.702, untruncated YaRN.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from localchat.engine.build.quantization import FP4_VALUES
from localchat.engine.models import Architecture, GgufMap, GgufSource, llama, moe
from localchat.errors import ModelConfigError, UnsupportedModelError


def config_from_hf(hf: dict[str, Any]) -> moe.MoeConfig:
    """Read a gpt-oss config.json."""
    base = llama.LlamaConfig.from_hf(hf)
    layers = base.num_hidden_layers
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                      for i in range(layers)]
    if len(types) != layers:
        raise ModelConfigError(f"config.json: {len(types)} layer_types for {layers} layers")
    window = int(hf.get("sliding_window") or 0)
    base = dataclasses.replace(
        base, attn_sinks=True, qkv_bias=bool(hf.get("attention_bias", True)),
        o_bias=bool(hf.get("attention_bias", True)),
        sliding_window=window,
        sliding_layers=[int(t == "sliding_attention" and window > 0) for t in types])
    cfg = moe.moe_config(base, moe.experts_of(hf), int(hf.get("num_experts_per_tok") or 0),
                         int(hf.get("intermediate_size") or 0), True)
    return dataclasses.replace(
        cfg, router_bias=True, expert_bias=True, expert_act="swiglu_clamp",
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)))


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 weights to float32: `blocks` [..., G, 16] uint8 (two FP4 codes a byte, the low
    nibble first), `scales` [..., G] uint8 (E8M0: 2 ** (s - 127) per block of 32) ->
    [..., G * 32]."""
    blocks = np.asarray(blocks, dtype=np.uint8)
    scales = np.asarray(scales, dtype=np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ModelConfigError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape}")
    codes = np.empty((*blocks.shape[:-1], 32), dtype=np.uint8)
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    values = FP4_VALUES[codes]
    exponents = scales.astype(np.int32) - 127
    values = np.ldexp(values, exponents[..., None]).astype(np.float32)
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


def _experts(get: Callable[[str], np.ndarray], names: set[str], base: str) -> np.ndarray:
    """One stacked projection as [E, out, in] float: transformers' [E, in, out], or the
    checkpoint's MXFP4 blocks and scales (already [E, out, in])."""
    if base + "_blocks" in names:
        return dequantize_mxfp4(get(base + "_blocks"), get(base + "_scales"))
    return np.swapaxes(get(base), 1, 2)


def _gate_then_up(a: np.ndarray) -> np.ndarray:
    """[E, 2F, ...] with gate and up interleaved (gate at even rows) -> each expert's gate
    rows, then its up rows, as the stacked experts of `models.moe` hold them."""
    return np.concatenate([a[:, 0::2], a[:, 1::2]], axis=1)


def _hf_experts(get: Callable[[str], np.ndarray], names: set[str],
                base: str) -> tuple[np.ndarray, ...]:
    """(gate/up [E, 2F, H], its bias [E, 2F], down [E, H, F], its bias [E, H]) from
    transformers' or OpenAI's tensors under `base` (`model.layers.N.mlp.experts.`)."""
    return (_gate_then_up(_experts(get, names, base + "gate_up_proj")),
            _gate_then_up(get(base + "gate_up_proj_bias")),
            _experts(get, names, base + "down_proj"), get(base + "down_proj_bias"))


def _gguf_experts(get: Callable[[str], np.ndarray], names: set[str],
                  base: str) -> tuple[np.ndarray, ...]:
    """The same from llama.cpp's tensors as `GGUF` names them: [E, out, in] already, gate and up
    apart or fused (gate rows, then up rows)."""
    if base + "gate_up_exps.weight" in names:
        gate_up, gate_up_bias = get(base + "gate_up_exps.weight"), get(base + "gate_up_exps.bias")
    else:
        gate_up = np.concatenate([get(base + "gate_proj.weight"), get(base + "up_proj.weight")],
                                 axis=1)
        gate_up_bias = np.concatenate([get(base + "gate_proj.bias"), get(base + "up_proj.bias")],
                                      axis=1)
    return gate_up, gate_up_bias, get(base + "down_proj.weight"), get(base + "down_proj.bias")


def mlp_params(cfg: moe.MoeConfig, get: Callable[[str], np.ndarray], names: set[str],
               layer_id: int) -> Iterator[tuple[str, np.ndarray]]:
    """Layer `layer_id`'s router and experts from gpt-oss's tensors (float or MXFP4, or a GGUF
    import's)."""
    hf = f"model.layers.{layer_id}.mlp."
    ours = hf
    e, h, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    yield ours + "gate.weight", get(hf + "router.weight")
    yield ours + "gate.bias", get(hf + "router.bias")
    hf_layout = any(hf + f"experts.gate_up_proj{s}" in names for s in ("", "_blocks"))
    gate_up, gate_up_bias, down, down_bias = (_hf_experts if hf_layout else _gguf_experts)(
        get, names, hf + "experts.")
    if gate_up.shape != (e, 2 * f, h):
        raise ModelConfigError(f"layer {layer_id}: experts' gate/up {gate_up.shape}, "
                               f"expected {(e, 2 * f, h)}")
    if down.shape != (e, h, f):
        raise ModelConfigError(f"layer {layer_id}: experts' down {down.shape}, "
                               f"expected {(e, h, f)}")
    yield ours + "experts.gate_up_proj.weight", gate_up.reshape(e * 2 * f, h)
    yield ours + "experts.gate_up_bias", gate_up_bias
    yield ours + "experts.down_proj.weight", down.reshape(e * h, f)
    yield ours + "experts.down_bias", down_bias


def hf_params(cfg: moe.MoeConfig, get: Callable[[str], np.ndarray],
              names: set[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Our parameters from gpt-oss's HF tensors, or a GGUF import's (whose sinks, read as any
    block tensor, are `self_attn.sinks.weight`)."""

    def fetch(name: str) -> np.ndarray:
        if name.endswith(".self_attn.sinks") and name not in names and name + ".weight" in names:
            return get(name + ".weight")
        return get(name)

    return llama.hf_params(cfg, fetch, names, mlp_params=mlp_params)


# -- llama.cpp's GGUF files (`gpt-oss`) ------------------------------------------------------
# what llama.cpp's gpt-oss graph fixes (its converter does not store them): the clamped
# SwiGLU's constants and the window on every other layer, from layer 0
GGUF_SWIGLU_LIMIT = 7.0
GGUF_SWIGLU_ALPHA = 1.702
GGUF_SWA_PATTERN = 2


def _f32(value: Any) -> float:
    """A float GGUF stored in 32 bits as the shortest decimal reading back the same (1e-06, not
    9.99999997e-07), so that the config equals the HF folder's."""
    return float(str(np.float32(value)))


def _sliding_layers(gf: GgufSource, layers: int) -> list[bool]:
    """Which layers are windowed: `attention.sliding_window_pattern` when the file has it (per
    layer, or every n-th layer full as llama.cpp reads a number), else llama.cpp's gpt-oss
    rule (even layers windowed)."""
    pattern = gf.arch_key("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ModelConfigError(f"{gf.path.name}: a sliding window pattern of {len(pattern)} "
                                   f"layers for {layers}")
        return [bool(p) for p in pattern]
    n = GGUF_SWA_PATTERN if pattern is None else int(pattern)
    return [n == 0 or i % n < n - 1 for i in range(layers)]


def _swiglu_limit(gf: GgufSource) -> float:
    """The clamp: `swiglu_clamp_exp` (per layer) where the file has it, else llama.cpp's 7."""
    value = gf.arch_key("swiglu_clamp_exp")
    values = {_f32(v) for v in (value if isinstance(value, list) else [value]) if v}
    if len(values) > 1:
        raise UnsupportedModelError(f"{gf.path.name}: per-layer SwiGLU clamps differ")
    return values.pop() if values else GGUF_SWIGLU_LIMIT


def gguf_config(gf: GgufSource, read: dict[str, Any]) -> dict[str, Any]:
    """A gpt-oss config.json from llama.cpp's `gpt-oss` metadata (what `config_from_hf` reads
    of OpenAI's): the experts, the window and its layers, YaRN, the clamp."""
    base = llama.gguf_config(gf, read)
    base.pop("rope_scaling", None)
    layers = read["num_hidden_layers"]
    experts = int(gf.arch_key("expert_count") or 0)
    used = int(gf.arch_key("expert_used_count") or 0)
    shape = (gf.tensor_shape("blk.0.ffn_down_exps.weight") or (0, 0, 0))
    width = int(gf.arch_key("expert_feed_forward_length") or shape[-1])
    if not experts or not used or not width:
        raise UnsupportedModelError(f"{gf.path.name}: a gpt-oss GGUF without its experts")
    if gf.tensor_shape("blk.0.ffn_gate_inp.bias") is None:
        raise UnsupportedModelError(f"{gf.path.name}: a gpt-oss GGUF without router biases")
    window = int(gf.arch_key("attention.sliding_window") or 0)
    kind = gf.arch_key("rope.scaling.type")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _f32(read["rope_theta"])}
    if kind == "yarn":
        original = gf.arch_key("rope.scaling.original_context_length")
        factor = gf.arch_key("rope.scaling.factor")
        if not original or not factor:
            raise ModelConfigError(f"{gf.path.name}: YaRN without its factor or original "
                                   f"context length")
        rope.update(rope_type="yarn", factor=_f32(factor),
                    original_max_position_embeddings=int(original),
                    beta_fast=_f32(gf.arch_key("rope.scaling.yarn_beta_fast") or 32.0),
                    beta_slow=_f32(gf.arch_key("rope.scaling.yarn_beta_slow") or 1.0),
                    truncate=False)
        attention = gf.arch_key("rope.scaling.yarn_attn_factor")
        if attention:
            rope["attention_factor"] = _f32(attention)
    elif kind and kind != "none":
        raise UnsupportedModelError(f"{gf.path.name}: gpt-oss with {kind} rope scaling")
    return {**base, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "rms_norm_eps": _f32(read["rms_norm_eps"]), "rope_theta": rope["rope_theta"],
            "rope_parameters": rope, "intermediate_size": width,
            "num_local_experts": experts, "num_experts_per_tok": used,
            "sliding_window": window or None,
            "layer_types": ["sliding_attention" if s and window else "full_attention"
                            for s in _sliding_layers(gf, layers)],
            "swiglu_limit": _swiglu_limit(gf), "swiglu_alpha": GGUF_SWIGLU_ALPHA}


GGUF = GgufMap(
    tensors=llama.GGUF_TENSORS,
    layer_tensors={
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_sinks": "self_attn.sinks",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_gate_inp": "mlp.router",
        # [E, out, in] with their [E, out] biases (`_gguf_experts` reads these names)
        "ffn_gate_exps": "mlp.experts.gate_proj",
        "ffn_up_exps": "mlp.experts.up_proj",
        "ffn_gate_up_exps": "mlp.experts.gate_up_exps",
        "ffn_down_exps": "mlp.experts.down_proj",
    },
    config=gguf_config,
    config_keys={**llama.GGUF_CONFIG_KEYS,
                 "feed_forward_length": ("intermediate_size", int, 1),
                 "rope.freq_base": ("rope_theta", float, 150000.0)},
)


def architecture(name: str) -> Architecture:
    """The registry's view of this module."""
    return dataclasses.replace(moe.architecture(name, config_from_hf, GGUF),
                               hf_params=hf_params)
