"""`localchat debug`: run a prompt through a debug build of a compiled model (which also returns
every block's output and every operation's, see `models/probes.py`) and through a reference
(HF `transformers` in float32), and say which layer, then which operation, differs first.

    report = debug_model(model_dir, reference=hf_folder, prompt="Hello", ops_layer=3)
    print(report.render())          # or report.to_json()
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from localchat import model_dir as md
from localchat.engine.debug.compiled import ForwardTrace, ProbeValue, run_compiled
from localchat.engine.debug.reference import (
    EXTRA,
    MissingExtraError,
    reference_folder,
    require_torch,
    run_blink_reference,
    run_reference,
    split_fused,
)
from localchat.engine.debug.report import DebugReport, Row, build_report, tolerance
from localchat.errors import InvalidRequestError

DEBUG_PROMPT = ("The quick brown fox jumps over the lazy dog. Once upon a time, in a small "
                  "village by the sea, there lived an old fisherman who")


def debug_model(model_dir: Path, reference: Path, *, prompt: str = DEBUG_PROMPT,
                token_ids: list[int] | None = None, ops_layer: int | None = None,
                device: str = "cpu",
                log: Callable[[str], None] | None = None) -> DebugReport:
    """Compare `model_dir` (a localchat model directory) with `reference` (an HF folder or a
    .gguf) on `prompt` (or on `token_ids`), layer by layer; with `ops_layer`, also that layer
    op by op."""
    require_torch()  # before any compile: without the extra there is nothing to compare with
    meta = md.load_config(model_dir)
    layers = int(meta["model_config"]["num_hidden_layers"])
    if ops_layer is not None and not 0 <= ops_layer < layers:
        raise InvalidRequestError(f"--ops {ops_layer}: the model has layers 0 to {layers - 1}",
                                  "ops")
    from localchat.engine.tokenizer import load_tokenizer

    ids = list(token_ids) if token_ids is not None else load_tokenizer(model_dir).encode(prompt)
    if not ids:
        raise InvalidRequestError("the prompt has no tokens", "prompt")
    chunk = int(meta["prefill_chunk_size"])
    notes = []
    if len(ids) > chunk:
        notes.append(f"note: the prompt was cut to its first {chunk} tokens (one prefill chunk)")
        ids = ids[:chunk]
    ours = run_compiled(model_dir, ids, device, log)
    if _rounds_activations(str(meta["quantization"]), device):
        notes.append("note: on this CPU the 4- and 8-bit kernels round activations to int8 per "
                     "group of 32 (AVX2/VNNI, as llama.cpp does), so even an exact import's "
                     "logits differ a little from float activations and top-1 agreement may be "
                     "under 100%")
    with reference_folder(reference, log) as folder:
        if folder.suffix.lower() == ".pth":
            if log:
                log(f"running the reference ({folder.name}) with the rwkv package, float32")
            ref = run_blink_reference(folder, ids, layers)
        else:
            if log:
                log(f"running the reference ({folder.name}) with transformers, float32")
            ref = run_reference(folder, ids, [(p.layer, p.name) for p in ours.probes], layers)
    split_fused(ref, ours)
    report = build_report(str(meta.get("name") or model_dir), str(reference),
                          str(meta["quantization"]), ours, ref, ops_layer)
    report.notes = notes + report.notes
    return report


def _rounds_activations(quantization: str, device: str) -> bool:
    """Whether the compiled 4- and 8-bit kernels of this CPU round activations to int8."""
    if quantization.startswith("q0"):
        return False
    from localchat.engine.device import select_device
    from localchat.engine.kernels.common import int8_activations

    chosen = select_device(device)
    return chosen.kind == "cpu" and int8_activations(chosen.target)


__all__ = ["DEBUG_PROMPT", "EXTRA", "DebugReport", "ForwardTrace", "MissingExtraError",
           "ProbeValue", "Row", "debug_model", "tolerance"]
