"""Sharding: which jobs of a jobs file one cluster task runs (`--shard I/N`, `--shard auto`).
The split is deterministic, so every task of an array computes the same assignment."""

from __future__ import annotations

import os
import re
from pathlib import Path

from thinconv.batch.jobs import Job
from thinconv.errors import UsageError

SHARDS_ENV = "THINCONV_SHARDS"  # the shard count for --shard auto under a Kubernetes indexed Job


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
