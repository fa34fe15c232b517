"""`localchat pull` of RWKV-7 World recipes: the one BlinkDL `.pth` a recipe's `source.file`
names is fetched from a repo holding every size (the others never downloaded), resumed and
sha256-checked as any pull, made a converter folder by `prepare_pth_source` (version from the
tensor names, World vocabulary and template), converted, compiled and run.

The loopback hub (`hub_server.py`, the real huggingface_hub client) hosts a tiny random RWKV-7
World checkpoint (`rwkv7_variants.py`, bfloat16 as published) under the real recipe's repo id
and file name, beside large decoy checkpoints. Also: the catalogue's order (RWKV-7 before
RWKV-4) in `localchat list --available` and the TUI's models view.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest
from test_pull_e2e import error_line, home, localchat, ok  # noqa: F401 - `home` is a fixture

from localchat.downloader import pull
from localchat.downloader.hub import HubClient
from localchat.downloader.pull import engine_hooks, parse_source
from localchat.errors import (
    IntegrityError,
    ModelConfigError,
    RemoteNotFoundError,
    UnknownRecipeError,
)
from localchat.recipes import all_recipes, catalogue, packaged_recipe_dir, resolve_recipe
from localchat.store import Store

from fixtures import rwkv_package_dir
from hub_server import HubServer
from rwkv7_variants import build_variant

NAME, REPO = "rwkv7-world-0.1b", "BlinkDL/rwkv-7-world"
FILE = resolve_recipe(NAME).file
SIBLINGS = sorted(r.file for r in all_recipes().values() if r.repo == REPO and r.name != NAME)
DECOY_BYTES = 12 * 1024 * 1024  # each: a pull of the 0.1B that took one would be plain


def blinkdl_repo() -> dict[str, bytes]:
    """BlinkDL's RWKV-7 World repo: the tiny model under the 0.1B's file name, every other size
    beside it (as large decoys), and the repo's own files."""
    files = {FILE: (build_variant("rwkv7-world") / "model.pth").read_bytes()}
    for i, name in enumerate(SIBLINGS):
        files[name] = bytes([i + 1]) * DECOY_BYTES
    files["README.md"] = b"# RWKV-7 World\n"
    files[".gitattributes"] = b"*.pth filter=lfs diff=lfs merge=lfs -text\n"
    return files


@pytest.fixture(scope="module")
def hub() -> Iterator[HubServer]:
    with HubServer() as server:
        server.add_repo(REPO, blinkdl_repo())
        yield server


def vocab_env() -> dict[str, str]:
    """The World vocabulary from the `rwkv` package (as a user with it installed gets it): no
    vocabulary is published beside BlinkDL's checkpoints, and PyPI is off in these tests."""
    return {"PYTHONPATH": str(rwkv_package_dir())}


