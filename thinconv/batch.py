"""Batch conversion: many models × output types from one jobs file, unattended and resumable.

The pieces, each usable alone (docs/batch.md describes the jobs file and the semantics):

* :func:`load_jobs` reads and validates a jobs file (TOML or JSON Lines) completely before
  anything runs, reporting every problem with its job number and field;
* :func:`assign_shards` / :func:`shard_jobs` split the jobs deterministically across a cluster;
  :func:`parse_shard` reads ``I/N`` or the scheduler's environment (``--shard auto``);
* :func:`archive_mismatch` decides whether an existing archive is the one a job would write
  (its *fingerprint*: source identity, options, recipe, thinconv version);
* :func:`plan_batch` says what a run would do (``--dry-run``); :func:`run_batch` runs the jobs
  on worker processes, skips the done ones, isolates failures, writes the JSON Lines report
  and stops cleanly on SIGINT / SIGTERM.

Job numbers are 1-based: job 1 is the first job of the file.
"""

from __future__ import annotations

import glob
import json
import multiprocessing
import os
import queue
import re
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_connections
from pathlib import Path
from typing import Any, Iterator

import thinconv
from thinconv.errors import JobsFileError, ThinError, UsageError
from thinconv.plan import DEFAULT_PAGE_SIZE, ConvertOptions, parse_keep, parse_page_size

JOB_KEYS = ("source", "out", "recipe", "dtype", "revision", "keep", "page_size", "rope_layout", "strict", "probe")
DEFAULT_KEYS = tuple(k for k in JOB_KEYS if k != "out")  # one `out` for several jobs would collide
STATUSES = ("done", "skipped", "failed")
INTERRUPTED = "interrupted"
PROGRESS_INTERVAL = 0.1  # seconds between progress messages of one job (≤ 10/s)
WORKER_MEMORY = 2 * 1024**3  # what one conversion worker is budgeted (pages in flight, probe, mmaps)
SHARDS_ENV = "THINCONV_SHARDS"  # the shard count for --shard auto under a Kubernetes indexed Job


# ---------------------------------------------------------------- the jobs file

@dataclass(frozen=True)
class Job:
    """One conversion: a source (hub repo id or absolute local folder) to one archive."""

    index: int  # 1-based position in the jobs file
    source: str
    out: Path  # absolute
    options: ConvertOptions
    recipe: str | None = None
    revision: str | None = None  # hub sources only
    hub: bool = False


