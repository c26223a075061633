"""ggml-compatible block quantization (q8_0, q4_0, q4_1) — spec §3.

Output bytes equal ggml's ``quantize_row_<scheme>_ref`` (and ``gguf.quants.quantize``): f32
arithmetic in the same order as the C code, round-half-away-from-zero for q8_0, truncation for
the q4 types, f16 (round-to-nearest-even) for d and m.

Speed comes from a transposed tile layout. A tile of ``k`` blocks is copied, four values at a
time (then upcast exactly if bf16/f16), into ``L[8, 4k]`` with ``L[r, 4i + c] = x[block i, 4r + c]``,
so every per-block reduction and broadcast is a long contiguous numpy loop instead of millions of
32-element ones; quants go back out four bytes at a time. Each thread keeps ~8.5 MB of scratch.
The error report squares the tile's errors in f32 and sums them pairwise (relative accuracy ~1e-6).

Deliberate choices where ggml's C and gguf-py disagree or C is undefined:

* signed zeros follow the C loops (q4_0: an all-zero block has ``max = +0.0`` so ``d = -0.0``;
  q4_1: ``min``/``max`` are the *first* occurrence), whereas gguf-py takes numpy's choice;
* a block whose ``1/d`` overflows (|values| below ~1e-37) or whose q4_1 range overflows f32
  gets all-zero quants — what both produce on x86, where C's float->int8 cast of inf/NaN is UB;
* NaN/inf input raises :class:`NonFiniteError` (ggml and gguf-py disagree on it).
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from thinconv.casts import BF16, bf16_to_f32, f16_to_f32
from thinconv.format import dtypes
from thinconv.format.blocks import dequantize_rows  # noqa: F401 - the quantizer's inverse, re-exported

BLOCK_SIZE = dtypes.BLOCK_SIZE
BLOCK_BYTES = {name: dtypes.get(name).nbytes for name in dtypes.BLOCK_DTYPES}
# The quantizer's inputs: the float archive dtypes, which all upcast exactly to f32.
SOURCE_DTYPES = tuple(dtypes.numpy_dtype(name) for name in dtypes.FLOAT_DTYPES)

_F32 = np.float32
_TILE_BLOCKS = 16384  # 512 Ki values: big enough to amortise GIL hand-offs, small enough for L3
_CHUNK_VALUES = 2 * _TILE_BLOCKS * BLOCK_SIZE  # default work unit handed to a thread
_SUM_SLICE = 1 << 16  # values per float64 slice in the error sums
_SAFE_SQ = (2.0**-40, 2.0**40)  # f32 sums of squares neither overflow nor underflow in here
_SIGN = np.uint32(0x80000000)
_ALMOST_HALF = np.uint32(0x3EFFFFFF)  # bits of 0.49999997f, the largest float below 0.5


class NonFiniteError(ValueError):
    """The quantizer input holds NaN or ±inf; ``row`` is the first offending row."""

    def __init__(self, row: int) -> None:
        super().__init__(f"non-finite value in row {row}: block quantization needs finite input")
        self.row = row


@dataclass
class QuantErrorStats:
    """Streaming error report: feed (source, dequantized) f32 chunks in any order and layout."""

    count: int = 0
    sum_sq_err: float = 0.0
    sum_sq_src: float = 0.0
    max_abs_err: float = 0.0

    def accumulate(self, src_chunk_f32: np.ndarray, deq_chunk_f32: np.ndarray) -> None:
        """Add one chunk; the two arrays hold the same elements in the same order."""
        src = np.ascontiguousarray(src_chunk_f32, dtype=_F32).reshape(-1)
        deq = np.ascontiguousarray(deq_chunk_f32, dtype=_F32).reshape(-1)
        if src.shape != deq.shape:
            raise ValueError(f"error stats: source has {src.size} values, dequantized has {deq.size}")
        if src.size:
            amax = max(float(src.max()), -float(src.min()))
            self._add_diff(deq - src, src, amax)

    def merge(self, other: QuantErrorStats) -> None:
        """Fold another report (e.g. another page of the same tensor) into this one."""
        self.count += other.count
        self.sum_sq_err += other.sum_sq_err
        self.sum_sq_src += other.sum_sq_src
        self.max_abs_err = max(self.max_abs_err, other.max_abs_err)

    def result(self) -> dict[str, float]:
        """{"rmse", "max_abs_err", "rel_rmse"}; rel_rmse = rmse / rms(source), 0.0 if that is 0."""
        n = max(self.count, 1)
        rmse = math.sqrt(self.sum_sq_err / n)
        rms = math.sqrt(self.sum_sq_src / n)
        return {"rmse": rmse, "max_abs_err": self.max_abs_err, "rel_rmse": rmse / rms if rms > 0 else 0.0}

    def _add_diff(self, diff: np.ndarray, src: np.ndarray, src_amax: float) -> None:
        # diff, src: contiguous f32 of equal size; diff = dequantized - source (may be clobbered).
        self.count += src.size
        d, s = diff.reshape(-1), src.reshape(-1)
        worst = max(float(d.max()), -float(d.min()))
        # Sums use numpy's pairwise summation, not BLAS dot: BLAS kernels differ between CPUs, and
        # these figures land in the archive, whose bytes must not depend on the host.
        if _SAFE_SQ[0] <= src_amax <= _SAFE_SQ[1]:
            # f32 squares, pairwise f32 sum per tile (relative error ~1e-6), tiles added in float64
            np.square(d, out=d)
            sq_err = float(np.add.reduce(d))
            np.square(s, out=d)
            sq_src = float(np.add.reduce(d))
        else:  # squares would over/underflow f32: square in float64, in small slices
            sq_err = sq_src = 0.0
            for a in range(0, d.size, _SUM_SLICE):
                d64, s64 = d[a:a + _SUM_SLICE].astype(np.float64), s[a:a + _SUM_SLICE].astype(np.float64)
                sq_err += float(np.add.reduce(np.square(d64, out=d64)))
                sq_src += float(np.add.reduce(np.square(s64, out=s64)))
        if math.isnan(worst) or math.isnan(sq_err):
            # d or m overflowed f16 (|x| beyond ~8e6 for q8_0, ~5e5 for q4_0, 65504 for q4_1's
            # min): the block decodes to inf/NaN, so the error is unbounded — report inf.
            worst = sq_err = math.inf
        self.max_abs_err = max(self.max_abs_err, worst)
        self.sum_sq_err += sq_err
        self.sum_sq_src += sq_src


def _check_scheme(scheme: str) -> int:
    if scheme not in BLOCK_BYTES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; expected one of {sorted(BLOCK_BYTES)}")
    return BLOCK_BYTES[scheme]


def _check_source(x: np.ndarray, what: str) -> None:
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise ValueError(f"{what}: expected a 2-D array, got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in SOURCE_DTYPES:
        raise ValueError(f"{what}: dtype {x.dtype} does not upcast exactly to f32; expected f32, f16 or bf16")
    if x.shape[1] % BLOCK_SIZE:
        raise ValueError(f"{what}: {x.shape[1]} columns is not a multiple of {BLOCK_SIZE}")


class _Scratch:
    """Per-thread work buffers for tiles of up to ``cap`` blocks."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        n = cap * BLOCK_SIZE
        self.lf = np.empty(n, _F32)  # the tile in f32, transposed layout
        self.wf = np.empty(n, _F32)  # scaled values, later dequantized values
        self.wu = np.empty(n, np.uint32)  # rounding offsets
        self.src16 = np.empty(n, np.uint16)  # transposed bf16/f16 before the upcast
        self.q = np.empty(n, np.uint8)  # quants, transposed layout
        self.p = np.empty(n // 2, np.uint8)  # packed nibbles
        self.fifteen = np.full(4 * cap, 15, np.uint8)  # broadcast row: numpy's min with a scalar is slow
        self.rows = [np.empty(4 * cap, _F32) for _ in range(2)]  # per-block-column reductions

    def views(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        n = k * BLOCK_SIZE
        shape = (8, 4 * k)
        return (self.lf[:n].reshape(shape), self.wf[:n].reshape(shape),
                self.wu[:n].reshape(shape), self.q[:n].reshape(shape))


_local = threading.local()
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _scratch(blocks: int) -> _Scratch:
    """This thread's buffers, grown to fit ``blocks`` (at most a tile) and kept for reuse."""
    need = min(blocks, _TILE_BLOCKS)
    s = getattr(_local, "scratch", None)
    if s is None or s.cap < need:
        s = _local.scratch = _Scratch(max(need, 256))
    return s


def _pool(threads: int) -> ThreadPoolExecutor:
    # Long-lived workers keep their scratch between quantize_chunked calls.
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="thin-quant")
        return pool


def _forget_pools_after_fork() -> None:
    # A forked child inherits the executors but not their threads: work sent there would hang.
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools_after_fork)


