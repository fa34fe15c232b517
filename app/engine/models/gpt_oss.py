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
quantize them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from localchat.engine.models import Architecture, llama, moe
from localchat.errors import ModelConfigError

# FP4 (E2M1) values of the 16 codes, sign in the high bit: OCP Microscaling format
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


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


def mlp_params(cfg: moe.MoeConfig, get: Callable[[str], np.ndarray], names: set[str],
               layer_id: int) -> Iterator[tuple[str, np.ndarray]]:
    """Layer `layer_id`'s router and experts from gpt-oss's tensors (float or MXFP4)."""
    hf = f"model.layers.{layer_id}.mlp."
    ours = hf
    e, h, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    yield ours + "gate.weight", get(hf + "router.weight")
    yield ours + "gate.bias", get(hf + "router.bias")
    gate_up = _gate_then_up(_experts(get, names, hf + "experts.gate_up_proj"))
    if gate_up.shape != (e, 2 * f, h):
        raise ModelConfigError(f"layer {layer_id}: experts' gate/up {gate_up.shape}, "
                               f"expected {(e, 2 * f, h)}")
    yield ours + "experts.gate_up_proj.weight", gate_up.reshape(e * 2 * f, h)
    yield ours + "experts.gate_up_bias", _gate_then_up(get(hf + "experts.gate_up_proj_bias"))
    down = _experts(get, names, hf + "experts.down_proj")
    if down.shape != (e, h, f):
        raise ModelConfigError(f"layer {layer_id}: experts' down {down.shape}, "
                               f"expected {(e, h, f)}")
    yield ours + "experts.down_proj.weight", down.reshape(e * h, f)
    yield ours + "experts.down_bias", get(hf + "experts.down_proj_bias")


def architecture(name: str) -> Architecture:
    """The registry's view of this module."""
    return dataclasses.replace(
        moe.architecture(name, config_from_hf),
        hf_params=functools.partial(llama.hf_params, mlp_params=mlp_params))
