"""Pull jobs: their state (written by the pulling thread), the progress adapter the downloader
reports to, and the panel that shows every job with its stage, bytes, speed and ETA."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from textual.widgets import Static

from localchat.tui.backend import PullCancelled


def human_bytes(n: float) -> str:
    """Bytes for people: 1.5 MB, 820 kB."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


@dataclass
class Job:
    """One pull. Fields are written by its worker thread and read by the panel."""

    ref: str
    state: str = "queued"  # queued, running, done, failed, cancelled
    stage: str = ""
    message: str = ""
    files_total: int = 0
    files_done: int = 0
    bytes_total: int = 0
    bytes_done: int = 0
    current_file: str = ""
    stage_started: float = field(default_factory=time.monotonic)
    download_started: float | None = None
    cancel_requested: bool = False
    stages: list[str] = field(default_factory=list)  # every stage seen, in order
    model: str = ""  # when done: the ref of the model it installed ("" if not known)

    @property
    def active(self) -> bool:
        """Whether the job is queued or running."""
        return self.state in ("queued", "running")

    def set_stage(self, stage: str) -> None:
        """Enter a stage (download, convert, compile ...)."""
        self.stage = stage
        self.stages.append(stage)
        self.stage_started = time.monotonic()

    def line(self) -> str:
        """The job's status in one line."""
        head = f"{self.ref}: {self.state}"
        if self.state == "running":
            head += f" · {self.stage}"
            if self.stage == "download" and self.bytes_total:
                elapsed = time.monotonic() - (self.download_started or time.monotonic())
                speed = self.bytes_done / elapsed if elapsed > 0 else 0.0
                left = self.bytes_total - self.bytes_done
                eta = f", ETA {left / speed:.0f} s" if speed > 0 else ""
                pct = 100 * self.bytes_done / self.bytes_total
                head += (f" {pct:.0f}% {human_bytes(self.bytes_done)}/"
                         f"{human_bytes(self.bytes_total)} ({self.files_done}/{self.files_total}"
                         f" files) {human_bytes(speed)}/s{eta}")
                if self.current_file:
                    head += f" · {self.current_file}"
            else:
                head += f" ({time.monotonic() - self.stage_started:.0f} s)"
        if self.message:
            head += f" — {self.message}"
        return head


class JobProgress:
    """The downloader's progress interface, recording into a `Job`; raises PullCancelled from
    the download loop when the user cancelled the job (downloads resume at the next pull)."""

    def __init__(self, job: Job) -> None:
        self.job = job

    def _check(self) -> None:
        if self.job.cancel_requested:
            raise PullCancelled(f"pull of {self.job.ref} cancelled")

    def begin(self, files: Sequence[tuple[str, int | None]], done_bytes: int) -> None:
        job = self.job
        if job.download_started is None:
            job.download_started = time.monotonic()
        job.files_total += len(files)
        job.bytes_total += sum(size or 0 for _, size in files) + done_bytes
        job.bytes_done += done_bytes
        self._check()

    def file_begin(self, path: str, size: int | None, done: int) -> None:
        self.job.current_file = path
        self._check()

    def advance(self, path: str, nbytes: int) -> None:
        self.job.bytes_done += nbytes
        self._check()

    def file_end(self, path: str) -> None:
        self.job.files_done += 1
        self.job.current_file = ""

    def end(self) -> None:
        pass


class JobsPanel(Static):
    """Every pull job, one line each, refreshed a few times a second."""

    def __init__(self, jobs: list[Job], **kwargs: object) -> None:
        super().__init__("", **kwargs)  # type: ignore[arg-type]
        self.jobs = jobs
        self._shown: str | None = None

    def on_mount(self) -> None:
        self.refresh_jobs()
        self.set_interval(0.25, self.refresh_jobs)

    def refresh_jobs(self) -> None:
        """Redraw from the jobs' current state, only when it changed: every update is a layout
        pass and a full repaint, which would take CPU from a reply decoding meanwhile."""
        text = "\n".join(job.line() for job in self.jobs[-6:])
        text = "Jobs (Esc cancels the newest running one)\n" + text if text else ""
        if text == self._shown:
            return
        self._shown = text
        self.display = bool(self.jobs)
        self.update(text)
