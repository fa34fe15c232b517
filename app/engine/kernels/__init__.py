"""Hand-written, already-scheduled TIR kernels (the compile pipeline leaves them as written).

- `common`: shared constants and helpers (weight packing, vector widths, thread counts, the
  `scheduled` function attributes, the AVX-512 probe, the GEMV's input transposition).
- `matmul`: CPU linear layers (float or 4-bit weights) for prefill; one-row calls take the GEMV.
- `gemv`: the decode GEMV (4-bit weights unpacked in registers, or float), Llama and RWKV alike.
- `attention`: CPU attention over TVM's paged KV cache (soft-cap, sliding window), the KV cache
  that uses it, and the rotary kernels (in the cache, or per layer by the model).
- `gpu_attention`: an attention-logit soft-cap written into TVM's GPU attention kernels (Gemma 2).
- `elementwise`: RMSNorm (any leading axes, optional 1 + w), the gated MLP activation (SiLU,
  GELU-tanh) and the logit soft-cap.
- `moe`: the MoE router's top-k (CPU, and one thread per token on a GPU), the experts' grouped
  GEMV and their combination (CPU).
- `wkv`: RWKV-4's token shift, WKV scan (CPU and GPU) and the copy kernels of its RNN state.
- `tvm_private`: every private (underscore) TVM name localchat uses, checked against the TVM
  version they were read against.
"""

from localchat.engine.kernels import tvm_private

# before any kernel is parsed: TVM's own macro lookup is most of a 4-bit GEMV's parse time
tvm_private.install_fast_macro_lookup()
