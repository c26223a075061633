"""Benchmark thinconv.quant against gguf-py's reference quantizer (a script, not a test).

    PYTHONPATH=/work/main python bench/bench_quant.py [--rows 4096] [--cols 4096] [--repeat 3]

For each source dtype and scheme it prints params/s of ``quantize_chunked`` (``--threads``
threads, error report included), of ``quantize_rows`` (1 thread, no report) and of
``gguf.quants.quantize`` on the same array in the same run, whether the bytes are identical, and
the peak RSS each call adds on top of the resident input (measured in a fresh subprocess, so
memory recycled by the allocator cannot hide it). Timings are best-of-``--repeat``; on a shared
machine, compare the load averages printed before and after.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np

from thinconv.quant import quantize_chunked, quantize_rows

GGUF_TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
              "q4_1": gguf.GGMLQuantizationType.Q4_1}
DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}


def make_input(rows: int, cols: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, cols), dtype=np.float32)
    x[rng.random(x.shape) < 1e-3] *= 20  # a few outliers, like real weights
    return x.astype(DTYPES[dtype])


def runner(impl: str, scheme: str, threads: int):
    if impl == "thin":
        return lambda a: quantize_chunked(a, scheme, threads=threads)[0]
    if impl == "bare":  # what a converter's write pass does: no error report
        return lambda a: quantize_chunked(a, scheme, threads=threads, report=False)[0]
    if impl == "rows":
        return lambda a: quantize_rows(a, scheme)
    return lambda a: gguf.quants.quantize(a, GGUF_TYPES[scheme])


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_rss_child(args: argparse.Namespace) -> None:
    """Subprocess mode: print the MB one call adds to the peak RSS over the resident input."""
    src = make_input(args.rows, args.cols, args.dtype)
    fn = runner(args.impl, args.scheme, args.threads)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS (Linux)
    base = _status_mb("VmRSS")
    fn(src)
    print(f"{_status_mb('VmHWM') - base:.1f}")


def peak_rss(args: argparse.Namespace, impl: str, dtype: str, scheme: str) -> str:
    cmd = [sys.executable, __file__, "--rss-child", impl, "--dtype", dtype, "--scheme", scheme,
           "--rows", str(args.rows), "--cols", str(args.cols), "--threads", str(args.threads)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    return res.stdout.strip() if res.returncode == 0 else "n/a"


def best_time(fn, src: np.ndarray, repeat: int) -> tuple[float, np.ndarray]:
    fn(src[:64])  # warm up (threads, scratch)
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn(src)
        times.append(time.perf_counter() - t0)
    return min(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rss-child", choices=["thin", "rows", "gguf"], dest="impl", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="f32", choices=list(DTYPES), help=argparse.SUPPRESS)
    ap.add_argument("--scheme", default="q8_0", choices=list(GGUF_TYPES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.impl:
        peak_rss_child(args)
        return

    n = args.rows * args.cols
    print(f"{args.rows}x{args.cols} = {n / 1e6:.1f} M params; quantize_chunked threads={args.threads}; "
          f"best of {args.repeat}; cpus={os.cpu_count()}; loadavg before {os.getloadavg()[0]:.2f}")
    print(f"{'source':6} {'scheme':6} {'chunked Mp/s':>12} {'no-report':>9} {'rows Mp/s':>9} {'gguf Mp/s':>9} "
          f"{'ratio':>6} {'ratio nr':>8} {'identical':>9} {'peak+MB chunked':>15} {'rows':>6} {'gguf':>6}")
    for dtype in DTYPES:
        src = make_input(args.rows, args.cols, dtype)
        for scheme in GGUF_TYPES:
            t_thin, ours = best_time(runner("thin", scheme, args.threads), src, args.repeat)
            t_bare, bare = best_time(runner("bare", scheme, args.threads), src, args.repeat)
            t_rows, rows_out = best_time(runner("rows", scheme, 1), src, args.repeat)
            t_ref, ref = best_time(runner("gguf", scheme, 1), src, args.repeat)
            same = bool(np.array_equal(ours, ref) and np.array_equal(rows_out, ref) and np.array_equal(bare, ref))
            mem = [peak_rss(args, impl, dtype, scheme) for impl in ("thin", "rows", "gguf")]
            print(f"{dtype:6} {scheme:6} {n / t_thin / 1e6:12.0f} {n / t_bare / 1e6:9.0f} {n / t_rows / 1e6:9.0f} "
                  f"{n / t_ref / 1e6:9.0f} {t_ref / t_thin:6.2f} {t_ref / t_bare:8.2f} {str(same):>9} {mem[0]:>15} "
                  f"{mem[1]:>6} {mem[2]:>6}", flush=True)
    print(f"loadavg after {os.getloadavg()[0]:.2f}  (output alone: q8_0 {n * 34 / 32 / 2**20:.1f} MB, "
          f"q4_0 {n * 18 / 32 / 2**20:.1f} MB, q4_1 {n * 20 / 32 / 2**20:.1f} MB)")


if __name__ == "__main__":
    main()
