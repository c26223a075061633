"""Conversion: run a plan — stream every page out of the checkpoint, record checksums, stats and
quantization error, then hand lazily regenerated pages to the packer.

Two passes, each one page at a time, so memory stays bounded by a few pages whatever the model
size: the manifest (which precedes the pages in the file) needs every page's checksum, and the
packer re-checks each page against it as it writes — the gatekeeper sees the real bytes.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol

import blake3
import ml_dtypes
import numpy as np

import thinconv
from thinconv.checkpoint.source import Checkpoint
from thinconv.errors import ConversionError, PackError
from thinconv.format import spec
from thinconv.format.writer import FilePage, LazyPage, PackResult, pack
from thinconv.plan import Plan, TensorPlan, tied_head_problem
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

    def add(self, x: np.ndarray) -> None:
        """Fold in a chunk of float32 values (at most CHUNK_VALUES: it reuses a per-thread buffer)."""
        x = x.reshape(-1)
        finite = np.isfinite(x)
        n_finite = int(np.count_nonzero(finite))
        part = RunningStats()
        if n_finite != x.size:
            part.nan = int(np.count_nonzero(np.isnan(x)))
            part.inf = x.size - n_finite - part.nan
            x = x[finite]
        if n_finite:
            # float64 through one reused buffer (no page-sized temporaries), summed by numpy's
            # pairwise sum rather than BLAS, whose kernels differ between CPUs: the archive's
            # bytes must not depend on the host.
            buf = _scratch64(x.size)
            np.copyto(buf, x)
            part.count, part.mean = n_finite, float(np.add.reduce(buf)) / n_finite
            np.subtract(buf, part.mean, out=buf)
            part.m2 = float(np.add.reduce(np.square(buf, out=buf)))
            part.lo, part.hi = float(x.min()), float(x.max())
        self.merge(part)

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


def _scratch64(n: int) -> np.ndarray:
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < n:
        buf = _local.buf = np.empty(max(n, CHUNK_VALUES), np.float64)
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


def _as_bytes(a: np.ndarray) -> np.ndarray:
    """A contiguous uint8 view (bf16 arrays cannot export a buffer themselves)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


@dataclass
class PageOutput:
    data: np.ndarray  # the page's bytes, uint8
    stats: RunningStats | None = None  # source-value statistics (pass 1 only)
    qerr: Any = None  # thinconv.quant.QuantErrorStats of a block-quantized page (pass 1 only)


CHUNK_VALUES = 1 << 20  # values per work chunk: temporaries stay a few MiB whatever the page size


