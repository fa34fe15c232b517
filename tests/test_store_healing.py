"""A store that heals, through the real `localchat` CLI in subprocesses on real files: damaged
shards, configs and libraries are named with their repair command, marked in `list` and repaired
by `pull`; leftovers of killed pulls are cleaned; a second pull waits for the first; another
user runs from a store they cannot write; and a fuzz test over every file of a stored model.

One tiny random Llama (with a tokenizer) is pulled from a local folder once per module into a
template store, in two quantizations (two different libraries); each test copies that store.
Compiled libraries are kept in the test cache between runs (see `kept_libs`).
"""

from __future__ import annotations

import json
import os
import pwd
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from fixtures import keep_libraries, seed_libraries
from hub_server import tiny_llama_folder

NAME, Q4, Q0 = "tiny-llama", "q4f32_1", "q0f32"
MANIFEST = "localchat-manifest.json"


@pytest.fixture(autouse=True)
def _no_shared_library_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each store compiles for itself here (a store heals by compiling what it lost), not from
    the one library cache conftest.py gives the other tests (`localchat` below drops it too)."""
    monkeypatch.delenv("LOCALCHAT_SHARED_LIBRARY_CACHE", raising=False)


def localchat(home: Path, *args: str, stdin: str = "", timeout: float = 300,
              user: str | None = None, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("LOCALCHAT_", "HF_"))}
    full.update(LOCALCHAT_HOME=str(home), HF_ENDPOINT="http://127.0.0.1:9",
                LOCALCHAT_DISK_RESERVE="0", PIP_NO_INDEX="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "localchat.cli", *args], input=stdin,
                          capture_output=True, text=True, env=full, timeout=timeout, user=user)


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The one `localchat: error:` line of a failed command (and no traceback, no signal)."""
    assert proc.returncode == 1, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("localchat: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr
    return errors[0]


def listed(home: Path, **kw: object) -> dict[str, dict]:
    rows = json.loads(ok(localchat(home, "list", "--json", **kw)).stdout)  # type: ignore[arg-type]
    return {f"{r['name']}:{r['quantization']}": r for r in rows}


def reply(home: Path, ref: str, **kw: object) -> subprocess.CompletedProcess[str]:
    """Four greedy tokens (the default samples), so a repaired model can be compared."""
    return localchat(home, "run", ref, "hello world", "--raw", "--json", "--max-tokens", "4",
                     "--temperature", "0", **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("src") / NAME)


@pytest.fixture(scope="module")
def template_home(tmp_path_factory: pytest.TempPathFactory, source: Path) -> Path:
    """A store holding tiny-llama in two quantizations, compiled (libraries kept across runs)."""
    home = tmp_path_factory.mktemp("template") / "home"
    libs = home / "cache" / "libs"
    libs.mkdir(parents=True)
    seed_libraries(libs)
    for quant in (Q4, Q0):
        ok(localchat(home, "pull", str(source), "--quant", quant))
    keep_libraries(libs)
    return home


@pytest.fixture
def home(template_home: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "home"
    shutil.copytree(template_home, dest)
    return dest


def model_dir(home: Path, quant: str = Q4) -> Path:
    return home / "models" / NAME / quant


def shard(home: Path) -> Path:
    return sorted(model_dir(home).glob("params_shard_*.bin"))[0]


def library(home: Path, quant: str = Q4) -> Path:
    [lib] = (model_dir(home, quant) / "lib").glob("*.so")
    return lib


def repair_command(source: Path) -> str:
    return f"localchat pull {source} --quant {Q4}"


# -- damaged files -----------------------------------------------------------------------------
def test_truncated_shard_is_named_with_its_repair_listed_damaged_and_pull_repairs_it(
        home: Path, source: Path) -> None:
    good = json.loads(ok(reply(home, f"{NAME}:{Q4}")).stdout)["token_ids"]
    path = shard(home)
    path.write_bytes(path.read_bytes()[:100])
    line = error_line(reply(home, f"{NAME}:{Q4}"))
    assert path.name in line and "truncated" in line and repair_command(source) in line
    rows = listed(home)
    assert rows[f"{NAME}:{Q4}"]["damaged"] and rows[f"{NAME}:{Q4}"]["compiled"] == "damaged"
    assert not rows[f"{NAME}:{Q0}"]["damaged"]
    table = ok(localchat(home, "list"))
    assert "damaged" in table.stdout and path.name in table.stderr
    repaired = ok(localchat(home, *repair_command(source).split()[1:]))
    assert repaired.stdout.startswith(f"pulled {NAME}:{Q4}")
    assert json.loads(ok(reply(home, f"{NAME}:{Q4}")).stdout)["token_ids"] == good
    assert not listed(home)[f"{NAME}:{Q4}"]["damaged"]


def test_same_size_corruption_is_found_by_verify_and_pull(home: Path, source: Path) -> None:
    path = shard(home)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    ok(reply(home, f"{NAME}:{Q4}"))  # sizes only on load: this one is not seen by run
    report = localchat(home, "doctor", "--verify", "--json")
    assert report.returncode == 1, report.stderr
    [bad] = json.loads(report.stdout)["damaged"]
    assert bad["model"] == f"{NAME}:{Q4}" and path.name in bad["problem"]
    assert "altered" in bad["problem"] and bad["repair"] == repair_command(source)
    again = ok(localchat(home, "pull", str(source), "--quant", Q4))
    assert "building it again" in again.stderr and "pulled" in again.stdout
    assert ok(localchat(home, "doctor", "--verify", "--json")).returncode == 0


def test_a_bad_library_is_rebuilt_never_loaded(home: Path) -> None:
    lib = library(home)
    cached = home / "cache" / "libs" / lib.name
    lib.unlink()
    os.link(cached, lib)  # as a pull installs it (copytree made two files of it)
    full = lib.stat().st_size
    with open(lib, "r+b") as f:  # truncated in place: every hard link to it sees it
        f.truncate(full // 3)
    assert "damaged" == listed(home)[f"{NAME}:{Q4}"]["compiled"]
    run = ok(reply(home, f"{NAME}:{Q4}"))
    assert "fails its recorded sha256" in run.stderr and "compiling" in run.stderr
    assert "Warning" not in run.stderr  # TVM's own warnings go to the debug log only
    assert library(home).stat().st_size == full and cached.stat().st_size == full
    assert not listed(home)[f"{NAME}:{Q4}"]["damaged"]


def test_garbage_config_is_listed_damaged_removed_by_rm_and_repaired_by_pull(
        home: Path, source: Path) -> None:
    config = model_dir(home) / "localchat-config.json"
    config.write_text('{"architecture": "llama"')  # incomplete: cut mid-write
    assert listed(home)[f"{NAME}:{Q4}"]["damaged"]
    line = error_line(reply(home, f"{NAME}:{Q4}"))
    assert "localchat-config.json" in line and repair_command(source) in line
    assert "localchat-config.json" in error_line(localchat(home, "show", NAME + ":" + Q4))
    ok(localchat(home, "pull", str(source), "--quant", Q4))
    ok(reply(home, f"{NAME}:{Q4}"))
    config.write_text("\0garbage")
    removed = ok(localchat(home, "rm", f"{NAME}:{Q4}", "--yes"))
    assert removed.stdout.startswith(f"removed {NAME}:{Q4}")
    assert list(listed(home)) == [f"{NAME}:{Q0}"]


# -- leftovers and concurrent pulls ------------------------------------------------------------
def test_leftovers_of_killed_pulls_are_cleaned_by_any_pull_and_by_doctor(
        home: Path, source: Path) -> None:
    def leftover(name: str) -> Path:
        path = home / "models" / name / f".staging-{Q4}-k1ll3d00"
        path.mkdir(parents=True)
        (path / "params_shard_0.bin").write_bytes(b"\0" * 4096)
        return path

    other = leftover("some-other-model")
    ok(localchat(home, "pull", str(source), "--quant", Q0))  # already pulled; cleans anyway
    assert not other.exists()
    mine = leftover(NAME)
    text = ok(localchat(home, "doctor")).stdout
    assert str(mine) in text and "interrupted pull" in text and not mine.exists()


FIRST_PULL = """
import sys, time
from localchat.cli import main
from localchat.store import Store
home, source, quant = sys.argv[1:4]
with Store(home).lock("tiny-llama", quant):  # the pull below takes it again (re-entrant)
    print("locked", flush=True)
    time.sleep(2)  # the second pull starts meanwhile
    code = main(["pull", source, "--quant", quant])
sys.exit(code)
"""


def test_a_second_pull_waits_for_the_first_then_says_already_pulled(
        home: Path, source: Path) -> None:
    shutil.rmtree(model_dir(home, Q0))
    env = {**os.environ, "LOCALCHAT_HOME": str(home), "HF_ENDPOINT": "http://127.0.0.1:9"}
    first = subprocess.Popen([sys.executable, "-c", FIRST_PULL, str(home), str(source), Q0],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert first.stdout is not None and first.stdout.readline().strip() == "locked"
    second = localchat(home, "pull", str(source), "--quant", Q0)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0 and out.strip().startswith(f"pulled {NAME}:{Q0}"), err
    ok(second)
    assert "being pulled by another localchat process; waiting for it" in second.stderr
    assert "already pulled" in second.stdout


# -- another user ------------------------------------------------------------------------------
def _nobody() -> str:
    if os.geteuid() != 0:
        pytest.skip("switching to another user needs root")
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody'")
    try:
        subprocess.run([sys.executable, "-c", "import localchat"], user="nobody", check=True,
                       capture_output=True, timeout=60)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"'nobody' cannot run this Python ({sys.executable}): {exc}")
    return "nobody"


def test_another_user_runs_from_a_store_they_cannot_write(template_home: Path) -> None:
    user = _nobody()
    shared = Path(tempfile.mkdtemp(prefix="localchat-shared-"))
    try:
        os.chmod(shared, 0o755)
        home = shared / "home"
        shutil.copytree(template_home, home)
        for base, dirs, _files in os.walk(home):  # as the store is: 0755 dirs, 0644 files
            for d in dirs:
                os.chmod(os.path.join(base, d), 0o755)
        os.chmod(home, 0o755)
        own = shared / "nobody-home"
        own.mkdir()
        shutil.chown(own, user)
        env = {"HOME": str(own), "XDG_CACHE_HOME": str(own / ".cache")}
        assert oct(model_dir(home).joinpath(MANIFEST).stat().st_mode & 0o777) == "0o644"
        before = sorted((str(p), p.stat().st_mtime_ns) for p in home.rglob("*"))
        ok(reply(home, f"{NAME}:{Q4}", user=user, env=env))
        assert sorted((str(p), p.stat().st_mtime_ns) for p in home.rglob("*")) == before
        assert not list(own.rglob("*.so")), "compiled although the store had the library"
        os.chmod(model_dir(home, Q0), 0o700)  # one model this user cannot read
        rows = listed(home, user=user, env=env)
        assert not rows[f"{NAME}:{Q4}"]["damaged"] and rows[f"{NAME}:{Q0}"]["damaged"]
        assert "unreadable" in rows[f"{NAME}:{Q0}"]["problem"]
        ok(reply(home, f"{NAME}:{Q4}", user=user, env=env))
    finally:
        shutil.rmtree(shared, ignore_errors=True)


# -- fuzz --------------------------------------------------------------------------------------
def _damage(path: Path, how: str, rng: random.Random) -> None:
    if how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    elif how == "random":
        size = path.stat().st_size
        path.unlink()  # a new file: the library cache's hard link keeps the good bytes
        path.write_bytes(rng.randbytes(max(size, 1)))
    elif how == "delete":
        path.unlink()
    else:  # unreadable: a directory where the file was (root reads any file despite chmod)
        path.unlink()
        path.mkdir()
        os.chmod(path, 0)


FUZZ_MODES = ("random", "delete", "unreadable", "truncate")


def _fuzz_cases(template_home: Path) -> Iterator[tuple[str, str]]:
    root = model_dir(template_home)
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    for i, rel in enumerate(files):
        how = FUZZ_MODES[i % len(FUZZ_MODES)]
        if rel.startswith("lib/") and how == "truncate":
            how = "random"  # in place would recompile the shared library (tested above)
        yield rel, how


def test_fuzz_every_file_of_a_stored_model(template_home: Path, source: Path,
                                           tmp_path: Path) -> None:
    rng = random.Random(10)
    cases = list(_fuzz_cases(template_home))
    assert len(cases) >= 6 and {how for _, how in cases} == set(FUZZ_MODES)
    for rel, how in cases:
        home = tmp_path / f"home-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(template_home, home)
        _damage(model_dir(home) / rel, how, rng)
        results = [localchat(home, "list", "--json"), localchat(home, "show", f"{NAME}:{Q4}"),
                   reply(home, f"{NAME}:{Q4}"),
                   localchat(home, "pull", str(source), "--quant", Q4)]
        rows = {r["quantization"]: r for r in json.loads(results[0].stdout)}
        unseen = how == "random" or (how == "delete" and rel.startswith("lib/"))  # by sizes
        assert rows[Q4]["damaged"] or unseen, f"{rel} ({how}): not seen as damaged"
        assert not rows[Q0]["damaged"], f"{rel} ({how}): the other model"
        for proc in results:
            where = f"{rel} ({how}): {proc.args[3:]}"
            assert proc.returncode in (0, 1), f"{where} rc={proc.returncode} {proc.stderr}"
            assert proc.returncode != -signal.SIGBUS, where
            assert "Traceback" not in proc.stderr, f"{where}\n{proc.stderr}"
            if proc.returncode == 1:
                error_line(proc)
        assert results[-1].returncode == 0, f"{rel} ({how}): pull did not repair"
        ok(reply(home, f"{NAME}:{Q4}"))  # repaired
    ok(reply(home, f"{NAME}:{Q0}"))  # the other model kept working
