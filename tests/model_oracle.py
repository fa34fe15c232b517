"""Helpers shared by the oracle tests: our logits under teacher forcing, and how far apart."""

from __future__ import annotations

import numpy as np

from localchat.engine.runtime import Model


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """Largest absolute difference relative to the largest magnitude of the reference `b`."""
    return float(np.abs(a - b).max() / np.abs(b).max())


def run_teacher_forced(model: Model, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
    """Our logits before each of `tokens`, feeding the reference tokens (teacher forcing)."""
    seq = model.new_sequence()
    try:
        logits = [model.prefill(seq, prompt)]
        for tok in tokens[:-1]:
            logits.append(model.decode([seq], [tok])[0])
        return logits
    finally:
        model.remove(seq)


def run_greedy(model: Model, prompt: list[int], steps: int) -> list[int]:
    """Our greedy continuation of `prompt`, `steps` tokens."""
    seq = model.new_sequence()
    try:
        tok = int(np.argmax(model.prefill(seq, prompt)))
        out = [tok]
        for _ in range(steps - 1):
            tok = int(np.argmax(model.decode([seq], [tok])[0]))
            out.append(tok)
        return out
    finally:
        model.remove(seq)


def batched_and_alone(model: Model, prompts: list[list[int]],
                      steps: int = 6) -> list[tuple[list[np.ndarray], list[np.ndarray]]]:
    """Per prompt, the logits of a greedy run batched with the others (one batch_prefill, then
    batched decodes) and of the same run alone."""

    def alone(prompt: list[int]) -> list[np.ndarray]:
        seq = model.new_sequence()
        logits = [model.prefill(seq, prompt)]
        for _ in range(steps):
            logits.append(model.decode([seq], [int(np.argmax(logits[-1]))])[0])
        model.remove(seq)
        return logits

    seqs = [model.new_sequence() for _ in prompts]
    first = model.batch_prefill(seqs, prompts)
    together = [[row] for row in first]
    for _ in range(steps):
        logits = model.decode(seqs, [int(np.argmax(t[-1])) for t in together])
        for t, row in zip(together, logits):
            t.append(row)
    for seq in seqs:
        model.remove(seq)
    return list(zip(together, [alone(p) for p in prompts]))


def cuda_sources(hf_folder, quant: str = "q4f16_1") -> list[str]:
    """The CUDA source of the model in `hf_folder` built for sm_80 through localchat's own GPU
    pipeline (`compile.relax_pipeline`), without linking a library: what the GPU-path tests
    read when no GPU is lent."""
    import tvm

    from localchat.engine.build.compile import export_module, relax_pipeline
    from localchat.engine.build.convert import read_hf_config
    from localchat.engine.build.quantization import get_quant_mode
    from localchat.engine.device import cuda_target
    from localchat.engine.models import detect_architecture

    hf = read_hf_config(hf_folder)
    arch = detect_architecture(hf)
    target = cuda_target("sm_80")
    mod, _ = export_module(arch, arch.config_from_hf(hf), get_quant_mode(quant), target)
    ex = tvm.compile(mod, target=target, relax_pipeline=relax_pipeline(target))

    def modules(m):
        yield m
        for child in m.imports:
            yield from modules(child)

    return [m.inspect_source() for m in modules(ex.mod) if m.kind == "cuda"]
