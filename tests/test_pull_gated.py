"""`localchat pull` of a gated repo, through the real CLI and the real `huggingface_hub` client
against the loopback hub: gated as huggingface.co gates (the listing public, every file 401
without a token, 403 with a token whose account has not accepted the licence).

On a terminal with no token set, the pull names the licence and the page to accept it on, asks
for a token without echoing it, and completes with it; anywhere else it fails with one line
saying to set HF_TOKEN; a token `hf auth login` stored is used without asking.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fixtures import keep_libraries, seed_libraries
from hub_server import HubServer, folder_files, tiny_llama_folder

NAME, REPO = "llama-3.1-8b-instruct", "meta-llama/Llama-3.1-8B-Instruct"  # a gated recipe
GPT2_REPO = "org/gated-gpt2"  # gated, and an architecture localchat refuses after the gate
GRANTED = "hf_granted_0123456789abcdef"
LICENCE = "Llama 3.1 Community License"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    llama = tiny_llama_folder(tmp_path_factory.mktemp("repos") / "tiny-llama")
    with HubServer() as server:
        server.add_repo(REPO, folder_files(llama), gated=True, listed=True, tokens=(GRANTED,))
        server.add_repo(GPT2_REPO, {
            "config.json": json.dumps({"architectures": ["GPT2LMHeadModel"],
                                       "model_type": "gpt2"}).encode(),
            "model.safetensors": b"\0" * 1000}, gated=True, listed=True, tokens=(GRANTED,))
        yield server


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """A fresh LOCALCHAT_HOME whose compiled libraries are shared across test runs (a library
    is named by the hash of all that shapes it: a kept one is what compiling would give)."""
    home = tmp_path / "home"
    libs = home / "cache" / "libs"
    libs.mkdir(parents=True)
    seed_libraries(libs)
    yield home
    keep_libraries(libs)


def environment(home: Path, hub: HubServer, **extra: str) -> dict[str, str]:
    """The CLI's environment: the store at `home`, the hub at the loopback, no token anywhere
    (an empty HF_HOME: no token `hf auth login` stored) unless `extra` sets one."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN_PATH",
                        "LOCALCHAT_PREBUILT_INDEX")}
    hf_home = home.parent / "hf-home"
    hf_home.mkdir(exist_ok=True)
    env.update(LOCALCHAT_HOME=str(home), HF_ENDPOINT=hub.url, HF_HOME=str(hf_home),
               LOCALCHAT_DISK_RESERVE="0", PIP_NO_INDEX="1", TERM="dumb", **extra)
    return env


def localchat(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI with no terminal (stdin from /dev/null, output captured)."""
    return subprocess.run([sys.executable, "-m", "localchat.cli", *args], env=env, text=True,
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=600)


def error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The one `localchat: error:` line a failed command printed, its last line."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("localchat: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr
    return errors[0]


def stored(env: dict[str, str]) -> list[dict]:
    proc = localchat(env, "list", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_without_a_terminal_it_fails_in_one_line_naming_the_licence_and_hf_token(
        hub: HubServer, home: Path) -> None:
    env = environment(home, hub)
    line = error_line(localchat(env, "pull", NAME))
    assert f"{REPO} is a gated repo ({LICENCE}, licence llama3.1) (HTTP 401)" in line
    assert f"{hub.url}/{REPO}" in line and "set HF_TOKEN" in line
    # a token whose account has not accepted the licence: 403, and never a prompt
    line = error_line(localchat(environment(home, hub, HF_TOKEN="hf_not_accepted"), "pull", NAME))
    assert "HTTP 403" in line and LICENCE in line and f"{hub.url}/{REPO}" in line
    assert "hf_not_accepted" not in line
    assert stored(env) == []


def test_a_stored_login_token_is_used_without_asking(hub: HubServer, home: Path) -> None:
    """`hf auth login`'s token (HF_HOME/token) passes the gate: the pull goes on to the config
    check, which refuses this repo's GPT-2 architecture."""
    env = environment(home, hub)
    Path(env["HF_HOME"], "token").write_text(GRANTED)
    hub.reset_counters()
    line = error_line(localchat(env, "pull", GPT2_REPO))
    assert "GPT2LMHeadModel" in line
    files = [r for r in hub.requests if "/resolve/" in r.path]
    assert files and {r.authorization for r in files} == {f"Bearer {GRANTED}"}
    assert all(r.status < 400 for r in files)


def test_on_a_terminal_it_asks_for_a_token_never_echoes_it_and_pulls(
        hub: HubServer, home: Path) -> None:
    pexpect = pytest.importorskip("pexpect")
    env = environment(home, hub, COLUMNS="400")
    hub.reset_counters()
    child = pexpect.spawn(sys.executable, ["-m", "localchat.cli", "pull", NAME], env=env,
                          encoding="utf-8", timeout=600, dimensions=(40, 400))
    child.logfile_read = seen = io.StringIO()  # all the terminal showed
    try:
        child.expect(rf"{REPO} is gated: accept {LICENCE}, licence llama3\.1 at "
                     rf"{hub.url}/{REPO}")
        child.expect_exact("Hugging Face token (not shown; Enter to cancel): ")
        child.sendline(GRANTED)
        child.expect_exact("token received")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    transcript = seen.getvalue()
    assert child.exitstatus == 0, transcript
    assert f"pulled {NAME}:q4f32_1" in transcript
    assert GRANTED not in transcript  # not echoed, not printed
    files = [r for r in hub.requests if "/resolve/" in r.path]
    assert files[0].status == 401 and files[0].authorization is None  # asked after the 401
    assert files[-1].authorization == f"Bearer {GRANTED}" and files[-1].status < 400
    [model] = stored(environment(home, hub))
    assert (model["name"], model["quantization"]) == (NAME, "q4f32_1")


def test_on_a_terminal_enter_cancels_with_the_one_line_error(hub: HubServer,
                                                              home: Path) -> None:
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(sys.executable, ["-m", "localchat.cli", "pull", NAME],
                          env=environment(home, hub, COLUMNS="400"), encoding="utf-8",
                          timeout=300, dimensions=(40, 400))
    try:
        child.expect_exact("Hugging Face token (not shown; Enter to cancel): ")
        child.sendline("")
        child.expect(r"localchat: error: .*HTTP 401.*set HF_TOKEN")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 1
