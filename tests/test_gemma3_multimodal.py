"""Gemma 3's multimodal checkpoints (`Gemma3ForConditionalGeneration`, gemma-3-4b-it and up):
convert takes the language model out (its `text_config`, its tensors in either layout
transformers has saved) and leaves the vision tower; the text-only greedy tokens equal
transformers' multimodal model on the same weights."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from functools import cache
from pathlib import Path

import numpy as np
import torch

from fixtures import _engine_digest, cache_dir, one_builder_at_a_time
from model_oracle import rel_err, run_greedy, run_teacher_forced

TEXT = {  # gemma3-odd's text model: odd shapes, a window shorter than prompt + reply
    "vocab_size": 1001,
    "hidden_size": 72,
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 3,
    "num_key_value_heads": 1,
    "head_dim": 48,
    "query_pre_attn_scalar": 40,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
    },
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
}
# more layers than the text model: the vision tower's must not count as the model's
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
          "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
PROMPT = [int(t) for t in np.random.RandomState(11).randint(3, 999, 20)]
STEPS = 10
# (language model prefix, vision prefix) of the checkpoint layouts: the published one, which
# transformers 5 saves, and the one some transformers 4.x releases save
LAYOUTS = {"published": ("language_model.model.", "vision_tower."),
           "nested": ("model.language_model.", "model.vision_tower.")}


@cache
@one_builder_at_a_time
def source() -> Path:
    """A tiny random Gemma3ForConditionalGeneration, its norms moved off their initial 0."""
    import transformers

    digest = hashlib.sha256(json.dumps([TEXT, VISION, transformers.__version__],
                                       sort_keys=True).encode()).hexdigest()[:10]
    out = cache_dir() / "variants" / f"gemma3-multimodal-{digest}"
    if (out / "config.json").exists():
        return out
    config = transformers.Gemma3Config(text_config=TEXT, vision_config=VISION,
                                       mm_tokens_per_image=4)
    torch.manual_seed(4321)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".gemma3-multimodal-"))
    model.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


@one_builder_at_a_time
def relayout(layout: str) -> Path:
    """The checkpoint with its tensors renamed to `layout` (the same values)."""
    from safetensors.numpy import load_file, save_file

    src = source()
    body, vision = LAYOUTS[layout]
    tensors = load_file(src / "model.safetensors")
    names = {n: n for n in tensors}
    found = [n for n in tensors if n.startswith("language_model.model.")]
    assert found, "transformers saved another layout: update LAYOUTS"
    for n in tensors:
        if n.startswith("language_model.model."):
            names[n] = body + n[len("language_model.model."):]
        elif n.startswith("vision_tower."):
            names[n] = vision + n[len("vision_tower."):]
    out = cache_dir() / "variants" / f"{src.name}-{layout}"
    if not (out / "config.json").exists():
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
        save_file({names[n]: v for n, v in tensors.items()}, str(tmp / "model.safetensors"))
        shutil.copy2(src / "config.json", tmp / "config.json")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    return out


@cache
@one_builder_at_a_time
def converted_layout(layout: str) -> Path:
    from localchat.engine.build.convert import convert_model

    src = relayout(layout)
    out = cache_dir() / "converted" / f"{src.name}-q0f32-{_engine_digest()}"
    if not (out / "localchat-config.json").exists():
        convert_model(src, out, "q0f32")
    return out


@cache
def reference() -> tuple[list[int], list[np.ndarray]]:
    """transformers' multimodal model, text-only prompt: greedy tokens and their logits."""
    from transformers import Gemma3ForConditionalGeneration

    hf = Gemma3ForConditionalGeneration.from_pretrained(
        source(), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=STEPS, min_new_tokens=STEPS,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(PROMPT):].tolist(), [lg[0].numpy() for lg in out.logits]


def test_language_model_of_a_multimodal_checkpoint_matches_transformers() -> None:
    from localchat import model_dir as md
    from localchat.engine.runtime import Model

    ref_tokens, ref_logits = reference()
    for layout in LAYOUTS:
        out = converted_layout(layout)
        meta = md.load_config(out)
        assert meta["architecture"] == "gemma3"
        assert meta["eos_token_ids"] == [1]  # from text_config
        assert not any("vision" in n or "multi_modal" in n for n in meta["param_names"])
        model = Model(out, "cpu")  # the second layout reuses the first's compiled library
        got = run_teacher_forced(model, PROMPT, ref_tokens)
        worst = max(rel_err(o, r) for o, r in zip(got, ref_logits))
        assert worst <= 1e-4, f"{layout}: max relative error {worst:.2e}"
        assert run_greedy(model, PROMPT, STEPS) == ref_tokens, layout
