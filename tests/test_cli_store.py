"""The store verbs of the CLI in-process: list, rm, show, doctor, and pull's output and errors
(with stand-in engine steps, so nothing compiles); and the library names a pull installs."""

from __future__ import annotations

import importlib
import io
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from localchat.cli import main
from localchat.downloader.pull import EngineHooks, pull
from localchat.model_dir import CONFIG_FILE as MODEL_CONFIG
from localchat.prebuilt import PrebuiltIndex
from localchat.store import Store

from hub_server import HubServer, folder_files, tiny_llama_folder

pull_module = importlib.import_module("localchat.downloader.pull")  # the module, not pull()
TINY_CONFIG = {
    "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1024,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": {},
    "tie_word_embeddings": False, "qkv_bias": False, "o_bias": False,
    "context_window_size": 256, "prefill_chunk_size": 256,
}


@pytest.fixture(autouse=True)
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALCHAT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    for var in ("HF_TOKEN", "HF_HUB_OFFLINE", "LOCALCHAT_PREBUILT_INDEX"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "home")


def canonical_library(quant: str = "q4f32_1") -> str:
    """The file name the runtime loads for the tiny config on this machine's CPU."""
    from localchat.engine.build.compile import library_key, target_key
    from localchat.engine.build.quantization import get_quant_mode
    from localchat.engine.device import cpu_target
    from localchat.engine.models import get_architecture

    arch = get_architecture("llama")
    target = cpu_target()
    key = library_key(arch, arch.config_from_dict(TINY_CONFIG), get_quant_mode(quant), target)
    return f"{target_key(target)}-{key}.so"


def add_model(store: Store, name: str, quant: str, libs: tuple[str, ...] = (),
              **meta: Any) -> Path:
    with store.staging(name, quant) as tmp:
        config = {"format": 1, "name": name, "quantization": quant, "architecture": "llama",
                  "model_config": TINY_CONFIG, "context_window_size": 256,
                  "prefill_chunk_size": 256, "param_names": ["w"], **meta}
        (tmp / MODEL_CONFIG).write_text(json.dumps(config))
        (tmp / "params_shard_0.bin").write_bytes(b"\0" * 5000)
        (tmp / "tokenizer.json").write_text("{}")
        if libs:
            (tmp / "lib").mkdir()
            for lib in libs:
                (tmp / "lib" / lib).write_bytes(b"\x7fELF")
    return store.model_dir(name, quant)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("localchat: error:")]
    assert len(lines) == 1 and err.strip().splitlines()[-1] == lines[0], err
    return lines[0]


# -- list ------------------------------------------------------------------------------------
def test_list_of_an_empty_store_says_how_to_pull(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "list")
    assert code == 0 and "localchat pull" in out
    assert json.loads(run(capsys, "list", "--json")[1]) == []


def test_list_shows_quantization_device_size_and_whether_compiled(
        store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    current = canonical_library()
    target = current.rsplit("-", 1)[0]
    add_model(store, "alpha", "q4f32_1", libs=(current,), origin="hub")
    add_model(store, "beta", "q4f32_1", libs=(f"{target}-0123456789abcdef.so",))  # old build
    add_model(store, "gamma", "q0f32")
    add_model(store, "delta", "q4f32_1", libs=("cuda-sm_90-0123456789abcdef.so",))
    rows = {r["name"]: r for r in json.loads(run(capsys, "list", "--json")[1])}
    assert {n: r["compiled"] for n, r in rows.items()} == {
        "alpha": "yes", "beta": "stale", "gamma": "no", "delta": "no"}
    assert rows["alpha"]["targets"] == [target] and rows["delta"]["targets"] == ["cuda-sm_90"]
    assert rows["gamma"]["quantization"] == "q0f32" and rows["alpha"]["size_bytes"] > 5000
    code, out, _ = run(capsys, "list")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "QUANT", "ARCH", "DEVICE", "SIZE", "COMPILED"]
    alpha = next(ln for ln in lines if ln.startswith("alpha"))
    assert alpha.split()[:4] == ["alpha", "q4f32_1", "llama", target]
    assert alpha.rstrip().endswith("yes") and "KB" in alpha


def test_list_remembers_the_status_and_needs_no_tvm_while_nothing_changes(
        store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    """The second `list` of an unchanged store answers from the status cache: no TVM import
    (about a second); a changed model (a library added) is asked again."""
    import subprocess
    import sys

    current = canonical_library()
    add_model(store, "alpha", "q4f32_1", libs=(current,))
    beta = add_model(store, "beta", "q4f32_1")
    code = ("import sys, json\nfrom localchat.cli import main\nmain(['list', '--json'])\n"
            "print('TVM', 'tvm' in sys.modules)")
    env = {**__import__("os").environ, "LOCALCHAT_HOME": str(store.data_dir)}
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, timeout=120, check=True).stdout
    assert first.rstrip().endswith("TVM True")
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, timeout=120, check=True).stdout
    assert again.rstrip().endswith("TVM False")
    rows = {r["name"]: r["compiled"] for r in json.loads(again.rpartition("TVM")[0])}
    assert rows == {"alpha": "yes", "beta": "no"}
    (beta / "lib").mkdir()
    (beta / "lib" / current).write_bytes(b"\x7fELF")
    changed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, timeout=120, check=True).stdout
    assert {r["name"]: r["compiled"] for r in json.loads(changed.rpartition("TVM")[0])} == {
        "alpha": "yes", "beta": "yes"}


