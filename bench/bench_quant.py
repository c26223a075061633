"""Benchmark thinconv.quant against gguf-py's reference quantizer (a script, not a test).

    PYTHONPATH=/work/main python bench/bench_quant.py [--rows 4096] [--cols 4096] [--repeat 3]

For each scheme and source dtype it prints params/s of ``quantize_chunked`` (2 threads, with the
error report) and of ``gguf.quants.quantize`` on the same array, whether the bytes are
identical, and the peak RSS growth of each call over the resident input.
"""

from __future__ import annotations

import argparse
import gc
import resource
import time
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np

from thinconv.quant import quantize_chunked

GGUF_TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
              "q4_1": gguf.GGMLQuantizationType.Q4_1}
CLEAR_REFS = Path("/proc/self/clear_refs")


def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_growth(fn):
    """Run fn(); return (result, seconds, MB of peak RSS above the RSS before the call)."""
    gc.collect()
    CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS (Linux)
    base = _rss_mb("VmRSS")
    t0 = time.perf_counter()
    res = fn()
    dt = time.perf_counter() - t0
    return res, dt, _rss_mb("VmHWM") - base


def best(fn, repeat: int):
    runs = [peak_growth(fn) for _ in range(repeat)]
    res = runs[-1][0]
    return res, min(r[1] for r in runs), max(r[2] for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    base = rng.standard_normal((args.rows, args.cols), dtype=np.float32)
    base[rng.random(base.shape) < 1e-3] *= 20  # a few outliers, like real weights
    n = base.size
    print(f"{args.rows}x{args.cols} = {n / 1e6:.1f} M params, threads={args.threads}, best of {args.repeat}")
    print(f"{'scheme':6} {'source':6} {'thinconv Mp/s':>14} {'gguf Mp/s':>10} {'ratio':>6} "
          f"{'identical':>9} {'thin peakMB':>11} {'gguf peakMB':>11}")
    for dtype in (np.float32, ml_dtypes.bfloat16, np.float16):
        src = base.astype(dtype)
        for scheme, qtype in GGUF_TYPES.items():
            quantize_chunked(src[:64], scheme)  # warm up threads' scratch
            (ours, _), t_ours, m_ours = best(lambda: quantize_chunked(src, scheme, threads=args.threads), args.repeat)
            ref, t_ref, m_ref = best(lambda: gguf.quants.quantize(src, qtype), args.repeat)
            same = bool(np.array_equal(ours, ref))
            print(f"{scheme:6} {np.dtype(dtype).name:6} {n / t_ours / 1e6:14.0f} {n / t_ref / 1e6:10.0f} "
                  f"{t_ref / t_ours:6.1f} {str(same):>9} {m_ours:11.1f} {m_ref:11.1f}")
        del src


if __name__ == "__main__":
    main()
