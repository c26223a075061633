"""Page production: the exact bytes of every page of a plan — passthrough views, casts, block
quantization — with the source values' statistics and the quantization error measured on the way.

Deterministic (the same bytes on any host) and bounded: a page is produced in row chunks of
~CHUNK_VALUES values into per-thread scratch buffers; no page-sized buffer ever exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import ml_dtypes
import numpy as np

from thinconv.casts import BF16, as_bytes, bf16_to_f16, f32_to_bf16, scratch, widen
from thinconv.checkpoint.source import Checkpoint
from thinconv.errors import ConversionError
from thinconv.format import dtypes, spec
from thinconv.plan import Plan, TensorPlan
from thinconv.quant import SOURCE_DTYPES as QUANT_INPUTS
from thinconv.quant import NonFiniteError, QuantErrorStats, quantize_rows
from thinconv.rope import derived_tables
from thinconv.rows import TensorSource

CHUNK_VALUES = 1 << 20  # values per work chunk: temporaries stay a few MiB whatever the page size


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
        """Fold in a chunk of float32 (or float64) values, at most casts.SCRATCH_VALUES of them; returns
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
            dev = scratch(n, x.dtype, "dev")
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


@dataclass
class PageOutput:
    """What producing a page measured (its bytes went to `emit`)."""

    stats: RunningStats | None = None  # source-value statistics
    qerr: Any = None  # thinconv.quant.QuantErrorStats of a block-quantized page


class PageMaker:
    """Produces the exact bytes of every page of a plan (deterministic: the same on any host).

    A page is produced in row chunks of ~CHUNK_VALUES values, each handed to `emit` (which hashes
    and writes it) and its source rows dropped from memory before the next: no page-sized buffer
    exists, only a few MiB of per-thread temporaries."""

    def __init__(self, ckpt: Checkpoint, plan: Plan):
        self.ckpt, self.plan = ckpt, plan
        self._sources: dict[str, TensorSource] = {}
        self._derived: dict[str, np.ndarray] | None = None

    def source(self, tp: TensorPlan) -> TensorSource:
        if tp.name not in self._sources:
            self._sources[tp.name] = TensorSource(self.ckpt, tp, self.plan.model, self.plan.recipe.path)
        return self._sources[tp.name]

    def make(self, tp: TensorPlan, start: int, end: int, emit: Callable[[np.ndarray], None]) -> PageOutput:
        """Emit the bytes of output rows [start, end) of `tp` in order; return what was measured:
        the source values' statistics, and the quantization error of a block-quantized page."""
        stats = RunningStats()
        if tp.role in spec.DERIVED_ROLES:
            if self._derived is None:
                self._derived = {k: np.ascontiguousarray(v, dtype="<f4") for k, v in derived_tables(self.plan.model).items()}
            table = self._derived[tp.name]
            stats.add(table)
            emit(as_bytes(table))
            return PageOutput(stats)
        source = self.source(tp)
        step = max(1, CHUNK_VALUES // (tp.shape[-1] if len(tp.shape) >= 2 else 1))
        qerr = None
        if dtypes.is_block(tp.dtype):
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
        want = dtypes.numpy_dtype(tp.dtype)
        wide = widen(src)  # exact: every source dtype widens to f32 (f64 stays f64)
        part = stats.add(wide)
        if src.dtype == want:  # passthrough: the chunk is a view of the source
            return as_bytes(src)
        out = scratch(src.size, want, "out").reshape(src.shape)
        if src.dtype == BF16 and want == np.float16:
            bf16_to_f16(src, out)
        elif want == BF16 and wide.dtype == np.float32:
            f32_to_bf16(wide, out)
        else:
            # Cast from the exact wide values: equal to a direct cast (tests/test_casts.py checks
            # bf16 ↔ f16 on all 65,536 inputs) and faster. Overflow is reported below, not warned.
            with np.errstate(over="ignore", invalid="ignore"):
                out[...] = wide
        if part.count and max(-part.lo, part.hi) > float(ml_dtypes.finfo(want).max):
            PageMaker._check_range(tp, wide, out, want)
        return as_bytes(out)

    @staticmethod
    def _quantize(tp: TensorPlan, src: np.ndarray, stats: RunningStats, qerr: Any) -> np.ndarray:
        # The quantizer's input: the source upcast exactly to f32 (the quantizer does it tile by
        # tile; an f64 source is rounded to f32 first). It adds the error of these rows to qerr.
        if src.dtype not in QUANT_INPUTS:  # f64 rounds to f32 (as any f64 → f32 cast); f8 upcasts exactly
            src = src.astype(np.float32)
        out = scratch(src.shape[0] * tp.row_bytes, np.uint8, "out").reshape(src.shape[0], tp.row_bytes)
        try:
            with np.errstate(all="ignore"):  # an overflowing block scale is reported as one error later
                quantize_rows(src, tp.dtype, out=out, report=qerr)
        except NonFiniteError:
            raise ConversionError(f"tensor {tp.name} ({', '.join(tp.sources)}) holds values that are NaN or Inf in "
                                  f"float32, which {tp.dtype} cannot represent; keep it in a float dtype or fix the "
                                  f"checkpoint") from None
        stats.add(widen(src))
        return as_bytes(out)

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
