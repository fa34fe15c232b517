"""`localchat debug`: a debug build's per-layer and per-operation values against transformers on
the same weights. Tiny random models: against their own source nothing diverges at q0f32; against
a copy with one weight changed, the report names that layer (and, with --ops, that operation);
4-bit models err more but stay within their tolerance; every architecture of the registry has a
debug build whose operations all find their reference module."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from localchat.cli import main
from localchat.engine.debug import debug_model, tolerance

import llama_variants
import rwkv_variants
from fixtures import converted, rwkv_package_dir

TOKENS = list(range(3, 40, 2))  # 19 tokens; the tiny models have no tokenizer


def altered_copy(src: Path, dest: Path, tensor: str, factor: float) -> Path:
    """A copy of the HF folder `src` with one tensor multiplied by `factor`."""
    shutil.copytree(src, dest)
    weights = load_file(dest / "model.safetensors")
    weights[tensor] = weights[tensor] * np.float32(factor)
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="module")
def llama_src() -> Path:
    return llama_variants.build_variant("llama-gqa")


@pytest.fixture(scope="module")
def rwkv_src() -> Path:
    return rwkv_variants.build_variant("rwkv4")


def test_llama_against_its_source_has_no_divergent_layer(llama_src: Path) -> None:
    report = debug_model(converted(llama_src, "q0f32"), llama_src, token_ids=TOKENS)
    assert report.first_divergent_layer is None
    assert [row.layer for row in report.layers] == [0, 1]
    for row in report.layers:
        assert row.rel_err < 1e-5 and row.cosine > 0.99999 and not row.nonfinite
    assert report.logits.rel_err < 1e-5
    assert report.top1_agreement == 1.0 and report.top5_agreement == 1.0
    assert "no layer diverges" in report.render()


def test_a_scaled_mlp_weight_names_its_layer(llama_src: Path, tmp_path: Path) -> None:
    ref = altered_copy(llama_src, tmp_path / "ref", "model.layers.1.mlp.down_proj.weight", 2.0)
    report = debug_model(converted(llama_src, "q0f32"), ref, token_ids=TOKENS)
    assert report.first_divergent_layer == 1
    assert report.layers[0].rel_err < 1e-5 and report.layers[1].rel_err > 1e-2
    assert "first divergent layer: 1" in report.render()


def test_ops_name_an_altered_norm(llama_src: Path, tmp_path: Path) -> None:
    ref = altered_copy(llama_src, tmp_path / "ref",
                       "model.layers.0.post_attention_layernorm.weight", 1.5)
    report = debug_model(converted(llama_src, "q0f32"), ref, token_ids=TOKENS, ops_layer=0)
    assert report.first_divergent_layer == 0
    assert report.first_divergent_op == "post_attention_layernorm"
    names = [row.name for row in report.ops]
    before = names[:names.index("post_attention_layernorm")]
    assert {"input_layernorm", "self_attn.q_proj", "self_attn.o_proj"} <= set(before)
    assert all(row.rel_err < 1e-5 for row in report.ops if row.name in before)


def test_a_4bit_model_errs_more_within_its_tolerance(llama_src: Path) -> None:
    exact = debug_model(converted(llama_src, "q0f32"), llama_src, token_ids=TOKENS)
    q4 = debug_model(converted(llama_src, "q4f32_1"), llama_src, token_ids=TOKENS)
    assert q4.tolerance == tolerance("q4f32_1")[0] > exact.tolerance
    assert q4.first_divergent_layer is None
    for a, b in zip(exact.layers, q4.layers):
        assert b.rel_err > 100 * a.rel_err
    assert q4.layers[-1].rel_err >= q4.layers[0].rel_err  # errors add up through the layers
    assert "4-bit" in q4.render()
    # the int8 rounding of activations is named where this CPU's kernels do it, never for q0
    from localchat.engine.device import cpu_target
    from localchat.engine.kernels.common import int8_activations

    assert ("round activations to int8" in q4.render()) == int8_activations(cpu_target())
    assert "round activations to int8" not in exact.render()


def test_rwkv_layers_and_states_against_its_source(rwkv_src: Path, tmp_path: Path) -> None:
    model = converted(rwkv_src, "q0f32")
    report = debug_model(model, rwkv_src, token_ids=TOKENS, ops_layer=1)
    assert report.first_divergent_layer is None
    for row in report.layers:
        assert row.rel_err < 1e-5 and row.state_rel_err is not None and row.state_rel_err < 1e-5
    ops = {row.name for row in report.ops}
    assert {"ln1", "attention.key", "state.att_num", "feed_forward.value", "output"} <= ops
    assert all(row.rel_err is not None for row in report.ops)

    ref = altered_copy(rwkv_src, tmp_path / "ref", "rwkv.blocks.2.feed_forward.value.weight", 2.0)
    assert debug_model(model, ref, token_ids=TOKENS).first_divergent_layer == 2


def test_rwkv_against_the_blink_pth_compares_states(rwkv_src: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(rwkv_package_dir()))  # the `rwkv` package's reference
    report = debug_model(converted(rwkv_src, "q0f32"), rwkv_src / "blink" / "model.pth",
                         token_ids=TOKENS)
    assert report.first_divergent_layer is None and report.top1_agreement == 1.0
    assert report.logits.rel_err < 1e-5
    for row in report.layers:  # no block outputs from that reference: each layer's state
        assert row.rel_err is None and row.state_rel_err < 1e-5


# every block option of the registry's architectures (Llama and RWKV-4 have their own tests)
@pytest.mark.parametrize("variant", ["qwen3-odd", "gemma2-odd", "gemma3-odd", "olmo2-odd",
                                     "smollm3-odd", "phi3-odd"])
def test_every_architecture_has_a_debug_build(variant: str) -> None:
    src = llama_variants.build_variant(variant)
    report = debug_model(converted(src, "q0f32"), src, token_ids=TOKENS, ops_layer=0)
    assert report.first_divergent_layer is None and not report.nonfinite
    # each operation finds the reference module it names ("rotary" has none: no HF module)
    assert [row.name for row in report.ops if row.rel_err is None] in ([], ["rotary"])
    assert report.first_divergent_op is None


def test_gpt_oss_debug_build_meets_its_reference() -> None:
    """gpt-oss (sinks, windows, biased experts): no layer or operation of the debug build
    diverges from transformers, each operation found in the reference's modules."""
    import moe_variants

    src = moe_variants.build_variant("gpt-oss")
    report = debug_model(converted(src, "q0f32"), src, token_ids=TOKENS, ops_layer=0)
    assert report.first_divergent_layer is None and not report.nonfinite
    assert all(row.rel_err is not None and row.rel_err < 1e-4 for row in report.ops)
    assert report.first_divergent_op is None