def _load_tile(src: np.ndarray, k: int, sc: _Scratch) -> np.ndarray:
    """Upcast (exactly) and transpose ``k`` blocks of flat ``src`` into ``L[8, 4k]`` f32."""
    L = sc.lf[: k * BLOCK_SIZE].reshape(8, 4 * k)
    if src.dtype == _F32:
        # 'V16' = 4 values: alignment-agnostic (mmap views), and a fast fixed-size copy.
        np.copyto(L.view("V16"), src.view("V16").reshape(k, 8).T)
        return L
    t = sc.src16[: k * BLOCK_SIZE].reshape(8, 4 * k)
    np.copyto(t.view("V8"), src.view("V8").reshape(k, 8).T)
    if src.dtype == BF16:
        bf16_to_f32(t, L)  # exact, and GIL-free (ml_dtypes' cast would serialize two threads)
    else:
        f16_to_f32(t, L)  # exact for finite values; inf/NaN land at |x| >= 65536, rejected by the caller
    return L


def _block_minmax(L: np.ndarray, k: int, sc: _Scratch) -> tuple[np.ndarray, np.ndarray]:
    cmax = np.maximum.reduce(L, axis=0, out=sc.rows[0][: 4 * k])
    cmin = np.minimum.reduce(L, axis=0, out=sc.rows[1][: 4 * k])
    bmax = np.maximum(np.maximum(cmax[0::4], cmax[1::4]), np.maximum(cmax[2::4], cmax[3::4]))
    bmin = np.minimum(np.minimum(cmin[0::4], cmin[1::4]), np.minimum(cmin[2::4], cmin[3::4]))
    return bmax, bmin


