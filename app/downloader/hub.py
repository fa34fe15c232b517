"""Hub access through `huggingface_hub`: repo listings and resumable, verified file downloads.

huggingface_hub lists the repo (sizes, LFS sha256, git blob ids) and carries the HTTP session,
auth headers, `HF_ENDPOINT` and `HF_TOKEN`. The transfer is ours: its own `hf_hub_download`
writes to a per-process temporary file that a killed process never resumes, and it does not
check sha256 sums. Here a file grows in `<name>.incomplete` next to its destination, resumes
with an HTTP Range request, is hashed (sha256 for LFS files, git blob sha1 otherwise) and only
then renamed into place, so a file at its final path is always complete and verified.
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from huggingface_hub import HfApi, constants, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.errors import HTTPError as _TransportHTTPError
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from localchat.downloader.files import is_code, is_safe_path
from localchat.downloader.gated import GatedAccessError
from localchat.downloader.progress import DownloadProgress, NullProgress
from localchat.downloader.space import human_size
from localchat.errors import (
    AccessDeniedError,
    DiskSpaceError,
    DownloadError,
    IntegrityError,
    LocalchatError,
    NetworkError,
    RemoteNotFoundError,
)

INCOMPLETE_SUFFIX = ".incomplete"
_READ_BLOCK = 1 << 20
_DISK_FULL = {errno.ENOSPC, errno.EFBIG} | ({errno.EDQUOT} if hasattr(errno, "EDQUOT") else set())


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Network-level errors of the HTTP library huggingface_hub uses (httpx or httpx2)."""
    module = importlib.import_module(_TransportHTTPError.__module__.split(".")[0])
    return (module.TransportError,)


TRANSPORT_ERRORS = _transport_errors()


@dataclass(frozen=True)
class RepoFile:
    """One file of a repo at a commit, with what the hub published about it."""

    path: str
    size: int | None
    sha256: str | None  # LFS files
    git_sha1: str | None  # git blob id (for LFS files: the pointer's id, not used)

    @property
    def is_lfs(self) -> bool:
        """Whether the hub stores this file with LFS (and so publishes its sha256)."""
        return self.sha256 is not None


@dataclass(frozen=True)
class RepoSnapshot:
    """A repo's file listing at one commit."""

    repo_id: str
    revision: str
    commit: str
    files: tuple[RepoFile, ...]

    @property
    def paths(self) -> list[str]:
        """All file paths."""
        return [f.path for f in self.files]

    def file(self, path: str) -> RepoFile:
        """The entry for `path`; RemoteNotFoundError if the repo has no such file."""
        for f in self.files:
            if f.path == path:
                return f
        raise RemoteNotFoundError(f"{self.repo_id}@{self.revision} has no file {path}")


class _Hasher(Protocol):
    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


def new_hasher(file: RepoFile) -> tuple[_Hasher, str] | None:
    """A hasher for the digest the hub published for `file`, with the expected hex digest."""
    if file.sha256:
        return hashlib.sha256(), file.sha256.lower()
    if file.git_sha1 and file.size is not None:
        h = hashlib.sha1(usedforsecurity=False)
        h.update(b"blob %d\0" % file.size)
        return h, file.git_sha1.lower()
    return None


