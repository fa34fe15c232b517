"""A random-weight RWKV-7 GGUF in llama.cpp's layout (architecture `rwkv7`), for timing llama.cpp
on a shape no downloaded checkpoint is needed for (its quantized copies: `gguf_quantize`).

The tensor names, shapes and dtypes follow llama.cpp's loader (`llama_model_rwkv7`'s
`load_arch_tensors`) and its converter's choices: 1-D tensors, the token-shift lerps and the
decay LoRA in F32 (the converter keeps them F32; `llama_model_quantize` never quantizes RWKV's
small 2-D tensors), every other matrix in `dtype`. The tokenizer is the RWKV World vocabulary as
the converter writes it (tokenizer model "rwkv", token 0 `<s>`, escaped byte strings).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

WORLD_VOCAB_ROWS = 65536
CONTEXT = 1048576  # what llama.cpp's converter writes for RWKV (no positional limit)


def _world_tokens(vocab: int) -> tuple[list[bytes], list[int]]:
    """The World vocabulary as llama.cpp's converter lists it, padded to `vocab` entries."""
    import gguf

    from localchat.engine.models.rwkv7_pth import world_vocab
    from localchat.engine.tokenizer_world import read_world_vocab

    # world_vocab looks beside a checkpoint first; there is none, so it finds the installed copy
    by_id = read_world_vocab(world_vocab(Path(os.devnull) / "none.pth"))
    tokens, types = [b"<s>"], [int(gguf.TokenType.CONTROL)]
    for i in range(1, vocab):
        if i in by_id:
            # llama.cpp's rwkv tokenizer unescapes Python's bytes repr
            tokens.append(repr(by_id[i])[2:-1].encode("utf-8"))
            types.append(int(gguf.TokenType.NORMAL))
        else:
            tokens.append(f"[PAD{i}]".encode())
            types.append(int(gguf.TokenType.UNUSED))
    return tokens, types


def _specs(hidden: int, layers: int, ffn: int, vocab: int, ranks: tuple[int, int, int, int],
           dtype: type) -> Iterator[tuple[str, tuple[int, ...], type, str]]:
    """(name, numpy shape, dtype, init) of every tensor; numpy shapes are ggml's `ne` reversed."""
    decay, iclr, vres, gate = ranks
    f32 = np.float32
    yield "token_embd.weight", (vocab, hidden), dtype, "normal"
    yield "token_embd_norm.weight", (hidden,), f32, "one"
    yield "token_embd_norm.bias", (hidden,), f32, "zero"
    yield "output_norm.weight", (hidden,), f32, "one"
    yield "output_norm.bias", (hidden,), f32, "zero"
    yield "output.weight", (vocab, hidden), dtype, "normal"
    for i in range(layers):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (hidden,), f32, "one"
        yield p + "attn_norm.bias", (hidden,), f32, "zero"
        yield p + "attn_norm_2.weight", (hidden,), f32, "one"
        yield p + "attn_norm_2.bias", (hidden,), f32, "zero"
        yield p + "time_mix_w0.weight", (hidden,), f32, "decay"
        yield p + "time_mix_w1.weight", (decay, hidden), f32, "normal"
        yield p + "time_mix_w2.weight", (hidden, decay), f32, "normal"
        yield p + "time_mix_a0.weight", (hidden,), f32, "small"
        yield p + "time_mix_a1.weight", (iclr, hidden), dtype, "normal"
        yield p + "time_mix_a2.weight", (hidden, iclr), dtype, "normal"
        # layer 0 has no value-residual LoRA; llama.cpp still loads a placeholder of the
        # in-context-learning-rate rank there
        v = iclr if i == 0 else vres
        yield p + "time_mix_v0.weight", (hidden,), f32, "small"
        yield p + "time_mix_v1.weight", (v, hidden), dtype, "normal"
        yield p + "time_mix_v2.weight", (hidden, v), dtype, "normal"
        yield p + "time_mix_g1.weight", (gate, hidden), dtype, "normal"
        yield p + "time_mix_g2.weight", (hidden, gate), dtype, "normal"
        yield p + "time_mix_lerp_fused.weight", (6, 1, 1, hidden), f32, "unit"
        yield p + "time_mix_k_k.weight", (hidden,), f32, "unit"
        yield p + "time_mix_k_a.weight", (hidden,), f32, "unit"
        yield p + "time_mix_r_k.weight", (hidden,), f32, "small"
        yield p + "time_mix_key.weight", (hidden, hidden), dtype, "normal"
        yield p + "time_mix_value.weight", (hidden, hidden), dtype, "normal"
        yield p + "time_mix_receptance.weight", (hidden, hidden), dtype, "normal"
        yield p + "time_mix_ln.weight", (hidden,), f32, "one"
        yield p + "time_mix_ln.bias", (hidden,), f32, "zero"
        yield p + "time_mix_output.weight", (hidden, hidden), dtype, "normal"
        yield p + "channel_mix_lerp_k.weight", (1, 1, hidden), f32, "unit"
        yield p + "channel_mix_key.weight", (ffn, hidden), dtype, "normal"
        yield p + "channel_mix_value.weight", (hidden, ffn), dtype, "normal"