def _natural_blocks(L: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Blocks ``idx`` of a transposed tile, back in element order: [len(idx), 32] f32."""
    return L.reshape(8, -1, 4)[:, idx, :].transpose(1, 0, 2).reshape(len(idx), BLOCK_SIZE)


def _inverse(d: np.ndarray) -> np.ndarray:
    # C: id = d ? 1.0f/d : 0.0f   (inf when d is subnormal enough)
    inv = _F32(1) / d
    inv[d == 0] = 0
    return inv


def _put_f16(col: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Store ``v`` as f16 (round-to-nearest-even, like GGML_FP32_TO_FP16); return it as f32."""
    h = v.astype(np.float16)
    col[...] = h
    return h.astype(_F32)


def _first_nonfinite(bmax: np.ndarray, bmin: np.ndarray, is_f16: bool) -> int:
    ok = np.isfinite(bmax) & np.isfinite(bmin)
    if is_f16:  # the f16 bit trick maps inf/NaN to |x| >= 65536
        ok &= (bmax < 65536) & (bmin > -65536)
    return int(np.argmin(ok))


@dataclass
class _Tile:
    """One tile of ``k`` blocks in the transposed layout, handed to a scheme's quantizer."""

    L: np.ndarray  # the source values, f32 [8, 4k]
    W: np.ndarray  # f32 work; a scheme leaves the dequantized values here when `dequant`
    S: np.ndarray  # uint32 work
    Q: np.ndarray  # uint8 quants [8, 4k]
    bmax: np.ndarray  # per-block max, f32 [k]
    bmin: np.ndarray  # per-block min
    out: np.ndarray  # the blocks' bytes [k, block_bytes]
    sc: _Scratch
    dequant: bool  # the error report needs the dequantized values


def _quant_tile(scheme: str, src: np.ndarray, out: np.ndarray, sc: _Scratch,
                stats: QuantErrorStats | None, is_f16: bool) -> int:
    """Quantize ``out.shape[0]`` blocks of flat ``src`` into ``out`` [k, block_bytes].

    Returns -1, or the index of the first block holding a non-finite value (nothing is written).
    Few, large numpy calls on purpose: each one is a GIL hand-off when two threads run.
    """
    k = out.shape[0]
    _, W, S, Q = sc.views(k)
    L = _load_tile(src, k, sc)
    bmax, bmin = _block_minmax(L, k, sc)
    hi, lo = float(bmax.max()), float(bmin.min())  # NaN propagates through max/min
    if not (math.isfinite(hi) and math.isfinite(lo)) or (is_f16 and max(hi, -lo) >= 65536):
        return _first_nonfinite(bmax, bmin, is_f16)
    _QUANTIZERS[scheme](_Tile(L, W, S, Q, bmax, bmin, out, sc, stats is not None))
    if stats is not None:
        np.subtract(W, L, out=W)
        stats._add_diff(W, L, max(hi, -lo))
    return -1


def _quant_q8_0(t: _Tile) -> None:
    """x = d·q, d = amax / 127, q = round-half-away(x / d)."""
    amax = np.maximum(t.bmax, -t.bmin)
    amax += _F32(0)  # C's amax is never -0.0
    d = amax / _F32(127)
    inv = _inverse(d)
    np.multiply(t.L, np.repeat(inv, 4), out=t.W)
    # roundf(v) = trunc(v + copysign(0.49999997f, v)) exactly for |v| < 2**23 (see tests);
    # the int8 cast truncates.
    np.bitwise_and(t.W.view(np.uint32), _SIGN, out=t.S)
    np.bitwise_or(t.S, _ALMOST_HALF, out=t.S)
    np.add(t.W, t.S.view(_F32), out=t.W)
    Qi = t.Q.view(np.int8)
    np.copyto(Qi, t.W, casting="unsafe")
    _zero_bad(t.Q, inv)
    np.copyto(t.out[:, 2:].view("V4"), t.Q.view("V4").T)
    d16 = _put_f16(t.out[:, :2].view(np.float16)[:, 0], d)
    if t.dequant:
        np.copyto(t.W, Qi)
        np.multiply(t.W, np.repeat(d16, 4), out=t.W)


def _quant_q4_0(t: _Tile) -> None:
    """x = d·(q − 8), d = m / −8 with m the value of largest magnitude, q = trunc(x / d + 8.5)."""
    # C keeps the first value of largest magnitude, +0.0 for an all-zero block.
    s = t.bmax + t.bmin  # < 0 exactly when -bmin > bmax, == 0 exactly on a magnitude tie
    m = t.bmax.copy()
    np.copyto(m, t.bmin, where=s < 0)
    m += _F32(0)
    ties = np.flatnonzero(s == 0)
    if ties.size:
        ties = ties[t.bmax[ties] != 0]
        blocks = _natural_blocks(t.L, ties)
        m[ties] = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)[:, 0]
    d = m / _F32(-8)
    inv = _inverse(d)
    np.multiply(t.L, np.repeat(inv, 4), out=t.W)
    np.add(t.W, _F32(8.5), out=t.W)
    d16 = _pack_nibbles(t, d, inv, offset=2)
    if t.dequant:
        np.subtract(t.Q, np.uint8(8), out=t.Q)  # wraps to the int8 value q - 8
        np.copyto(t.W, t.Q.view(np.int8))
        np.multiply(t.W, np.repeat(d16, 4), out=t.W)


