"""The loopback hub against huggingface_hub's own download functions: it is hub-compatible."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import (
    HfApi,
    get_hf_file_metadata,
    hf_hub_download,
    hf_hub_url,
    snapshot_download,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from hub_server import HubServer, git_blob_sha1

WEIGHTS = os.urandom(300_000)
FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": WEIGHTS,
         "sub/notes.txt": b"hello"}


@pytest.fixture
def hub() -> Iterator[HubServer]:
    with HubServer() as server:
        server.add_repo("org/repo", FILES)
        yield server


def test_snapshot_download_reproduces_the_repo(hub: HubServer, tmp_path: Path) -> None:
    out = Path(snapshot_download("org/repo", local_dir=tmp_path / "snap", endpoint=hub.url,
                                 token=False))
    for name, data in FILES.items():
        assert (out / name).read_bytes() == data
    methods = {r.method for r in hub.requests}
    assert methods == {"GET", "HEAD"}


def test_model_info_publishes_sizes_lfs_sha256_and_blob_ids(hub: HubServer) -> None:
    info = HfApi(endpoint=hub.url).model_info("org/repo", files_metadata=True, token=False)
    siblings = {s.rfilename: s for s in info.siblings or []}
    weights = siblings["model.safetensors"]
    assert weights.lfs is not None and weights.lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest()
    assert weights.size == len(WEIGHTS)
    assert siblings["config.json"].lfs is None
    assert siblings["config.json"].blob_id == git_blob_sha1(FILES["config.json"])
    tree = {f.path for f in HfApi(endpoint=hub.url).list_repo_tree(
        "org/repo", recursive=True, token=False)}
    assert tree == {"config.json", "model.safetensors", "sub", "sub/notes.txt"}


def test_head_metadata_follows_the_lfs_redirect(hub: HubServer) -> None:
    url = hf_hub_url("org/repo", "model.safetensors", endpoint=hub.url)
    meta = get_hf_file_metadata(url, token=False)
    assert meta.etag == hashlib.sha256(WEIGHTS).hexdigest()
    assert meta.size == len(WEIGHTS) and meta.commit_hash is not None
    assert [r.status for r in hub.requests] == [302, 200]


def test_client_retries_a_dropped_transfer(hub: HubServer, tmp_path: Path) -> None:
    hub.drop_file("org/repo", "model.safetensors", at=100_000)
    path = hf_hub_download("org/repo", "model.safetensors", cache_dir=tmp_path,
                           endpoint=hub.url, token=False)
    assert Path(path).read_bytes() == WEIGHTS
    gets = [r for r in hub.requests if r.method == "GET" and r.path.startswith("/_blobs/")]
    assert len(gets) == 2  # cut at byte 100000, then fetched again


def test_huggingface_hub_does_not_check_sha256_of_an_altered_file(hub: HubServer,
                                                                   tmp_path: Path) -> None:
    # Why localchat hashes every file itself: the client accepts the altered bytes.
    hub.alter_file("org/repo", "model.safetensors", at=7)
    path = hf_hub_download("org/repo", "model.safetensors", cache_dir=tmp_path,
                           endpoint=hub.url, token=False)
    data = Path(path).read_bytes()
    assert len(data) == len(WEIGHTS) and data != WEIGHTS


def test_errors_map_to_huggingface_hub_exceptions(hub: HubServer, tmp_path: Path) -> None:
    hub.add_repo("org/gated", FILES, gated=True, tokens=("hf_ok",))
    api = HfApi(endpoint=hub.url)
    with pytest.raises(RepositoryNotFoundError) as missing:
        api.model_info("org/none", token=False)
    assert missing.value.response.status_code == 404
    with pytest.raises(RevisionNotFoundError):
        api.model_info("org/repo", revision="nope", token=False)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("org/repo", "absent.bin", cache_dir=tmp_path, endpoint=hub.url,
                        token=False)
    with pytest.raises(GatedRepoError) as anonymous:
        api.model_info("org/gated", token=False)
    assert anonymous.value.response.status_code == 401
    with pytest.raises(GatedRepoError) as wrong:
        api.model_info("org/gated", token="hf_wrong")
    assert wrong.value.response.status_code == 403
    assert api.model_info("org/gated", token="hf_ok").sha


def test_range_requests_give_206_and_416_past_the_end(hub: HubServer) -> None:
    from huggingface_hub.utils import get_session

    url = hf_hub_url("org/repo", "config.json", endpoint=hub.url)
    part = get_session().get(url, headers={"Range": "bytes=5-"})
    assert part.status_code == 206 and part.content == FILES["config.json"][5:]
    total = len(FILES["config.json"])
    assert part.headers["Content-Range"] == f"bytes 5-{total - 1}/{total}"
    response = get_session().get(url, headers={"Range": "bytes=9999-"})
    assert response.status_code == 416
    assert response.headers["Content-Range"] == f"bytes */{len(FILES['config.json'])}"
