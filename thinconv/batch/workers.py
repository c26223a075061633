"""The worker processes: each runs one job at a time (verify, or convert from scratch) and sends
progress and its result to the batch process over a pipe; signals stop it cleanly."""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from thinconv.batch.fingerprint import verify_archive
from thinconv.batch.jobs import Job
from thinconv.batch.report import INTERRUPTED, JobResult, job_result
from thinconv.convert import convert_source
from thinconv.errors import ThinError
from thinconv.format.reader import open_archive
from thinconv.recipe import load_registry

PROGRESS_INTERVAL = 0.1  # seconds between progress messages of one job (≤ 10/s)
WORKER_MEMORY = 2 * 1024**3  # what one conversion worker is budgeted (pages in flight, probe, mmaps)


class StopFlag:
    """Set by SIGINT / SIGTERM (see :func:`stop_on_signals`) or by the caller."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None

    def set(self, signum: int | None = None) -> None:
        if self.signum is None:
            self.signum = signum
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()

    @property
    def exit_code(self) -> int:
        """128 + the signal number (130 for SIGINT, 143 for SIGTERM), as a shell reports it."""
        return 128 + (self.signum or signal.SIGINT)


@contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """SIGINT and SIGTERM set the flag instead of raising; the previous handlers come back after."""
    flag = StopFlag()
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, lambda signum, frame: flag.set(signum))
    try:
        yield flag
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def default_workers() -> int:
    """max(1, min(cores // 2, available memory // 2 GiB)): each conversion already uses 2 threads."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    memory = available_memory()
    by_memory = memory // WORKER_MEMORY if memory else cores
    return max(1, min(cores // 2, by_memory))


def available_memory() -> int | None:
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:  # a cgroup v2 limit (containers, Slurm with cgroups)
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            free = max(int(limit) - used, 0)
            avail = free if avail is None else min(avail, free)
    except (OSError, ValueError):
        pass
    return avail


class _Stop(BaseException):
    """Raised in a worker by SIGINT / SIGTERM, so the converter's temp-file cleanup runs."""


def worker_main(conn, recipe_dirs: list[str], parent: int) -> None:
    """A worker process: run the tasks the parent sends, one at a time, until told to stop."""
    stopping = [False]

    def on_signal(signum, frame):
        if not stopping[0]:  # once: a second signal must not interrupt the cleanup of the first
            stopping[0] = True
            raise _Stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    _die_with_parent(parent)
    if hasattr(signal, "SIGXFSZ"):  # a file-size limit is a write error we clean up after, not a kill
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    lock = threading.Lock()

    def send(msg) -> None:
        # Signals wait while a message is on its way: an interrupted send would corrupt the pipe.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            with lock:
                conn.send(msg)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    registry = None
    try:
        while not stopping[0]:
            task = conn.recv()
            if task is None:
                return
            job, commit, mode = task
            t0 = time.perf_counter()
            try:
                if registry is None:
                    registry = load_registry([Path(d) for d in recipe_dirs])
                result = _run_task(job, commit, mode, registry, send)
            except _Stop:
                send(("result", job_result(job, "failed", seconds=time.perf_counter() - t0, error=INTERRUPTED)))
                return
            except ThinError as e:
                result = job_result(job, "failed", seconds=time.perf_counter() - t0, error=str(e))
            except Exception as e:  # a bug or an unexpected OS error: still one line, and the batch goes on
                first = (str(e).strip().splitlines() or [""])[0]
                result = job_result(job, "failed", seconds=time.perf_counter() - t0,
                                 error=f"{type(e).__name__}: {first}".rstrip(": "))
            send(("result", result))
    except (_Stop, EOFError, OSError):
        return


def _die_with_parent(parent: int) -> None:
    """Linux: SIGTERM this worker when the batch process (pid `parent`) dies, even by SIGKILL (its
    conversion then stops and removes its temp file instead of running on unattended)."""
    try:
        import ctypes  # lazy: Linux only, and only in worker processes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


class _PipeProgress:
    """The converter's progress, sent to the parent at most every PROGRESS_INTERVAL seconds."""

    def __init__(self, send, job: Job):
        self.send, self.job = send, job
        self.phase, self.total, self.done, self.last = "", 0, 0, 0.0

    def start(self, phase: str, total: int) -> None:
        self.phase, self.total, self.done = phase, total, 0
        self._emit()

    def advance(self, n: int) -> None:
        self.done += n
        if time.monotonic() - self.last >= PROGRESS_INTERVAL or self.done >= self.total:
            self._emit()

    def _emit(self) -> None:
        self.last = time.monotonic()
        self.send(("progress", self.phase, self.done, self.total))


def _run_task(job: Job, commit: str | None, mode: str, registry, send) -> JobResult:
    t0 = time.perf_counter()
    progress = _PipeProgress(send, job)
    if mode == "verify":
        problem = verify_archive(job.out, progress)
        if problem is None:
            with open_archive(job.out) as a:  # header and manifest only: the pages were just verified
                return job_result(job, "skipped", seconds=time.perf_counter() - t0, bytes_in=_bytes_in(a.manifest),
                                  bytes_out=a.file_size, archive_hash=a.header.archive_hash.hex())
        send(("redo", f"archive fails verification: {problem}"))  # the log says why the job runs after all
    # Pinned to the commit the batch resolved (and downloaded); the archive records the revision
    # as the job names it, so it is the archive `thinconv convert` would write.
    result = convert_source(job.source, job.out, options=job.options, recipe=job.recipe,
                            revision=job.revision if job.hub else None, commit=commit if job.hub else None,
                            force=True, registry=registry, progress=progress)
    return job_result(job, "done", seconds=time.perf_counter() - t0, bytes_in=_bytes_in(result.manifest),
                   bytes_out=result.size, archive_hash=result.archive_hash, warnings=list(result.warnings))


def _bytes_in(manifest: dict) -> int | None:
    files = ((manifest.get("validation") or {}).get("source") or {}).get("files")
    return sum(f["size"] for f in files) if files else None
