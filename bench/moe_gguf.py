"""llama.cpp's files of bench_moe.py's random mixture-of-experts weights, and its timing of them.

`write_gguf` reads the HF folder bench_moe.py wrote (safetensors, float16) and writes the same
weights as a GGUF in the layout llama.cpp's converter gives, by the folder's `model_type`:

- `qwen3_moe` (the experts in transformers 5's fused [E, 2F, H], gate rows then up rows): a
  `qwen3moe` GGUF, its metadata keys, the router as `ffn_gate_inp`, each projection's experts
  merged into one [E, out, in] tensor, `ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`;
- `gpt_oss` (transformers' GptOss layout: `gate_up_proj` [E, H, 2F] with gate and up in
  alternate columns, `down_proj` [E, F, H], their biases, `router`, `self_attn.sinks`): a
  `gpt-oss` GGUF, its keys (sliding window, YaRN), the experts transposed to [E, out, in] with
  gate and up apart (`ffn_gate_exps` / `ffn_up_exps` and their `.bias` [E, F]),
  `ffn_down_exps` and its bias, the router's bias, `attn_sinks.weight`, the q/k/v/o biases;

matrices in F16 or, where the disk is short, Q8_0 (gguf.quants; llama.cpp then requantizes from
it), norms, biases, sinks and the router F32. The tokenizer is a minimal "gpt2" one of the
model's vocabulary size (the 256 byte symbols, filler tokens, one merge): the benchmark feeds
token ids, so only that llama.cpp loads it matters. llama.cpp's own file of a type is made by
`gguf_quantize.quantize` (for gpt-oss its natural type is MXFP4_MOE: the experts in MXFP4, the
rest Q8_0); `run_peer` times one file at one thread count the way bench/bench_engine.py times
its peer, and `bytes_per_token` counts what a decode step of it reads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

# The most the GGUFs may take on the disk at once (the source and one quantized file).
DISK_BUDGET = 10e9
# Bytes per parameter of llama.cpp's 4-bit files, over-estimated (Q4_K_M's Q6_K tensors).
Q4_BYTES_PER_PARAM = 0.65
# The same where rows are not a multiple of 256 (gpt-oss's 2880): Q4_K_M's K-quant tensors fall
# back to Q5_0 and Q8_0 there, and MXFP4_MOE keeps all but the experts in Q8_0.
Q4_BYTES_PER_PARAM_NO_K = 0.9


def _tensors(hf_dir: Path) -> dict[str, Path]:
    """Each HF tensor's name -> the safetensors file that holds it."""
    from safetensors import safe_open

    where = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            where.update({name: file for name in f.keys()})
    return where


