"""Conversion: run a plan in one streaming pass — every page produced from the mmap'd source
(passthrough views, casts, quantization), measured (stats, quantization error), hashed and written
at its final offset, while the probe follows on its own thread; the manifest goes in last.

Memory is bounded by a few pages in flight whatever the model size: source pages are dropped from
the mapping once written, and nothing holds a page's bytes after it is on disk.
"""

from __future__ import annotations

import bisect
import math
import os
import threading
import time
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import blake3
import numpy as np

from threadpoolctl import threadpool_limits

import thinconv
from thinconv.checkpoint.source import Checkpoint, open_checkpoint
from thinconv.errors import ConversionError, ThinFormatError
from thinconv.format import spec
from thinconv.format.reader import open_archive
from thinconv.format.writer import (
    check_output, head_bytes, move_data, page_offsets, plan_layout, pwrite_all, start_writeback, write_atomically,
)
from thinconv.pages import PageMaker, PageOutput, RunningStats
from thinconv.mapping import tied_head_problem
from thinconv.plan import AssetPlan, ConvertOptions, Plan, TensorPlan, plan_conversion
from thinconv.probe import PROBE_TOKENS, PROBE_TOP_K, conversion_probe, default_tokens
from thinconv.recipe import Registry, load_registry


class Progress(Protocol):
    def start(self, phase: str, total: int) -> None: ...
    def advance(self, n: int) -> None: ...


class _NoProgress:
    def start(self, phase: str, total: int) -> None:
        pass

    def advance(self, n: int) -> None:
        pass


@dataclass
class ConvertResult:
    path: Path
    size: int
    page_count: int
    archive_hash: str
    seconds: float
    manifest: dict
    warnings: list[str] = field(default_factory=list)
    layout_shift: str = "none"  # how the data region reached its final data_off: none | fallocate | copy
    removed_temps: list[Path] = field(default_factory=list)  # stale temp files of `path` a killed run left

    @property
    def quant_overall(self) -> dict | None:
        """Parameter-weighted rel_rmse over quantized tensors."""
        q = {n: v for n, v in self.manifest["validation"].get("quant", {}).items() if v.get("rel_rmse") is not None}
        if not q:
            return None
        sizes = {t["name"]: math.prod(t["shape"]) for t in self.manifest["tensors"]}
        total = sum(sizes[n] for n in q)
        return {"tensors": len(q), "rel_rmse": sum(v["rel_rmse"] * sizes[n] for n, v in q.items()) / total,
                "worst": max(q.items(), key=lambda kv: kv[1]["rel_rmse"])[0]}


ASSET_CHUNK = 4 * 1024 * 1024  # bytes of an asset read, hashed and written at a time


@dataclass(frozen=True)
class _PageJob:
    """One page of the output, in file order: tensor rows [start, end) or asset bytes [start, end)."""

    pid: str
    size: int
    start: int
    end: int
    tensor: TensorPlan | None = None
    asset: AssetPlan | None = None


class _StreamAborted(Exception):
    pass