def _quant_q4_1(t: _Tile) -> None:
    """x = d·q + m, m = min, d = (max − min) / 15, q = trunc((x − m) / d + 0.5)."""
    # C keeps the first occurrence of min/max: only the sign of a zero can differ.
    for ext, fn in ((t.bmin, np.argmin), (t.bmax, np.argmax)):
        z = np.flatnonzero(ext == 0)
        if z.size:
            blocks = _natural_blocks(t.L, z)
            ext[z] = np.take_along_axis(blocks, fn(blocks, axis=1)[:, None], axis=1)[:, 0]
    d = (t.bmax - t.bmin) / _F32(15)
    inv = _inverse(d)  # 0 when d overflowed to inf: those blocks are zeroed below
    np.subtract(t.L, np.repeat(t.bmin, 4), out=t.W)
    np.multiply(t.W, np.repeat(inv, 4), out=t.W)
    np.add(t.W, _F32(0.5), out=t.W)
    d16 = _pack_nibbles(t, d, inv, offset=4, bad_d=d)
    m16 = _put_f16(t.out[:, :4].view(np.float16)[:, 1], t.bmin)
    if t.dequant:
        np.copyto(t.W, t.Q)
        np.multiply(t.W, np.repeat(d16, 4), out=t.W)
        np.add(t.W, np.repeat(m16, 4), out=t.W)