def _plan(hf_dir: Path) -> list[tuple[str, tuple[int, ...], bool, object]]:
    """(llama.cpp name, numpy shape, kept in F32, loader) for every tensor, in file order."""
    import gguf
    from safetensors import safe_open

    cfg = json.loads((hf_dir / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    gpt_oss = cfg["model_type"] == "gpt_oss"
    arch = gguf.MODEL_ARCH.GPT_OSS if gpt_oss else gguf.MODEL_ARCH.QWEN3MOE
    names = gguf.get_tensor_name_map(arch, layers)
    where = _tensors(hf_dir)
    shapes = {}
    for file in sorted(set(where.values())):
        with safe_open(str(file), framework="numpy") as fh:
            shapes.update({n: tuple(fh.get_slice(n).get_shape()) for n in fh.keys()})

    def load(name: str, rows: slice | None = None, then=None):
        def get() -> np.ndarray:
            with safe_open(str(where[name]), framework="numpy") as fh:
                if rows is None:
                    value = fh.get_tensor(name)
                else:
                    # only those rows of each expert (the fused tensor is 2/3 of a layer)
                    value = np.ascontiguousarray(fh.get_slice(name)[:, rows])
            return value if then is None else np.ascontiguousarray(then(value))
        return get

    plan = []
    for name, shape in shapes.items():
        if ".mlp.experts." in name:
            continue
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise SystemExit(f"no llama.cpp name for {name}")
        if name.endswith(".self_attn.sinks"):  # llama.cpp's converter names it so
            gname += ".weight"
        # norms, biases, sinks and the router stay F32, as llama.cpp's converter and quantizer
        # keep them
        f32 = len(shape) == 1 or ".ffn_gate_inp." in gname or gname.endswith(".bias")
        plan.append((gname, shape, f32, load(name)))
    for i in range(layers):
        gate_up = f"model.layers.{i}.mlp.experts.gate_up_proj"
        down = f"model.layers.{i}.mlp.experts.down_proj"
        if gpt_oss:
            plan += _gpt_oss_experts(i, shapes, load)
            continue
        f = cfg["moe_intermediate_size"]
        e, _, h = shapes[gate_up]
        # transformers 5's fused [E, 2F, H]: per expert its gate rows, then its up rows
        plan.append((f"blk.{i}.ffn_gate_exps.weight", (e, f, h), False,
                     load(gate_up, slice(0, f))))
        plan.append((f"blk.{i}.ffn_up_exps.weight", (e, f, h), False,
                     load(gate_up, slice(f, 2 * f))))
        plan.append((f"blk.{i}.ffn_down_exps.weight", shapes[down], False, load(down)))
    return plan


def _gpt_oss_experts(i: int, shapes: dict[str, tuple[int, ...]], load) -> list[tuple]:
    """Layer `i`'s experts of a GptOss folder as llama.cpp's `gpt-oss` files hold them:
    transformers' [E, H, 2F] (gate at even columns, up at odd) as [E, F, H] gate and up apart,
    [E, F, H] down as [E, H, F], each with its bias ([E, F] or [E, H], F32)."""
    p = f"model.layers.{i}.mlp.experts."
    e, h, f2 = shapes[p + "gate_up_proj"]
    f = f2 // 2
    plan = []
    for part, cols in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
        plan.append((f"blk.{i}.ffn_{part}_exps.weight", (e, f, h), False,
                     load(p + "gate_up_proj",
                          then=lambda a, c=cols: a[:, :, c].transpose(0, 2, 1))))
        plan.append((f"blk.{i}.ffn_{part}_exps.bias", (e, f), True,
                     load(p + "gate_up_proj_bias", then=lambda a, c=cols: a[:, c])))
    plan.append((f"blk.{i}.ffn_down_exps.weight", (e, h, f), False,
                 load(p + "down_proj", then=lambda a: a.transpose(0, 2, 1))))
    plan.append((f"blk.{i}.ffn_down_exps.bias", (e, h), True, load(p + "down_proj_bias")))
    return plan


def sizes(hf_dir: Path) -> dict[str, float]:
    """Bytes of the F16 and the Q8_0 GGUF of `hf_dir`, and of a 4-bit file (over-estimated)."""
    plan = _plan(hf_dir)
    params = sum(int(np.prod(s)) for _, s, f32, _ in plan if not f32)
    small = sum(4 * int(np.prod(s)) for _, s, f32, _ in plan if f32)
    k_quants = all(s[-1] % 256 == 0 for _, s, f32, _ in plan if not f32)
    q4 = Q4_BYTES_PER_PARAM if k_quants else Q4_BYTES_PER_PARAM_NO_K
    return {"F16": 2 * params + small, "Q8_0": params * 34 / 32 + small, "Q4": params * q4 + small}


def source_type(hf_dir: Path, out_dir: Path) -> str:
    """F16 when it and a 4-bit file fit the budget and the free disk at once, else Q8_0."""
    est = sizes(hf_dir)
    free = shutil.disk_usage(out_dir).free - 1e9  # room for others' writes
    room = min(DISK_BUDGET, free)
    if est["F16"] + est["Q4"] <= room:
        return "F16"
    if est["Q8_0"] + est["Q4"] <= free:
        return "Q8_0"
    raise SystemExit(f"the peer's GGUFs need {(est['Q8_0'] + est['Q4']) / 1e9:.1f} GB free at "
                     f"once; {shutil.disk_usage(out_dir).free / 1e9:.1f} GB are")


def _token_list(vocab: int) -> list[str]:
    """The 256 byte symbols of GPT-2's byte-level BPE, then fillers to `vocab` tokens."""
    from localchat.engine.build.gguf import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    return alphabet + ["\u0120\u0120"] + [f"<f{i}>" for i in range(vocab - len(alphabet) - 1)]


def _experts_header(w, cfg: dict) -> None:
    """The experts' and the architecture's own metadata keys: `qwen3moe`'s, or `gpt-oss`'s
    (its sliding window, YaRN; what llama.cpp fixes for gpt-oss, the window on every other
    layer and the clamp at 7, it does not read)."""
    import gguf

    if cfg["model_type"] != "gpt_oss":
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        return
    rope = cfg["rope_parameters"]
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def write_gguf(hf_dir: Path, path: Path, dtype: str = "F16") -> Path:
    """The HF folder's weights as llama.cpp's `qwen3moe` or `gpt-oss` GGUF, matrices in `dtype`
    (F16, Q8_0)."""
    import gguf
    from gguf.quants import quant_shape_to_byte_shape, quantize

    cfg = json.loads((hf_dir / "config.json").read_text())
    qtype = getattr(gguf.GGMLQuantizationType, dtype)
    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "gpt-oss" if cfg["model_type"] == "gpt_oss" else "qwen3moe")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    _experts_header(w, cfg)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "F16"
                    else gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab = cfg["vocab_size"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(_token_list(vocab))
    w.add_token_types([1] * vocab)
    # llama.cpp refuses a "gpt2" vocabulary without merges (and the writer drops an empty list)
    w.add_token_merges(["\u0120 \u0120"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    plan = _plan(hf_dir)
    for name, shape, f32, _ in plan:
        if f32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        elif dtype == "F16":
            w.add_tensor_info(name, shape, np.dtype(np.float16), 2 * int(np.prod(shape)))
        else:
            byte_shape = quant_shape_to_byte_shape(shape, qtype)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                              raw_dtype=qtype)
    # header and tensor infos first, then one tensor at a time: the writer never holds them all
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _name, shape, f32, get in plan:
        value = get()
        if f32:
            value = value.astype(np.float32)
        elif dtype == "F16":
            value = value.astype(np.float16)
        else:
            rows = value.reshape(-1, shape[-1])
            out = np.empty(quant_shape_to_byte_shape(rows.shape, qtype), np.uint8)
            step = 1 << 14  # rows per chunk: bounded float32 temporaries
            for r in range(0, rows.shape[0], step):
                out[r:r + step] = quantize(rows[r:r + step].astype(np.float32), qtype)
            value = out.reshape(quant_shape_to_byte_shape(shape, qtype))
        w.write_tensor_data(np.ascontiguousarray(value))
        del value
    w.close()
    tmp.rename(path)
    return path


def bytes_per_token(path: Path, experts: int, top: int) -> int:
    """Weight bytes one decode step reads from a GGUF: all but the token embedding, the merged
    experts' tensors at top / experts."""
    import gguf

    total = 0.0
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.name.startswith("token_embd."):
            continue
        total += int(t.n_bytes) * (top / experts if "_exps." in t.name else 1)
    return int(total)


def run_peer(path: Path, threads: int, prompt: list[int], decode: int,
             long: list[int] | None = None, long_decode: int = 32) -> dict:
    """llama.cpp on `path` with `threads` threads: prefill of `prompt`, then `decode` greedy
    steps (argmax of the raw logits, as ours), as bench/bench_engine.py's peer is timed; with
    `long`, the context reset, `long` prefilled and `long_decode` greedy steps timed after it."""
    import time

    import llama_cpp
    from llama_cpp import Llama

    n_ctx = max(512, len(prompt) + decode + 16, len(long or ()) + 2 * long_decode)
    llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512,
                n_threads=threads, n_threads_batch=threads, verbose=False)
    n_vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                     shape=(n_vocab,))

    llm.eval(prompt[:8])  # warm-up, as ours
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    prefill_s = time.perf_counter() - start
    finite = bool(np.isfinite(last_logits()).all())
    tokens = []

    def greedy(steps: int) -> float:
        """Seconds for `steps` greedy steps, each token appended to `tokens`."""
        nonlocal finite
        start = time.perf_counter()
        for _ in range(steps):
            logits = last_logits()
            finite &= bool(np.isfinite(logits).all())
            tokens.append(int(np.argmax(logits)))
            llm.eval([tokens[-1]])
        return time.perf_counter() - start

    decode_s = greedy(decode)
    result = {"prefill_tok_s": len(prompt) / prefill_s, "decode_tok_s": decode / decode_s,
              "tokens": tokens[:8], "finite": finite}
    if long:
        llm.reset()
        llm.eval(long)
        result["long_decode_tok_s"] = long_decode / greedy(long_decode)
        result["finite"] = finite
    return result
