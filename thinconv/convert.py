"""Conversion: run a plan — stream every page out of the checkpoint, record checksums, stats and
quantization error, then hand lazily regenerated pages to the packer.

Two passes, each one page at a time, so memory stays bounded by a few pages whatever the model
size: the manifest (which precedes the pages in the file) needs every page's checksum, and the
packer re-checks each page against it as it writes — the gatekeeper sees the real bytes.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol

import blake3
import ml_dtypes
import numpy as np

import thinconv
from thinconv.checkpoint.source import Checkpoint
from thinconv.errors import ConversionError, PackError
from thinconv.format import spec
from thinconv.format.writer import FilePage, LazyPage, PackResult, pack
from thinconv.plan import Plan, TensorPlan
from thinconv.rope import rope_inv_freq
from thinconv.transforms import get_transform

NUMPY_OUT = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype(ml_dtypes.bfloat16)}
F16_MAX = float(np.finfo(np.float16).max)


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

    def add(self, x: np.ndarray) -> None:
        finite = np.isfinite(x)
        n_finite = int(np.count_nonzero(finite))
        if n_finite != x.size:
            nans = int(np.count_nonzero(np.isnan(x)))
            self.nan += nans
            self.inf += x.size - n_finite - nans
            x = x[finite]
        if n_finite == 0:
            return
        x64 = x.astype(np.float64, copy=False)
        mean = float(x64.mean())
        m2 = float(np.square(x64 - mean).sum())
        self.lo, self.hi = min(self.lo, float(x.min())), max(self.hi, float(x.max()))
        total = self.count + n_finite
        delta = mean - self.mean
        self.mean += delta * n_finite / total
        self.m2 += m2 + delta * delta * self.count * n_finite / total
        self.count = total

    def result(self) -> dict:
        if self.count == 0:
            return {"min": None, "max": None, "mean": None, "std": None, "nan": self.nan, "inf": self.inf}
        return {"min": self.lo, "max": self.hi, "mean": self.mean, "std": math.sqrt(self.m2 / self.count),
                "nan": self.nan, "inf": self.inf}


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
        self.tp, self.model = tp, model
        self.arrays = [ckpt.array(s) for s in tp.sources]
        if len(tp.shape) == 1:
            self.arrays = [a.reshape(-1) for a in self.arrays]
        self.offsets = np.cumsum([0] + [a.shape[0] for a in self.arrays])
        self.perm = rope_row_permutation(tp.shape[0], model["head_dim"], model["rope"]["rotary_dim"]) \
            if tp.permute_rope else None
        self.transform = get_transform(tp.transform, f"{recipe_path}: transforms") if tp.transform else None

    def rows(self, start: int, end: int) -> np.ndarray:
        if self.perm is None:
            out = self._range(start, end)
        else:
            idx = self.perm[start:end]
            out = np.concatenate([self._range(i, i + 1) for i in idx]) if len(self.arrays) > 1 else self.arrays[0][idx]
        if self.transform is not None:
            out = self.transform(out, name=self.tp.name, start=start, end=end, model=self.model)
            if out.shape[0] != end - start or list(out.shape[1:]) != self.tp.shape[1:]:
                raise ConversionError(f"transform {self.tp.transform!r} changed the shape of {self.tp.name} rows "
                                      f"[{start}, {end})")
        return out

    def _range(self, start: int, end: int) -> np.ndarray:
        pieces = []
        for a, off in zip(self.arrays, self.offsets):
            s, e = max(start, off), min(end, off + a.shape[0])
            if s < e:
                pieces.append(a[s - off: e - off])
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def _as_bytes(a: np.ndarray) -> np.ndarray:
    """A contiguous uint8 view (bf16 arrays cannot export a buffer themselves)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


@dataclass
class PageOutput:
    data: np.ndarray  # the page's bytes, uint8
    src32: np.ndarray | None = None  # the source rows as float32, for stats (pass 1 only)
    deq32: np.ndarray | None = None  # dequantized rows, for the error report (pass 1 only)


