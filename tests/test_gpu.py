"""On a machine with a GPU the compiled library runs there and agrees with transformers.
Skipped where no GPU (or no TVM runtime for it) exists, as on CI."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from localchat.engine.device import backend_supported, device_present, select_device
from localchat.engine.runtime import Model

from fixtures import converted
from llama_variants import build_variant

GPU_KINDS = [k for k in ("cuda", "metal", "vulkan") if backend_supported(k) and device_present(k)]
pytestmark = pytest.mark.skipif(not GPU_KINDS, reason="no GPU device on this machine")


@pytest.mark.parametrize("quant", ["q0f16", "q4f16_1"])
def test_gpu_logits_follow_transformers(quant: str) -> None:
    from transformers import AutoModelForCausalLM

    src = build_variant("qwen2")
    prompt = [int(t) for t in np.random.RandomState(5).randint(0, 512, 20)]
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].numpy()
    model = Model(converted(src, quant), select_device(GPU_KINDS[0]))
    ours = model.prefill(model.new_sequence(), prompt)
    assert int(np.argmax(ours)) == int(np.argmax(ref))
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 0.1
