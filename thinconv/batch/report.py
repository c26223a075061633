"""What a run produces and reports: one result per job, the JSON Lines report, the run's summary,
and the observer interface a front end renders; plus the stale temp files a hard kill leaves."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from thinconv.batch.jobs import Job
from thinconv.errors import UsageError
from thinconv.format.temps import remove_stale_temps

STATUSES = ("done", "skipped", "failed")
INTERRUPTED = "interrupted"


@dataclass
class JobResult:
    """One line of the report."""

    job: int
    source: str
    out: str
    status: str  # done | skipped | failed
    seconds: float = 0.0
    bytes_in: int | None = None
    bytes_out: int | None = None
    archive_hash: str | None = None
    error: str | None = None
    warnings: list[str] = field(default_factory=list)

    def record(self) -> dict:
        return {"job": self.job, "source": self.source, "out": self.out, "status": self.status,
                "seconds": round(self.seconds, 3), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "archive_hash": self.archive_hash, "error": self.error, "warnings": self.warnings}


def job_result(job: Job, status: str, **kw) -> JobResult:
    return JobResult(job.index, job.source, str(job.out), status, **kw)


def read_report(path: str | os.PathLike) -> list[dict]:
    """The lines of a report written by :func:`run_batch` (a missing file is a UsageError)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UsageError(f"{path}: no such report (--retry-failed reads the previous run's --report)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise UsageError(f"{path}: line {n}: not valid JSON; is this a batch report?") from None
        if not isinstance(rec, dict) or rec.get("status") not in STATUSES or not isinstance(rec.get("out"), str):
            raise UsageError(f"{path}: line {n}: not a batch report line")
        out.append(rec)
    return out


def failed_outs(report: list[dict]) -> set[str]:
    """The outputs whose last report line says failed."""
    last: dict[str, str] = {}
    for rec in report:
        last[rec["out"]] = rec["status"]
    return {out for out, status in last.items() if status == "failed"}


def remove_stale_temp_files(jobs: list[Job]) -> list[Path]:
    """Delete the converter's temp files (``.<out name>.*.tmp``) a hard-killed run left next to
    each job's output — not those a running conversion still holds (see remove_stale_temps);
    returns what was removed."""
    removed = []
    for job in jobs:
        removed += remove_stale_temps(job.out)
    return removed


# ---------------------------------------------------------------- observing a run

class BatchObserver:
    """What a run reports as it goes; every call comes from the caller's thread. Override what
    you render (the CLI: a rich live table, or one plain line per event)."""

    def message(self, text: str) -> None:
        """A batch-level event (resolving or downloading a hub source, cleanup)."""

    def job_started(self, job: Job, reason: str) -> None:
        """`job` went to a worker; `reason` says why it runs (or that it is being verified)."""

    def job_progress(self, job: Job, phase: str, done: int, total: int) -> None:
        """Bytes `done` of `total` in `phase` (verifying, converting)."""

    def job_redo(self, job: Job, reason: str) -> None:
        """`job`'s archive looked up to date but is converted again after all; `reason` says why
        (e.g. ``archive fails verification: page '…' at offset …: checksum mismatch``)."""
        self.message(f"job {job.index} redo: {reason}; converting it again")

    def job_finished(self, job: Job, result: JobResult) -> None:
        """`job` is done, skipped or failed (already written to the report)."""


@dataclass
class Summary:
    results: list[JobResult]
    interrupted: bool = False
    not_started: int = 0
    seconds: float = 0.0

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def ok(self) -> bool:
        return not self.interrupted and self.count("failed") == 0


@dataclass
class Planned:
    """What a run would do with one job (``--dry-run``)."""

    job: Job
    action: str  # run | skip | fail
    reason: str
    commit: str | None = None