class PageMaker:
    """Produces the exact bytes of every page of a plan (deterministic, so both passes agree)."""

    def __init__(self, ckpt: Checkpoint, plan: Plan):
        self.ckpt, self.plan = ckpt, plan
        self._sources: dict[str, TensorSource] = {}
        self._rope: np.ndarray | None = None

    def source(self, tp: TensorPlan) -> TensorSource:
        if tp.name not in self._sources:
            self._sources[tp.name] = TensorSource(self.ckpt, tp, self.plan.model, self.plan.recipe.path)
        return self._sources[tp.name]

    def make(self, tp: TensorPlan, start: int, end: int, analyse: bool) -> PageOutput:
        if tp.name == "rope_freqs":
            if self._rope is None:
                model = self.plan.model
                self._rope = np.ascontiguousarray(rope_inv_freq(model["rope"], head_dim=model["head_dim"],
                                                                max_position_embeddings=model["max_position_embeddings"]),
                                                  dtype="<f4")
            return PageOutput(_as_bytes(self._rope), self._rope if analyse else None)
        src = self.source(tp).rows(start, end)
        if tp.dtype in spec.BLOCK_DTYPES:
            from thinconv.quant import dequantize_rows, quantize_rows

            src32 = np.ascontiguousarray(src, dtype=np.float32)
            blocks = quantize_rows(src32, tp.dtype)
            deq = dequantize_rows(blocks, tp.dtype, tp.shape[1]) if analyse else None
            return PageOutput(_as_bytes(blocks), src32 if analyse else None, deq)
        want = NUMPY_OUT[tp.dtype]
        if src.dtype == want:
            return PageOutput(_as_bytes(src), src.astype(np.float32) if analyse else None)
        src32 = src.astype(np.float32)
        out = src32.astype(want)
        if tp.dtype == "f16":
            overflow = np.isinf(out) & np.isfinite(src32)
            if overflow.any():
                worst = float(np.abs(src32[overflow]).max())
                raise ConversionError(f"tensor {tp.name} ({', '.join(tp.sources)}): {int(overflow.sum())} value(s) beyond "
                                      f"the f16 range (largest |x| = {worst:g} > {F16_MAX:g}); use --dtype bf16 or f32")
        return PageOutput(_as_bytes(out), src32 if analyse else None)


@dataclass
class ConvertResult:
    path: Path
    size: int
    page_count: int
    archive_hash: str
    seconds: float
    manifest: dict
    warnings: list[str] = field(default_factory=list)

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


