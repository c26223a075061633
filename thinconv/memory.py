"""Bounded resident memory while big files stream through read-only mmaps (sources and archives).

The OS page cache keeps the bytes; dropping them from this process's mapping only keeps RSS flat,
and a later read maps them back. Shared by the checkpoint reader and the archive reader.
"""

from __future__ import annotations

import mmap

# A fault maps the faulting page's cached neighbours too: 64 KiB of fault-around, or — recent
# kernels map a large page-cache folio whole (measured here on 6.18) — up to a PMD-sized folio (2 MiB on x86-64,
# ext4/xfs use them). A range dropped with this margin leaves none of them resident; with 64 KiB,
# a Mixtral-shaped checkpoint of 12 layers kept 38 MiB of neighbouring experts mapped.
FAULT_AROUND = 2 * 1024 * 1024


def drop_resident(mm: mmap.mmap, pos: int, n: int) -> None:
    """Tell the kernel this process is done with mapped bytes [pos, pos + n) (the page cache keeps
    them; a later read maps them back). Keeps RSS bounded while a big file streams through."""
    start = pos - pos % mmap.PAGESIZE
    end = min(pos + n, len(mm))
    if end <= start:
        return
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)
    except (AttributeError, OSError, ValueError):
        pass  # only a memory-footprint optimisation
