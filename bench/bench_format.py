"""Benchmark the THIN v0 reader on a ~1 GB archive (a script that prints figures, not a test).

    PYTHONPATH=/work/main python bench/bench_format.py [--gb 1.0] [--dir /tmp] [--keep]

Builds a fake bf16 llama-shaped archive through `pack` with lazy page sources (pages are slices
of a 16 MiB pool, so the builder stays small), then measures, each in a fresh subprocess that
reports its own peak RSS (VmHWM):

  verify        Archive.verify() on a warm page cache, best of 3 → GB/s
  tensor read   open, then for every tensor sum a uint16 view of `tensor()` (touches every byte)
  open          open_archive() alone (header, page table, manifest checks)
  inspect       `thinconv inspect ARCHIVE` wall time, best of 5 (and its -X importtime top modules)

Targets on a 2-core machine: verify ≥ 3 GB/s, peak RSS < 200 MB, inspect start-up ≤ 0.3 s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import blake3
import ml_dtypes
import numpy as np

from thinconv.format import LazyPage, pack, spec
from thinconv.format.writer import split_bytes, split_rows
from thinconv.rope import model_rope_freqs

ROOT = Path(__file__).resolve().parent.parent
POOL_BYTES = 16 * 1024 * 1024
PAGE_SIZE = 16 * 1024 * 1024


def model_for(gb: float) -> dict:
    """A llama-shaped model (hidden 2048, ffn 5632, vocab 32000) with as many layers as fit `gb` in bf16."""
    hidden, inter, vocab, heads, kv, head_dim = 2048, 5632, 32000, 16, 4, 128
    per_layer = 2 * (2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim + 3 * hidden * inter)
    fixed = 2 * 2 * vocab * hidden
    layers = max(1, round((gb * 1e9 - fixed) / per_layer))
    return {
        "architecture": "llama", "source_architecture": "LlamaForCausalLM", "hidden_size": hidden,
        "intermediate_size": inter, "num_layers": layers, "num_attention_heads": heads, "num_kv_heads": kv,
        "head_dim": head_dim, "vocab_size": vocab, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "norm": {"type": "rmsnorm", "eps": 1e-5}, "mlp": {"type": "gated", "activation": "silu"},
        "attention": {"qkv_bias": False, "o_bias": False, "qk_norm": False, "sliding_window": None,
                      "layer_types": ["full"] * layers, "scale": head_dim ** -0.5},
        "rope": {"theta": 10000.0, "rotary_dim": head_dim, "layout": "half", "scaling": None,
                 "attention_factor": 1.0},
        "special_tokens": {"bos": 1, "eos": [2], "pad": None},
    }


class Pool:
    """Page bytes = a window of a fixed pool of bf16 normals, starting where the page's index says."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.data = rng.standard_normal(POOL_BYTES // 2, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint8)

    def chunks(self, k: int, size: int):
        pos = (k * 1_000_003 * 2) % POOL_BYTES
        while size > 0:
            n = min(size, POOL_BYTES - pos)
            yield self.data[pos: pos + n]
            size -= n
            pos = 0

    def checksum(self, k: int, size: int) -> str:
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        for c in self.chunks(k, size):
            h.update(c)
        return h.hexdigest()


