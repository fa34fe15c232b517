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