def test_pull_takes_only_the_recipes_pth_resumes_it_and_the_model_runs(
        hub: HubServer, home: Path) -> None:  # noqa: F811 - the fixture
    assert FILE == "RWKV-x070-World-0.1B-v2.8-20241210-ctx4096.pth" and len(SIBLINGS) == 3
    size = len(hub.file(REPO, FILE).data)
    hub.reset_counters()
    hub.drop_file(REPO, FILE, at=size // 2)  # the connection breaks half way: resumed
    pulled = ok(localchat(home, hub, "pull", NAME, extra_env=vocab_env()))
    assert pulled.stdout.startswith(f"pulled {NAME}:q4f32_1: ") and "for cpu" in pulled.stdout
    assert f"1 file of {REPO}: {FILE}" in pulled.stderr

    # only the one checkpoint came down, every byte of it once; the rest by an HTTP Range
    assert hub.served_by_file(REPO) == {FILE: size}
    gets = [r for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]
    assert gets and all(unquote(r.path).endswith("/" + FILE) for r in gets)
    ranged = [r.range for r in gets if r.range]
    assert len(ranged) == 1 and ranged[0].startswith("bytes=") and ranged[0] != "bytes=0-"
    assert int(ranged[0][len("bytes="):].rstrip("-")) > 0

    downloads = Store(home).downloads_dir
    assert not list(downloads.rglob("*.pth*")), "the download was kept"
    assert not list(downloads.glob(".pth-import-*")), "the prepared folder was kept"

    shown = json.loads(ok(localchat(home, hub, "show", NAME, "--json")).stdout)
    config = shown["config"]
    assert config["architecture"] == "rwkv7" and config["template"] == "rwkv_world"
    assert (shown["source"]["repo"], shown["source"]["file"]) == (REPO, FILE)
    assert "rwkv_vocab_v20230424.txt" in {f["path"] for f in shown["files"]}
    assert not any(f["path"].endswith(".pth") for f in shown["files"])
    [row] = json.loads(ok(localchat(home, hub, "list", "--json")).stdout)
    assert (row["name"], row["architecture"], row["compiled"]) == (NAME, "rwkv7", "yes")

    # the World tokenizer and template end to end: a chat turn and a raw continuation
    chat = ok(localchat(home, hub, "run", NAME, "hello world", "--json", "--max-tokens", "4"))
    reply = json.loads(chat.stdout.strip().splitlines()[-1])
    assert 1 <= len(reply["token_ids"]) <= 4
    raw = ok(localchat(home, hub, "run", NAME, "the quick", "--raw", "--json",
                       "--max-tokens", "4"))
    assert 1 <= len(json.loads(raw.stdout.strip().splitlines()[-1])["token_ids"]) <= 4

    again = ok(localchat(home, hub, "pull", NAME, extra_env=vocab_env()))
    assert "already pulled" in again.stdout and hub.served_by_file(REPO) == {FILE: size}


def test_the_bare_repo_id_names_several_models(hub: HubServer, home: Path) -> None:  # noqa: F811
    names = sorted(r.name for r in all_recipes().values() if r.repo == REPO)
    with pytest.raises(UnknownRecipeError) as err:
        parse_source(REPO)
    assert err.value.suggestions == names and "pull one by name" in str(err.value)
    with pytest.raises(UnknownRecipeError):
        resolve_recipe(REPO.upper())
    assert all(n in error_line(localchat(home, hub, "pull", REPO)) for n in names)
    assert hub.bytes_served(REPO) == 0 or hub.served_by_file(REPO).keys() <= {FILE}


# failures, in process: a recipe folder whose 0.1B points at repos made for each case --------
def recipe_dir(tmp_path: Path, repo: str, file: str = FILE) -> Path:
    """A recipes folder with the packaged 0.1B recipe, its source moved to `repo` / `file`."""
    text = (packaged_recipe_dir() / f"{NAME}.toml").read_text()
    assert f'repo = "{REPO}"' in text and f'file = "{FILE}"' in text
    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / f"{NAME}.toml").write_text(
        text.replace(f'repo = "{REPO}"', f'repo = "{repo}"').replace(FILE, file))
    return folder


def pull_in_process(tmp_path: Path, hub: HubServer, recipes: Path) -> Store:
    store = Store(tmp_path / "home")
    client = HubClient(endpoint=hub.url, token=False, retries=1, retry_wait=0.01)
    pull(NAME, hooks=engine_hooks("cpu", store), store=store, hub=client, reserve_bytes=0,
         recipes_dir=recipes)
    return store


def assert_nothing_stored(tmp_path: Path) -> None:
    store = Store(tmp_path / "home")
    assert store.models() == []
    assert not list(store.downloads_dir.glob(".pth-import-*"))


def test_a_checkpoint_that_fails_its_sha256_is_discarded(hub: HubServer, tmp_path: Path) -> None:
    hub.add_repo("org/altered-rwkv7", {FILE: hub.file(REPO, FILE).data})
    hub.alter_file("org/altered-rwkv7", FILE, at=1000)
    with pytest.raises(IntegrityError, match=f"{FILE} .*does not match .*sha256"):
        pull_in_process(tmp_path, hub, recipe_dir(tmp_path, "org/altered-rwkv7"))
    assert_nothing_stored(tmp_path)
    assert not list(Store(tmp_path / "home").downloads_dir.rglob(f"{FILE}*"))


