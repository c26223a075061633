"""Block quantization: byte-exact vs gguf-py (and a scalar port of ggml's C), error bounds, stats."""

from __future__ import annotations

import math
import tracemalloc

import gguf
import ml_dtypes
import numpy as np
import pytest

from thinconv import quant
from thinconv.quant import (
    BLOCK_BYTES,
    NonFiniteError,
    QuantErrorStats,
    dequantize_rows,
    quantize_chunked,
    quantize_rows,
)

SCHEMES = ("q8_0", "q4_0", "q4_1")
QTYPE = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
         "q4_1": gguf.GGMLQuantizationType.Q4_1}
F32 = np.float32
BF16 = ml_dtypes.bfloat16


def ref_bytes(x: np.ndarray, scheme: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gguf.quants.quantize(x.astype(F32), QTYPE[scheme])


def assert_same_as_gguf(x: np.ndarray, scheme: str, **kw) -> np.ndarray:
    """quantize_rows and quantize_chunked (2 threads) both equal gguf-py, byte for byte."""
    ref = ref_bytes(x, scheme)
    got = quantize_rows(x, scheme)
    assert got.shape == ref.shape and got.dtype == np.uint8
    bad = np.flatnonzero((got != ref).any(axis=1))
    assert bad.size == 0, f"{scheme}: rows {bad[:5]} differ from gguf"
    chunked, _ = quantize_chunked(x, scheme, **kw)
    np.testing.assert_array_equal(chunked, ref)
    return got


# --- scalar port of ggml-quants.c (*_ref): an oracle independent of numpy vectorisation ------------

def _c_int8(v: np.float32) -> int:
    """C's (int8_t) of a float on x86: cvttss2si, then the low byte (inf/NaN -> INT_MIN -> 0)."""
    if not math.isfinite(float(v)) or abs(float(v)) >= 2.0**31:
        return 0
    b = int(float(v)) & 0xFF
    return b - 256 if b > 127 else b


def _f16(v: np.float32) -> bytes:
    return np.float16(v).tobytes()


def c_ref_block(block: np.ndarray, scheme: str) -> bytes:
    x = [F32(v) for v in block]
    with np.errstate(all="ignore"):
        if scheme == "q8_0":
            amax = F32(0)
            for v in x:
                amax = amax if amax > abs(v) else abs(v)
            d = F32(amax / F32(127))
            inv = F32(1) / d if d else F32(0)
            q = []
            for v in x:
                t = F32(v * inv)
                r = math.copysign(math.floor(abs(float(t)) + 0.5), float(t)) if math.isfinite(float(t)) else float(t)
                q.append(_c_int8(F32(r)) & 0xFF)
            return _f16(d) + bytes(q)
        if scheme == "q4_0":
            amax, mx = F32(0), F32(0)
            for v in x:
                if amax < abs(v):
                    amax, mx = abs(v), v
            d = F32(mx / F32(-8))
            inv = F32(1) / d if d else F32(0)
            lo, off = F32(0), F32(8.5)
            head = _f16(d)
        else:
            lo, hi = F32(np.finfo(F32).max), F32(-np.finfo(F32).max)
            for v in x:
                if v < lo:
                    lo = v
                if v > hi:
                    hi = v
            d = F32(F32(hi - lo) / F32(15))
            inv = F32(1) / d if d else F32(0)
            off = F32(0.5)
            head = _f16(d) + _f16(lo)
        qs = []
        for j in range(16):
            a = F32(F32(x[j] - lo) * inv) if scheme == "q4_1" else F32(x[j] * inv)
            b = F32(F32(x[j + 16] - lo) * inv) if scheme == "q4_1" else F32(x[j + 16] * inv)
            q0 = min(15, _c_int8(F32(a + off))) & 0xFF
            q1 = min(15, _c_int8(F32(b + off))) & 0xFF
            qs.append((q0 | (q1 << 4)) & 0xFF)
        return head + bytes(qs)


def c_ref(x: np.ndarray, scheme: str) -> np.ndarray:
    blocks = x.astype(F32).reshape(-1, 32)
    raw = b"".join(c_ref_block(b, scheme) for b in blocks)
    return np.frombuffer(raw, np.uint8).reshape(x.shape[0], -1)


# --- data -------------------------------------------------------------------------------------------

def edge_blocks() -> np.ndarray:
    """One 32-wide row per awkward case (finite values only)."""
    rng = np.random.default_rng(7)
    rows = [
        np.zeros(32),                                  # all zero
        np.full(32, 0.3), np.full(32, -0.3),           # constant, both signs
        np.full(32, 1e-3), np.full(32, -7.0),
        np.r_[127.0, np.arange(-15, 16) + 0.5],        # q8_0 d=1: every x*id is k+0.5
        np.r_[-127.0, -(np.arange(-15, 16) + 0.5)],
        np.r_[-8.0, np.arange(-7.5, 7.6, 0.5)[:31]],   # q4_0 d=1: x*id+8.5 lands on integers
        np.r_[np.arange(16) - 0.5, np.arange(16) + 0.5],  # q4_1 ties after (x-min)*id + 0.5
        np.r_[3.0, -3.0, rng.uniform(-1, 1, 30)],      # q4_0 magnitude tie, + first
        np.r_[-3.0, 3.0, rng.uniform(-1, 1, 30)],      # q4_0 magnitude tie, - first
        np.r_[rng.uniform(-1, 1, 31), 2.0],            # extreme last
        rng.standard_normal(32) * 1e-40,               # subnormal: 1/d overflows
        rng.standard_normal(32) * 1e-37,               # 1/d near the f32 limit
        rng.standard_normal(32) * 1e-44,               # d underflows to 0
        np.r_[1e-39, np.zeros(31)],
        rng.standard_normal(32) * 65504,               # around f16 max
        rng.standard_normal(32) * 1e6,                 # d overflows f16 (q4_0, q4_1)
        rng.standard_normal(32) * 1e9,                 # d overflows f16 (all)
        np.r_[3e38, -3e38, rng.standard_normal(30)],   # q4_1 max - min overflows f32
        np.r_[np.full(16, 3.4e38), np.full(16, 1.0)],
        rng.standard_t(1, 32),                         # heavy tails
        np.r_[1.0, rng.standard_normal(31) * 1e-6],    # one dominant value
    ]
    return np.array(rows, dtype=F32).reshape(len(rows), 32)


def heavy_tailed(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    x = rng.standard_t(2, shape).astype(F32)
    x[rng.random(shape) < 2e-3] *= 1000
    return x


# --- byte exactness -----------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", SCHEMES)
def test_random_normal_and_heavy_tailed_match_gguf(scheme):
    rng = np.random.default_rng(0)
    rows = (2 * quant._TILE_BLOCKS + 37) * 32 // 1024 + 1  # two full tiles and a partial one
    assert_same_as_gguf(rng.standard_normal((rows, 1024), dtype=F32), scheme)
    assert_same_as_gguf(heavy_tailed(rng, (33, 1024)), scheme, chunk_rows=4)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_edge_blocks_match_gguf_and_c(scheme):
    e = edge_blocks()
    x = np.concatenate([e.reshape(1, -1), e[::-1].reshape(1, -1)])  # blocks side by side in rows
    got = assert_same_as_gguf(x, scheme)
    np.testing.assert_array_equal(got, c_ref(x, scheme))
    assert_same_as_gguf(e, scheme)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_ties_round_like_c(scheme):
    """Values whose scaled form sits exactly on (or one ulp beside) a rounding boundary."""
    base = {"q8_0": (127.0, np.arange(-126, 127) + 0.5),   # d = 1: x*id = x
            "q4_0": (-8.0, np.arange(-7.5, 8.0, 0.5)),     # d = 1: x*id + 8.5 on n and n + .5
            "q4_1": (15.0, np.arange(0, 15.0, 0.5))}[scheme]  # min 0, d = 1
    anchor, vals = base
    vals = vals.astype(F32)
    vals = np.concatenate([vals, np.nextafter(vals, F32(-np.inf)), np.nextafter(vals, F32(np.inf))])
    vals = np.resize(vals, (len(vals) + 30) // 31 * 31).reshape(-1, 31)
    blocks = np.concatenate([np.full((vals.shape[0], 1), anchor, F32), vals], axis=1)
    if scheme == "q4_1":
        blocks[:, 1] = 0.0  # pin min to 0 so d = 1 exactly
    x = blocks.reshape(1, -1)
    got = assert_same_as_gguf(x, scheme)
    np.testing.assert_array_equal(got, c_ref(x, scheme))
    if scheme == "q8_0":  # d = 1 exactly: the quants are roundf(x) themselves
        q = got.reshape(-1, 34)[:, 2:].view(np.int8)[:, 1:].astype(np.float64)
        v = blocks[:, 1:].astype(np.float64)
        np.testing.assert_array_equal(q, np.copysign(np.floor(np.abs(v) + 0.5), v))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
def test_sources_upcast_exactly(scheme, dtype):
    rng = np.random.default_rng(3)
    x = heavy_tailed(rng, (21, 512))
    x[0, :32] = 0
    x[1, :64] = 60000.0 if dtype == np.float16 else 3e5  # near the source type's range edge
    x[2, :32] = 6e-8 if dtype == np.float16 else 1e-38   # source subnormals
    src = x.astype(dtype)
    ref = ref_bytes(src.astype(F32), scheme)
    np.testing.assert_array_equal(quantize_rows(src, scheme), ref)
    for threads, chunk_rows in ((1, None), (2, 1), (2, 5)):
        got, _ = quantize_chunked(src, scheme, threads=threads, chunk_rows=chunk_rows)
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("dtype", [np.float16, BF16])
def test_every_half_precision_value_upcasts_exactly(dtype):
    """All 2**16 finite bit patterns: the bit-trick (f16) / ml_dtypes (bf16) upcast feeds the same bytes."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    vals = bits.view(dtype)
    vals = vals[np.isfinite(vals.astype(F32))]
    x = np.resize(vals, (len(vals) + 31) // 32 * 32).reshape(-1, 32)
    np.testing.assert_array_equal(quantize_rows(x, "q4_1"), ref_bytes(x.astype(F32), "q4_1"))


def test_read_only_unaligned_mmap_source(tmp_path):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((9, 256)).astype(BF16)
    path = tmp_path / "t.bin"
    path.write_bytes(b"\0" * 3 + x.tobytes())
    mm = np.memmap(path, dtype=BF16, mode="r", offset=3, shape=x.shape)
    got, _ = quantize_chunked(mm, "q4_0", chunk_rows=2)
    np.testing.assert_array_equal(got, ref_bytes(x.astype(F32), "q4_0"))
    strided = rng.standard_normal((20, 128)).astype(F32)[::3]  # non-contiguous rows
    np.testing.assert_array_equal(quantize_chunked(strided, "q8_0")[0], ref_bytes(strided, "q8_0"))


def test_signed_zeros_follow_c():
    """ggml's loops start from max = +0.0 (q4_0) and keep the first min/max (q4_1)."""
    z = np.zeros((1, 96), F32)
    z[0, :32] = -0.0                      # all -0.0: q4_0 d = 0.0/-8 = -0.0
    z[0, 33:64:2] = -0.0                  # mixed zeros, first +0.0
    z[0, 64:] = np.r_[-0.0, np.zeros(15), np.linspace(0.1, 1, 16)]  # q4_1: min is the first zero (-0)
    for scheme in SCHEMES:
        np.testing.assert_array_equal(quantize_rows(z, scheme), c_ref(z, scheme))
    d_q4_0 = quantize_rows(z, "q4_0").reshape(-1, 18)[:2, :2].view(np.uint16)[:, 0]
    assert list(d_q4_0) == [0x8000, 0x8000]
    m_q4_1 = quantize_rows(z, "q4_1").reshape(-1, 20)[:, 2:4].view(np.uint16)[:, 0]
    assert list(m_q4_1) == [0x8000, 0x0000, 0x8000]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
def test_non_finite_input_names_the_row(scheme, bad, dtype):
    x = np.ones((40, 64), F32)
    x[29, 33] = bad
    with pytest.raises(NonFiniteError) as err:
        quantize_chunked(x.astype(dtype), scheme, chunk_rows=8)
    assert err.value.row == 29 and "row 29" in str(err.value)
    with pytest.raises(NonFiniteError):
        quantize_rows(x.astype(dtype), scheme)


def test_f16_max_is_finite():
    x = np.full((1, 32), 65504.0, np.float16)
    x[0, 1] = -65504.0
    np.testing.assert_array_equal(quantize_rows(x, "q8_0"), ref_bytes(x, "q8_0"))


# --- dequantization and error bounds -----------------------------------------------------------------

@pytest.mark.parametrize("scheme", SCHEMES)
def test_dequantize_matches_gguf_and_bounds(scheme):
    rng = np.random.default_rng(5)
    x = np.concatenate([heavy_tailed(rng, (15, 256)), edge_blocks()[:12].reshape(3, 128).repeat(2, axis=1)])
    q = quantize_rows(x, scheme)
    deq = dequantize_rows(q, scheme, x.shape[1])
    np.testing.assert_array_equal(deq, gguf.quants.dequantize(q, QTYPE[scheme]))
    np.testing.assert_array_equal(dequantize_rows(q.tobytes(), scheme, x.shape[1]), deq)
    np.testing.assert_array_equal(dequantize_rows(memoryview(q.tobytes()), scheme, x.shape[1]), deq)

    xb = x.reshape(-1, 32).astype(np.float64)
    err = np.abs(xb - deq.reshape(-1, 32))
    bb = BLOCK_BYTES[scheme]
    d16 = q.reshape(-1, bb)[:, :2].view(np.float16).astype(np.float64)
    mx, mn = xb.max(axis=1, keepdims=True), xb.min(axis=1, keepdims=True)
    amax = np.maximum(mx, -mn)
    slack = 2.0**-20 * amax  # f32 rounding of x*id and of the product
    if scheme == "q8_0":
        d = amax / 127
        bound = d / 2 + 127 * np.abs(d16 - d) + slack      # |x - x^| <= d/2 (+ f16 rounding of d)
    elif scheme == "q4_0":
        d = amax / 8
        bound = d + 8 * np.abs(np.abs(d16) - d) + slack    # <= d: the top value clips to 7*d
    else:
        d = (mx - mn) / 15
        m16 = q.reshape(-1, bb)[:, 2:4].view(np.float16).astype(np.float64)
        bound = d / 2 + 15 * np.abs(d16 - d) + np.abs(m16 - mn) + 2.0**-20 * np.abs(mx - mn) + slack
    assert np.all(err <= bound), f"{scheme}: max excess {(err - bound).max()}"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_error_stats_match_direct_numpy(scheme):
    rng = np.random.default_rng(6)
    x = heavy_tailed(rng, (37, 2048)).astype(BF16)
    q, stats = quantize_chunked(x, scheme, chunk_rows=3)
    src = x.astype(np.float64)
    e = dequantize_rows(q, scheme, x.shape[1]).astype(np.float64) - src
    rmse = math.sqrt(np.mean(e**2))
    res = stats.result()
    assert set(res) == {"rmse", "max_abs_err", "rel_rmse"}
    assert stats.count == x.size
    assert res["rmse"] == pytest.approx(rmse, rel=1e-5)
    assert res["max_abs_err"] == pytest.approx(np.abs(e).max(), rel=1e-6)
    assert res["rel_rmse"] == pytest.approx(rmse / math.sqrt(np.mean(src**2)), rel=1e-5)
    # deterministic regardless of threads / chunking
    _, single = quantize_chunked(x, scheme, threads=1, chunk_rows=3)
    assert single == stats

    # the public accumulator, fed page by page, agrees
    acc = QuantErrorStats()
    deq = dequantize_rows(q, scheme, x.shape[1])
    for r in range(0, x.shape[0], 10):
        acc.accumulate(x[r:r + 10].astype(F32), deq[r:r + 10])
    for key, v in acc.result().items():
        assert v == pytest.approx(res[key], rel=1e-5)


def test_error_stats_extreme_magnitudes_and_zero_source():
    x = np.zeros((2, 64), F32)
    _, st = quantize_chunked(x, "q8_0")
    assert st.result() == {"rmse": 0.0, "max_abs_err": 0.0, "rel_rmse": 0.0}
    rng = np.random.default_rng(8)
    tiny = rng.standard_normal((2, 64)).astype(F32) * 1e-20  # squares underflow f32; d16 underflows
    q, st = quantize_chunked(tiny, "q8_0")
    assert not dequantize_rows(q, "q8_0", 64).any()
    assert st.result()["rmse"] == pytest.approx(math.sqrt(np.mean(tiny.astype(np.float64) ** 2)), rel=1e-6)
    assert st.result()["rel_rmse"] == pytest.approx(1.0)
    big = rng.standard_normal((2, 64)).astype(F32) * 1e30  # d overflows f16: decodes to inf/NaN
    for scheme in SCHEMES:
        res = quantize_chunked(big, scheme)[1].result()
        assert res["rmse"] == res["max_abs_err"] == res["rel_rmse"] == math.inf
    merged = QuantErrorStats()
    merged.merge(st)
    merged.merge(QuantErrorStats())
    assert merged == st


def test_chunked_never_holds_the_tensor_in_f32():
    x = np.ones((4096, 4096), BF16)  # 64 MiB as f32
    tracemalloc.start()
    try:
        q, _ = quantize_chunked(x, "q4_0")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < q.nbytes + 20 * 2**20  # output + two threads' tile scratch (~8.5 MiB each)


def _quantize_in_child(x: np.ndarray, conn) -> None:
    conn.send(quantize_chunked(x, "q8_0", chunk_rows=1)[0].tobytes())


def test_worker_pool_survives_fork():
    import multiprocessing

    x = np.random.default_rng(11).standard_normal((4, 64)).astype(F32)
    expected = quantize_chunked(x, "q8_0", chunk_rows=1)[0]  # the pool now exists in this process
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_quantize_in_child, args=(x, child))
    proc.start()
    try:
        assert parent.poll(20), "quantize_chunked hung in a forked child"
        assert parent.recv() == expected.tobytes()
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()


# --- API contract -------------------------------------------------------------------------------------

def test_shapes_and_out_parameter():
    x = np.random.default_rng(10).standard_normal((3, 64)).astype(F32)
    for scheme, bb in BLOCK_BYTES.items():
        out = np.empty((3, 2 * bb), np.uint8)
        assert quantize_rows(x, scheme, out=out) is out
        np.testing.assert_array_equal(out, ref_bytes(x, scheme))
    empty, st = quantize_chunked(np.zeros((0, 64), F32), "q8_0")
    assert empty.shape == (0, 68) and st.count == 0
    assert dequantize_rows(b"", "q4_0", 64).shape == (0, 64)


@pytest.mark.parametrize("call", [
    lambda: quantize_rows(np.zeros((2, 64), F32), "q5_0"),
    lambda: quantize_rows(np.zeros((2, 48), F32), "q8_0"),
    lambda: quantize_rows(np.zeros(64, F32), "q8_0"),
    lambda: quantize_rows(np.zeros((2, 64), np.float64), "q8_0"),
    lambda: quantize_rows(np.zeros((2, 64), F32), "q8_0", out=np.empty((2, 67), np.uint8)),
    lambda: quantize_chunked(np.zeros((2, 64), F32), "q4_1", chunk_rows=0),
    lambda: quantize_chunked(np.zeros((2, 64), F32), "q4_1", threads=0),
    lambda: dequantize_rows(b"\0" * 19, "q4_0", 32),
    lambda: dequantize_rows(b"\0" * 18, "q4_0", 33),
    lambda: dequantize_rows(b"\0" * 18, "q9", 32),
])
def test_programming_errors_raise_value_error(call):
    with pytest.raises(ValueError):
        call()
