"""`batch`: the command and its two views (a live table on a terminal, plain lines otherwise).
The batch engine is imported inside the command (start-up time of the other commands)."""

from __future__ import annotations

import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from thinconv.cli.app import app, err, examples, fail, human, out, print_json, reported
from thinconv.errors import JobsFileError, UsageError


class PlainBatchLog:
    """One line per batch event on stdout (when it is not a terminal: logs, CI, schedulers)."""

    def __enter__(self) -> "PlainBatchLog":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def line(self, text: str) -> None:
        out.print(text)
        sys.stdout.flush()

    def message(self, text: str) -> None:
        self.line(text)

    def job_started(self, job, reason: str) -> None:
        self.line(f"job {job.index} start: {job.source} → {job.out} ({reason})")

    def job_progress(self, job, phase: str, done: int, total: int) -> None:
        pass

    def job_redo(self, job, reason: str) -> None:
        self.line(f"job {job.index} redo: {reason}; converting it again")

    def job_finished(self, job, result) -> None:
        self.line(batch_result_line(result))


def batch_result_line(r) -> str:
    if r.status == "failed":
        return f"job {r.job} FAILED: {r.error}"
    what = "done" if r.status == "done" else "skipped (up to date)"
    return (f"job {r.job} {what}: {r.out} {human(r.bytes_out or 0)} in {r.seconds:.1f} s, archive hash "
            f"{r.archive_hash or 'unknown'}" + "".join(f"\n  warning: {w}" for w in r.warnings))


class JsonBatchLog(PlainBatchLog):
    """--json: stdout carries only the final JSON object; batch messages go to stderr."""

    def line(self, text: str) -> None:
        err.print(text)

    def job_started(self, job, reason: str) -> None:
        pass

    def job_finished(self, job, result) -> None:
        pass


def result_json(r) -> dict:
    """One job's result in the JSON vocabulary of every command (`size`, `archive_hash`)."""
    return {"job": r.job, "source": r.source, "out": r.out, "status": r.status, "seconds": round(r.seconds, 3),
            "size": r.bytes_out, "archive_hash": r.archive_hash, "error": r.error, "warnings": r.warnings}


class LiveBatchView(PlainBatchLog):
    """A rich live table on a terminal: one row per running job (phase, bytes, bytes/s), overall
    progress and failures so far; finished jobs scroll above it as lines."""

    def __init__(self, total: int) -> None:
        self.clock = time.monotonic
        self.total, self.t0 = total, self.clock()
        self.running: dict[int, dict] = {}
        self.finished = {"done": 0, "skipped": 0, "failed": 0}
        self.live = Live(console=out, refresh_per_second=4, get_renderable=self.render, transient=True)

    def __enter__(self) -> "LiveBatchView":
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)

    def line(self, text: str) -> None:
        self.live.console.print(text)

    def job_started(self, job, reason: str) -> None:
        self.running[job.index] = {"job": job, "phase": "starting", "done": 0, "total": 0, "before": 0,
                                   "t0": self.clock()}

    def job_progress(self, job, phase: str, done: int, total: int) -> None:
        row = self.running.get(job.index)
        if row is None:
            return
        if phase != row["phase"]:
            row["before"] += row["done"]
        row.update(phase=phase, done=done, total=total)

    def job_finished(self, job, result) -> None:
        self.running.pop(job.index, None)
        self.finished[result.status] += 1
        style = {"done": "green", "skipped": "cyan", "failed": "bold red"}[result.status]
        self.live.console.print(f"[{style}]{escape(batch_result_line(result))}[/]", markup=True)

    def render(self):
        table = Table(title_justify="left", expand=False)
        for col in ("job", "source", "out", "phase", "progress", "speed"):
            table.add_column(col, justify="right" if col in ("job", "progress", "speed") else "left")
        now = self.clock()
        for index, row in sorted(self.running.items()):
            job = row["job"]
            rate = (row["before"] + row["done"]) / max(now - row["t0"], 1e-3)
            pct = f"{100 * row['done'] / row['total']:.0f} %" if row["total"] else ""
            table.add_row(str(index), job.source, job.out.name, row["phase"],
                          f"{human(row['done'])} / {human(row['total'])} {pct}", f"{human(int(rate))}/s")
        f = self.finished
        n = sum(f.values())
        footer = Text(f"{n}/{self.total} finished: {f['done']} done, {f['skipped']} skipped, {f['failed']} failed; "
                      f"{len(self.running)} running; {now - self.t0:.0f} s",
                      style="bold red" if f["failed"] else "")
        return Group(table, footer) if self.running else footer