def test_cli_json_and_errors(llama_src: Path, capsys, tmp_path: Path) -> None:
    model = str(converted(llama_src, "q0f32"))
    ids = ",".join(map(str, TOKENS[:6]))
    assert main(["debug", model, "--reference", str(llama_src), "--token-ids", ids,
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["first_divergent_layer"] is None and data["tokens"] == 6
    assert [row["layer"] for row in data["layers"]] == [0, 1]
    assert {"max_abs_err", "rel_err", "cosine"} <= set(data["layers"][0])

    # without --reference: the source the model was converted from, still on disk
    assert main(["debug", model, "--token-ids", ids, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["reference"] == str(llama_src)

    assert main(["debug", model, "--reference", str(tmp_path / "nowhere"),
                 "--token-ids", ids]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["debug", model, "--reference", str(llama_src), "--token-ids", "1,x"]) == 1
    assert "--token-ids" in capsys.readouterr().err
    assert main(["debug", model, "--reference", str(llama_src), "--token-ids", ids,
                 "--ops", "7"]) == 1
    assert "layers 0 to 1" in capsys.readouterr().err


def test_without_the_extra_one_line_names_it(llama_src: Path) -> None:
    code = ("import sys; sys.modules['torch'] = None; from localchat.cli import main; "
            f"sys.exit(main(['debug', {str(converted(llama_src, 'q0f32'))!r}, "
            f"'--reference', {str(llama_src)!r}, '--token-ids', '1,2']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "pip install 'localchat-tvm[debug]'" in done.stderr
