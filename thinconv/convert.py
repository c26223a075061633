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
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import blake3
import ml_dtypes
import numpy as np

import thinconv
from thinconv.checkpoint.source import Checkpoint
from thinconv.errors import ConversionError, PackError, ThinFormatError
from thinconv.format import spec
from thinconv.format.reader import open_archive
from thinconv.format.writer import (
    head_bytes, move_data, page_offsets, plan_layout, pwrite_all, start_writeback, write_atomically,
)
from thinconv.plan import AssetPlan, Plan, TensorPlan, tied_head_problem
from thinconv.rope import model_rope_freqs
from thinconv.transforms import get_transform

if TYPE_CHECKING:
    from thinconv.plan import ConvertOptions

NUMPY_OUT = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype(ml_dtypes.bfloat16)}


class Progress(Protocol):
    def start(self, phase: str, total: int) -> None: ...
    def advance(self, n: int) -> None: ...


class _NoProgress:
    def start(self, phase: str, total: int) -> None:
        pass

    def advance(self, n: int) -> None:
        pass


@dataclass
class RunningStats:
    """min, max, mean, std over finite values (Chan's parallel merge), plus NaN/Inf counts."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    lo: float = math.inf
    hi: float = -math.inf
    nan: int = 0
    inf: int = 0

    def add(self, x: np.ndarray) -> "RunningStats":
        """Fold in a chunk of float32 (or float64) values, at most CHUNK_VALUES of them; returns
        the chunk's own statistics.

        Sums run in the chunk's own dtype with numpy's pairwise summation, so mean and std are
        good to ~1e-6 of the values' scale (min and max are exact); chunks merge in float64.
        Not BLAS: its kernels differ between CPUs, and these figures land in the archive, whose
        bytes must not depend on the host."""
        x = x.reshape(-1)
        part = RunningStats()
        if not x.size:
            return part
        lo, hi = x.min(), x.max()  # NaN propagates through min/max: finite bounds mean all finite
        if not (math.isfinite(lo) and math.isfinite(hi)):
            finite = np.isfinite(x)
            part.nan = int(np.count_nonzero(np.isnan(x)))
            part.inf = x.size - int(np.count_nonzero(finite)) - part.nan
            x = x[finite]
            if not x.size:
                self.merge(part)
                return part
            lo, hi = x.min(), x.max()
        if x.dtype == np.float32 and max(-float(lo), float(hi)) > 1e18:
            x = x.astype(np.float64)  # squares would overflow float32
        n = x.size
        with np.errstate(over="ignore", invalid="ignore"):  # beyond ~1e154 (f64 sources) std is inf
            mean = float(np.add.reduce(x)) / n
            dev = _scratch(n, x.dtype)
            np.subtract(x, x.dtype.type(mean), out=dev)
            part.count, part.mean, part.m2 = n, mean, float(np.add.reduce(np.square(dev, out=dev)))
        part.lo, part.hi = float(lo), float(hi)
        self.merge(part)
        return part

    def merge(self, part: "RunningStats") -> None:
        self.nan += part.nan
        self.inf += part.inf
        if part.count == 0:
            return
        total = self.count + part.count
        delta = part.mean - self.mean
        self.mean += delta * part.count / total
        self.m2 += part.m2 + delta * delta * self.count * part.count / total
        self.lo, self.hi = min(self.lo, part.lo), max(self.hi, part.hi)
        self.count = total

    def result(self) -> dict:
        if self.count == 0:
            return {"min": None, "max": None, "mean": None, "std": None, "nan": self.nan, "inf": self.inf}
        return {"min": self.lo, "max": self.hi, "mean": self.mean, "std": math.sqrt(self.m2 / self.count),
                "nan": self.nan, "inf": self.inf}


_local = threading.local()


def _scratch(n: int, dtype: np.dtype, use: str = "dev") -> np.ndarray:
    """A per-thread reusable buffer (one per `use`): no temporaries allocated per chunk."""
    key = f"{use}_{np.dtype(dtype).char}"
    buf = getattr(_local, key, None)
    if buf is None or buf.size < n:
        buf = np.empty(max(n, CHUNK_VALUES), dtype)
        setattr(_local, key, buf)
    return buf[:n]


def rope_row_permutation(rows: int, head_dim: int, rotary_dim: int) -> np.ndarray:
    """Source row for each output row under the interleaved layout (spec §2.1): within each head,
    new row 2i = old row i, new row 2i+1 = old row i + rotary_dim/2; other rows stay."""
    half = rotary_dim // 2
    within = np.arange(head_dim)
    within[0:rotary_dim:2] = np.arange(half)
    within[1:rotary_dim:2] = np.arange(half) + half
    heads = rows // head_dim
    return (np.arange(heads)[:, None] * head_dim + within[None, :]).reshape(-1)


class TensorSource:
    """Reads output rows [start, end) of one planned tensor from the checkpoint, in source dtype."""

    def __init__(self, ckpt: Checkpoint, tp: TensorPlan, model: dict, recipe_path: str):
        self.tp, self.model, self.ckpt = tp, model, ckpt
        self.arrays = [ckpt.array(s) for s in tp.sources]
        if len(tp.shape) == 1:
            self.arrays = [a.reshape(-1) for a in self.arrays]
        self.offsets = np.cumsum([0] + [a.shape[0] for a in self.arrays])
        self.perm = rope_row_permutation(tp.shape[0], model["head_dim"], model["rope"]["rotary_dim"]) \
            if tp.permute_rope else None
        self.transform = get_transform(tp.transform, f"{recipe_path}: transforms") if tp.transform else None

    def rows(self, start: int, end: int) -> np.ndarray:
        if self.perm is None:
            return self._transformed(start, end)
        # The permutation moves rows only within a head, so the source span [lo, hi) is at most a
        # head wider than the page. The transform sees it in source order with its source row
        # numbers (as documented); the permutation applies to its result, as to any source.
        idx = self.perm[start:end]
        lo, hi = int(idx.min()), int(idx.max()) + 1
        return self._transformed(lo, hi)[idx - lo]

    def _transformed(self, start: int, end: int) -> np.ndarray:
        out = self._range(start, end)
        if self.transform is not None:
            out = self.transform(out, name=self.tp.name, start=start, end=end, model=self.model)
            if out.shape[0] != end - start or list(out.shape[1:]) != self.tp.shape[1:]:
                raise ConversionError(f"transform {self.tp.transform!r} changed the shape of {self.tp.name} rows "
                                      f"[{start}, {end})")
        return out

    def release(self, start: int, end: int) -> None:
        """Drop the source bytes behind output rows [start, end) from resident memory."""
        if self.perm is not None:
            idx = self.perm[start:end]
            start, end = int(idx.min()), int(idx.max()) + 1
        for name, a, off in zip(self.tp.sources, self.arrays, self.offsets):
            s, e = max(start, off), min(end, off + a.shape[0])
            if s < e:
                row = a.nbytes // max(a.shape[0], 1)
                self.ckpt.release(name, (s - off) * row, (e - off) * row)

    def _range(self, start: int, end: int) -> np.ndarray:
        pieces = []
        for a, off in zip(self.arrays, self.offsets):
            s, e = max(start, off), min(end, off + a.shape[0])
            if s < e:
                pieces.append(a[s - off: e - off])
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


_BF16 = np.dtype(ml_dtypes.bfloat16)


def _widened(x: np.ndarray) -> np.ndarray:
    """x as float32 (float64 stays) in a reused per-thread buffer.

    bf16 is the top half of an f32, so it widens by a 16-bit shift: exact for every pattern, and
    a plain numpy integer loop, which releases the GIL (ml_dtypes' own casts hold it, which
    would serialize the page threads)."""
    if x.dtype in (np.float64, np.float32):
        return np.ascontiguousarray(x)
    out = _scratch(x.size, np.float32, "wide").reshape(x.shape)
    if x.dtype == _BF16:
        np.left_shift(x.view(np.uint16), 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(out, x, casting="unsafe")
    return out


def _bf16_to_f16(src: np.ndarray, out: np.ndarray) -> None:
    """bf16 → f16, as numpy's cast rounds it, at integer speed (numpy's own cast is scalar code,
    ~0.6 G values/s). A bf16 whose exponent is in f16's normal range converts exactly: same
    sign, exponent rebiased (127 → 15), 7 mantissa bits shifted up by 3. Anything else (zeros,
    f16 subnormals, overflow, Inf, NaN) goes through numpy's cast."""
    u = src.reshape(-1).view(np.uint16)
    h = out.reshape(-1).view(np.uint16)
    np.bitwise_and(u, 0x7FFF, out=h)
    normal = _scratch(u.size, np.uint16, "mask")
    np.subtract(h, 0x3880, out=normal)  # wraps below the range: one unsigned comparison
    np.subtract(h, 0x3800, out=h)  # exponent 127 - 112 bias → 15 bias, in bf16's bit positions
    np.left_shift(h, 3, out=h)
    np.bitwise_or(h, np.bitwise_and(u, 0x8000, out=_scratch(u.size, np.uint16, "sign")), out=h)
    if normal.max() > 0x477F - 0x3880:  # some exponent outside f16's normal range [-14, 15]
        odd = np.flatnonzero(normal > 0x477F - 0x3880)
        with np.errstate(over="ignore", invalid="ignore"):
            h[odd] = u[odd].view(_BF16).astype(np.float32).astype(np.float16).view(np.uint16)