class PageMaker:
    """Produces the exact bytes of every page of a plan (deterministic, so both passes agree).

    Work inside a page runs in row chunks of ~CHUNK_VALUES values, so besides the page's own
    output buffer only a few MiB of temporaries exist per page in flight."""

    def __init__(self, ckpt: Checkpoint, plan: Plan):
        self.ckpt, self.plan = ckpt, plan
        self._sources: dict[str, TensorSource] = {}
        self._rope: np.ndarray | None = None

    def source(self, tp: TensorPlan) -> TensorSource:
        if tp.name not in self._sources:
            self._sources[tp.name] = TensorSource(self.ckpt, tp, self.plan.model, self.plan.recipe.path)
        return self._sources[tp.name]

    def make(self, tp: TensorPlan, start: int, end: int, analyse: bool) -> PageOutput:
        stats = RunningStats() if analyse else None
        if tp.name == "rope_freqs":
            if self._rope is None:
                self._rope = np.ascontiguousarray(model_rope_freqs(self.plan.model), dtype="<f4")
            if stats:
                stats.add(self._rope)
            return PageOutput(_as_bytes(self._rope), stats)
        src = self.source(tp).rows(start, end)
        step = max(1, CHUNK_VALUES // (src.shape[1] if src.ndim == 2 else 1))
        chunks = [(a, min(a + step, src.shape[0])) for a in range(0, src.shape[0], step)]
        if tp.dtype in spec.BLOCK_DTYPES:
            return self._quantize(tp, src, chunks, stats)
        want = NUMPY_OUT[tp.dtype]
        if src.dtype == want:  # passthrough: the page is a view of the source
            if stats:
                for a, b in chunks:
                    stats.add(src[a:b].astype(np.float32))
            return PageOutput(_as_bytes(src), stats)
        out = np.empty(src.shape, want)
        for a, b in chunks:
            # A direct cast: for bf16 ↔ f16 it equals the exact route through f32 on all 65,536
            # inputs (tests/test_casts.py checks); overflow is reported below, not warned.
            with np.errstate(over="ignore", invalid="ignore"):
                out[a:b] = src[a:b]
            if stats:  # pass 1 checks and measures; pass 2 only regenerates the same bytes
                wide = src[a:b].astype(np.float64 if src.dtype == np.float64 else np.float32)
                self._check_range(tp, wide, out[a:b], want)
                stats.add(wide)
        return PageOutput(_as_bytes(out), stats)

    @staticmethod
    def _quantize(tp: TensorPlan, src: np.ndarray, chunks: list[tuple[int, int]], stats: RunningStats | None) -> PageOutput:
        from thinconv.quant import NonFiniteError, QuantErrorStats, dequantize_rows, quantize_rows

        out = np.empty((src.shape[0], tp.row_bytes), np.uint8)
        qerr = QuantErrorStats() if stats is not None else None
        for a, b in chunks:
            src32 = np.ascontiguousarray(src[a:b], dtype=np.float32)
            try:
                quantize_rows(src32, tp.dtype, out=out[a:b])
            except NonFiniteError:
                raise ConversionError(f"tensor {tp.name} ({', '.join(tp.sources)}) holds values that are NaN or Inf in "
                                      f"float32, which {tp.dtype} cannot represent; keep it in a float dtype or fix the "
                                      f"checkpoint") from None
            if stats is not None:
                stats.add(src32)
                with np.errstate(all="ignore"):  # an overflowing block scale is reported as one error later
                    qerr.accumulate(src32, dequantize_rows(out[a:b], tp.dtype, tp.shape[1]))
        return PageOutput(_as_bytes(out), stats, qerr)

    @staticmethod
    def _check_range(tp: TensorPlan, src: np.ndarray, out: np.ndarray, want: np.dtype) -> None:
        """Any narrowing cast (f64 sources → f32 included) must not turn finite values into Inf."""
        limit = float(ml_dtypes.finfo(want).max)
        with np.errstate(over="ignore", invalid="ignore"):
            finite = np.isfinite(src)
            if float(np.max(np.abs(src), initial=0.0, where=finite)) <= limit:
                return  # the common case, without a pass over the (slow) f16 output
            overflow = np.isinf(out) & finite
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
            progress: Progress | None = None) -> ConvertResult:
    """Write `plan` as a .thin archive at `out` (atomically; nothing is left behind on failure)."""
    t0 = time.perf_counter()
    progress = progress or _NoProgress()
    out = Path(out)
    _check_output(out, force)
    tied = tied_head_problem(ckpt, plan.mapping)  # the one value check planning leaves to conversion
    if tied:
        raise ConversionError(f"{ckpt.root}: {tied}")
    probe, probe_note = None, None
    if plan.options.probe:
        from thinconv.check import conversion_probe

        probe, probe_note = conversion_probe(ckpt, plan)
    maker = PageMaker(ckpt, plan)
    progress.start("analysing", sum(t.nbytes for t in plan.tensors))
    pages, stats, quant, warnings = _analyse(maker, plan, progress)
    if probe_note:
        warnings.append(probe_note)
    sources, prefetcher = _tensor_page_sources(maker, plan)
    assets = _add_assets(plan, pages, sources)
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
    manifest = {"format": "thin", "format_version": spec.VERSION, "alignment": spec.ALIGNMENT, "model": plan.model,
                "tensors": [_tensor_entry(tp) for tp in plan.tensors], "pages": pages, "assets": assets,
                "runtime": {"page_size": plan.options.page_size}, "validation": validation}
    progress.start("writing", sum(p["size"] for p in pages))
    try:
        result: PackResult = pack(manifest, sources, out, force=force, progress=progress.advance)
    finally:
        prefetcher.close()
    return ConvertResult(result.path, result.size, result.page_count, result.archive_hash,
                         time.perf_counter() - t0, manifest, warnings)


