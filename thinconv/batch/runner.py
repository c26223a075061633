"""Running a batch: resolve hub sources once, skip up-to-date archives, download what is needed
once, dispatch the rest to worker processes, write the report, stop cleanly on signals."""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_connections
from typing import Any, Callable

from thinconv.batch.fingerprint import archive_mismatch, download_source, resolve_commit, verify_archive
from thinconv.batch.jobs import Job
from thinconv.batch.report import (INTERRUPTED, BatchObserver, JobResult, Planned, Summary, job_result,
                                   remove_stale_temp_files)
from thinconv.batch.workers import StopFlag, default_workers, worker_main
from thinconv.errors import ThinError, UsageError


def _resolve_all(jobs: list[Job], token: str | None, observer: BatchObserver,
                 stop: StopFlag | None = None) -> dict[tuple[str, str | None], str | ThinError]:
    """Each distinct (hub repo, revision) resolved once to a commit (or the error)."""
    commits: dict[tuple[str, str | None], str | ThinError] = {}
    for job in jobs:
        key = (job.source, job.revision)
        if not job.hub or key in commits or (stop is not None and stop.is_set()):
            continue
        try:
            commits[key] = resolve_commit(job.source, job.revision, token)
            observer.message(f"resolved {job.source}@{job.revision or 'main'} → {commits[key]}")
        except ThinError as e:
            commits[key] = e
            observer.message(f"cannot resolve {job.source}@{job.revision or 'main'}: {e}")
    return commits


def _precheck(job: Job, commits: dict) -> Planned:
    commit = commits.get((job.source, job.revision)) if job.hub else None
    if isinstance(commit, ThinError):
        return Planned(job, "fail", str(commit))
    try:
        why = archive_mismatch(job, commit)
    except ThinError as e:
        return Planned(job, "fail", str(e), commit)
    return Planned(job, "run" if why else "verify", why or "up to date: verifying it", commit)


def plan_batch(jobs: list[Job], *, token: str | None = None, observer: BatchObserver | None = None) -> list[Planned]:
    """What :func:`run_batch` would do with each job, writing nothing: ``skip`` (the archive is up
    to date and verifies), ``run`` (with the reason) or ``fail`` (e.g. an unresolvable hub source).
    Reads every existing archive in full to verify it."""
    observer = observer or BatchObserver()
    commits = _resolve_all(jobs, token, observer)
    plans = []
    for job in jobs:
        p = _precheck(job, commits)
        if p.action == "verify":
            problem = verify_archive(job.out)
            p = Planned(job, "run", f"archive fails verification: {problem}", p.commit) if problem else \
                Planned(job, "skip", "up to date", p.commit)
        plans.append(p)
    return plans


class _Downloader(threading.Thread):
    """Fetches each hub source a run needs into the HF cache, once, one source at a time, in
    the order jobs need them; the main thread dispatches a job when its source is ready."""

    def __init__(self, sources: list[tuple[str, str]], token: str | None, stop: StopFlag):
        super().__init__(name="thinconv-batch-downloads", daemon=True)
        self.sources, self.token, self.stop = sources, token, stop
        self.state: dict[tuple[str, str], str | ThinError] = {s: "pending" for s in sources}
        self.messages: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()

    def run(self) -> None:
        for repo, commit in self.sources:
            if self.stop.is_set():
                return
            self.messages.put(f"downloading {repo}@{commit}")
            try:
                download_source(repo, commit, self.token)
                outcome: str | ThinError = "ready"
            except ThinError as e:
                outcome = e
            except Exception as e:  # noqa: BLE001 - one line for the jobs of this source
                outcome = ThinError(f"{repo}@{commit}: download failed: {type(e).__name__}: {e}")
            with self.lock:
                self.state[(repo, commit)] = outcome

    def status(self, key: tuple[str, str]) -> str | ThinError:
        with self.lock:
            return self.state.get(key, "ready")


@dataclass
class _Worker:
    process: Any
    conn: Any
    job: Job | None = None
    started: float = 0.0