def _f32_to_bf16(src: np.ndarray, out: np.ndarray) -> None:
    """f32 → bf16 rounded to nearest even, as ml_dtypes rounds it, by integer arithmetic (which,
    unlike ml_dtypes' cast, releases the GIL): add 0x7FFF plus the lowest kept bit, keep the top
    16 bits. Exact for every finite value, subnormals and overflow to Inf included; NaNs (which
    must stay NaN) go through ml_dtypes."""
    u = src.reshape(-1).view(np.uint32)
    t = _scratch(u.size, np.uint32, "round")
    np.right_shift(u, 16, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(t, 0x7FFF, out=t)
    np.add(t, u, out=t)
    np.right_shift(t, 16, out=t)
    h = out.reshape(-1).view(np.uint16)
    np.copyto(h, t, casting="unsafe")
    np.bitwise_and(u, 0x7FFFFFFF, out=t)
    if t.max() > 0x7F800000:  # some NaN
        nan = np.flatnonzero(t > 0x7F800000)
        with np.errstate(invalid="ignore"):
            h[nan] = src.reshape(-1)[nan].astype(_BF16).view(np.uint16)


def _as_bytes(a: np.ndarray) -> np.ndarray:
    """A contiguous uint8 view (bf16 arrays cannot export a buffer themselves)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


@dataclass
class PageOutput:
    """What producing a page measured (its bytes went to `emit`)."""

    stats: RunningStats | None = None  # source-value statistics
    qerr: Any = None  # thinconv.quant.QuantErrorStats of a block-quantized page


CHUNK_VALUES = 1 << 20  # values per work chunk: temporaries stay a few MiB whatever the page size


class PageMaker:
    """Produces the exact bytes of every page of a plan (deterministic: the same on any host).

    A page is produced in row chunks of ~CHUNK_VALUES values, each handed to `emit` (which hashes
    and writes it) and its source rows dropped from memory before the next: no page-sized buffer
    exists, only a few MiB of per-thread temporaries."""

    def __init__(self, ckpt: Checkpoint, plan: Plan):
        self.ckpt, self.plan = ckpt, plan
        self._sources: dict[str, TensorSource] = {}
        self._rope: np.ndarray | None = None

    def source(self, tp: TensorPlan) -> TensorSource:
        if tp.name not in self._sources:
            self._sources[tp.name] = TensorSource(self.ckpt, tp, self.plan.model, self.plan.recipe.path)
        return self._sources[tp.name]

    def make(self, tp: TensorPlan, start: int, end: int, emit: Callable[[np.ndarray], None]) -> PageOutput:
        """Emit the bytes of output rows [start, end) of `tp` in order; return what was measured:
        the source values' statistics, and the quantization error of a block-quantized page."""
        stats = RunningStats()
        if tp.name == "rope_freqs":
            if self._rope is None:
                self._rope = np.ascontiguousarray(model_rope_freqs(self.plan.model), dtype="<f4")
            stats.add(self._rope)
            emit(_as_bytes(self._rope))
            return PageOutput(stats)
        source = self.source(tp)
        step = max(1, CHUNK_VALUES // (tp.shape[1] if len(tp.shape) == 2 else 1))
        qerr = None
        if tp.dtype in spec.BLOCK_DTYPES:
            from thinconv.quant import QuantErrorStats

            qerr = QuantErrorStats()
        for a in range(start, end, step):
            b = min(a + step, end)
            src = source.rows(a, b)
            if qerr is not None:
                emit(self._quantize(tp, src, stats, qerr))
            else:
                emit(self._cast(tp, src, stats))
            source.release(a, b)
        return PageOutput(stats, qerr)

    @staticmethod
    def _cast(tp: TensorPlan, src: np.ndarray, stats: RunningStats) -> np.ndarray:
        want = NUMPY_OUT[tp.dtype]
        wide = _widened(src)  # exact: every source dtype widens to f32 (f64 stays f64)
        part = stats.add(wide)
        if src.dtype == want:  # passthrough: the chunk is a view of the source
            return _as_bytes(src)
        out = _scratch(src.size, want, "out").reshape(src.shape)
        if src.dtype == _BF16 and want == np.float16:
            _bf16_to_f16(src, out)
        elif want == _BF16 and wide.dtype == np.float32:
            _f32_to_bf16(wide, out)
        else:
            # Cast from the exact wide values: equal to a direct cast (tests/test_casts.py checks
            # bf16 ↔ f16 on all 65,536 inputs) and faster. Overflow is reported below, not warned.
            with np.errstate(over="ignore", invalid="ignore"):
                out[...] = wide
        if part.count and max(-part.lo, part.hi) > float(ml_dtypes.finfo(want).max):
            PageMaker._check_range(tp, wide, out, want)
        return _as_bytes(out)

    @staticmethod
    def _quantize(tp: TensorPlan, src: np.ndarray, stats: RunningStats, qerr: Any) -> np.ndarray:
        from thinconv.quant import NonFiniteError, quantize_rows

        # The quantizer's input: the source upcast exactly to f32 (the quantizer does it tile by
        # tile; an f64 source is rounded to f32 first). It adds the error of these rows to qerr.
        if src.dtype == np.float64:
            src = src.astype(np.float32)
        out = _scratch(src.shape[0] * tp.row_bytes, np.uint8, "out").reshape(src.shape[0], tp.row_bytes)
        try:
            with np.errstate(all="ignore"):  # an overflowing block scale is reported as one error later
                quantize_rows(src, tp.dtype, out=out, report=qerr)
        except NonFiniteError:
            raise ConversionError(f"tensor {tp.name} ({', '.join(tp.sources)}) holds values that are NaN or Inf in "
                                  f"float32, which {tp.dtype} cannot represent; keep it in a float dtype or fix the "
                                  f"checkpoint") from None
        stats.add(_widened(src))
        return _as_bytes(out)

    @staticmethod
    def _check_range(tp: TensorPlan, src: np.ndarray, out: np.ndarray, want: np.dtype) -> None:
        """Any narrowing cast (f64 sources → f32 included) must not turn finite values into Inf
        (called only for chunks whose finite values reach beyond the target's range)."""
        limit = float(ml_dtypes.finfo(want).max)
        with np.errstate(over="ignore", invalid="ignore"):
            overflow = np.isinf(out) & np.isfinite(src)
        if overflow.any():
            worst = float(np.abs(src[overflow].astype(np.float64)).max())
            hint = {"f16": "use --dtype bf16 or f32", "bf16": "use --dtype f32"}.get(
                tp.dtype, "f32 is the widest THIN dtype: fix the checkpoint")
            raise ConversionError(f"tensor {tp.name} ({', '.join(tp.sources)}): {int(overflow.sum())} value(s) beyond "
                                  f"the {tp.dtype} range (largest |x| = {worst:g} > {limit:g}); {hint}")


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
        from thinconv.check import conversion_probe

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
    check_output(out, force)
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
                with open(job.asset.file.path, "rb") as src:
                    src.seek(job.start)
                    emit(np.frombuffer(src.read(job.size), np.uint8))
            if cursor - offset != job.size:
                raise ConversionError(f"page {job.pid}: produced {cursor - offset} bytes, the plan says {job.size}")
            start_writeback(fd, offset, job.size)  # so the final fsync finds little to do
            return hasher.hexdigest(), page

        progress.start("converting", plan.total_bytes)
        from threadpoolctl import threadpool_limits

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
        write_atomically(out, force, write, check)
    except ThinFormatError as e:
        raise ConversionError(f"internal error: the written archive does not open: {e}") from None
    layout = state["layout"]
    return ConvertResult(out, layout.file_size, len(jobs), layout.archive_hash.hex(), time.perf_counter() - t0,
                         state["manifest"], state["warnings"], state["shift"])


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
    if not plan.options.probe or not spec.rope_freqs_present(plan.model):
        return None
    from thinconv.check import PROBE_TOKENS, PROBE_TOP_K, default_tokens

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
                      "options": plan.options.record()},
        "source": ckpt.provenance(),
        "stats": stats,
    }
    if quant:
        validation["quant"] = quant
    if probe is not None:
        validation["probe"] = probe
    return {"format": "thin", "format_version": spec.VERSION, "alignment": spec.ALIGNMENT, "model": plan.model,
            "tensors": [_tensor_entry(tp) for tp in plan.tensors], "pages": pages, "assets": assets,
            "runtime": {"page_size": plan.options.page_size}, "validation": validation}


