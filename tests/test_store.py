"""The model store: paths, atomic registration, listing, resolving, removal and locking."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import platformdirs
import pytest

from localchat.errors import LocalchatError, ModelNotFoundError, StoreError
from localchat.model_dir import CONFIG_FILE as MODEL_CONFIG
from localchat.model_dir import MANIFEST_FILE
from localchat.store import Store


def config(name: str, quant: str, **extra: object) -> str:
    """A complete localchat-config.json (an incomplete one is a damaged model)."""
    return json.dumps({"name": name, "quantization": quant, "architecture": "llama",
                       "model_config": {}, "context_window_size": 256,
                       "prefill_chunk_size": 256, "param_names": ["w"], **extra})


def add_model(store: Store, name: str, quant: str, targets: tuple[str, ...] = ()) -> Path:
    """Register a small model directory through the staging path."""
    with store.staging(name, quant) as tmp:
        (tmp / MODEL_CONFIG).write_text(config(name, quant))
        (tmp / "params_shard_0.bin").write_bytes(b"\0" * 1000)
        if targets:
            (tmp / "lib").mkdir()
            for t in targets:
                (tmp / "lib" / f"{t}.so").write_bytes(b"lib")
    return store.model_dir(name, quant)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "home")


def test_localchat_home_overrides_platform_dirs(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCALCHAT_HOME", raising=False)
    default = Store()
    assert default.data_dir == Path(platformdirs.user_data_dir("localchat", appauthor=False))
    assert default.cache_dir == Path(platformdirs.user_cache_dir("localchat", appauthor=False))
    monkeypatch.setenv("LOCALCHAT_HOME", str(tmp_path / "lc"))
    home = Store()
    assert home.models_dir == tmp_path / "lc" / "models"
    assert home.downloads_dir == tmp_path / "lc" / "cache" / "downloads"
    assert home.libs_dir == tmp_path / "lc" / "cache" / "libs"


def test_staging_commits_atomically_and_lists_the_model(store: Store) -> None:
    path = add_model(store, "smollm2-135m-instruct", "q4f16_1", targets=("cuda-sm_90",))
    [model] = store.models()
    assert (model.name, model.quantization, model.path) == ("smollm2-135m-instruct", "q4f16_1",
                                                            path)
    assert model.targets == ("cuda-sm_90",) and model.compiled
    assert model.size_bytes == 1000 + 3 + len((path / MODEL_CONFIG).read_bytes()) + len(
        (path / MANIFEST_FILE).read_bytes())
    assert model.ref == "smollm2-135m-instruct:q4f16_1"
    assert [p.name for p in path.parent.iterdir()] == ["q4f16_1"]  # no staging left


def test_failed_staging_leaves_nothing(store: Store) -> None:
    with pytest.raises(RuntimeError), store.staging("m", "q4f32_1") as tmp:
        (tmp / MODEL_CONFIG).write_text("{}")
        raise RuntimeError("conversion failed")
    with pytest.raises(StoreError, match="no localchat-config.json"), \
            store.staging("m", "q4f32_1") as tmp:
        (tmp / "weights.bin").write_bytes(b"x")
    assert store.models() == []
    assert list((store.models_dir / "m").iterdir()) == []


def test_existing_model_is_only_replaced_when_asked(store: Store) -> None:
    add_model(store, "m", "q4f32_1")
    with pytest.raises(StoreError, match="already in the store"), store.staging("m", "q4f32_1"):
        pass
    with store.staging("m", "q4f32_1", replace=True) as tmp:
        (tmp / MODEL_CONFIG).write_text(config("m", "q4f32_1", v=2))
    [model] = store.models()
    assert model.config["v"] == 2
    assert sorted(p.name for p in (store.models_dir / "m").iterdir()) == ["q4f32_1"]


def test_leftovers_of_a_killed_pull_are_never_listed_and_get_cleaned(store: Store) -> None:
    parent = store.models_dir / "m"
    stale = parent / ".staging-q4f32_1-abc123"
    stale.mkdir(parents=True)
    (stale / MODEL_CONFIG).write_text(json.dumps({"name": "m", "quantization": "q4f32_1"}))
    converter_tmp = parent / "..staging-q4f32_1-abc123.tmp-xyz"
    converter_tmp.mkdir()
    assert store.models() == []
    add_model(store, "m", "q4f32_1")
    assert not stale.exists() and not converter_tmp.exists()
    assert [m.ref for m in store.models()] == ["m:q4f32_1"]


def test_resolve_by_name_ref_path_and_default(store: Store, tmp_path: Path) -> None:
    q4 = add_model(store, "org/model", "q4f16_1")
    q0 = add_model(store, "org/model", "q0f32")
    solo = add_model(store, "solo", "q4f32_1")
    assert q4.parent.name == "org--model"
    assert store.resolve("solo") == solo
    assert store.resolve("org/model:q0f32") == q0
    assert store.resolve("org/model", quantization="q4f16_1") == q4
    assert store.resolve(str(solo)) == solo
    # a bare name is its default quantization: the first pulled, until set otherwise
    assert store.default_quantization("org/model") == "q4f16_1"
    assert store.resolve("org/model") == q4
    store.set_default("org/model", "q0f32")
    assert store.resolve("org/model") == q0
    assert [m.ref for m in store.find("org/model")] == ["org/model:q0f32"]
    assert len(store.find_all("org/model")) == 2
    with pytest.raises(ModelNotFoundError, match="Did you mean: solo"):
        store.resolve("sol")
    with pytest.raises(ModelNotFoundError, match="not a model directory"):
        store.resolve(str(tmp_path))


def test_not_found_hints_name_only_what_exists_or_can_be_pulled(store: Store) -> None:
    add_model(store, "solo", "q4f32_1")
    with pytest.raises(ModelNotFoundError) as typo:
        store.resolve("smollm2-135m-instruc")
    assert "Did you mean: smollm2-135m-instruct" in str(typo.value)
    assert "pull smollm2-135m-instruc`" not in str(typo.value)
    assert "localchat list --available" in str(typo.value)
    with pytest.raises(ModelNotFoundError, match="Get it with `localchat pull smollm2-135m"):
        store.resolve("smollm2-135m-instruct")
    with pytest.raises(ModelNotFoundError, match="solo is stored as solo:q4f32_1"):
        store.resolve("solo:q0f32")


def test_default_moves_when_the_default_is_removed(store: Store) -> None:
    add_model(store, "a", "q4f16_1")
    add_model(store, "a", "q0f32")
    assert store.default_quantization("a") == "q4f16_1"
    store.remove("a")  # the bare name: only its default
    assert [m.ref for m in store.models()] == ["a:q0f32"]
    assert store.default_quantization("a") == "q0f32"
    add_model(store, "a", "q4f32_1")
    assert store.default_quantization("a") == "q0f32"


def test_display_ref_is_the_bare_name_for_the_default_only(store: Store) -> None:
    add_model(store, "org/model", "q4f16_1")
    add_model(store, "org/model", "q0f32")
    add_model(store, "b", "q4f32_1")
    stored = store.models()
    shown = [store.display_ref(m, stored) for m in stored]
    assert shown == ["b", "org/model:q0f32", "org/model"]
    assert shown == [store.display_ref(m) for m in stored]  # listing again gives the same
    store.set_default("org/model", "q0f32")
    assert [store.display_ref(m) for m in store.find_all("org/model")] == [
        "org/model", "org/model:q4f16_1"]


def test_remove_deletes_one_quantization_or_all(store: Store) -> None:
    add_model(store, "a", "q4f16_1")
    add_model(store, "a", "q0f32")
    add_model(store, "b", "q4f32_1")
    removed = store.remove("a:q0f32")
    assert [m.ref for m in removed] == ["a:q0f32"]
    assert [m.ref for m in store.models()] == ["a:q4f16_1", "b:q4f32_1"]
    add_model(store, "a", "q0f32")
    removed = store.remove("a", every_quantization=True)
    assert sorted(m.ref for m in removed) == ["a:q0f32", "a:q4f16_1"]
    assert [m.ref for m in store.models()] == ["b:q4f32_1"]
    assert not (store.models_dir / "a").exists()
    with pytest.raises(ModelNotFoundError):
        store.remove("a")


def test_add_library_to_a_stored_model(store: Store, tmp_path: Path) -> None:
    add_model(store, "m", "q4f32_1")
    lib = tmp_path / "built.so"
    lib.write_bytes(b"native")
    dest = store.add_library("m", "q4f32_1", "llvm-znver5", lib)
    assert dest.read_bytes() == b"native"
    assert store.models()[0].targets == ("llvm-znver5",)
    with pytest.raises(ModelNotFoundError):
        store.add_library("other", "q4f32_1", "llvm", lib)


def test_corrupt_config_is_listed_as_damaged_and_can_be_removed(store: Store) -> None:
    path = add_model(store, "m", "q4f32_1")
    (path / MODEL_CONFIG).write_text("{not json")
    [model] = store.models()
    assert model.ref == "m:q4f32_1" and model.damaged
    assert "localchat-config.json" in model.damage_message()
    assert "localchat pull m --quant q4f32_1" in model.damage_message()
    with pytest.raises(LocalchatError, match="is damaged: localchat-config.json"):
        store.resolve("m")
    assert [m.ref for m in store.remove("m")] == ["m:q4f32_1"] and store.models() == []


def test_invalid_names_are_refused(store: Store) -> None:
    for bad in ("", "..", ".hidden", "a\\b", "a:b"):
        with pytest.raises(StoreError):
            store.model_dir(bad, "q4f32_1")


HOLD_LOCK = """
import sys, time
from localchat.store import Store
with Store(sys.argv[1]).lock("m", "q4f32_1"):
    print("locked", flush=True)
    time.sleep(60)
"""


def test_lock_excludes_other_processes_and_dies_with_its_holder(store: Store) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(store.data_dir)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        start = time.monotonic()
        with pytest.raises(StoreError, match="being pulled or removed by another"), \
                store.lock("m", "q4f32_1", timeout=0.3):
            pass
        assert time.monotonic() - start >= 0.3
    finally:
        holder.send_signal(signal.SIGKILL)  # kill -9: the kernel drops its lock
        holder.wait()
    with store.lock("m", "q4f32_1", timeout=5):
        with store.lock("m", "q4f32_1", timeout=0):  # re-entrant within one thread
            pass
