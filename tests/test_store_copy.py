"""`Store.copy`: a stored model under a second name (Ollama's `cp`), both listed and resolved."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from localchat import model_dir as md
from localchat.errors import ModelNotFoundError, StoreError
from localchat.store import Store


def add_model(store: Store, name: str, quant: str) -> Path:
    """Register a small, complete model directory (config, a weight file, a library)."""
    with store.staging(name, quant) as tmp:
        (tmp / md.CONFIG_FILE).write_text(json.dumps({
            "name": name, "quantization": quant, "architecture": "llama", "model_config": {},
            "context_window_size": 256, "prefill_chunk_size": 256, "param_names": ["w"]}))
        (tmp / "params_shard_0.bin").write_bytes(b"\1" * 1000)
        (tmp / "lib").mkdir()
        (tmp / "lib" / "cpu-0123456789abcdef.so").write_bytes(b"lib")
    return store.model_dir(name, quant)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "home")


def test_copy_lists_and_resolves_both_names(store: Store) -> None:
    source = add_model(store, "smollm2", "q4f32_1")
    copied = store.copy("smollm2", "my-model")
    assert (copied.name, copied.quantization) == ("my-model", "q4f32_1")
    assert [m.ref for m in store.models()] == ["my-model:q4f32_1", "smollm2:q4f32_1"]
    assert store.resolve("my-model") == copied.path != source
    assert not copied.damaged and not store.verify(copied).damaged
    assert md.read_config(copied.path)["name"] == "my-model"
    assert md.read_config(source)["name"] == "smollm2"  # the source's config is untouched
    assert copied.targets == ("cpu",)
    # the weights are shared (hard links), so a copy costs no disk space
    assert os.stat(copied.path / "params_shard_0.bin").st_ino == os.stat(
        source / "params_shard_0.bin").st_ino
    # removing either one leaves the other whole
    store.remove("smollm2")
    assert [m.ref for m in store.models()] == ["my-model:q4f32_1"]
    assert (copied.path / "params_shard_0.bin").read_bytes() == b"\1" * 1000
    assert not store.verify(store.models()[0]).damaged


def test_copy_keeps_the_quantization_and_refuses_what_it_cannot_do(store: Store) -> None:
    add_model(store, "smollm2", "q4f32_1")
    assert store.copy("smollm2:q4f32_1", "other:q4f32_1").ref == "other:q4f32_1"
    with pytest.raises(StoreError, match="already in the store"):
        store.copy("smollm2", "other")
    with pytest.raises(StoreError, match="keeps its quantization"):
        store.copy("smollm2", "third:q0f32")
    for bad in ("../x", ".hidden", "a:b:c\0"):
        with pytest.raises(StoreError):
            store.copy("smollm2", bad)
    with pytest.raises(ModelNotFoundError):
        store.copy("no-such-model", "x")
    with pytest.raises(ModelNotFoundError):
        store.copy("../etc", "x")
    assert [m.ref for m in store.models()] == ["other:q4f32_1", "smollm2:q4f32_1"]
    # nothing half-made is left behind by the refusals
    assert sorted(p.name for p in store.models_dir.iterdir()
                  if not p.name.startswith(".")) == ["other", "smollm2"]
    assert not list(store.models_dir.glob("*/.staging-*"))