def check_output(out: Path, force: bool) -> None:
    """Fail before any work (or download) when the output cannot be written: it exists without
    `force`, is a folder, or its folder is missing or read-only. The writer re-checks at the end."""
    if out.exists() and not force:
        raise PackError(f"{out} already exists (use --force to overwrite)")
    if out.is_dir():
        raise PackError(f"{out} is a directory")
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise PackError(f"output folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise PackError(f"output folder {folder} is not writable")


def _tensor_entry(tp: TensorPlan) -> dict:
    return {"name": tp.name, "role": tp.role, "layer": tp.layer, "source": tp.sources, "shape": tp.shape,
            "dtype": tp.dtype, "quant": tp.quant, "hints": tp.hints,
            "pages": [spec.page_id(tp.name, k) for k in range(len(tp.pages))]}


def select_recipe(registry, ckpt: Checkpoint, recipe_name: str | None, label: str):
    """The recipe for `ckpt`: by config.json's architectures, or the named one if it handles them."""
    from thinconv.errors import RecipeError

    archs = ckpt.config.get("architectures") or []
    if recipe_name is None:
        return registry.for_architecture(archs, f"{label}/config.json")
    recipe = registry.get(recipe_name)
    if not set(archs) & set(recipe.architectures):
        raise RecipeError(f"{label}/config.json: architecture {', '.join(archs) or '(none)'} is not handled by recipe "
                          f"{recipe.name!r} ({', '.join(recipe.architectures)}); try `thinconv convert`")
    return recipe


@contextmanager
def open_plan(src: str | os.PathLike, options: "ConvertOptions | None" = None, *, recipe: str | None = None,
              revision: str | None = None, token: str | None = None, registry=None,
              commit: str | None = None) -> Iterator[tuple[Checkpoint, Plan]]:
    """Open a local checkpoint folder or a hub repo id and plan its conversion (no tensor data read).

    Hub files come through the HF cache; `token` defaults to $HF_TOKEN, `registry` to the built-in
    and $THINCONV_RECIPES recipes; the recipe is `recipe` or the one for config.json's architecture.
    `commit` pins a hub source to a commit resolved earlier (see open_checkpoint). The
    checkpoint stays open inside the `with` block."""
    from thinconv.checkpoint.source import open_checkpoint
    from thinconv.plan import ConvertOptions, plan_conversion
    from thinconv.recipe import load_registry

    registry = registry if registry is not None else load_registry([])
    token = token if token is not None else os.environ.get("HF_TOKEN")
    with open_checkpoint(src, revision=revision, token=token, commit=commit) as ckpt:
        yield ckpt, plan_conversion(ckpt, select_recipe(registry, ckpt, recipe, str(src)), options or ConvertOptions())


def convert_source(src: str | os.PathLike, out: str | os.PathLike, *, options: "ConvertOptions | None" = None,
                   recipe: str | None = None, revision: str | None = None, token: str | None = None,
                   force: bool = False, registry=None, progress: Progress | None = None,
                   commit: str | None = None) -> ConvertResult:
    """Convert a local checkpoint folder or a hub repo id to a .thin archive at `out` (what
    `thinconv convert` runs); arguments as for :func:`open_plan` and :func:`convert`."""
    check_output(Path(out), force)
    with open_plan(src, options, recipe=recipe, revision=revision, token=token, registry=registry,
                   commit=commit) as (ckpt, plan):
        return convert(ckpt, plan, out, force=force, progress=progress)
