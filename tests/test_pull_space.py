"""The disk space a pull asks for: a GGUF import is estimated from the tensor table, not from
the file size (an F16 1B GGUF once asked for 11.1 GB where 2.7 GB was used)."""

from __future__ import annotations

from localchat.downloader.pull import _estimate_model_bytes, gguf_parameters

from fixtures import smollm2_gguf


def test_gguf_weights_are_counted_from_the_tensor_table() -> None:
    path = smollm2_gguf()
    params = gguf_parameters(path)
    # SmolLM2-135M: 134.5 M weights, in a 4-bit file of ~98 MB (size-based guesses are off)
    assert 130e6 < params < 140e6
    assert abs(params - path.stat().st_size * 2) > 40e6


def test_estimates_follow_the_target_precision() -> None:
    params = 1_235_814_400  # a 1B-shape Llama
    as_16bit = params * 2
    f16 = _estimate_model_bytes(as_16bit, "q0f16")
    q4 = _estimate_model_bytes(as_16bit, "q4f16_1")
    assert 2.4e9 < f16 < 2.8e9  # about what the F16 model really uses, not 11 GB
    assert 0.6e9 < q4 < 0.8e9
    assert _estimate_model_bytes(as_16bit, "q0f32") > 1.9 * f16


def test_the_exact_mode_reason_names_the_llama_cpp_type_and_what_is_not_exact() -> None:
    from localchat.downloader.pull import _exact_reason

    assert "Q4_1 weights exactly" in _exact_reason("q4f32_asym")
    assert "Q4_0 weights exactly" in _exact_reason("q4f32_0")
    assert "Q4_K and Q6_K weights exactly" in _exact_reason("q4f32_k")
    assert "Q8_0 weights exactly" in _exact_reason("q8f32_0")
    assert "MXFP4 experts" in _exact_reason("q4f32_mx")
