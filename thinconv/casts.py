"""Float casts at integer speed, exact, and free of the GIL.

numpy's bf16/f16 casts are scalar code and ml_dtypes' hold the GIL (which would serialize the
converter's page threads). These do the same rounding with numpy integer loops, which release
it. Each is tested bit for bit against numpy / ml_dtypes (tests/test_casts.py).

Work buffers come from `scratch`: per thread, reused, so a chunk allocates nothing.
"""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
SCRATCH_VALUES = 1 << 20  # the smallest scratch buffer: one converter chunk of values

_local = threading.local()


def scratch(n: int, dtype, use: str) -> np.ndarray:
    """A per-thread reusable buffer of `n` values, one per (`use`, dtype): no temporaries per chunk."""
    key = f"{use}_{np.dtype(dtype).char}"
    buf = getattr(_local, key, None)
    if buf is None or buf.size < n:
        buf = np.empty(max(n, SCRATCH_VALUES), dtype)
        setattr(_local, key, buf)
    return buf[:n]


def widen(x: np.ndarray) -> np.ndarray:
    """`x` as float32 (float32 and float64 stay as they are), exact, in a reused per-thread buffer.

    bf16 is the top half of an f32, so it widens by a 16-bit shift: exact for every pattern."""
    if x.dtype in (np.float64, np.float32):
        return np.ascontiguousarray(x)
    out = scratch(x.size, np.float32, "wide").reshape(x.shape)
    if x.dtype == BF16:
        bf16_to_f32(x.view(np.uint16), out)
    else:
        np.copyto(out, x, casting="unsafe")
    return out


def bf16_to_f32(bits: np.ndarray, out: np.ndarray) -> None:
    """bf16 bit patterns (uint16) → f32 `out` of the same shape; exact for every pattern."""
    np.left_shift(bits, 16, out=out.view(np.uint32), dtype=np.uint32)


_F16_MASK = np.uint32(0x8FFFE000)  # sign + f16 exponent/mantissa after the <<13 shift
_F16_SCALE = np.float32(2.0**112)  # rebias the exponent 15 → 127; exact for subnormals too


def f16_to_f32(bits: np.ndarray, out: np.ndarray) -> None:
    """f16 bit patterns (uint16) → f32 `out` of the same shape, ~5× numpy's cast.

    Exact for every finite value. Inf and NaN come out as finite values of magnitude ≥ 65536
    (finite f16 values stop at 65504): a caller that may meet them checks for that (the
    quantizer rejects them) or uses numpy's cast."""
    np.copyto(out.view(np.int32), bits.view(np.int16))  # sign-extends
    u = out.view(np.uint32)
    np.left_shift(u, np.uint32(13), out=u)
    np.bitwise_and(u, _F16_MASK, out=u)
    np.multiply(out, _F16_SCALE, out=out)


def bf16_to_f16(src: np.ndarray, out: np.ndarray) -> None:
    """bf16 → f16 `out`, rounded as numpy's cast rounds it, ~3× faster. A bf16 whose exponent is in
    f16's normal range converts exactly: same sign, exponent rebiased (127 → 15), 7 mantissa bits
    shifted up by 3. Anything else (zeros, f16 subnormals, overflow, Inf, NaN) goes through numpy."""
    u = src.reshape(-1).view(np.uint16)
    h = out.reshape(-1).view(np.uint16)
    np.bitwise_and(u, 0x7FFF, out=h)
    normal = scratch(u.size, np.uint16, "mask")
    np.subtract(h, 0x3880, out=normal)  # wraps below the range: one unsigned comparison
    np.subtract(h, 0x3800, out=h)  # exponent 127 - 112 bias → 15 bias, in bf16's bit positions
    np.left_shift(h, 3, out=h)
    np.bitwise_or(h, np.bitwise_and(u, 0x8000, out=scratch(u.size, np.uint16, "sign")), out=h)
    if normal.max() > 0x477F - 0x3880:  # some exponent outside f16's normal range [-14, 15]
        odd = np.flatnonzero(normal > 0x477F - 0x3880)
        with np.errstate(over="ignore", invalid="ignore"):
            h[odd] = u[odd].view(BF16).astype(np.float32).astype(np.float16).view(np.uint16)


def f32_to_bf16(src: np.ndarray, out: np.ndarray) -> None:
    """f32 → bf16 `out`, rounded to nearest even as ml_dtypes rounds it: add 0x7FFF plus the lowest
    kept bit, keep the top 16 bits. Exact for every finite value, subnormals and overflow to Inf
    included; NaNs (which must stay NaN) go through ml_dtypes."""
    u = src.reshape(-1).view(np.uint32)
    t = scratch(u.size, np.uint32, "round")
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
            h[nan] = src.reshape(-1)[nan].astype(BF16).view(np.uint16)


def as_bytes(a: np.ndarray) -> np.ndarray:
    """A contiguous uint8 view (bf16 arrays cannot export a buffer themselves)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)