def test_a_file_the_repo_lacks_names_the_checkpoints_it_has(hub: HubServer,
                                                            tmp_path: Path) -> None:
    missing = "RWKV-x070-World-0.1B-v2.8-20990101-ctx4096.pth"
    with pytest.raises(RemoteNotFoundError) as err:
        pull_in_process(tmp_path, hub, recipe_dir(tmp_path, REPO, missing))
    message = str(err.value)
    assert f"has no file {missing}" in message and FILE in message and SIBLINGS[0] in message
    assert "README.md" not in message
    assert_nothing_stored(tmp_path)


def test_an_rwkv4_checkpoint_under_an_rwkv7_recipe_is_refused_before_converting(
        hub: HubServer, tmp_path: Path) -> None:
    from rwkv_variants import build_variant as build_rwkv4

    hub.add_repo("org/rwkv4-as-7", {FILE: (build_rwkv4("rwkv4") / "blink" / "model.pth")
                                    .read_bytes()})
    with pytest.raises(ModelConfigError, match="model_type 'rwkv' but the recipe .* 'rwkv7'"):
        pull_in_process(tmp_path, hub, recipe_dir(tmp_path, "org/rwkv4-as-7"))
    assert_nothing_stored(tmp_path)


# the catalogue ------------------------------------------------------------------------------
def rwkv_order(names: list[str]) -> list[str]:
    return [n for n in names if n.startswith("rwkv")]


def test_list_available_shows_rwkv7_before_rwkv4(hub: HubServer, home: Path) -> None:  # noqa: F811
    rows = json.loads(ok(localchat(home, hub, "list", "--available", "--json")).stdout)
    names = [r["name"] for r in rows]
    assert names == [r.name for r in catalogue()] and sorted(names) == sorted(all_recipes())
    rwkv = rwkv_order(names)
    assert rwkv[:5] == ["rwkv7-g1-1.5b", "rwkv7-world-2.9b", "rwkv7-world-1.5b",
                        "rwkv7-world-0.4b", "rwkv7-world-0.1b"]
    assert rwkv[5:8] == ["rwkv6-world-7b", "rwkv6-world-3b", "rwkv6-world-1.6b"]
    assert all(n.startswith("rwkv-world-") for n in rwkv[8:]) and len(rwkv) == 13
    assert rows[names.index(NAME)]["file"] == FILE
    text = ok(localchat(home, hub, "list", "--available")).stdout
    lines = [ln.split()[0] for ln in text.splitlines() if ln.strip()]
    assert lines == names


def test_the_tui_models_view_shows_rwkv7_before_rwkv4(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from textual.widgets import DataTable

    from localchat.tui.app import LocalchatApp
    from localchat.tui.backend import recipe_catalog
    from localchat.tui.screens.models import ModelsScreen, in_catalogue_order

    monkeypatch.setenv("LOCALCHAT_HOME", str(tmp_path / "home"))
    # whatever order a backend lists the catalog in, the view shows the catalogue's
    shuffled = sorted(recipe_catalog(), key=lambda c: c.name, reverse=True)
    assert [c.name for c in in_catalogue_order(shuffled)] == [r.name for r in catalogue()]

    async def shown() -> list[str]:
        app = LocalchatApp()
        async with app.run_test(size=(140, 60)) as pilot:
            screen = app.screen
            assert isinstance(screen, ModelsScreen)
            deadline = time.monotonic() + 30
            while not screen.loaded:
                assert time.monotonic() < deadline, "the model list did not load"
                await pilot.pause(0.05)
            table = screen.query_one(DataTable)
            return [str(table.get_row_at(i)[0]) for i in range(table.row_count)]

    names = asyncio.run(shown())
    assert names == [r.name for r in catalogue()]
    assert names.index("rwkv7-world-0.1b") < names.index("rwkv-world-169m")