def load_jobs(path: str | os.PathLike, *, registry=None) -> list[Job]:
    """Read and validate a jobs file: TOML (``[defaults]`` + ``[[job]]``) or JSON Lines (one job
    object a line, optionally a first ``{"defaults": {...}}`` line). Relative ``source`` and
    ``out`` paths resolve against the file's folder; recipe names are checked against `registry`
    (default: the built-in and $THINCONV_RECIPES recipes).

    Raises :class:`JobsFileError` listing every problem (``FILE: job N (…): field 'x': …``)."""
    path = Path(path)
    name = path.name
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JobsFileError([f"{path}: no such jobs file"]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise JobsFileError([f"{path}: cannot read ({getattr(e, 'strerror', None) or e})"]) from None
    if _is_jsonl(path, text):
        defaults, entries, problems = _parse_jsonl(name, text)
    else:
        defaults, entries, problems = _parse_toml(name, text)
    if problems:
        raise JobsFileError(problems)
    if registry is None:
        from thinconv.recipe import load_registry

        registry = load_registry([])
    base = path.resolve().parent
    checked_defaults: dict[str, Any] = {}
    for key, value in defaults.items():
        if key not in DEFAULT_KEYS:
            hint = " (each job names its own out)" if key == "out" else ""
            problems.append(f"{name}: defaults: unknown field {key!r}{hint} (fields: {', '.join(DEFAULT_KEYS)})")
            continue
        parsed, problem = _check_field(key, value, registry)
        if problem:
            problems.append(f"{name}: defaults: field {key!r}: {problem}")
        else:
            checked_defaults[key] = parsed
    bad_defaults = {k for k in defaults if k not in checked_defaults}
    jobs: list[Job] = []
    outs: dict[Path, int] = {}
    for index, (where, entry) in enumerate(entries, start=1):
        hint = entry.get("out") if isinstance(entry.get("out"), str) else entry.get("source")
        label = f"{name}: job {index} ({where}{hint if isinstance(hint, str) else '?'})"
        job, job_problems = _check_job(index, entry, checked_defaults, bad_defaults, base, registry)
        problems += [f"{label}: {p}" for p in job_problems]
        if job is None:
            continue
        if job.out in outs:
            problems.append(f"{label}: field 'out': {job.out} is also the output of job {outs[job.out]}")
            continue
        outs[job.out] = index
        jobs.append(job)
    if not entries and not problems:
        problems.append(f"{name}: no jobs (add [[job]] tables with source and out)")
    if problems:
        raise JobsFileError(problems)
    return jobs


def _is_jsonl(path: Path, text: str) -> bool:
    if path.suffix.lower() in (".jsonl", ".ndjson", ".json"):
        return True
    if path.suffix.lower() == ".toml":
        return False
    return text.lstrip().startswith("{")


def _parse_toml(name: str, text: str) -> tuple[dict, list[tuple[str, dict]], list[str]]:
    import tomllib

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        return {}, [], [f"{name}: not valid TOML ({e})"]
    problems = [f"{name}: unknown top-level key {k!r} (expected [defaults] and [[job]])"
                for k in data if k not in ("defaults", "job")]
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        problems.append(f"{name}: 'defaults' must be a table ([defaults])")
        defaults = {}
    jobs = data.get("job", [])
    if not isinstance(jobs, list) or not all(isinstance(j, dict) for j in jobs):
        problems.append(f"{name}: 'job' must be an array of tables ([[job]])")
        jobs = []
    return defaults, [("", j) for j in jobs], problems


def _parse_jsonl(name: str, text: str) -> tuple[dict, list[tuple[str, dict]], list[str]]:
    defaults: dict = {}
    entries: list[tuple[str, dict]] = []
    problems: list[str] = []
    first = True
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            problems.append(f"{name}: line {lineno}: not valid JSON ({e})")
            first = False
            continue
        if not isinstance(obj, dict):
            problems.append(f"{name}: line {lineno}: expected a JSON object, got {type(obj).__name__}")
        elif "defaults" in obj:
            if not first or len(obj) != 1 or not isinstance(obj["defaults"], dict):
                problems.append(f"{name}: line {lineno}: a defaults line must be the first line and hold only "
                                f"{{\"defaults\": {{...}}}}")
            else:
                defaults = obj["defaults"]
        else:
            entries.append((f"line {lineno}: ", obj))
        first = False
    return defaults, entries, problems


def _check_field(key: str, value: Any, registry) -> tuple[Any, str | None]:
    """(parsed value, None) or (None, what is wrong) for one field of a job or of the defaults."""
    if key in ("source", "out", "revision", "recipe", "dtype", "rope_layout"):
        if not isinstance(value, str) or not value.strip():
            return None, f"expected a non-empty string, got {value!r}"
    if key in ("strict", "probe") and not isinstance(value, bool):
        return None, f"expected true or false, got {value!r}"
    try:
        if key == "dtype":
            ConvertOptions(dtype=value)
        elif key == "rope_layout":
            ConvertOptions(rope_layout=value)
        elif key == "recipe":
            registry.get(value)
        elif key == "page_size":
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                return None, f"expected a byte count like 16777216 or \"16MiB\", got {value!r}"
            value = parse_page_size(value) if isinstance(value, str) else value
            ConvertOptions(page_size=value)
        elif key == "keep":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                return None, f"expected a list of \"ROLE_GLOB=DTYPE\" strings, got {value!r}"
            value = parse_keep(value)
            ConvertOptions(keep=value)
    except ThinError as e:
        return None, re.sub(r"^--[\w-]+ ", "", str(e))
    return value, None


def _check_job(index: int, entry: dict, defaults: dict, bad_defaults: set[str], base: Path,
               registry) -> tuple[Job | None, list[str]]:
    """(the job, []) or (None, every problem of this entry)."""
    from thinconv.checkpoint.source import _looks_like_repo_id

    problems = [f"unknown field {k!r} (fields: {', '.join(JOB_KEYS)})" for k in entry if k not in JOB_KEYS]
    values = dict(defaults)
    bad = set(bad_defaults)
    for key, value in entry.items():
        if key in JOB_KEYS:
            bad.discard(key)
            parsed, problem = _check_field(key, value, registry)
            if problem:
                problems.append(f"field {key!r}: {problem}")
                bad.add(key)
            else:
                values[key] = parsed
    for key in ("source", "out"):
        if key not in values and key not in bad:
            problems.append(f"field {key!r}: missing")
    source, hub = None, False
    if "source" in values and "source" not in bad:
        raw_source = values["source"]
        local = base / Path(raw_source).expanduser()
        if local.is_dir():
            source = str(local.resolve())
        elif not Path(raw_source).is_absolute() and _looks_like_repo_id(raw_source) and not local.exists():
            source, hub = raw_source, True
        elif local.exists():
            problems.append(f"field 'source': {local} is a file, expected a checkpoint folder or a hub repo id "
                            f"(org/name)")
        else:
            problems.append(f"field 'source': no such folder {local}, and {raw_source!r} is not a hub repo id "
                            f"(org/name)")
    revision = values.get("revision")
    if revision is not None and source is not None and not hub:
        problems.append(f"field 'revision': {revision!r} applies only to hub repo ids; {source} is a local folder")
    out = None
    if "out" in values and "out" not in bad:
        out = (base / Path(values["out"]).expanduser()).resolve()
        if out.is_dir():
            problems.append(f"field 'out': {out} is a folder; name the .thin file to write")
        elif not out.parent.is_dir():
            problems.append(f"field 'out': the output folder {out.parent} does not exist")
    if problems or bad or source is None or out is None:
        return None, problems
    try:
        options = ConvertOptions(dtype=values.get("dtype", "auto"), page_size=values.get("page_size", DEFAULT_PAGE_SIZE),
                                 rope_layout=values.get("rope_layout", "half"), keep=values.get("keep", ()),
                                 strict=values.get("strict", False), probe=values.get("probe", True))
    except ThinError as e:
        return None, [f"options: {e}"]
    return Job(index, source, out, options, values.get("recipe"), revision, hub), []


# ---------------------------------------------------------------- sharding

def parse_shard(text: str, environ: dict[str, str] | None = None) -> tuple[int, int]:
    """``"I/N"`` → (I, N) with 0 ≤ I < N; ``"auto"`` reads the scheduler's environment:
    Slurm arrays (SLURM_ARRAY_TASK_ID, minus SLURM_ARRAY_TASK_MIN, divided by SLURM_ARRAY_TASK_STEP;
    N from $THINCONV_SHARDS, SLURM_ARRAY_TASK_COUNT or MAX - MIN + 1) or Kubernetes indexed Jobs
    (JOB_COMPLETION_INDEX; N from $THINCONV_SHARDS, which Kubernetes does not set for you)."""
    env = os.environ if environ is None else environ
    if text.strip() == "auto":
        return _auto_shard(env)
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m:
        raise UsageError(f"--shard {text!r}: expected I/N (e.g. 0/4, with 0 ≤ I < N) or auto")
    i, n = int(m.group(1)), int(m.group(2))
    if n < 1 or i >= n:
        raise UsageError(f"--shard {text}: expected 0 ≤ I < N and N ≥ 1")
    return i, n


def _env_int(env: dict[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"--shard auto: ${name} is {value!r}, expected an integer") from None


def _auto_shard(env: dict[str, str]) -> tuple[int, int]:
    shards = _env_int(env, SHARDS_ENV)
    task = _env_int(env, "SLURM_ARRAY_TASK_ID")
    if task is not None:
        lo = _env_int(env, "SLURM_ARRAY_TASK_MIN") or 0
        step = _env_int(env, "SLURM_ARRAY_TASK_STEP") or 1
        hi = _env_int(env, "SLURM_ARRAY_TASK_MAX")
        count = shards or _env_int(env, "SLURM_ARRAY_TASK_COUNT") or \
            (None if hi is None else (hi - lo) // step + 1)
        index, where = (task - lo) // step, "SLURM_ARRAY_TASK_ID"
    else:
        index, count, where = _env_int(env, "JOB_COMPLETION_INDEX"), shards, "JOB_COMPLETION_INDEX"
        if index is None:
            raise UsageError("--shard auto: neither $SLURM_ARRAY_TASK_ID (Slurm job array) nor $JOB_COMPLETION_INDEX "
                             "(Kubernetes indexed Job) is set; pass --shard I/N")
        if count is None:
            raise UsageError(f"--shard auto: $JOB_COMPLETION_INDEX is set but ${SHARDS_ENV} is not; set it to the "
                             f"Job's completions")
    if count is None:
        raise UsageError(f"--shard auto: cannot tell the number of shards; set ${SHARDS_ENV}")
    if count < 1 or not 0 <= index < count:
        raise UsageError(f"--shard auto: ${where} gives shard {index}, outside 0..{count - 1}")
    return index, count


def source_size(job: Job) -> int | None:
    """Bytes of a local source folder's files (None for hub sources: a cache differs between nodes
    and over time, and every shard must compute the same assignment)."""
    if job.hub:
        return None
    try:
        return sum(p.stat().st_size for p in Path(job.source).iterdir() if p.is_file())
    except OSError:
        return None


def assign_shards(sizes: list[int | None], count: int) -> list[int]:
    """The shard of each job: largest first onto the lightest shard (ties: lower job index, then
    lower shard). Unknown sizes weigh the mean of the known ones. Deterministic: it depends only
    on `sizes` and `count`."""
    known = [s for s in sizes if s is not None]
    fill = max(1, round(sum(known) / len(known))) if known else 1
    weights = [fill if s is None else max(int(s), 1) for s in sizes]
    load = [0] * count
    shard = [0] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda k: (-weights[k], k)):
        target = min(range(count), key=lambda s: (load[s], s))
        shard[k] = target
        load[target] += weights[k]
    return shard


def shard_jobs(jobs: list[Job], index: int, count: int) -> list[Job]:
    """The jobs of shard `index` of `count` (in file order); every job lands in exactly one shard."""
    if count == 1:
        return list(jobs)
    owner = assign_shards([source_size(j) for j in jobs], count)
    return [j for j, s in zip(jobs, owner) if s == index]


# ---------------------------------------------------------------- done or not: the fingerprint

def job_fingerprint(job: Job, commit: str | None = None) -> dict:
    """What an archive must record to count as this job's output."""
    source = {"repo_id": job.source, "commit": commit} if job.hub else {"folder": job.source}
    return {"source": source, "options": job.options.record(), "version": thinconv.__version__, "recipe": job.recipe}


def archive_mismatch(job: Job, commit: str | None = None) -> str | None:
    """None when `job.out` holds the archive `job` would write — same thinconv version, recipe
    (when the job names one), options and source identity (hub: repo and resolved `commit`; local:
    file names and sizes, config.json, and no source file newer than the archive); else why not.
    Checks the manifest only, not the page checksums (see :func:`verify_archive`)."""
    from thinconv.format import spec
    from thinconv.format.reader import open_archive

    want = job_fingerprint(job, commit)
    if not job.out.exists():
        return "no archive yet"
    try:
        with open(job.out, "rb") as f:
            magic = f.read(len(spec.MAGIC))
    except OSError as e:
        return f"cannot read it ({e.strerror or e})"
    if magic != spec.MAGIC:
        raise ThinError(f"{job.out} exists and is not a .thin archive; move it away (batch replaces only archives)")
    try:
        with open_archive(job.out) as a:
            manifest = a.manifest
            archived_config = a.asset_bytes("config.json") if any(x["name"] == "config.json" for x in manifest["assets"]) else None
    except ThinError as e:
        return f"unreadable archive ({e})"
    validation = manifest.get("validation", {})
    conv, src = validation.get("converter") or {}, validation.get("source") or {}
    if conv.get("version") != want["version"]:
        return f"made by thinconv {conv.get('version')}, this is {want['version']}"
    if job.recipe is not None and conv.get("recipe") != job.recipe:
        return f"recipe {conv.get('recipe')!r} ≠ {job.recipe!r}"
    have_opts = conv.get("options")
    if have_opts != want["options"]:
        if not isinstance(have_opts, dict):
            return "the archive records no conversion options"
        diff = [k for k in want["options"] if have_opts.get(k) != want["options"][k]]
        return "options differ: " + ", ".join(f"{k} {have_opts.get(k)!r} → {want['options'][k]!r}" for k in diff)
    if job.hub:
        if src.get("repo_id") != job.source or src.get("commit") != commit:
            return f"source was {src.get('repo_id')}@{src.get('commit')}, now {job.source}@{commit}"
        return None
    if src.get("repo_id") is not None:
        return f"source was the hub repo {src.get('repo_id')}, now a local folder"
    return _local_mismatch(job, src, archived_config)


def _local_mismatch(job: Job, src: dict, archived_config: bytes | None) -> str | None:
    from thinconv.checkpoint.source import open_checkpoint

    try:
        with open_checkpoint(job.source) as ckpt:
            files = ckpt.files
    except ThinError as e:
        return f"source cannot be opened ({e})"
    have = [(f.get("name"), f.get("size")) for f in src.get("files", [])]
    now = [(f.name, f.size) for f in files]
    if sorted(have) != sorted(now):
        return "source files differ (names or sizes)"
    config = Path(job.source) / "config.json"
    try:
        if archived_config is not None and config.read_bytes() != archived_config:
            return "source config.json differs"
        made = job.out.stat().st_mtime
        newer = [f.name for f in files if f.path.stat().st_mtime > made]
    except OSError as e:
        return f"cannot read the source ({e.strerror or e})"
    if newer:
        return f"source file {newer[0]} is newer than the archive"
    return None


def verify_archive(path: Path, progress=None) -> str | None:
    """None when every checksum of the archive verifies; else the first failure. `progress`
    (start(phase, total) / advance(n), like the converter's) follows the bytes checked."""
    from thinconv.format.reader import open_archive

    try:
        with open_archive(path) as a:
            if progress is not None:
                progress.start("verifying", sum(p.size for p in a.pages))
            report = a.verify(progress=progress.advance if progress is not None else None)
    except ThinError as e:
        return str(e)
    return None if report.ok else f"{report.failures[0]}" + (f" (+{len(report.failures) - 1} more)"
                                                              if len(report.failures) > 1 else "")


def resolve_commit(repo_id: str, revision: str | None, token: str | None = None) -> str:
    """The commit a hub branch / tag / commit names, through the HF cache (only config.json is
    fetched; offline, the cache's refs answer)."""
    from thinconv.checkpoint.source import CONFIG_NAME, _hub_download

    if revision is not None and re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    return _hub_download(repo_id, revision or "main", token, [CONFIG_NAME]).name


def download_source(repo_id: str, commit: str, token: str | None = None) -> None:
    """Fetch everything a conversion of repo_id@commit reads into the HF cache (configs, index,
    tokenizer files, the shards the index names), as a conversion would."""
    from thinconv.checkpoint.source import open_checkpoint

    with open_checkpoint(repo_id, revision=commit, token=token):
        pass


# ---------------------------------------------------------------- results and report

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


def _result(job: Job, status: str, **kw) -> JobResult:
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
    each job's output; returns what was removed."""
    removed = []
    for job in jobs:
        for name in glob.glob(os.path.join(glob.escape(str(job.out.parent)), f".{glob.escape(job.out.name)}.*.tmp")):
            p = Path(name)
            try:
                if p.is_file() and not p.is_symlink():
                    p.unlink()
                    removed.append(p)
            except OSError:
                pass
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


# ---------------------------------------------------------------- stopping

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


# ---------------------------------------------------------------- workers

def default_workers() -> int:
    """max(1, min(cores // 2, available memory // 2 GiB)): each conversion already uses 2 threads."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    memory = _available_memory()
    by_memory = memory // WORKER_MEMORY if memory else cores
    return max(1, min(cores // 2, by_memory))


def _available_memory() -> int | None:
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


def _worker_main(conn, recipe_dirs: list[str], parent: int) -> None:
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
                    from thinconv.recipe import load_registry

                    registry = load_registry([Path(d) for d in recipe_dirs])
                result = _run_task(job, commit, mode, registry, send)
            except _Stop:
                send(("result", _result(job, "failed", seconds=time.perf_counter() - t0, error=INTERRUPTED)))
                return
            except ThinError as e:
                result = _result(job, "failed", seconds=time.perf_counter() - t0, error=str(e))
            except Exception as e:  # a bug or an unexpected OS error: still one line, and the batch goes on
                first = (str(e).strip().splitlines() or [""])[0]
                result = _result(job, "failed", seconds=time.perf_counter() - t0,
                                 error=f"{type(e).__name__}: {first}".rstrip(": "))
            send(("result", result))
    except (_Stop, EOFError, OSError):
        return


def _die_with_parent(parent: int) -> None:
    """Linux: SIGTERM this worker when the batch process (pid `parent`) dies, even by SIGKILL (its
    conversion then stops and removes its temp file instead of running on unattended)."""
    try:
        import ctypes

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
    from thinconv.convert import convert_source

    t0 = time.perf_counter()
    progress = _PipeProgress(send, job)
    if mode == "verify" and verify_archive(job.out, progress) is None:
        from thinconv.format.reader import open_archive

        with open_archive(job.out) as a:  # header and manifest only: the pages were just verified
            return _result(job, "skipped", seconds=time.perf_counter() - t0, bytes_in=_bytes_in(a.manifest),
                           bytes_out=a.file_size, archive_hash=a.header.archive_hash.hex())
    # Pinned to the commit the batch resolved (and downloaded); the archive records the revision
    # as the job names it, so it is the archive `thinconv convert` would write.
    result = convert_source(job.source, job.out, options=job.options, recipe=job.recipe,
                            revision=job.revision if job.hub else None, commit=commit if job.hub else None,
                            force=True, registry=registry, progress=progress)
    return _result(job, "done", seconds=time.perf_counter() - t0, bytes_in=_bytes_in(result.manifest),
                   bytes_out=result.size, archive_hash=result.archive_hash, warnings=list(result.warnings))


def _bytes_in(manifest: dict) -> int | None:
    files = ((manifest.get("validation") or {}).get("source") or {}).get("files")
    return sum(f["size"] for f in files) if files else None


# ---------------------------------------------------------------- planning and running

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
                finish(job, _result(job, "failed", error=p.reason))
            else:
                pending.append(p)
        downloads = list(dict.fromkeys((p.job.source, p.commit) for p in pending if p.job.hub and p.action == "run"))
        downloader = _Downloader(downloads, token, stop)
        if downloads and not stop.is_set():
            downloader.start()
        _dispatch(pending, workers or default_workers(), [str(d) for d in recipe_dirs], downloader, observer, stop,
                  finish)
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


def _dispatch(pending: list[Planned], n_workers: int, recipe_dirs: list[str], downloader: _Downloader,
              observer: BatchObserver, stop: StopFlag, finish) -> None:
    """The parent's loop: hand ready jobs to idle workers, relay progress, collect results."""
    ctx = multiprocessing.get_context("spawn")  # not fork: this process has threads
    pool: list[_Worker] = []
    n_workers = max(1, min(n_workers, len(pending)))

    def spawn() -> _Worker:
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(child_end, recipe_dirs, os.getpid()), name="thinconv-batch-worker",
                           daemon=True)
        proc.start()
        child_end.close()
        w = _Worker(proc, parent_end)
        pool.append(w)
        return w

    def handle(w: _Worker) -> None:
        """Read what worker `w` sent; a closed pipe means it exited."""
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                if msg[0] == "progress" and w.job is not None:
                    observer.job_progress(w.job, msg[1], msg[2], msg[3])
                elif msg[0] == "result" and w.job is not None:
                    job, w.job = w.job, None
                    finish(job, msg[1])
        except (EOFError, OSError):
            _reap(w)

    def _reap(w: _Worker) -> None:
        w.process.join(timeout=5)
        if w.job is not None:
            job, w.job = w.job, None
            code = w.process.exitcode
            error = INTERRUPTED if stop.is_set() else f"the worker process died (exit code {code}" + \
                (", killed: out of memory?)" if code == -signal.SIGKILL else ")")
            remove_stale_temp_files([job])
            finish(job, _result(job, "failed", seconds=time.perf_counter() - w.started, error=error))
        if w in pool:
            pool.remove(w)
        w.conn.close()

    queue_ = list(pending)
    if pending:
        observer.message(f"{len(pending)} job{'s' * (len(pending) != 1)} to check or convert on {n_workers} "
                         f"worker process{'es' * (n_workers != 1)}")
    try:
        while (queue_ or any(w.job for w in pool)) and not stop.is_set():
            while True:
                try:
                    observer.message(downloader.messages.get_nowait())
                except queue.Empty:
                    break
            # Hand out ready jobs (in file order, a job whose hub source is still downloading waits).
            for p in list(queue_):
                idle = [w for w in pool if w.job is None]
                if not idle and len(pool) >= n_workers:
                    break
                state = downloader.status((p.job.source, p.commit)) if p.job.hub and p.action == "run" else "ready"
                if state == "pending":
                    continue
                queue_.remove(p)
                observer.job_started(p.job, p.reason)
                if isinstance(state, ThinError):
                    finish(p.job, _result(p.job, "failed", error=str(state)))
                    continue
                w = idle[0] if idle else spawn()
                w.job, w.started = p.job, time.perf_counter()
                try:
                    w.conn.send((p.job, p.commit, p.action))
                except (OSError, EOFError):
                    _reap(w)
            if not pool:
                time.sleep(0.1)  # waiting for a download
                continue
            ready = wait_connections([w.conn for w in pool] + [w.process.sentinel for w in pool], timeout=0.2)
            for w in list(pool):
                if w.conn in ready or w.process.sentinel in ready:
                    handle(w)
                    if w in pool and not w.process.is_alive():
                        handle(w)
                        _reap(w)
    finally:
        _shutdown(pool, handle, _reap)


def _shutdown(pool: list[_Worker], handle, reap, grace: float = 60.0) -> None:
    """Stop the workers: idle ones are told to exit, busy ones get SIGTERM (their conversion
    raises, its temp file goes); results still arriving are recorded; SIGKILL after `grace` s."""
    for w in list(pool):
        try:
            if w.job is None:
                w.conn.send(None)
            elif w.process.pid is not None:
                os.kill(w.process.pid, signal.SIGTERM)
        except (OSError, EOFError, ValueError):
            pass
    deadline = time.monotonic() + grace
    while pool and time.monotonic() < deadline:
        ready = wait_connections([w.conn for w in pool] + [w.process.sentinel for w in pool], timeout=0.2)
        for w in list(pool):
            if w.conn in ready:
                handle(w)
            if w in pool and not w.process.is_alive():
                handle(w)
                if w in pool:
                    reap(w)
    for w in list(pool):
        w.process.kill()
        reap(w)


__all__ = ["Job", "JobResult", "Planned", "Summary", "BatchObserver", "StopFlag", "load_jobs", "parse_shard",
           "assign_shards", "shard_jobs", "source_size", "job_fingerprint", "archive_mismatch", "verify_archive",
           "resolve_commit", "download_source", "read_report", "failed_outs", "remove_stale_temp_files",
           "plan_batch", "run_batch", "stop_on_signals", "default_workers"]