def _value(rng: np.random.Generator, shape: tuple[int, ...], dtype: type, init: str) -> np.ndarray:
    if init == "one":
        return np.ones(shape, dtype)
    if init == "zero":
        return np.zeros(shape, dtype)
    if init == "decay":  # pre-activation of the decay: slow to fast channels
        return rng.uniform(-5, -1, size=shape).astype(dtype)
    if init == "unit":  # lerp weights and k scales in [0, 1)
        return rng.random(shape, dtype=np.float32).astype(dtype)
    if init == "small":
        return (rng.standard_normal(shape, dtype=np.float32) * 0.1).astype(dtype)
    return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)


def write_rwkv7_gguf(path: Path | str, *, hidden: int, layers: int, head_size: int = 64,
                     ffn: int, vocab: int = WORLD_VOCAB_ROWS,
                     lora_ranks: tuple[int, int, int, int], seed: int = 0,
                     dtype: str = "f16") -> Path:
    """Write a random-weight RWKV-7 GGUF in llama.cpp's layout; lora_ranks = (decay, iclr,
    value-residual, gate)."""
    import gguf

    path = Path(path)
    np_dtype = {"f16": np.float16, "f32": np.float32}[dtype]
    ranks = tuple(int(r) for r in lora_ranks)
    w = gguf.GGUFWriter(str(path), "rwkv7")
    w.add_block_count(layers)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(0)  # RWKV has no attention heads in llama.cpp's sense
    w.add_layer_norm_eps(1e-5)
    w.add_rescale_every_n_layers(0)
    w.add_wkv_head_size(head_size)
    w.add_decay_lora_rank(ranks[0])
    w.add_iclr_lora_rank(ranks[1])
    w.add_value_residual_mix_lora_rank(ranks[2])
    w.add_gate_lora_rank(ranks[3])
    w.add_token_shift_count(2)  # llama.cpp's RWKV-7 graph asserts two shifted states
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
    tokens, types = _world_tokens(vocab)
    w.add_tokenizer_model("rwkv")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_eot_token_id(261)  # "\n\n", what the converter marks as end of turn
    specs = list(_specs(hidden, layers, ffn, vocab, ranks, np_dtype))
    # tensor infos first, data after, one tensor at a time: the 32-layer file is ~6 GB
    for name, shape, dt, _ in specs:
        nbytes = int(np.prod(shape)) * np.dtype(dt).itemsize
        w.add_tensor_info(name, shape, np.dtype(dt), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _name, shape, dt, init in specs:
        w.write_tensor_data(_value(rng, shape, dt, init))
    w.close()
    return path


def decode_bytes_per_token(path: Path | str) -> int:
    """Bytes a decode step reads from a GGUF: every tensor but the token embedding, plus one
    row of it."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    total = sum(int(t.n_bytes) for t in reader.tensors)
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    rows = int(emb.shape[-1])  # GGUFReader gives ggml's ne order: (hidden, vocab)
    return total - int(emb.n_bytes) + int(emb.n_bytes) // rows