def test_list_available_names_the_recipes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "list", "--available")
    assert code == 0 and "smollm2-135m-instruct" in out and "rwkv-world-3b" in out


# -- rm --------------------------------------------------------------------------------------
def test_rm_asks_first_and_keeps_the_model_unless_confirmed(
        store: Store, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    add_model(store, "alpha", "q4f32_1")
    monkeypatch.setattr("sys.stdin", io.StringIO("n\n"))
    code, out, err = run(capsys, "rm", "alpha")
    assert code == 1 and "remove alpha:q4f32_1" in err and "nothing removed" in err
    assert len(store.models()) == 1
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # no answer (EOF) is a no
    assert run(capsys, "rm", "alpha")[0] == 1 and len(store.models()) == 1
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    code, out, _ = run(capsys, "rm", "alpha")
    assert code == 0 and out.startswith("removed alpha:q4f32_1") and store.models() == []


def test_rm_takes_the_default_the_one_named_or_all_with_all(
        store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    for quant in ("q4f32_1", "q0f32"):
        add_model(store, "alpha", quant)
    add_model(store, "beta", "q4f32_1")
    code, out, _ = run(capsys, "rm", "alpha:q0f32", "--yes")
    assert code == 0 and re.fullmatch(r"removed alpha:q0f32 \(\d\.\d KB freed\)", out.strip())
    add_model(store, "alpha", "q0f32")
    # a bare name is its default quantization (the first pulled), and says what it keeps
    code, out, err = run(capsys, "rm", "alpha", "--yes")
    assert code == 0 and out.startswith("removed alpha:q4f32_1") and len(out.splitlines()) == 1
    assert "keeping alpha:q0f32" in err and "--all" in err
    add_model(store, "alpha", "q4f32_1")
    code, out, err = run(capsys, "rm", "alpha", "--all", "--yes")
    assert code == 0 and len(out.strip().splitlines()) == 2
    assert "removing alpha:q0f32" in err and "alpha:q4f32_1" in err
    assert [m.ref for m in store.models()] == ["beta:q4f32_1"]


def test_rm_of_an_unknown_name_suggests_close_matches(
        store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    add_model(store, "smollm2-135m-instruct", "q4f32_1")
    code, _, err = run(capsys, "rm", "smollm2-135m", "--yes")
    assert code == 1 and "Did you mean: smollm2-135m-instruct" in one_error(err)
    assert len(store.models()) == 1


# -- show ------------------------------------------------------------------------------------
def test_show_gives_config_template_source_revision_and_files(
        store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    source = {"kind": "hub", "repo": "org/tiny", "revision": "main", "commit": "c0ffee" * 6,
              "endpoint": "http://hub"}
    path = add_model(store, "alpha", "q4f32_1", libs=(canonical_library(),), source=source,
                     template="chatml", origin="hub", display_name="Alpha Tiny")
    code, out, _ = run(capsys, "show", "alpha")
    assert code == 0
    fields = dict(re.split(r"\s{2,}", ln.strip(), maxsplit=1) for ln in out.splitlines()
                  if re.match(r"^\S.*\s{2,}\S", ln))
    assert fields["model"].startswith("alpha:q4f32_1") and "Alpha Tiny" in fields["model"]
    assert fields["source"] == f"hub org/tiny @ main (commit {'c0ffee' * 2})"
    assert fields["revision"] == "c0ffee" * 6
    assert fields["template"].startswith("chatml (built-in")
    assert fields["libraries"] == canonical_library()
    assert "hidden_size" in out and "params_shard_0.bin" in out
    shown = json.loads(run(capsys, "show", "alpha", "--json")[1])
    assert shown["source"] == source and shown["path"] == str(path)
    assert {f["path"] for f in shown["files"]} >= {MODEL_CONFIG, "tokenizer.json",
                                                   f"lib/{canonical_library()}"}
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>")
    code, out, _ = run(capsys, "show", "alpha", "--template")
    assert "model's own Jinja" in out and "<system>You are helpful.<user>Hi!<assistant>" in out


# -- doctor ----------------------------------------------------------------------------------
def test_doctor_reports_tvm_devices_store_and_hub(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    import tvm

    with HubServer() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        report = json.loads(run(capsys, "doctor", "--json")[1])
    assert report["tvm"] == tvm.__version__
    assert report["backends"]["cpu"] and report["devices"]["cpu"]
    assert report["auto_device"]["kind"] in ("cpu", "cuda", "metal", "vulkan")
    assert report["store"]["models"]["path"] == str(tmp_path / "home" / "models")
    assert report["store"]["models"]["free_bytes"] > 0
    assert report["hub"]["reachable"] and report["hub"]["endpoint"] == hub.url

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed}")
    start = time.monotonic()
    code, out, _ = run(capsys, "doctor")
    assert code == 0 and time.monotonic() - start < 30
    assert f"TVM        {tvm.__version__}" in out and "backends   cuda" in out
    assert "unreachable" in out and "offline source" in out


# -- pull ------------------------------------------------------------------------------------
def stand_in_hooks(calls: list[str]) -> EngineHooks:
    """Engine steps that copy files and write a stub library, recording what ran."""

    def convert(source: Path, output_dir: Path, quantization: str, **kwargs: Any) -> Path:
        calls.append("convert")
        config = {"format": 1, "architecture": "llama", "quantization": quantization,
                  "model_config": TINY_CONFIG, "context_window_size": 256,
                  "prefill_chunk_size": 256, "param_names": ["w"]}
        (Path(output_dir) / MODEL_CONFIG).write_text(json.dumps(config))
        return Path(output_dir)

    def compile_(model_dir: Path) -> Path:
        calls.append("compile")
        out = Path(model_dir).parent / ".cache" / "llvm-test-00000000000000aa.so"
        out.parent.mkdir(exist_ok=True)
        out.write_bytes(b"\x7fELF")
        return out

    return EngineHooks(convert=convert, compile=compile_, target_key="llvm-test",
                       device_kind="cpu", tvm_version="0.0", device_name="cpu",
                       library_name=lambda _d: "llvm-test-00000000000000aa")


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    with HubServer() as server:
        server.add_repo("org/tiny-llama", folder_files(tiny_llama_folder(tmp_path / "tiny")))
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


def test_pull_says_which_device_shows_progress_and_ends_with_one_summary_line(
        hub: HubServer, store: Store, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(pull_module, "engine_hooks", lambda *a, **k: stand_in_hooks(calls))
    monkeypatch.setattr(pull_module.PrebuiltIndex, "default", classmethod(
        lambda cls: PrebuiltIndex()))
    code, out, err = run(capsys, "pull", "org/tiny-llama")
    assert code == 0 and calls == ["convert", "compile"]
    assert re.fullmatch(r"pulled org/tiny-llama:q4f32_1: \S+ \w+ on disk, \S+ \w+ downloaded, "
                        r"[\d.]+ s, for cpu \(from hub\); q4f32_1: the default for CPUs "
                        r"\(`--quant` picks another\)\n", out), out
    assert "device: cpu (llvm-test) picked by --device auto" in err
    assert "model.safetensors" in err and "download (" in err  # a bar per file and overall
    assert "✓ convert to q4f32_1" in err and "✓ compile for llvm-test" in err
    [model] = store.models()
    assert model.libraries == ("llvm-test-00000000000000aa.so",)

    code, out, _ = run(capsys, "pull", "org/tiny-llama")
    assert code == 0 and "already pulled" in out and calls == ["convert", "compile"]


def test_pull_errors_are_one_line_before_any_work(
        hub: HubServer, store: Store, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_engine(*args: Any, **kwargs: Any) -> EngineHooks:
        raise AssertionError("the engine must not load for a bad name")

    monkeypatch.setattr(pull_module, "engine_hooks", no_engine)
    code, out, err = run(capsys, "pull", "smolm2-135m-instruct")
    assert code == 1 and out == ""
    assert "Did you mean: smollm2-135m-instruct" in one_error(err)
    assert "device:" not in err
    code, _, err = run(capsys, "pull", "./no-such-folder")
    assert code == 1 and "not an HF model folder" in one_error(err)
    assert store.models() == [] and hub.requests == []


def test_pull_with_an_unknown_quantization_fails_before_downloading(
        hub: HubServer, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "pull", "org/tiny-llama", "--quant", "q3f99")
    assert code == 1 and "q3f99" in one_error(err) and hub.requests == []


# -- library names ---------------------------------------------------------------------------
def test_engine_hooks_install_the_library_under_the_name_the_runtime_loads(
        store: Store, tmp_path: Path) -> None:
    model_dir = add_model(store, "alpha", "q4f32_1")
    hooks = pull_module.engine_hooks("cpu", store)
    assert f"{hooks.library_stem(model_dir)}.so" == canonical_library()
    assert hooks.target_key == canonical_library().rsplit("-", 1)[0]


def test_pull_again_replaces_a_stale_library_of_the_same_target(
        hub: HubServer, store: Store) -> None:
    calls: list[str] = []
    hooks = stand_in_hooks(calls)
    model = pull("org/tiny-llama", hooks=hooks, store=store, prebuilt_index=PrebuiltIndex())
    lib = model.path / "lib"
    (lib / "llvm-test-00000000000000aa.so").rename(lib / "llvm-test-00000000000000bb.so")
    (lib / "cuda-sm_90-00000000000000cc.so").write_bytes(b"\x7fELF")  # another device's
    again = pull("org/tiny-llama", hooks=hooks, store=store, prebuilt_index=PrebuiltIndex())
    assert again.origin == "compiled" and calls == ["convert", "compile", "compile"]
    assert sorted(p.name for p in lib.iterdir()) == ["cuda-sm_90-00000000000000cc.so",
                                                     "llvm-test-00000000000000aa.so"]
    assert again.targets == ("cuda-sm_90", "llvm-test")
