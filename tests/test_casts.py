"""The converter casts bf16 ↔ f16 directly; that must equal the exact route through f32."""

import ml_dtypes
import numpy as np
import pytest


@pytest.mark.parametrize("src, dst", [(ml_dtypes.bfloat16, np.float16), (np.float16, ml_dtypes.bfloat16)])
def test_direct_cast_equals_the_route_through_f32_on_every_input(src, dst):
    x = np.arange(65536, dtype=np.uint16).view(src)
    with np.errstate(all="ignore"):
        direct = x.astype(dst)
        via_f32 = x.astype(np.float32).astype(dst)
    nan = np.isnan(via_f32.astype(np.float32))
    assert np.array_equal(direct.view(np.uint16)[~nan], via_f32.view(np.uint16)[~nan])
    assert np.isnan(direct.astype(np.float32)[nan]).all()


def test_integer_bf16_to_f16_equals_numpy_on_every_input():
    """The converter's fast bf16 → f16 (bit arithmetic, numpy's cast only off f16's normal range)."""
    from thinconv.casts import bf16_to_f16

    x = np.arange(65536, dtype=np.uint16).view(ml_dtypes.bfloat16)
    with np.errstate(all="ignore"):
        want = x.astype(np.float32).astype(np.float16)
    for order in (np.arange(65536), np.random.default_rng(0).permutation(65536)):  # odd values anywhere
        got = np.empty(65536, np.float16)
        bf16_to_f16(x[order], got)
        assert np.array_equal(got.view(np.uint16), want[order].view(np.uint16))  # NaN payloads included


def test_integer_bf16_to_f16_on_a_2d_chunk_of_normal_values():
    from thinconv.casts import bf16_to_f16

    x = (np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32) * 0.05).astype(ml_dtypes.bfloat16)
    x[3, 5] = 0  # one value off the fast path
    got = np.empty(x.shape, np.float16)
    bf16_to_f16(x, got)
    assert np.array_equal(got.view(np.uint16), x.astype(np.float32).astype(np.float16).view(np.uint16))


def test_integer_f32_to_bf16_equals_ml_dtypes():
    """The converter's f32 → bf16 (round to nearest even by integer arithmetic, NaN via ml_dtypes)
    against ml_dtypes on random bit patterns and every edge: ties, subnormals, overflow, Inf, NaN."""
    from thinconv.casts import f32_to_bf16

    rng = np.random.default_rng(2)
    bits = [rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)]
    edges = np.array([0, 0x80000000, 1, 0x7FFF, 0x8000, 0x18000, 0x28000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000,
                      0x7F800000, 0xFF800000, 0x7F800001, 0x7FC00000, 0xFFFFFFFF, 0x807FFFFF, 0x3F808000,
                      0x3F818000], np.uint32)
    bits.append(edges)
    bits.append((np.arange(1 << 16, dtype=np.uint32) << 16) | 0x8000)  # every tie
    for b in bits:
        x = b.view(np.float32)
        got = np.empty(x.size, ml_dtypes.bfloat16)
        f32_to_bf16(x, got)
        with np.errstate(all="ignore"):
            want = x.astype(ml_dtypes.bfloat16)
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_f16_to_f32_is_exact_for_every_finite_input_and_flags_the_rest():
    """The quantizer's f16 upcast (bit arithmetic): equal to numpy's cast on all finite f16 values;
    Inf and NaN land at |x| >= 65536 (the documented contract the quantizer relies on)."""
    from thinconv.casts import f16_to_f32

    bits = np.arange(65536, dtype=np.uint16)
    got = np.empty(65536, np.float32)
    f16_to_f32(bits, got)
    want = bits.view(np.float16).astype(np.float32)
    finite = np.isfinite(want)
    assert np.array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))  # signed zeros too
    assert (np.abs(got[~finite]) >= 65536).all()


def test_bf16_widening_is_exact_on_every_pattern():
    from thinconv.casts import bf16_to_f32, widen

    x = np.arange(65536, dtype=np.uint16)
    got = np.empty(65536, np.float32)
    bf16_to_f32(x, got)
    want = x.view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(widen(x.view(ml_dtypes.bfloat16).reshape(256, 256)).view(np.uint32).reshape(-1),
                          want.view(np.uint32))
    f64 = np.linspace(-3, 3, 7)
    assert widen(f64).dtype == np.float64 and np.array_equal(widen(f64), f64)  # f64 stays f64