def build(path: Path, gb: float) -> dict:
    model = model_for(gb)
    pool = Pool()
    tensors, pages, sources = [], [], {}
    k_global = 0
    for name in spec.tensor_names(model):
        role, layer = spec.split_name(name)
        shape = spec.expected_shape(model, role)
        dtype = "bf16" if len(shape) == 2 else "f32"
        cols = shape[1] if len(shape) == 2 else 1
        rb = spec.row_bytes(dtype, cols)
        ids = []
        for k, (s, e) in enumerate(split_rows(shape[0], rb, PAGE_SIZE) if len(shape) == 2 else [(0, shape[0])]):
            pid, size = spec.page_id(name, k), (e - s) * rb
            ids.append(pid)
            if name == "rope_freqs":  # the real table: verify checks it against model.rope
                data = model_rope_freqs(model).tobytes()
                pages.append({"id": pid, "tensor": name, "rows": [s, e], "size": size,
                              "checksum": blake3.blake3(data).hexdigest()})
                sources[pid] = data
                k_global += 1
                continue
            pages.append({"id": pid, "tensor": name, "rows": [s, e], "size": size,
                          "checksum": pool.checksum(k_global, size)})
            sources[pid] = LazyPage(size, lambda g=k_global, size=size: pool.chunks(g, size))
            k_global += 1
        tensors.append({"name": name, "role": role, "layer": layer, "source": [] if name == "rope_freqs" else [name],
                        "shape": shape, "dtype": dtype, "quant": None,
                        "hints": {"placement": "device", "access": "matmul" if len(shape) == 2 else "elementwise"},
                        "pages": ids})
    config = json.dumps({"architectures": ["LlamaForCausalLM"]}).encode()
    for k, (s, e) in enumerate(split_bytes(len(config), PAGE_SIZE)):
        pid = spec.page_id("config.json", k)
        pages.append({"id": pid, "asset": "config.json", "size": e - s, "checksum": blake3.blake3(config[s:e]).hexdigest()})
        sources[pid] = config[s:e]
    manifest = {"format": "thin", "format_version": 0, "alignment": 4096, "model": model, "tensors": tensors,
                "pages": pages, "assets": [{"name": "config.json", "media_type": "application/json",
                                            "size": len(config), "pages": ["config.json#0"]}],
                "runtime": {"page_size": PAGE_SIZE}, "validation": {}}
    t0 = time.perf_counter()
    result = pack(manifest, sources, path, force=True)
    return {"seconds": time.perf_counter() - t0, "size": result.size, "pages": result.page_count,
            "layers": model["num_layers"]}


MEM = '''
def _mem():
    f = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
    kb = lambda k: int(f[k].split()[0]) / 1024
    return {"hwm": kb("VmHWM"), "anon": kb("RssAnon"), "file": kb("RssFile")}
'''

VERIFY = MEM + """
import json, sys, time
from thinconv.format import open_archive
best = None
with open_archive(sys.argv[1]) as a:
    for _ in range(3):
        t0 = time.perf_counter()
        r = a.verify()
        dt = time.perf_counter() - t0
        assert r.ok, r.failures
        best = dt if best is None else min(best, dt)
print(json.dumps({"seconds": best, "bytes": r.bytes_checked, **_mem()}))
"""

READ = MEM + """
import json, sys, time
import numpy as np
from thinconv.format import open_archive
t0 = time.perf_counter()
total = 0
with open_archive(sys.argv[1]) as a:
    for name in a.tensor_names:
        t = a.tensor(name)
        total += t.nbytes
        t.view(np.uint8).sum(dtype=np.uint64)
        del t
        if sys.argv[2:] == ["release"]:
            a.release(name)  # streaming: keep RSS bounded by one tensor
    mem = _mem()  # while the archive (and its mapping) is still open
print(json.dumps({"seconds": time.perf_counter() - t0, "bytes": total, **mem}))
"""

OPEN = MEM + """
import json, sys, time
t0 = time.perf_counter()
from thinconv.format import open_archive
t1 = time.perf_counter()
with open_archive(sys.argv[1]) as a:
    n = len(a.pages)
print(json.dumps({"seconds": time.perf_counter() - t1, "import": t1 - t0, "pages": n, **_mem()}))
"""


INSPECT_MEM = MEM + """
import atexit, json, sys
atexit.register(lambda: sys.__stderr__.write("MEM " + json.dumps(_mem()) + "\\n"))
sys.argv = ["thinconv", "inspect", sys.argv[1]]
from thinconv.cli import main
main()
"""