@app.command("batch", epilog=examples("thinconv batch zoo.toml --workers 4 --report report.jsonl",
                                      "thinconv batch zoo.toml --dry-run",
                                      "thinconv batch zoo.toml --shard auto --json"))
def batch_cmd(jobs_file: Path = typer.Argument(..., metavar="JOBS_FILE", help="Jobs file, TOML or JSON Lines "
                                               "(schema: docs/batch.md)."),
              workers: Optional[int] = typer.Option(None, "--workers", metavar="N", help="Parallel conversions "
                                                    "(default: what fits the cores and memory)."),
              shard: Optional[str] = typer.Option(None, "--shard", metavar="I/N|auto", help="I/N: run only shard I of "
                                                  "N (0 ≤ I < N); auto: shard I = $SLURM_ARRAY_TASK_ID or "
                                                  "$JOB_COMPLETION_INDEX, N from --shards / $THINCONV_SHARDS (or a "
                                                  "whole 0..N-1 Slurm array)."),
              shards: Optional[int] = typer.Option(None, "--shards", metavar="N", help="With --shard auto: the number "
                                                   "of shards (as $THINCONV_SHARDS); keep it when resubmitting some "
                                                   "tasks."),
              report: Optional[Path] = typer.Option(None, "--report", metavar="FILE", help="Write a JSON Lines report: "
                                                    "one line per finished job."),
              dry_run: bool = typer.Option(False, "--dry-run", help="List what would run and what would be "
                                           "skipped; write nothing."),
              retry_failed: bool = typer.Option(False, "--retry-failed", help="Run only the jobs the previous "
                                                "--report FILE lists as failed."),
              recipes: list[Path] = typer.Option([], "--recipes", metavar="DIR", help="Extra recipe folder "
                                                 "(repeatable)."),
              as_json: bool = typer.Option(False, "--json", help="Print one JSON object at the end (README: JSON "
                                           "output); progress lines go to stderr.")) -> None:
    """Run many conversions from a jobs file: parallel, resumable (done jobs are skipped), shardable
    across a cluster. Exit 0 all succeeded, 1 some failed, 2 bad jobs file, 130/143 stopped by
    SIGINT/SIGTERM."""
    with _exit_on_signals(), reported():  # until the run starts, a signal ends the command at once
        _batch(jobs_file, workers, shard, shards, report, dry_run, retry_failed, recipes, as_json)


