"""llama.cpp's own quantized copy of a GGUF, as the benchmarks' peers run it."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path


def quantize(src: Path | str, dst: Path | str, qtype: str) -> Path:
    """llama.cpp's `qtype` file ("Q4_0", "Q4_K_M", "Q4_1") of `src` with its default tensor
    types (`llama_model_quantize`; an already quantized source, e.g. Q8_0, is requantized)."""
    import llama_cpp

    src, dst = Path(src), Path(dst)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    params.nthread = os.cpu_count() or 1
    params.allow_requantize = True
    tmp = dst.with_suffix(".tmp")
    log = dst.with_suffix(".log")
    # llama.cpp logs a line per tensor on stderr: kept in a file, shown only on failure
    saved = os.dup(2)
    with open(log, "wb") as fh:
        os.dup2(fh.fileno(), 2)
        try:
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(),
                                                ctypes.byref(params))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    text = log.read_text(errors="replace")
    log.unlink()
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"llama_model_quantize {qtype} failed ({rc}):\n{text[-3000:]}")
    tmp.rename(dst)
    return dst