class StreamGate:
    """Keeps the probe (on its own thread) in step with the page stream.

    The probe reads a tensor's source rows only once the stream has written the pages holding
    them, and the stream starts a page at most `lag` pages ahead of the probe: both read the same
    source pages while they are in memory, so the probe costs no second pass over the model."""

    def __init__(self, plan: Plan, lag: int = 4):
        self.lag = lag
        self._cond = threading.Condition()
        self._done = self._probe_at = -1
        self._probe_finished = self._aborted = False
        self._first: dict[str, int] = {}
        self._ends: dict[str, list[int]] = {}
        self._head_dim = int(plan.model["head_dim"])
        self._permuted = {t.name for t in plan.tensors if t.permute_rope}
        k = 0
        for tp in plan.tensors:
            self._first[tp.name], self._ends[tp.name] = k, [e for _, e in tp.pages]
            k += len(tp.pages)
        self.tensor_pages = k

    def _ordinal(self, name: str, row_end: int) -> int:
        ends = self._ends[name]
        if name in self._permuted:  # the interleave moves rows within a head: wait for the whole head
            row_end = min(-(-row_end // self._head_dim) * self._head_dim, ends[-1])
        return self._first[name] + bisect.bisect_left(ends, row_end)

    def wait_rows(self, name: str, end: int) -> None:
        """Probe side: block until rows [0, end) of tensor `name` have streamed past."""
        k = self._ordinal(name, end)
        with self._cond:
            if k > self._probe_at:
                self._probe_at = k
                self._cond.notify_all()
            while self._done < k and not self._aborted:
                self._cond.wait()
            if self._aborted:
                raise _StreamAborted()

    def may_start(self, k: int) -> bool:
        with self._cond:
            return self._probe_finished or k >= self.tensor_pages or self._probe_at >= k - self.lag

    def wait_start(self, k: int) -> None:
        with self._cond:
            while not (self._probe_finished or k >= self.tensor_pages or self._probe_at >= k - self.lag):
                self._cond.wait()

    def page_done(self, k: int) -> None:
        with self._cond:
            self._done = k
            self._cond.notify_all()

    def probe_finished(self) -> None:
        with self._cond:
            self._probe_finished = True
            self._cond.notify_all()

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()


class _ProbeThread(threading.Thread):
    """Computes validation.probe from the source weights as the stream passes them."""

    def __init__(self, ckpt: Checkpoint, plan: Plan, gate: StreamGate):
        super().__init__(name="thinconv-probe", daemon=True)
        self.ckpt, self.plan, self.gate = ckpt, plan, gate
        self.probe: dict | None = None
        self.note: str | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.probe, self.note = conversion_probe(self.ckpt, self.plan, wait=self.gate.wait_rows)
        except _StreamAborted:
            pass
        except BaseException as e:  # handed to the converting thread
            self.error = e
        finally:
            self.gate.probe_finished()


# numpy's loops, blake3 and pwrite release the GIL, so two threads use both cores (ml_dtypes'
# casts do not: bf16 is widened, and narrowed to f16, by integer arithmetic instead).
WORKERS = 2
WINDOW = 4  # pages in flight: memory is a few pages whatever the model size


def convert(ckpt: Checkpoint, plan: Plan, out: str | os.PathLike, *, force: bool = False,
            progress: Progress | None = None) -> ConvertResult:
    """Write `plan` as a .thin archive at `out`, in one streaming pass over the source.

    Every page's place is known from the plan before any data is read, except for one shift: the
    manifest (stats, checksums, probe) is only complete at the end, so the data region is laid
    out at an estimated data_off and moved by whole 4096-byte steps if the estimate missed.
    Pages are produced on two threads, hashed, and written at their offsets into a temp file in
    out's folder; the header, manifest and page table go in last; the file is fsynced, re-opened
    by the reader as a check, and only then renamed into place (nothing is left on failure)."""
    t0 = time.perf_counter()
    progress = progress or _NoProgress()
    out = Path(out)
    check_output(out, force, [f.path for f in ckpt.files])
    tied = tied_head_problem(ckpt, plan.mapping)  # the one value check planning leaves to conversion
    if tied:
        raise ConversionError(f"{ckpt.root}: {tied}")
    jobs = _page_jobs(plan)
    rel, data_len = page_offsets([j.size for j in jobs])
    estimate = _estimated_data_off(ckpt, plan, jobs)
    maker = PageMaker(ckpt, plan)
    state: dict[str, Any] = {}

    def write(f) -> None:
        fd = f.fileno()

        def produce(k: int) -> tuple[str, PageOutput]:
            """Make page k, hash it and write it at its offset, chunk by chunk."""
            job, hasher, offset = jobs[k], blake3.blake3(), estimate + rel[k]
            cursor = offset

            def emit(chunk: np.ndarray) -> None:
                nonlocal cursor
                if cursor - offset + chunk.nbytes > job.size:
                    raise ConversionError(f"page {job.pid}: produced more than the {job.size} bytes the plan says")
                hasher.update(chunk)
                pwrite_all(fd, chunk, cursor)
                cursor += chunk.nbytes

            if job.tensor is not None:
                page = maker.make(job.tensor, job.start, job.end, emit)
            else:
                page = PageOutput()
                _copy_asset(job, emit)
            if cursor - offset != job.size:
                raise ConversionError(f"page {job.pid}: produced {cursor - offset} bytes, the plan says {job.size}")
            start_writeback(fd, offset, job.size)  # so the final fsync finds little to do
            return hasher.hexdigest(), page

        progress.start("converting", plan.total_bytes)
        # The probe's matmuls would otherwise start BLAS threads that spin against the page workers.
        with threadpool_limits(limits=1, user_api="blas"):
            checksums, outputs, probe, probe_note = _stream(ckpt, plan, jobs, produce, progress)
        stats, quant, warnings = _summaries(plan, outputs)
        if probe_note:
            warnings.append(probe_note)
        manifest = _manifest(ckpt, plan, jobs, checksums, stats, quant, probe)
        layout, head = head_bytes(manifest)
        # The manifest's pages are `jobs`, so its layout is the streamed one moved to its data_off.
        state["shift"] = move_data(fd, estimate, layout.data_off, estimate + data_len)
        pwrite_all(fd, head, 0)
        state.update(manifest=manifest, layout=layout, warnings=warnings)

    def check(tmp: Path) -> None:  # the reader's own checks of header, manifest and page table
        open_archive(tmp).close()

    try:
        stale = write_atomically(out, force, write, check)
    except ThinFormatError as e:
        raise ConversionError(f"internal error: the written archive does not open: {e}") from None
    layout = state["layout"]
    return ConvertResult(out, layout.file_size, len(jobs), layout.archive_hash.hex(), time.perf_counter() - t0,
                         state["manifest"], state["warnings"], state["shift"], stale)


def _copy_asset(job: _PageJob, emit: Callable[[np.ndarray], None]) -> None:
    """Asset bytes [start, end) in chunks of ASSET_CHUNK, whatever the page size: memory stays
    bounded for a 1 GiB page of a large tokenizer.json. A file that shrank since planning is named."""
    with open(job.asset.file.path, "rb") as src:
        src.seek(job.start)
        remaining = job.size
        while remaining > 0:
            block = src.read(min(ASSET_CHUNK, remaining))
            if not block:
                raise ConversionError(f"{job.asset.file.path}: ended {remaining} bytes early (it changed during "
                                      f"the conversion)")
            emit(np.frombuffer(block, np.uint8))
            remaining -= len(block)


def _page_jobs(plan: Plan) -> list[_PageJob]:
    jobs = [_PageJob(spec.page_id(tp.name, k), (e - s) * tp.row_bytes, s, e, tensor=tp)
            for tp in plan.tensors for k, (s, e) in enumerate(tp.pages)]
    jobs += [_PageJob(spec.page_id(ap.file.name, k), e - s, s, e, asset=ap)
             for ap in plan.assets for k, (s, e) in enumerate(ap.pages)]
    return jobs


def _stream(ckpt: Checkpoint, plan: Plan, jobs: list[_PageJob], produce: Callable[[int], tuple[str, PageOutput]],
            progress: Progress) -> tuple[list[str], list[PageOutput], dict | None, str | None]:
    """Run `produce` over the page indices on WORKERS threads, at most WINDOW in flight, collecting
    results in file order; the probe thread (if any) follows the stream through a StreamGate.
    Returns the checksums, the page results, and the probe with its skip note."""
    gate = StreamGate(plan)
    prober = None
    if plan.options.probe:
        prober = _ProbeThread(ckpt, plan, gate)
        prober.start()
    else:
        gate.probe_finished()
    checksums: list[str] = []
    outputs: list[PageOutput] = []
    pending: dict[int, Any] = {}
    pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="thinconv-page")
    try:
        submitted, k = 0, 0
        while k < len(jobs):
            while submitted < len(jobs) and submitted - k < WINDOW and gate.may_start(submitted):
                pending[submitted] = pool.submit(produce, submitted)
                submitted += 1
            if submitted == k:  # nothing in flight: the probe is behind
                gate.wait_start(k)
                continue
            checksum, page = pending.pop(k).result()
            gate.page_done(k)
            checksums.append(checksum)
            outputs.append(page)
            progress.advance(jobs[k].size)
            k += 1
        if prober is not None:
            prober.join()
            if prober.error is not None:
                raise prober.error
    finally:
        gate.abort()
        for f in pending.values():
            f.cancel()
        pool.shutdown(wait=True)
        if prober is not None:
            prober.join()
    return checksums, outputs, *((prober.probe, prober.note) if prober is not None else (None, None))


def _summaries(plan: Plan, outputs: list[PageOutput]) -> tuple[dict, dict, list[str]]:
    """validation.stats, validation.quant and warnings from the per-page results."""
    merged: dict[str, RunningStats] = {}
    errs: dict[str, Any] = {}
    k = 0
    for tp in plan.tensors:
        for _ in tp.pages:
            page = outputs[k]
            merged.setdefault(tp.name, RunningStats()).merge(page.stats)
            if page.qerr is not None:
                errs.setdefault(tp.name, type(page.qerr)()).merge(page.qerr)
            k += 1
    stats: dict[str, dict] = {}
    quant: dict[str, dict] = {}
    warnings: list[str] = []
    for tp in plan.tensors:
        st = merged[tp.name].result()
        if tp.name != "rope_freqs":
            stats[tp.name] = st
        if st["nan"] or st["inf"]:
            msg = f"tensor {tp.name} ({', '.join(tp.sources) or 'derived'}) holds {st['nan']} NaN and {st['inf']} Inf value(s)"
            if plan.options.strict:
                raise ConversionError(msg + " (--strict)")
            warnings.append(msg)
        if tp.name in errs:
            quant[tp.name] = errs[tp.name].result()
            if not all(math.isfinite(v) for v in quant[tp.name].values()):
                raise ConversionError(f"tensor {tp.name} ({', '.join(tp.sources)}): values too large for {tp.dtype} (the f16 "
                                      f"block scale overflows, largest |x| = {max(abs(st['min']), abs(st['max'])):g}); "
                                      f"keep it in a float dtype, e.g. --keep '{tp.role}=bf16'")
        elif tp.note:
            quant[tp.name] = {"rmse": None, "max_abs_err": None, "rel_rmse": None, "note": tp.note}
    return stats, quant, warnings


# Typical lengths of the values only known at the end (the data_off estimate; a miss costs a shift).
# (Lengths measured on bf16 and f32 models: min/max ~12 characters, mean ~21, std ~19.)
_STAT_PLACEHOLDER = {"min": -0.0830078125, "max": 0.083007812, "mean": 1.2345678901234567e-05,
                     "std": 0.01999999955296516, "nan": 0, "inf": 0}
_QUANT_PLACEHOLDER = {"rmse": 0.00012345678901234567, "max_abs_err": 0.0123456789012345, "rel_rmse": 0.01234567890123457}


def _probe_placeholder(plan: Plan) -> dict | None:
    if not plan.options.probe:
        return None
    tokens = default_tokens(plan.model, PROBE_TOKENS)
    ids = [plan.model["vocab_size"] - 1] * PROBE_TOP_K
    return {"tokens": tokens, "top_k": PROBE_TOP_K, "source_dtype": "bf16",
            "positions": [{"ids": ids, "logits": [-12.34567890123456] * PROBE_TOP_K} for _ in tokens]}


def _estimated_data_off(ckpt: Checkpoint, plan: Plan, jobs: list[_PageJob]) -> int:
    """data_off of a manifest shaped like the final one, with typical-length placeholder values."""
    stats = {tp.name: dict(_STAT_PLACEHOLDER) for tp in plan.tensors if tp.name != "rope_freqs"}
    quant = {tp.name: dict(_QUANT_PLACEHOLDER) for tp in plan.tensors if tp.quant}
    manifest = _manifest(ckpt, plan, jobs, ["0" * 64] * len(jobs), stats, quant, _probe_placeholder(plan))
    return plan_layout(manifest).data_off


def _manifest(ckpt: Checkpoint, plan: Plan, jobs: list[_PageJob], checksums: list[str], stats: dict,
              quant: dict, probe: dict | None) -> dict:
    """The archive's manifest."""
    pages = []
    for job, checksum in zip(jobs, checksums):
        entry = {"id": job.pid, "size": job.size, "checksum": checksum}
        entry.update({"tensor": job.tensor.name, "rows": [job.start, job.end]} if job.tensor else {"asset": job.asset.file.name})
        pages.append(entry)
    assets = [{"name": ap.file.name, "media_type": ap.media_type, "size": ap.file.size,
               "pages": [spec.page_id(ap.file.name, k) for k in range(len(ap.pages))]} for ap in plan.assets]
    validation: dict[str, Any] = {
        "converter": {"name": "thinconv", "version": thinconv.__version__, "recipe": plan.recipe.name,
                      "options": _options_record(plan)},
        "source": _provenance(ckpt, plan),
        "stats": stats,
    }
    if quant:
        validation["quant"] = quant
    lossy = {tp.name: tp.lossy for tp in plan.tensors if tp.lossy}
    if lossy:  # absent when every tensor is an exact copy or widening of its source (or quantized)
        validation["lossy"] = lossy
    if probe is not None:
        validation["probe"] = probe
    return {"format": "thin", "format_version": spec.VERSION, "alignment": spec.ALIGNMENT, "model": plan.model,
            "tensors": [_tensor_entry(tp) for tp in plan.tensors], "pages": pages, "assets": assets,
            "runtime": {"page_size": plan.options.page_size}, "validation": validation}


def _options_record(plan: Plan) -> dict:
    """validation.converter.options; with a user recipe, its files (recipe, file name and sha256;
    the recipe's own first, then those it extends): they shape the bytes as much as --dtype does. Absent for a
    built-in recipe, whose archives keep their bytes."""
    options = plan.options.record()
    if plan.recipe.files:
        options["recipe_files"] = [{"recipe": recipe, "file": name, "sha256": digest}
                                   for recipe, name, digest in plan.recipe.files]
    return options


def _provenance(ckpt: Checkpoint, plan: Plan) -> dict:
    """validation.source, plus the source's own quantization (a block-FP8 checkpoint) when it had one."""
    source = ckpt.provenance()
    if plan.mapping.fp8 is not None:
        source["quantization"] = plan.mapping.fp8.config
    return source


def _tensor_entry(tp: TensorPlan) -> dict:
    return {"name": tp.name, "role": tp.role, "layer": tp.layer, "source": tp.sources, "shape": tp.shape,
            "dtype": tp.dtype, "quant": tp.quant, "hints": tp.hints,
            "pages": [spec.page_id(tp.name, k) for k in range(len(tp.pages))]}


@contextmanager
def open_plan(src: str | os.PathLike, options: ConvertOptions | None = None, *, recipe: str | None = None,
              revision: str | None = None, token: str | None = None, registry: Registry | None = None,
              commit: str | None = None) -> Iterator[tuple[Checkpoint, Plan]]:
    """Open a local checkpoint folder or a hub repo id and plan its conversion (no tensor data read).

    Hub files come through the HF cache; `token` defaults to $HF_TOKEN, `registry` to the built-in
    and $THINCONV_RECIPES recipes; the recipe is `recipe` or the one for config.json's architecture.
    `commit` pins a hub source to a commit resolved earlier (see open_checkpoint). The
    checkpoint stays open inside the `with` block."""
    registry = registry if registry is not None else load_registry([])
    token = token if token is not None else os.environ.get("HF_TOKEN")
    with open_checkpoint(src, revision=revision, token=token, commit=commit) as ckpt:
        yield ckpt, plan_conversion(ckpt, registry.select(ckpt.config, recipe, str(src)), options or ConvertOptions())


def convert_source(src: str | os.PathLike, out: str | os.PathLike, *, options: ConvertOptions | None = None,
                   recipe: str | None = None, revision: str | None = None, token: str | None = None,
                   force: bool = False, registry: Registry | None = None, progress: Progress | None = None,
                   commit: str | None = None) -> ConvertResult:
    """Convert a local checkpoint folder or a hub repo id to a .thin archive at `out` (what
    `thinconv convert` runs); arguments as for :func:`open_plan` and :func:`convert`."""
    check_output(Path(out), force)
    with open_plan(src, options, recipe=recipe, revision=revision, token=token, registry=registry,
                   commit=commit) as (ckpt, plan):
        return convert(ckpt, plan, out, force=force, progress=progress)