def run_batch(jobs: list[Job], *, workers: int | None = None, report: str | os.PathLike | None = None,
              keep_lines: list[dict] | None = None, recipe_dirs: list[str | os.PathLike] = (),
              token: str | None = None, observer: BatchObserver | None = None,
              stop: StopFlag | None = None) -> Summary:
    """Run `jobs` on `workers` processes (default :func:`default_workers`).

    A job whose archive is up to date (:func:`archive_mismatch`) and verifies is skipped; every
    other job is converted from scratch, replacing the old archive only once the new one is
    complete. A failing job is recorded and the others go on. Each finished job appends a line to
    `report` (JSON Lines, flushed; `keep_lines` are written first, e.g. the lines of jobs that
    --retry-failed does not rerun). Each distinct hub source is downloaded once, by this process,
    before its jobs run. When `stop` is set (SIGINT / SIGTERM), no new job starts, running ones
    are interrupted (their temp files removed) and recorded as failed with error "interrupted"."""
    observer = observer or BatchObserver()
    stop = stop or StopFlag()
    t0 = time.perf_counter()
    summary = Summary([])
    report_file = None
    if report is not None:
        try:
            report_file = open(report, "w", encoding="utf-8")
        except OSError as e:
            raise UsageError(f"--report {report}: cannot write ({e.strerror or e})") from None
        for line in keep_lines or []:
            report_file.write(json.dumps(line, ensure_ascii=False) + "\n")
        report_file.flush()

    def finish(job: Job, result: JobResult) -> None:
        summary.results.append(result)
        if report_file is not None:
            report_file.write(json.dumps(result.record(), ensure_ascii=False) + "\n")
            report_file.flush()
        observer.job_finished(job, result)

    try:
        for p in remove_stale_temp_files(jobs):
            observer.message(f"removed a stale temp file {p}")
        commits = _resolve_all(jobs, token, observer, stop)
        pending: list[Planned] = []
        for job in jobs:
            if stop.is_set():
                break
            p = _precheck(job, commits)
            if p.action == "fail":
                observer.job_started(job, p.reason)
                finish(job, job_result(job, "failed", error=p.reason))
            else:
                pending.append(p)
        downloads = list(dict.fromkeys((p.job.source, p.commit) for p in pending if p.job.hub and p.action == "run"))
        downloader = _Downloader(downloads, token, stop)
        if downloads and not stop.is_set():
            downloader.start()
        n_workers = max(1, min(workers or default_workers(), len(pending)))
        if pending:
            observer.message(f"{len(pending)} job{'s' * (len(pending) != 1)} to check or convert on {n_workers} "
                             f"worker process{'es' * (n_workers != 1)}")
        _Dispatcher(n_workers, [str(d) for d in recipe_dirs], downloader, observer, stop, finish).run(pending)
        summary.interrupted = stop.is_set()
        summary.not_started = len(jobs) - len(summary.results)
        if summary.interrupted:
            for p in remove_stale_temp_files(jobs):
                observer.message(f"removed a temp file left by a stopped worker: {p}")
    finally:
        if report_file is not None:
            try:
                os.fsync(report_file.fileno())
            except OSError:
                pass
            report_file.close()
    summary.seconds = time.perf_counter() - t0
    return summary


