"""`/api/pull` end to end: the official `ollama` client pulls a model through `localchat serve`
from the loopback hub (the real huggingface_hub client underneath, HF_ENDPOINT pointed at it),
then the model is listed by `/api/tags` and answers `/api/chat`.

The tiny random Llama is hosted under the repo id of a real recipe, so the name goes the whole
way a user's does: name -> recipe -> hub -> convert -> compile -> store. The compile cache is
shared with tests/test_pull_e2e.py's (a kept library is exactly what compiling would produce).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import ollama
import pytest
from serve_helpers import Server, start_server, stop_server

from fixtures import keep_libraries, seed_libraries
from hub_server import HubServer, folder_files, tiny_llama_folder

NAME, REPO, QUANT = "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "q4f32_1"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    root = tmp_path_factory.mktemp("pull-repos")
    with HubServer() as server:
        server.add_repo(REPO, folder_files(tiny_llama_folder(root / "tiny-llama")))
        yield server


@pytest.fixture(scope="module")
def pull_server(hub: HubServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server over an empty store, its compile cache seeded from the tests' kept libraries."""
    home = tmp_path_factory.mktemp("pull-serve") / "home"
    libs = home / "cache" / "libs"
    libs.mkdir(parents=True)
    seed_libraries(libs)
    env: dict[str, str | None] = {
        "HF_ENDPOINT": hub.url, "LOCALCHAT_DISK_RESERVE": "0", "PIP_NO_INDEX": "1",
        "HF_TOKEN": None, "HF_HUB_OFFLINE": None, "TRANSFORMERS_OFFLINE": None,
        "LOCALCHAT_PREBUILT_INDEX": None}
    log = tmp_path_factory.mktemp("pull-serve-log") / "server.log"
    srv = start_server(home, log, env=env)
    yield srv
    stop_server(srv)
    keep_libraries(libs)


def test_ollama_client_pulls_through_the_server(pull_server: Server, hub: HubServer) -> None:
    client = ollama.Client(host=pull_server.url, timeout=600)
    assert client.list().models == []
    hub.reset_counters()
    parts = list(client.pull(NAME, stream=True))
    statuses = [p.status for p in parts]
    assert statuses[0] == "pulling manifest", statuses
    assert statuses[-1] == "success", pull_server.log_tail()
    assert "verifying sha256 digest" in statuses and "writing manifest" in statuses
    last_file = max(i for i, s in enumerate(statuses) if s.startswith("pulling "))
    assert last_file < statuses.index("verifying sha256 digest") < \
        statuses.index("writing manifest") < len(statuses) - 1, statuses

    progress = [p for p in parts if p.completed is not None]
    assert progress, statuses
    files = {p.digest for p in progress}
    assert {"config.json", "model.safetensors"} <= files, files
    for f in files:
        lines = [p for p in progress if p.digest == f]
        assert all(p.status == f"pulling {f}" for p in lines)
        done = [p.completed for p in lines]
        assert done == sorted(done), (f, done)  # never goes back
        last = lines[-1]
        assert last.total is not None and last.total > 0 and last.completed == last.total
    weights = [p for p in progress if p.digest == "model.safetensors"]
    fetched = [r for r in hub.requests if r.method == "GET" and
               r.path.endswith("/model.safetensors")]
    assert fetched and weights[-1].total > 100_000

    tags = httpx.get(f"{pull_server.url}/api/tags", timeout=30).json()["models"]
    assert [m["name"] for m in tags] == [NAME]  # its only quantization: the default
    assert tags[0]["details"]["quantization_level"] == QUANT
    assert tags[0]["details"]["family"] == "llama" and tags[0]["size"] > 0
    assert [m.model for m in client.list().models] == [NAME]

    # the pulled model serves at once, through the same client
    reply = client.chat(model=NAME, messages=[{"role": "user", "content": "hi"}],
                        options={"temperature": 0, "num_predict": 3})
    assert reply.done and reply.eval_count and 1 <= reply.eval_count <= 3

    again = list(client.pull(NAME, stream=True))  # already there: nothing fetched again
    assert again[-1].status == "success"


def test_ollama_client_deletes_a_loaded_model(pull_server: Server) -> None:
    """`/api/delete` (after the pull above): the model is unloaded, then gone from the store
    and the lists; deleting it again is a 404 with Ollama's error shape."""
    client = ollama.Client(host=pull_server.url, timeout=600)
    if not client.list().models:  # run alone: pull it first
        assert list(client.pull(NAME, stream=True))[-1].status == "success"
    client.generate(model=NAME, prompt="hi", options={"num_predict": 1})  # loaded
    assert [m.model for m in client.ps().models] == [NAME]
    client.delete(NAME)
    assert client.list().models == [] and client.ps().models == []
    assert not any((pull_server.home / "models").glob("*/*/localchat-config.json"))
    with pytest.raises(ollama.ResponseError) as err:
        client.delete(NAME)
    assert err.value.status_code == 404 and "not found" in err.value.error
    r = httpx.request("DELETE", f"{pull_server.url}/api/delete", json={})
    assert r.status_code == 400 and r.json() == {"error": "model is required"}
    assert httpx.get(f"{pull_server.url}/health").status_code == 200