def run_measured(argv: list[str]) -> tuple[float, str, str]:
    """Run argv; return (wall seconds, stdout, stderr). Peak RSS comes from the child's own VmHWM:
    wait4's ru_maxrss would include this (big) parent's RSS, inherited until exec."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{argv}: exit {proc.returncode}\n{proc.stderr}")
    return wall, proc.stdout, proc.stderr


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 * 1024 * 1024):
            pass


def importtime_top(path: Path, n: int = 14) -> list[tuple[int, str]]:
    """Slowest cumulative imports of the real `thinconv inspect` path (main() registers recipes)."""
    code = (f"import sys; sys.argv = ['thinconv', 'inspect', {str(path)!r}]\n"
            "from thinconv.cli import main\ntry:\n    main()\nexcept SystemExit:\n    pass")
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = []
    for line in r.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), parts[2].rstrip()))
    return sorted(rows, reverse=True)[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="archive size to build (default 1.0)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp"), help="where to write the archive (not the repo)")
    ap.add_argument("--keep", action="store_true", help="keep the archive (and reuse it if present)")
    args = ap.parse_args()
    path = args.dir / f"bench_format_{args.gb:g}gb.thin"
    thinconv = shutil.which("thinconv") or str(Path(sys.executable).with_name("thinconv"))

    if not (args.keep and path.exists()):
        info = build(path, args.gb)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"build    {info['size'] / 1e9:.2f} GB, {info['pages']} pages, {info['layers']} layers: "
              f"pack {info['seconds']:.1f} s ({info['size'] / 1e9 / info['seconds']:.2f} GB/s incl. hashing), "
              f"builder peak RSS {rss:.0f} MiB")
    size = path.stat().st_size
    try:
        warm(path)
        _, out, _ = run_measured([sys.executable, "-c", VERIFY, str(path)])
        r = json.loads(out)
        print(f"verify   {r['bytes'] / 1e9 / r['seconds']:.2f} GB/s (best of 3, warm cache, {r['seconds']:.3f} s), "
              f"peak RSS {r['hwm']:.0f} MiB   [target ≥ 3 GB/s, < 200 MiB]")

        warm(path)
        _, out, _ = run_measured([sys.executable, "-c", READ, str(path)])
        r = json.loads(out)
        print(f"read     {r['bytes'] / 1e9 / r['seconds']:.2f} GB/s (every tensor() view summed, {r['seconds']:.3f} s),"
              f" peak RSS {r['hwm']:.0f} MiB; at the end anon {r['anon']:.0f} MiB + mapped file pages "
              f"{r['file']:.0f} MiB (clean page cache, reclaimable)")

        warm(path)
        _, out, _ = run_measured([sys.executable, "-c", READ, str(path), "release"])
        r = json.loads(out)
        print(f"read+release {r['bytes'] / 1e9 / r['seconds']:.2f} GB/s (Archive.release after each tensor), "
              f"peak RSS {r['hwm']:.0f} MiB   [target < 200 MiB]")

        _, out, _ = run_measured([sys.executable, "-c", OPEN, str(path)])
        r = json.loads(out)
        print(f"open     {r['seconds'] * 1e3:.1f} ms for {r['pages']} pages (import thinconv.format "
              f"{r['import'] * 1e3:.0f} ms), peak RSS {r['hwm']:.0f} MiB")

        best = min(run_measured([thinconv, "inspect", str(path)])[0] for _ in range(5))
        _, _, err = run_measured([sys.executable, "-c", INSPECT_MEM, str(path)])
        mem = json.loads(next(line for line in err.splitlines() if line.startswith("MEM "))[4:])
        print(f"inspect  {best:.3f} s wall (best of 5), peak RSS {mem['hwm']:.0f} MiB   [target ≤ 0.3 s]")
        direct = (f"import sys; sys.argv = ['thinconv', 'inspect', {str(path)!r}]\n"
                  "from thinconv.cli import app\napp()")
        app_only = min(run_measured([sys.executable, "-c", direct])[0] for _ in range(5))
        bare = min(run_measured([sys.executable, "-c", "pass"])[0] for _ in range(5))
        print(f"         ({app_only:.3f} s through cli.app() without main()'s recipe sub-commands, which import "
              f"numpy via thinconv.rope; bare interpreter {bare:.3f} s)")
        print("thinconv inspect, slowest cumulative imports (µs):")
        for us, name in importtime_top(path):
            print(f"  {us:>9}  {name}")
        print(f"archive  {path} ({size / 1e9:.2f} GB){'' if args.keep else ', removed'}")
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