def _check_output(out: Path, force: bool) -> None:
    """Fail before any work when the output cannot be written (the packer re-checks at the end)."""
    if out.exists() and not force:
        raise PackError(f"{out} already exists (use --force to overwrite)")
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise PackError(f"output folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise PackError(f"output folder {folder} is not writable")


def _analyse(maker: PageMaker, plan: Plan, progress: Progress) -> tuple[list[dict], dict, dict, list[str]]:
    """Pass 1: every tensor page's checksum, the source statistics and quantization error.

    Returns (pages[] entries, validation.stats, validation.quant, warnings)."""

    def one_page(job: tuple[TensorPlan, int, int, int]):
        tp, k, s, e = job
        page = maker.make(tp, s, e, analyse=True)
        checksum = blake3.blake3(page.data, max_threads=blake3.blake3.AUTO).hexdigest()
        if tp.sources:
            maker.source(tp).release(s, e)
        return tp, k, s, e, checksum, page

    pages: list[dict] = []
    merged: dict[str, RunningStats] = {}
    errs: dict[str, Any] = {}
    jobs = [(tp, k, s, e) for tp in plan.tensors for k, (s, e) in enumerate(tp.pages)]
    for tp, k, s, e, checksum, page in _ordered_map(one_page, jobs):
        pages.append({"id": spec.page_id(tp.name, k), "tensor": tp.name, "rows": [s, e], "size": page.data.nbytes,
                      "checksum": checksum})
        merged.setdefault(tp.name, RunningStats()).merge(page.stats)
        if page.qerr is not None:
            errs.setdefault(tp.name, type(page.qerr)()).merge(page.qerr)
        progress.advance(page.data.nbytes)
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
    return pages, stats, quant, warnings


def _tensor_entry(tp: TensorPlan) -> dict:
    return {"name": tp.name, "role": tp.role, "layer": tp.layer, "source": tp.sources, "shape": tp.shape,
            "dtype": tp.dtype, "quant": tp.quant, "hints": tp.hints,
            "pages": [spec.page_id(tp.name, k) for k in range(len(tp.pages))]}


def _add_assets(plan: Plan, pages: list[dict], sources: dict[str, Any]) -> list[dict]:
    """Asset pages (verbatim source files, after all tensor pages): hash them, add their sources."""
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
    return assets


class _Prefetcher:
    """Produces pass-2 pages on worker threads a few pages ahead of the packer, which asks for them
    in order; at most `ahead` + 1 pages are held at once."""

    def __init__(self, jobs: list[Callable[[], np.ndarray]], done: list[Callable[[], None]], workers: int = 2,
                 ahead: int = 2):
        self.jobs, self.done, self.ahead = jobs, done, ahead
        self.pool = ThreadPoolExecutor(max_workers=workers)
        self.futures: dict[int, Any] = {}
        self.next = 0

    def get(self, i: int) -> np.ndarray:
        while self.next < len(self.jobs) and self.next <= i + self.ahead:
            self.futures[self.next] = self.pool.submit(self.jobs[self.next])
            self.next += 1
        if i > 0:
            self.done[i - 1]()  # the packer has written page i - 1
        future = self.futures.pop(i, None)
        return future.result() if future is not None else self.jobs[i]()

    def close(self) -> None:
        for f in self.futures.values():
            f.cancel()
        self.pool.shutdown(wait=True)


def _tensor_page_sources(maker: PageMaker, plan: Plan) -> tuple[dict[str, LazyPage], _Prefetcher]:
    """Pass 2: each page regenerated on demand (a few ahead, on both cores) while the packer writes."""
    sources: dict[str, LazyPage] = {}
    jobs: list[Callable[[], np.ndarray]] = []
    done: list[Callable[[], None]] = []
    prefetcher = _Prefetcher(jobs, done)
    for tp in plan.tensors:
        for k, (s, e) in enumerate(tp.pages):
            jobs.append(lambda tp=tp, s=s, e=e: maker.make(tp, s, e, analyse=False).data)
            done.append((lambda tp=tp, s=s, e=e: maker.source(tp).release(s, e)) if tp.sources else (lambda: None))

            def produce(i: int = len(jobs) - 1) -> list:
                return [prefetcher.get(i)]

            sources[spec.page_id(tp.name, k)] = LazyPage((e - s) * tp.row_bytes, produce)
    return sources, prefetcher


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
              revision: str | None = None, token: str | None = None, registry=None) -> Iterator[tuple[Checkpoint, Plan]]:
    """Open a local checkpoint folder or a hub repo id and plan its conversion (no tensor data read).

    Hub files come through the HF cache; `token` defaults to $HF_TOKEN, `registry` to the built-in
    and $THINCONV_RECIPES recipes; the recipe is `recipe` or the one for config.json's architecture.
    The checkpoint stays open inside the `with` block."""
    from thinconv.checkpoint.source import open_checkpoint
    from thinconv.plan import ConvertOptions, plan_conversion
    from thinconv.recipe import load_registry

    registry = registry if registry is not None else load_registry([])
    token = token if token is not None else os.environ.get("HF_TOKEN")
    with open_checkpoint(src, revision=revision, token=token) as ckpt:
        yield ckpt, plan_conversion(ckpt, select_recipe(registry, ckpt, recipe, str(src)), options or ConvertOptions())


def convert_source(src: str | os.PathLike, out: str | os.PathLike, *, options: "ConvertOptions | None" = None,
                   recipe: str | None = None, revision: str | None = None, token: str | None = None,
                   force: bool = False, registry=None, progress: Progress | None = None) -> ConvertResult:
    """Convert a local checkpoint folder or a hub repo id to a .thin archive at `out` (what
    `thinconv convert` runs); arguments as for :func:`open_plan` and :func:`convert`."""
    _check_output(Path(out), force)
    with open_plan(src, options, recipe=recipe, revision=revision, token=token, registry=registry) as (ckpt, plan):
        return convert(ckpt, plan, out, force=force, progress=progress)