def _pack_nibbles(t: _Tile, d: np.ndarray, inv: np.ndarray, offset: int, bad_d: np.ndarray | None = None) -> np.ndarray:
    """The q4 types' common tail: quants from W (in [0, 16.5]), capped at 15, packed two per byte
    after the block's `offset`-byte header; stores d as f16 and returns it as f32."""
    k = t.out.shape[0]
    # the uint8 cast truncates like C's (int8_t) cast.
    np.copyto(t.Q, t.W, casting="unsafe")
    np.minimum(t.Q, t.sc.fifteen[: 4 * k], out=t.Q)
    _zero_bad(t.Q, inv, bad_d)
    P = t.sc.p[: 16 * k].reshape(4, 4 * k)
    # rows 4..7 hold values 16..31, the high nibbles; all quants are <= 15 here, so shifting
    # four at a time as uint32 never carries into the neighbouring byte.
    np.left_shift(t.Q[4:].view(np.uint32), np.uint32(4), out=P.view(np.uint32))
    np.bitwise_or(P, t.Q[:4], out=P)
    np.copyto(t.out[:, offset:].view("V4"), P.view("V4").T)
    return _put_f16(t.out[:, :offset].view(np.float16)[:, 0], d)


_QUANTIZERS = {"q8_0": _quant_q8_0, "q4_0": _quant_q4_0, "q4_1": _quant_q4_1}


def _zero_bad(Q: np.ndarray, inv: np.ndarray, d: np.ndarray | None = None) -> None:
    """Blocks whose 1/d overflowed (or q4_1's d itself) get all-zero quants (see module doc)."""
    if np.isinf(inv.min()) or np.isinf(inv.max()) or (d is not None and np.isinf(d.max())):
        bad = np.isinf(inv) if d is None else np.isinf(inv) | np.isinf(d)
        Q[:, np.repeat(bad, 4)] = 0


