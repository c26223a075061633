"""Batch conversion: many models × output types from one jobs file, unattended and resumable.

The pieces, each usable alone (docs/batch.md describes the jobs file and the semantics):

* `jobs`: :func:`load_jobs` reads and validates a jobs file (TOML or JSON Lines) completely
  before anything runs, reporting every problem with its job number and field;
* `shards`: :func:`assign_shards` / :func:`shard_jobs` split the jobs deterministically across a
  cluster; :func:`resolve_shard` / :func:`parse_shard` read ``I/N`` or the scheduler's environment
  (``--shard auto``: the index is the array task id itself, the count is given or a whole array's);
* `fingerprint`: :func:`archive_mismatch` decides whether an existing archive is the one a job
  would write (source identity, options, recipe, thinconv version);
* `report`: results, the JSON Lines report, the summary and the observer a front end renders;
* `workers` and `runner`: :func:`plan_batch` says what a run would do (``--dry-run``);
  :func:`run_batch` runs the jobs on worker processes, skips the done ones, isolates failures,
  writes the report and stops cleanly on SIGINT / SIGTERM.

Job numbers are 1-based: job 1 is the first job of the file.
"""

from thinconv.batch.fingerprint import (archive_mismatch, download_source, job_fingerprint, resolve_commit,
                                        verify_archive)
from thinconv.batch.jobs import DEFAULT_KEYS, JOB_KEYS, Job, load_jobs
from thinconv.batch.report import (INTERRUPTED, STATUSES, BatchObserver, JobResult, Planned, Summary, failed_outs,
                                   read_report, remove_stale_temp_files)
from thinconv.batch.runner import plan_batch, run_batch
from thinconv.batch.shards import (SHARDS_ENV, Shard, assign_shards, parse_shard, resolve_shard, shard_jobs,
                                   source_size)
from thinconv.batch.workers import StopFlag, default_workers, stop_on_signals

__all__ = ["Job", "JobResult", "Planned", "Summary", "BatchObserver", "StopFlag", "Shard", "load_jobs", "parse_shard",
           "resolve_shard", "assign_shards", "shard_jobs", "source_size", "job_fingerprint", "archive_mismatch",
           "verify_archive", "resolve_commit", "download_source", "read_report", "failed_outs",
           "remove_stale_temp_files", "plan_batch", "run_batch", "stop_on_signals", "default_workers", "JOB_KEYS",
           "DEFAULT_KEYS", "STATUSES", "INTERRUPTED", "SHARDS_ENV"]