def _ordered_map(fn: Callable[[Any], Any], items: Iterable[Any], workers: int = 2, window: int = 3) -> Iterator[Any]:
    """map() on a thread pool, results in input order, at most `window` in flight (bounded memory)."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def convert(ckpt: Checkpoint, plan: Plan, out: str | os.PathLike, *, force: bool = False,
            progress: Progress | None = None, probe: dict | None = None) -> ConvertResult:
    """Write `plan` as a .thin archive at `out` (atomically; nothing is left behind on failure)."""
    t0 = time.perf_counter()
    progress = progress or _NoProgress()
    out = Path(out)
    if out.exists() and not force:
        raise PackError(f"{out} already exists (use --force to overwrite)")
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise PackError(f"output folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise PackError(f"output folder {folder} is not writable")
    maker = PageMaker(ckpt, plan)
    pages: list[dict] = []
    tensors: list[dict] = []
    stats: dict[str, dict] = {}
    quant: dict[str, dict] = {}
    warnings: list[str] = []
    progress.start("analysing", sum(t.nbytes for t in plan.tensors))

    def analyse(job: tuple[TensorPlan, int, int, int]):
        tp, k, s, e = job
        page = maker.make(tp, s, e, analyse=True)
        buf = memoryview(page.data).cast("B")
        checksum = blake3.blake3(buf, max_threads=blake3.blake3.AUTO).hexdigest()
        part = RunningStats()
        part.add(page.src32)
        err = None
        if page.deq32 is not None:
            diff = page.deq32 - page.src32
            err = (float(np.square(diff, dtype=np.float64).sum()), float(np.abs(diff).max(initial=0.0)),
                   float(np.square(page.src32, dtype=np.float64).sum()), page.src32.size)
        return tp, k, s, e, buf.nbytes, checksum, part, err

    jobs = [(tp, k, s, e) for tp in plan.tensors for k, (s, e) in enumerate(tp.pages)]
    merged: dict[str, RunningStats] = {}
    errs: dict[str, list[float]] = {}
    for tp, k, s, e, size, checksum, part, err in _ordered_map(analyse, jobs):
        pages.append({"id": spec.page_id(tp.name, k), "tensor": tp.name, "rows": [s, e], "size": size, "checksum": checksum})
        _merge_stats(merged.setdefault(tp.name, RunningStats()), part)
        if err is not None:
            acc = errs.setdefault(tp.name, [0.0, 0.0, 0.0, 0])
            acc[0] += err[0]
            acc[1] = max(acc[1], err[1])
            acc[2] += err[2]
            acc[3] += err[3]
        progress.advance(size)
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
            sq, mx, ref, n = errs[tp.name]
            rmse = math.sqrt(sq / n)
            rms = math.sqrt(ref / n)
            quant[tp.name] = {"rmse": rmse, "max_abs_err": mx, "rel_rmse": rmse / rms if rms > 0 else 0.0}
        elif tp.note:
            quant[tp.name] = {"rmse": None, "max_abs_err": None, "rel_rmse": None, "note": tp.note}
        tensors.append({"name": tp.name, "role": tp.role, "layer": tp.layer, "source": tp.sources, "shape": tp.shape,
                        "dtype": tp.dtype, "quant": tp.quant, "hints": tp.hints,
                        "pages": [spec.page_id(tp.name, k) for k in range(len(tp.pages))]})
    sources: dict[str, Any] = _tensor_page_sources(maker, plan)
    assets = []
    for ap in plan.assets:
        ids = []
        for k, (s, e) in enumerate(ap.pages):
            pid = spec.page_id(ap.file.name, k)
            src = FilePage(ap.file.path, s, e - s)
            h = blake3.blake3()
            for chunk in src.chunks():
                h.update(chunk)
            pages.append({"id": pid, "asset": ap.file.name, "size": e - s, "checksum": h.hexdigest()})
            sources[pid] = src
            ids.append(pid)
        assets.append({"name": ap.file.name, "media_type": ap.media_type, "size": ap.file.size, "pages": ids})
    validation: dict[str, Any] = {
        "converter": {"name": "thinconv", "version": thinconv.__version__, "recipe": plan.recipe.name},
        "source": ckpt.provenance(),
        "stats": stats,
    }
    if quant:
        validation["quant"] = quant
    if probe is not None:
        validation["probe"] = probe
    manifest = {"format": "thin", "format_version": spec.VERSION, "alignment": spec.ALIGNMENT, "model": plan.model,
                "tensors": tensors, "pages": pages, "assets": assets,
                "runtime": {"page_size": plan.options.page_size}, "validation": validation}
    total = sum(p["size"] for p in pages)
    progress.start("writing", total)
    result: PackResult = pack(manifest, sources, out, force=force, progress=progress.advance)
    return ConvertResult(result.path, result.size, result.page_count, result.archive_hash,
                         time.perf_counter() - t0, manifest, warnings)


def _merge_stats(into: RunningStats, part: RunningStats) -> None:
    into.nan += part.nan
    into.inf += part.inf
    if part.count == 0:
        return
    total = into.count + part.count
    delta = part.mean - into.mean
    into.mean += delta * part.count / total
    into.m2 += part.m2 + delta * delta * into.count * part.count / total
    into.lo, into.hi = min(into.lo, part.lo), max(into.hi, part.hi)
    into.count = total


def _tensor_page_sources(maker: PageMaker, plan: Plan) -> dict[str, LazyPage]:
    """Pass 2: each page regenerated on demand, one at a time, while the packer writes."""
    sources: dict[str, LazyPage] = {}
    for tp in plan.tensors:
        for k, (s, e) in enumerate(tp.pages):
            size = (e - s) * tp.row_bytes

            def produce(tp: TensorPlan = tp, s: int = s, e: int = e) -> list:
                return [maker.make(tp, s, e, analyse=False).data]

            sources[spec.page_id(tp.name, k)] = LazyPage(size, produce)
    return sources
