"""Download progress: the interface the downloader reports to, a rich display and a silent one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from localchat.downloader.space import human_size


class DownloadProgress(Protocol):
    """What the downloader tells about its work; sizes in bytes, None when unknown."""

    def begin(self, files: Sequence[tuple[str, int | None]], done_bytes: int) -> None:
        """A batch of files about to be fetched, and bytes of the batch already on disk.

        Called once per batch; until `end`, the batches of one download add up.
        """

    def file_begin(self, path: str, size: int | None, done: int) -> None:
        """A file starts (or resumes with `done` bytes already present)."""

    def advance(self, path: str, nbytes: int) -> None:
        """Bytes received for `path` (negative when a restart discards bytes)."""

    def file_end(self, path: str) -> None:
        """A file is complete and verified."""

    def end(self) -> None:
        """The download (all its batches) is over, finished or failed."""


class NullProgress:
    """Reports nothing."""

    def begin(self, files: Sequence[tuple[str, int | None]], done_bytes: int) -> None:
        pass

    def file_begin(self, path: str, size: int | None, done: int) -> None:
        pass

    def advance(self, path: str, nbytes: int) -> None:
        pass

    def file_end(self, path: str) -> None:
        pass

    def end(self) -> None:
        pass


class RichProgress:
    """A bar per file being fetched plus an overall bar, drawn by rich.

    On a console that is not a terminal (a log, a pipe) bars cannot move, so each finished file
    is written as one line instead, and the overall bar once at the end.
    """

    def __init__(self, console: Console | None = None, label: str = "download") -> None:
        self._progress = Progress(
            TextColumn("{task.description}", justify="left"),
            BarColumn(bar_width=None),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self._label = label
        self._overall: TaskID | None = None
        self._tasks: dict[str, TaskID] = {}
        self._sizes: dict[str, int | None] = {}
        self._files_total = 0
        self._files_done = 0

    def _overall_text(self) -> str:
        return f"[bold]{self._label}[/] ({self._files_done}/{self._files_total} files)"

    def begin(self, files: Sequence[tuple[str, int | None]], done_bytes: int) -> None:
        total = sum(size or 0 for _, size in files) + done_bytes
        self._files_total += len(files)
        if self._overall is None:
            self._progress.start()
            self._overall = self._progress.add_task(
                self._overall_text(), total=total, completed=done_bytes
            )
            return
        task = self._progress.tasks[self._overall]
        self._progress.update(
            self._overall,
            total=(task.total or 0) + total,
            completed=task.completed + done_bytes,
            description=self._overall_text(),
        )

    def file_begin(self, path: str, size: int | None, done: int) -> None:
        name = path if len(path) <= 40 else "…" + path[-39:]
        self._sizes[path] = size
        self._tasks[path] = self._progress.add_task(f"  {name}", total=size, completed=done)
        self._progress.refresh()  # show each file at least once, however fast it goes
        if self._overall is not None and done:
            self._progress.advance(self._overall, done)

    def advance(self, path: str, nbytes: int) -> None:
        task = self._tasks.get(path)
        if task is not None:
            self._progress.advance(task, nbytes)
        if self._overall is not None:
            self._progress.advance(self._overall, nbytes)

    def file_end(self, path: str) -> None:
        task = self._tasks.pop(path, None)
        if task is not None:
            self._progress.remove_task(task)
        console = self._progress.console
        if not console.is_terminal:
            size = self._sizes.get(path)
            console.print(f"  {path}" + (f" ({human_size(size)})" if size is not None else ""),
                          markup=False, highlight=False)
        self._files_done += 1
        if self._overall is not None:
            self._progress.update(self._overall, description=self._overall_text())

    def end(self) -> None:
        if self._overall is None:
            return
        for task in self._tasks.values():
            self._progress.remove_task(task)
        self._tasks.clear()
        self._progress.stop()
        self._progress.remove_task(self._overall)
        self._overall = None
        self._files_total = self._files_done = 0
