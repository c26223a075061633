"""Sharding: which jobs of a jobs file one cluster task runs (`--shard I/N`, `--shard auto`).
The split is deterministic, so every task of an array computes the same assignment."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from thinconv.batch.jobs import Job
from thinconv.errors import UsageError

SHARDS_ENV = "THINCONV_SHARDS"  # the shard count for --shard auto (the same as --shards N)


@dataclass(frozen=True)
class Shard:
    """Which shard a run is: `index` of `count`, and (``--shard auto``) where the two numbers came
    from, for the log."""

    index: int
    count: int
    origin: str = ""


def parse_shard(text: str, environ: dict[str, str] | None = None, shards: int | None = None) -> tuple[int, int]:
    """``"I/N"`` → (I, N) with 0 ≤ I < N; ``"auto"`` reads the scheduler's environment (see
    :func:`resolve_shard`); `shards` is ``--shards N``."""
    shard = resolve_shard(text, environ, shards)
    return shard.index, shard.count


def resolve_shard(text: str, environ: dict[str, str] | None = None, shards: int | None = None) -> Shard:
    """The shard a run is, from ``--shard I/N`` or ``--shard auto`` (+ ``--shards N``).

    ``auto``: the shard *index* is the scheduler's task id itself — ``SLURM_ARRAY_TASK_ID`` (Slurm
    job array) or ``JOB_COMPLETION_INDEX`` (Kubernetes indexed Job) — so a task resubmitted alone
    (``sbatch --array=1,3``) runs the same shard as in the first submission. The shard *count* is
    `shards` (``--shards N``), else ``$THINCONV_SHARDS``, else — Slurm only — the array's size,
    but only when the environment proves the array is the whole range ``0..N-1``
    (``SLURM_ARRAY_TASK_MIN`` = 0, ``SLURM_ARRAY_TASK_STEP`` = 1, ``SLURM_ARRAY_TASK_COUNT`` =
    ``SLURM_ARRAY_TASK_MAX`` + 1). Anything else is a UsageError (one line) saying what to set."""
    env = os.environ if environ is None else environ
    if text.strip() != "auto":
        if shards is not None:
            raise UsageError(f"--shards {shards} goes with --shard auto (--shard {text.strip()} already names the "
                             f"count)")
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not m:
            raise UsageError(f"--shard {text!r}: expected I/N (e.g. 0/4, with 0 ≤ I < N) or auto")
        i, n = int(m.group(1)), int(m.group(2))
        if n < 1 or i >= n:
            raise UsageError(f"--shard {text}: expected 0 ≤ I < N and N ≥ 1")
        return Shard(i, n)
    return _auto_shard(env, shards)


def _env_int(env: dict[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"--shard auto: ${name} is {value!r}, expected an integer") from None


def _auto_shard(env: dict[str, str], shards: int | None) -> Shard:
    if shards is not None:
        count, count_from = shards, f"--shards {shards}"
        if count < 1:
            raise UsageError(f"--shards {shards}: expected N ≥ 1")
    else:
        count, count_from = _env_int(env, SHARDS_ENV), f"${SHARDS_ENV}"
        if count is not None and count < 1:
            raise UsageError(f"--shard auto: ${SHARDS_ENV} is {count}, expected N ≥ 1")
    task = _env_int(env, "SLURM_ARRAY_TASK_ID")
    if task is not None:
        index, where = task, f"Slurm array task {task}"
        if count is None:
            lo, hi = _env_int(env, "SLURM_ARRAY_TASK_MIN"), _env_int(env, "SLURM_ARRAY_TASK_MAX")
            step, n = _env_int(env, "SLURM_ARRAY_TASK_STEP"), _env_int(env, "SLURM_ARRAY_TASK_COUNT")
            if lo == 0 and step == 1 and hi is not None and n == hi + 1:
                count, count_from = n, f"the array 0-{hi}"
            else:
                def show(v):
                    return "unset" if v is None else v
                raise UsageError(
                    f"--shard auto: this Slurm array (MIN={show(lo)} MAX={show(hi)} STEP={show(step)} "
                    f"COUNT={show(n)}) is not the whole range 0..N-1, so it does not tell the number of shards; "
                    f"set ${SHARDS_ENV} (or --shards N) to the shard count of the first submission, e.g. "
                    f"sbatch --array=1,3 --export=ALL,{SHARDS_ENV}=8 …")
    else:
        index = _env_int(env, "JOB_COMPLETION_INDEX")
        if index is None:
            raise UsageError("--shard auto: neither $SLURM_ARRAY_TASK_ID (Slurm job array) nor $JOB_COMPLETION_INDEX "
                             "(Kubernetes indexed Job) is set; pass --shard I/N")
        where = f"Kubernetes completion index {index}"
        if count is None:
            raise UsageError(f"--shard auto: $JOB_COMPLETION_INDEX is set but ${SHARDS_ENV} is not (Kubernetes does "
                             f"not export the completion count); set it to the Job's completions, or pass --shards N")
    if not 0 <= index < count:
        raise UsageError(f"--shard auto: {where} is not a shard of 0..{count - 1} ({count} shards from "
                         f"{count_from}); set {'--shards' if shards is not None else '$' + SHARDS_ENV} to the "
                         f"shard count of the first submission")
    return Shard(index, count, f"{where}, {count} shards from {count_from}")


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