def _quant_rows(scheme: str, x: np.ndarray, out: np.ndarray, stats: QuantErrorStats | None, row0: int) -> None:
    """Quantize contiguous rows ``x`` into ``out`` [rows, row_bytes], tile by tile."""
    bb = BLOCK_BYTES[scheme]
    src = x.reshape(-1)
    blocks = out.reshape(-1, bb)
    per_row = x.shape[1] // BLOCK_SIZE
    sc = _scratch(blocks.shape[0])
    is_f16 = x.dtype == np.float16
    with np.errstate(all="ignore"):  # inf/NaN in degenerate blocks are expected and handled
        for b0 in range(0, blocks.shape[0], _TILE_BLOCKS):
            b1 = min(b0 + _TILE_BLOCKS, blocks.shape[0])
            bad = _quant_tile(scheme, src[b0 * BLOCK_SIZE: b1 * BLOCK_SIZE], blocks[b0:b1], sc, stats, is_f16)
            if bad >= 0:
                raise NonFiniteError(row0 + (b0 + bad) // per_row)


def quantize_rows(x: np.ndarray, scheme: str, *, out: np.ndarray | None = None,
                  report: QuantErrorStats | None = None) -> np.ndarray:
    """Quantize a 2-D f32 (or f16/bf16, upcast exactly) array to uint8 [rows, cols/32*block_bytes].

    Bytes are identical to ggml's ``quantize_row_<scheme>_ref``. Single-threaded; see
    :func:`quantize_chunked` for large tensors. With ``report``, the quantization error of these
    rows is added to it (computed tile by tile as the rows are quantized). Raises ValueError for
    a bad scheme, shape or ``out``, and :class:`NonFiniteError` for NaN/inf.
    """
    bb = _check_scheme(scheme)
    _check_source(x, "quantize_rows")
    shape = (x.shape[0], x.shape[1] // BLOCK_SIZE * bb)
    if out is None:
        out = np.empty(shape, np.uint8)
    elif out.dtype != np.uint8 or out.shape != shape or not out.flags.c_contiguous:
        raise ValueError(f"quantize_rows: out must be C-contiguous uint8 {shape}, got {out.dtype} {out.shape}")
    if x.size:
        _quant_rows(scheme, np.ascontiguousarray(x), out, report, 0)
    return out


def quantize_chunked(src: np.ndarray, scheme: str, *, chunk_rows: int | None = None,
                     threads: int = 2, report: bool = True) -> tuple[np.ndarray, QuantErrorStats | None]:
    """Quantize a 2-D f32/f16/bf16 array (e.g. a read-only mmap view) with an error report.

    Rows are processed ``chunk_rows`` at a time on ``threads`` (long-lived) threads; each thread
    upcasts tiles of its chunk into a private scratch of at most ~8.5 MB, so the tensor never
    exists in f32.
    The report compares each dequantized tile with its source tile (deterministic: partial
    reports are merged in row order); ``report=False`` skips it (and returns None for it).
    """
    bb = _check_scheme(scheme)
    _check_source(src, "quantize_chunked")
    rows, cols = src.shape
    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_VALUES // max(cols, 1))
    if chunk_rows < 1 or threads < 1:
        raise ValueError(f"quantize_chunked: chunk_rows ({chunk_rows}) and threads ({threads}) must be >= 1")
    out = np.empty((rows, cols // BLOCK_SIZE * bb), np.uint8)
    starts = range(0, rows, chunk_rows) if src.size else range(0)

    def work(r0: int) -> QuantErrorStats | None:
        r1 = min(r0 + chunk_rows, rows)
        st = QuantErrorStats() if report else None
        _quant_rows(scheme, np.ascontiguousarray(src[r0:r1]), out[r0:r1], st, r0)
        return st

    if threads == 1 or len(starts) <= 1:
        parts = [work(r0) for r0 in starts]
    else:
        parts = list(_pool(threads).map(work, starts))  # re-raises the first failing chunk's error
    if not report:
        return out, None
    stats = QuantErrorStats()
    for p in parts:
        stats.merge(p)
    return out, stats