def sha256_file(path: Path) -> str:
    """The sha256 hex digest of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            h.update(block)
    return h.hexdigest()


class _Restart(Exception):
    """The partial file cannot be continued; start the file again from byte 0."""


class HubClient:
    """Talks to the hub at `endpoint` (default: HF_ENDPOINT, else huggingface.co).

    `token`: a token string, False for anonymous, None for huggingface_hub's default
    (HF_TOKEN, then the token saved by `hf auth login`).
    """

    def __init__(
        self,
        endpoint: str | None = None,
        token: str | bool | None = None,
        timeout: float | None = None,
        retries: int = 5,
        retry_wait: float = 0.5,
    ) -> None:
        endpoint = endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
        self.endpoint = endpoint.rstrip("/")
        self.token = token
        self.timeout = float(timeout if timeout is not None else constants.HF_HUB_DOWNLOAD_TIMEOUT)
        self.retries = retries
        self.retry_wait = retry_wait
        self._api = HfApi(endpoint=self.endpoint, token=token, library_name="localchat")

    # errors ----------------------------------------------------------------------------------
    @contextmanager
    def _errors(self, repo_id: str, revision: str, path: str | None = None) -> Iterator[None]:
        """Turn huggingface_hub and network errors into one-line localchat errors."""
        try:
            if hub_offline():
                raise OfflineModeIsEnabled("HF_HUB_OFFLINE is set")
            yield
        except LocalchatError:
            raise
        except BaseException as exc:
            translated = self._translate(exc, repo_id, revision, path)
            if translated is None:
                raise
            raise translated from exc

    def _translate(self, exc: BaseException, repo_id: str, revision: str,
                   path: str | None) -> LocalchatError | None:
        page = f"{self.endpoint}/{repo_id}"
        login = "set HF_TOKEN or run `hf auth login`"
        if isinstance(exc, OfflineModeIsEnabled):
            return NetworkError(
                f"offline mode is on (HF_HUB_OFFLINE): cannot fetch {repo_id} from the hub"
            )
        if isinstance(exc, TRANSPORT_ERRORS):
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return NetworkError(
                f"cannot reach the hub at {self.endpoint} ({reason}); check the network "
                f"connection, or set HF_ENDPOINT to a reachable mirror"
            )
        if not isinstance(exc, HfHubHTTPError):
            return None
        status = exc.response.status_code if exc.response is not None else None
        if isinstance(exc, GatedRepoError):  # gated.py names the licence, may ask a token
            return GatedAccessError.from_status(repo_id, page, status)
        if isinstance(exc, RevisionNotFoundError):
            return RemoteNotFoundError(f"revision {revision!r} not found in {repo_id} (HTTP 404)")
        if isinstance(exc, RemoteEntryNotFoundError):
            return RemoteNotFoundError(f"{repo_id}@{revision} has no file {path} (HTTP 404)")
        if isinstance(exc, RepositoryNotFoundError) and status not in (401, 403):
            return RemoteNotFoundError(f"repo {repo_id} not found on {self.endpoint} (HTTP 404)")
        if status in (401, 403):
            return AccessDeniedError(
                f"access to {repo_id} denied (HTTP {status}): it may be private or gated, or "
                f"the name is wrong; if you have access, {login}"
            )
        if status == 404:
            return RemoteNotFoundError(f"{repo_id}: not found on {self.endpoint} (HTTP 404)")
        return DownloadError(f"the hub answered HTTP {status} for {repo_id}")

    # listing ---------------------------------------------------------------------------------
    def snapshot(self, repo_id: str, revision: str = "main") -> RepoSnapshot:
        """List a repo's files at `revision`, resolved to a commit."""
        with self._errors(repo_id, revision):
            info = self._api.model_info(
                repo_id, revision=revision, files_metadata=True, timeout=self.timeout
            )
        if not info.sha:
            raise DownloadError(
                f"{self.endpoint} returned no commit for {repo_id}: is HF_ENDPOINT a hub?"
            )
        files = []
        for sibling in info.siblings or []:
            lfs = sibling.lfs
            files.append(
                RepoFile(
                    path=sibling.rfilename,
                    size=lfs.size if lfs is not None else sibling.size,
                    sha256=lfs.sha256 if lfs is not None else None,
                    git_sha1=sibling.blob_id,
                )
            )
        return RepoSnapshot(repo_id=repo_id, revision=revision, commit=info.sha, files=tuple(files))

    def file_url(self, snapshot: RepoSnapshot, path: str) -> str:
        """The resolve URL of a file, pinned to the snapshot's commit."""
        return hf_hub_url(snapshot.repo_id, path, revision=snapshot.commit, endpoint=self.endpoint)

    # downloading -----------------------------------------------------------------------------
    def download(
        self,
        snapshot: RepoSnapshot,
        paths: Sequence[str],
        dest: Path,
        progress: DownloadProgress | None = None,
        on_file: Callable[[str, Path], None] | None = None,
        allow_code: bool = False,
    ) -> dict[str, Path]:
        """Fetch `paths` of the snapshot into `dest` (resuming, verifying); returns their paths.

        Files already complete in `dest` are not fetched again. `on_file` is called after each
        file is verified (for example to check config.json before the weights). Reports the
        files to `progress` as one batch; calling `progress.end()` is left to the caller.
        Code files are refused unless `allow_code` (only for a prebuilt library whose sha256
        the caller pinned).
        """
        progress = progress or NullProgress()
        files = [snapshot.file(p) for p in paths]
        for f in files:
            if not is_safe_path(f.path) or (is_code(f.path) and not allow_code):
                raise DownloadError(f"refusing to download {f.path!r} from {snapshot.repo_id}")
        dest = Path(dest)
        pending = [f for f in files if not self._complete(f, dest / f.path)]
        done_bytes = sum((f.size or 0) for f in files if f not in pending)
        progress.begin([(f.path, f.size) for f in pending], done_bytes)
        result: dict[str, Path] = {}
        for f in files:
            target = dest / f.path
            if f in pending:
                with self._errors(snapshot.repo_id, snapshot.revision, f.path):
                    self._fetch(self.file_url(snapshot, f.path), f, target, progress)
            result[f.path] = target
            if on_file is not None:
                on_file(f.path, target)
        return result

    @staticmethod
    def _complete(file: RepoFile, target: Path) -> bool:
        """A file at its final path was verified before the rename; re-check only its size."""
        try:
            size = target.stat().st_size
        except OSError:
            return False
        if file.size is not None and size != file.size:
            target.unlink()
            return False
        return True

    def _fetch(self, url: str, file: RepoFile, target: Path, progress: DownloadProgress) -> None:
        """Download one file into `target` through its .incomplete file, resuming and verifying."""
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(target.name + INCOMPLETE_SUFFIX)
        failures = 0
        retried_from_zero = False
        started = False
        while True:
            have = part.stat().st_size if part.exists() else 0
            if file.size is not None and have > file.size:
                part.unlink()
                have = 0
            hashing = new_hasher(file)
            if not started:
                progress.file_begin(file.path, file.size, have)
                started = True
            try:
                if hashing is not None and have:
                    _hash_prefix(part, have, hashing[0])
                received = self._stream(url, part, have, file, hashing, progress)
            except _Restart:
                progress.advance(file.path, -have)
                part.unlink(missing_ok=True)
                continue
            except TRANSPORT_ERRORS:
                failures += 1
                if failures > self.retries:
                    raise
                time.sleep(min(self.retry_wait * 2 ** (failures - 1), 8.0))
                continue
            if received:
                failures = 0
            size = part.stat().st_size
            problem = None
            if file.size is not None and size != file.size:
                problem = f"size {size} instead of {file.size}"
            elif hashing is not None and hashing[0].hexdigest() != hashing[1]:
                kind = "sha256" if file.is_lfs else "git hash"
                problem = f"{kind} {hashing[0].hexdigest()} instead of {hashing[1]}"
            if problem is None:
                os.replace(part, target)
                progress.file_end(file.path)
                return
            part.unlink(missing_ok=True)
            progress.advance(file.path, -size)
            if have and not retried_from_zero:
                # The bytes kept from an earlier run may be the bad ones: fetch once afresh.
                retried_from_zero = True
                continue
            raise IntegrityError(
                f"{file.path} from {url} does not match what the hub published ({problem}); "
                f"the file was discarded, try again later or report it to the repo owner"
            )

    def _stream(self, url: str, part: Path, have: int, file: RepoFile,
                hashing: tuple[_Hasher, str] | None, progress: DownloadProgress) -> int:
        """GET the file from byte `have` and append it to `part`; returns the bytes received."""
        headers = build_hf_headers(token=self.token, library_name="localchat")
        headers["Accept-Encoding"] = "identity"
        if have:
            headers["Range"] = f"bytes={have}-"
        received = 0
        with get_session().stream(
            "GET", url, headers=headers, timeout=self.timeout, follow_redirects=True
        ) as response:
            if response.status_code == 416 and have:
                raise _Restart()
            if response.status_code >= 400:
                response.read()
                hf_raise_for_status(response)
            if have and response.status_code != 206:
                raise _Restart()  # the server ignored the Range header: start over
            if have and not response.headers.get("Content-Range", "").startswith(f"bytes {have}-"):
                raise _Restart()
            with open(part, "ab", buffering=0) as out:
                offset = have
                for chunk in response.iter_bytes():
                    if not chunk:
                        continue
                    offset = _write_all(out, chunk, offset, part)
                    if hashing is not None:
                        hashing[0].update(chunk)
                    received += len(chunk)
                    progress.advance(file.path, len(chunk))
                os.fsync(out.fileno())
        return received


def _write_all(out: BinaryIO, chunk: bytes, offset: int, part: Path) -> int:
    """Write all of `chunk` at the end of `out`; on a full disk keep only whole writes."""
    view = memoryview(chunk)
    try:
        while view:
            n = out.write(view)
            if n is None:
                n = 0
            view = view[n:]
    except OSError as exc:
        try:
            out.truncate(offset)  # drop the partial chunk so the next run resumes cleanly
        except OSError:
            pass
        if exc.errno in _DISK_FULL:
            raise DiskSpaceError(
                f"disk full while writing {part.name} in {part.parent} ({exc.strerror}); "
                f"free some space and pull again: the {human_size(offset)} already fetched are kept"
            ) from None
        raise
    return offset + len(chunk)


def _hash_prefix(path: Path, length: int, hasher: _Hasher) -> None:
    """Feed the first `length` bytes of a partial file to `hasher`."""
    remaining = length
    with open(path, "rb") as f:
        while remaining:
            block = f.read(min(_READ_BLOCK, remaining))
            if not block:
                raise _Restart()
            hasher.update(block)
            remaining -= len(block)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE, read now (huggingface_hub reads it once at import)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"} or constants.HF_HUB_OFFLINE