@contextmanager
def _exit_on_signals():
    """SIGINT / SIGTERM exit at once with 128 + the signal (nothing has been written yet). Installed
    first thing, so that thinconv as PID 1 of a container (which the kernel shields from signals it
    has no handler for) still stops; the run itself swaps in handlers that stop it cleanly. Under the
    console script (thinconv.launch), whose handlers already do this with one line, those stay."""
    previous = {}

    def on_signal(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        current = signal.getsignal(sig)
        if not callable(current) or current is signal.default_int_handler:
            previous[sig] = signal.signal(sig, on_signal)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _batch(jobs_file: Path, workers: Optional[int], shard: Optional[str], shards: Optional[int],
           report: Optional[Path], dry_run: bool, retry_failed: bool, recipes: list[Path], as_json: bool) -> None:
    from thinconv.batch import failed_outs, read_report, run_batch, stop_on_signals

    say = err.print if as_json else out.print
    if shard is None and shards is not None:
        raise UsageError(f"--shards {shards} goes with --shard auto")
    if workers is not None and workers < 1:
        raise UsageError(f"--workers {workers}: expected ≥ 1")
    if retry_failed and report is None:
        raise UsageError("--retry-failed needs --report FILE (the previous run's report, rewritten by this run)")
    jobs = _load(jobs_file, recipes, as_json)
    selected = jobs
    if shard is not None:
        from thinconv.batch import resolve_shard, shard_jobs
        which = resolve_shard(shard, shards=shards)
        selected = shard_jobs(jobs, which.index, which.count)
        origin = f" ({which.origin})" if which.origin else ""
        say(f"shard {which.index}/{which.count}{origin}: {len(selected)} of {len(jobs)} jobs")
    keep_lines = None
    if retry_failed:
        previous = read_report(report)
        failed = failed_outs(previous)
        selected = [j for j in selected if str(j.out) in failed]
        rerun = {str(j.out) for j in selected}
        keep_lines = [rec for rec in previous if rec["out"] not in rerun]
        say(f"--retry-failed: {len(selected)} failed job{'s' * (len(selected) != 1)} to retry")
    if dry_run:
        return _dry_run(selected, as_json)
    view = JsonBatchLog() if as_json else LiveBatchView(len(selected)) if out.is_terminal else PlainBatchLog()
    with stop_on_signals() as stop, view:
        summary = run_batch(selected, workers=workers, report=report, keep_lines=keep_lines,
                            recipe_dirs=recipes, observer=view, stop=stop)
    code = stop.exit_code if summary.interrupted else 1 if summary.count("failed") else 0
    if as_json:
        print_json({"ok": summary.ok, "jobs": len(selected), "done": summary.count("done"),
                    "skipped": summary.count("skipped"), "failed": summary.count("failed"),
                    "seconds": round(summary.seconds, 3), "interrupted": summary.interrupted,
                    "not_started": summary.not_started, "results": [result_json(r) for r in summary.results]})
        raise typer.Exit(code)
    line = (f"batch: {len(selected)} job{'s' * (len(selected) != 1)}: {summary.count('done')} done, "
            f"{summary.count('skipped')} skipped, {summary.count('failed')} failed in {summary.seconds:.1f} s")
    if summary.interrupted:
        err.print(f"{line}; stopped by a signal, {summary.not_started} not started (no partial archive is left; "
                  f"rerun to finish)")
    else:
        out.print(line)
    raise typer.Exit(code)


def _load(jobs_file: Path, recipes: list[Path], as_json: bool) -> list:
    """The jobs file, every problem in it listed (exit 2) before anything runs."""
    from thinconv.batch import load_jobs
    from thinconv.recipe import load_registry

    try:
        return load_jobs(jobs_file, registry=load_registry(recipes))
    except JobsFileError as e:
        headline = f"{jobs_file}: {len(e.problems)} problem{'s' * (len(e.problems) > 1)}; nothing was run"
        if as_json:
            fail(headline, 2, "jobs_file", problems=e.problems)
        for problem in e.problems:
            err.print(f"[bold red]error:[/] {escape(problem)}", markup=True)
        err.print(headline)
        raise typer.Exit(2)


def _dry_run(selected: list, as_json: bool) -> None:
    from thinconv.batch import plan_batch

    plans = plan_batch(selected, observer=JsonBatchLog() if as_json else PlainBatchLog())
    counts = {a: sum(p.action == a for p in plans) for a in ("run", "skip", "fail")}
    if as_json:
        print_json({"dry_run": True, "jobs": [{"job": p.job.index, "action": p.action, "source": p.job.source,
                                               "out": str(p.job.out), "reason": p.reason} for p in plans], **counts})
        return
    for p in plans:
        out.print(f"job {p.job.index} {p.action}: {p.job.source} → {p.job.out} ({p.reason})")
    out.print(f"dry run: {counts['run']} to run, {counts['skip']} to skip, {counts['fail']} failing; "
              f"nothing was written")
