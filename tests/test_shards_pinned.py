"""Batch's shard split pinned (docs/batch.md, "Sharding across a cluster"): largest job first onto
the lightest shard, ties by job number and then by the lower shard, unknown sizes weighing the
mean of the known ones (Python's round: halves to even). Each expected assignment below is worked
out by hand from that rule, so that the split of a jobs file stays the same across thinconv
versions and hosts (a resubmitted array task must run the same jobs as in the first submission)."""

from __future__ import annotations

from pathlib import Path

import pytest

from thinconv.batch import assign_shards, shard_jobs
from thinconv.batch.jobs import Job
from thinconv.plan import ConvertOptions


@pytest.mark.parametrize("sizes, count, expected", [
    # all equal: alternate from shard 0 (every pick is a tie: lower shard)
    ([5, 5, 5, 5, 5], 2, [0, 1, 0, 1, 0]),
    ([5, 5, 5, 5], 4, [0, 1, 2, 3]),
    ([5, 5, 5], 5, [0, 1, 2]),  # more shards than jobs: the last shards stay empty
    # weights 3 7 3 7 2 and 4 (the unknown: round(22 / 5)); order 1, 3, 5, 0, 2, 4 (ties by job number);
    # 1→0, 3→1, 5→2, 0→2 (4 < 7), then all three at 7: 2→0 (lower shard), 4→1 (7 = 7 < 10: lower shard)
    ([3, 7, 3, 7, 2, None], 3, [2, 0, 0, 1, 1, 2]),
    # no size known: every job weighs 1, so it is round-robin by job number
    ([None] * 7, 3, [0, 1, 2, 0, 1, 2, 0]),
    # empty folders weigh 1, like unknown sizes of an all-unknown file
    ([0, 0, 0, 0], 2, [0, 1, 0, 1]),
    # the unknown weighs round(2.5) = 2 (half to even): order 1, 0, 2; 1→0, 0→1, 2→1 (2 < 3)
    ([2, 3, None], 2, [1, 0, 1]),
])
def test_assign_shards_pinned_for_ties(sizes, count, expected):
    assert assign_shards(sizes, count) == expected


def test_shard_jobs_of_equal_folders_pinned(tmp_path):
    """Equal-sized local sources, through the sizes shard_jobs measures: jobs 1, 3, 5 on shard 0,
    jobs 2, 4 on shard 1 — on every host, whatever order the folders were created in."""
    jobs = []
    for k in (5, 3, 1, 4, 2):  # creation order must not matter
        folder = tmp_path / f"src{k}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 4096)
    for k in range(1, 6):
        jobs.append(Job(k, str(tmp_path / f"src{k}"), Path(tmp_path / f"out{k}.thin"), ConvertOptions()))
    assert [j.index for j in shard_jobs(jobs, 0, 2)] == [1, 3, 5]
    assert [j.index for j in shard_jobs(jobs, 1, 2)] == [2, 4]