class _Dispatcher:
    """The parent's loop: hand ready jobs to idle workers, relay progress, collect results."""

    def __init__(self, n_workers: int, recipe_dirs: list[str], downloader: _Downloader, observer: BatchObserver,
                 stop: StopFlag, finish: Callable[[Job, JobResult], None]):
        self.ctx = multiprocessing.get_context("spawn")  # not fork: this process has threads
        self.pool: list[_Worker] = []
        self.n_workers, self.recipe_dirs, self.downloader = n_workers, recipe_dirs, downloader
        self.observer, self.stop, self.finish = observer, stop, finish

    def run(self, pending: list[Planned]) -> None:
        queue_ = list(pending)
        try:
            while (queue_ or any(w.job for w in self.pool)) and not self.stop.is_set():
                while True:
                    try:
                        self.observer.message(self.downloader.messages.get_nowait())
                    except queue.Empty:
                        break
                self.hand_out(queue_)
                if not self.pool:
                    time.sleep(0.1)  # waiting for a download
                    continue
                self.collect(timeout=0.2)
        finally:
            self.shutdown()

    def hand_out(self, queue_: list[Planned]) -> None:
        """Ready jobs to idle (or new) workers, in file order; a job whose hub source is still
        downloading waits."""
        for p in list(queue_):
            idle = [w for w in self.pool if w.job is None]
            if not idle and len(self.pool) >= self.n_workers:
                return
            state = self.downloader.status((p.job.source, p.commit)) if p.job.hub and p.action == "run" else "ready"
            if state == "pending":
                continue
            queue_.remove(p)
            self.observer.job_started(p.job, p.reason)
            if isinstance(state, ThinError):
                self.finish(p.job, job_result(p.job, "failed", error=str(state)))
                continue
            w = idle[0] if idle else self.spawn()
            w.job, w.started = p.job, time.perf_counter()
            try:
                w.conn.send((p.job, p.commit, p.action))
            except (OSError, EOFError):
                self.reap(w)

    def spawn(self) -> _Worker:
        parent_end, child_end = self.ctx.Pipe()
        proc = self.ctx.Process(target=worker_main, args=(child_end, self.recipe_dirs, os.getpid()),
                                name="thinconv-batch-worker", daemon=True)
        proc.start()
        child_end.close()
        w = _Worker(proc, parent_end)
        self.pool.append(w)
        return w

    def collect(self, timeout: float) -> None:
        """Wait up to `timeout` s for messages or exits, and handle them."""
        pool = self.pool
        ready = wait_connections([w.conn for w in pool] + [w.process.sentinel for w in pool], timeout=timeout)
        for w in list(pool):
            if w.conn in ready or w.process.sentinel in ready:
                self.handle(w)
                if w in pool and not w.process.is_alive():
                    self.handle(w)
                    if w in pool:
                        self.reap(w)

    def handle(self, w: _Worker) -> None:
        """Read what worker `w` sent; a closed pipe means it exited."""
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                if msg[0] == "progress" and w.job is not None:
                    self.observer.job_progress(w.job, msg[1], msg[2], msg[3])
                elif msg[0] == "redo" and w.job is not None:
                    self.observer.job_redo(w.job, msg[1])
                elif msg[0] == "result" and w.job is not None:
                    job, w.job = w.job, None
                    self.finish(job, msg[1])
        except (EOFError, OSError):
            self.reap(w)

    def reap(self, w: _Worker) -> None:
        w.process.join(timeout=5)
        if w.job is not None:
            job, w.job = w.job, None
            code = w.process.exitcode
            error = INTERRUPTED if self.stop.is_set() else f"the worker process died (exit code {code}" + \
                (", killed: out of memory?)" if code == -signal.SIGKILL else ")")
            remove_stale_temp_files([job])
            self.finish(job, job_result(job, "failed", seconds=time.perf_counter() - w.started, error=error))
        if w in self.pool:
            self.pool.remove(w)
        w.conn.close()

    def shutdown(self, grace: float = 60.0) -> None:
        """Stop the workers: idle ones are told to exit, busy ones get SIGTERM (their conversion
        raises, its temp file goes); results still arriving are recorded; SIGKILL after `grace` s."""
        for w in list(self.pool):
            try:
                if w.job is None:
                    w.conn.send(None)
                elif w.process.pid is not None:
                    os.kill(w.process.pid, signal.SIGTERM)
            except (OSError, EOFError, ValueError):
                pass
        deadline = time.monotonic() + grace
        while self.pool and time.monotonic() < deadline:
            self.collect(timeout=0.2)
        for w in list(self.pool):
            w.process.kill()
            self.reap(w)
