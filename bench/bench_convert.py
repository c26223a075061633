"""Conversion speed and memory, whole process, next to `cp` of the same shard files.

Builds (once, cached) a Llama-shaped bf16 checkpoint of about 1.2 GB in 3 shards (hidden 2048,
10 layers, intermediate 5632, vocab 32000, 32/8 heads, random weights, seed 0), and the same at
2× the layers. Reports medians of several runs with a warm page cache: wall time, GB/s of
source bytes, the ratio to `cp`, and peak RSS, for `--dtype auto` (bf16 passthrough), f16, q8_0
and q4_0 (default options: probe included), plus `verify` GB/s and `inspect` start-up.

The mixture-of-experts case (issue 12): a Mixtral-shaped bf16 checkpoint of about 1.2 GB in the
Hub's per-expert layout (hidden 2048, 8 experts of width 1664, 5 layers, vocab 32000, 32/8 heads,
`block_sparse_moe.experts.{e}.w1/w2/w3`, stacked by the converter into [8, f, hidden] expert tensors)
and the same at 12 layers (2.1×), converted bf16 → bf16 and to q8_0, each next to `cp` and next
to the dense model's time scaled to the same bytes (target ≤ 1.3×), with peak RSS.
Not a test: run it by hand.

    python bench/bench_convert.py [--runs 5] [--cache DIR] [--results bench/RESULTS.md] [--no-moe]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

TARGETS = {"auto": 1.5, "f16": 2.0, "q8_0": 3.0, "q4_0": 4.0}  # seconds at 1×, 2-core machine
# the console script of this interpreter's environment (thinconv.cli is a package: no `-m thinconv.cli`)
THINCONV = [str(Path(sys.executable).parent / "thinconv")]


def make_checkpoint(root: Path, layers: int, hidden: int = 2048, inter: int = 5632, heads: int = 32, kv: int = 8,
                    vocab: int = 32000, shards: int = 3) -> Path:
    """A random-weight Llama checkpoint in `shards` files with an index (skipped if already built)."""
    from safetensors.numpy import save_file

    done = root / "model.safetensors.index.json"
    if done.is_file():
        return root
    hd = hidden // heads
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=1))
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    names = ["model.embed_tokens.weight"]
    for i in range(layers):
        p = f"model.layers.{i}."
        names += [p + n for n in ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                                  "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
    names += ["model.norm.weight", "lm_head.weight"]
    shapes = {"embed_tokens": (vocab, hidden), "lm_head": (vocab, hidden), "norm": (hidden,), "layernorm": (hidden,),
              "q_proj": (heads * hd, hidden), "k_proj": (kv * hd, hidden), "v_proj": (kv * hd, hidden),
              "o_proj": (hidden, heads * hd), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}

    def shape(name: str) -> tuple[int, ...]:
        return next(s for key, s in shapes.items() if key in name.split(".")[-2])

    total = sum(int(np.prod(shape(n))) for n in names)
    index, part, size, k = {}, {}, 0, 0
    for n in names:
        part[n] = w(*shape(n))
        size += part[n].size
        if size >= total * (k + 1) / shards or n == names[-1]:
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            save_file(part, str(root / fname))
            index.update({t: fname for t in part})
            part, k = {}, k + 1
    done.write_text(json.dumps({"metadata": {"total_size": total * 2}, "weight_map": index}, indent=1))
    return root


def make_moe_checkpoint(root: Path, layers: int, hidden: int = 2048, expert_inter: int = 1664, experts: int = 8,
                        heads: int = 32, kv: int = 8, vocab: int = 32000, shards: int = 3) -> Path:
    """A random-weight Mixtral checkpoint in the Hub's per-expert layout (skipped if already built)."""
    from safetensors.numpy import save_file

    done = root / "model.safetensors.index.json"
    if done.is_file():
        return root
    hd = hidden // heads
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": hidden,
              "intermediate_size": expert_inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "hidden_act": "silu", "tie_word_embeddings": False,
              "sliding_window": None, "num_local_experts": experts, "num_experts_per_tok": 2,
              "router_aux_loss_coef": 0.02, "output_router_logits": False,
              "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=1))
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "self_attn.q_proj.weight": (heads * hd, hidden),
                       p + "self_attn.k_proj.weight": (kv * hd, hidden), p + "self_attn.v_proj.weight": (kv * hd, hidden),
                       p + "self_attn.o_proj.weight": (hidden, heads * hd), p + "post_attention_layernorm.weight": (hidden,),
                       p + "block_sparse_moe.gate.weight": (experts, hidden)})
        for e in range(experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            shapes.update({q + "w1.weight": (expert_inter, hidden), q + "w2.weight": (hidden, expert_inter),
                           q + "w3.weight": (expert_inter, hidden)})
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    total = sum(int(np.prod(s)) for s in shapes.values())
    index, part, size, k = {}, {}, 0, 0
    names = list(shapes)
    for n in names:
        part[n] = (rng.standard_normal(shapes[n], dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        size += part[n].size
        if size >= total * (k + 1) / shards or n == names[-1]:
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            save_file(part, str(root / fname))
            index.update({t: fname for t in part})
            part, k = {}, k + 1
    done.write_text(json.dumps({"metadata": {"total_size": total * 2}, "weight_map": index}, indent=1))
    return root


def timed(cmd: list[str]) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds (user + sys) and peak RSS (MiB) of one whole process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.read().decode()}")
    proc.stderr.close()
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def median_runs(cmds: dict[str, tuple[list[str], Any]], runs: int) -> dict[str, dict]:
    """Run each command `runs` times (after one uncounted warm-up round), interleaved so that all
    see the same machine state; `before()` runs untimed before each. Medians, and the max RSS."""
    samples: dict[str, list] = {name: [] for name in cmds}
    for run in range(runs + 1):
        for name, (cmd, before) in cmds.items():
            if before:
                before()
            sample = timed(cmd)
            if run:
                samples[name].append(sample)
    return {name: {"seconds": statistics.median(x[0] for x in v), "cpu": statistics.median(x[1] for x in v),
                   "rss_mib": max(x[2] for x in v)} for name, v in samples.items()}


def shard_files(src: Path) -> list[Path]:
    return sorted(src.glob("*.safetensors"))


def bench_model(src: Path, work: Path, runs: int, dtypes: list[str]) -> dict:
    """Each conversion interleaved with `cp` of the same shards (the VM's page-cache behaviour
    drifts; interleaving keeps the two comparable)."""
    shards = shard_files(src)
    source_bytes = sum(p.stat().st_size for p in shards)
    dest = work / "cp"

    def clear_cp():
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir()

    out: dict[str, Any] = {"source_bytes": source_bytes, "cases": {}}
    for dtype in dtypes:
        thin = work / f"{dtype}.thin"
        convert_cmd = THINCONV + ["convert", str(src), str(thin), "--dtype", dtype]
        r = median_runs({"convert": (convert_cmd, lambda: thin.unlink(missing_ok=True)),
                         "cp": (["cp", *map(str, shards), str(dest)], clear_cp)}, runs)
        out["cases"][dtype] = {**r["convert"], "cp": r["cp"]["seconds"], "archive_bytes": thin.stat().st_size}
        if dtype == "auto":
            r = median_runs({"verify": (THINCONV + ["verify", str(thin)], None),
                             "inspect": (THINCONV + ["inspect", str(thin)], None)}, runs)
            out["verify"] = {**r["verify"], "gbps": thin.stat().st_size / r["verify"]["seconds"] / 1e9}
            out["inspect_seconds"] = r["inspect"]["seconds"]
        thin.unlink()
    shutil.rmtree(dest, ignore_errors=True)
    return out


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, Linux {platform.release()}, "
            f"Python {platform.python_version()}, numpy {np.__version__}")


def report(results: dict[str, dict], runs: int) -> str:
    lines = [f"Machine: {machine()}",
             f"Medians of {runs} whole-process runs (after a warm-up run), warm page cache, default options "
             "(probe included); each conversion interleaved with a `cp` of the same shards.", ""]
    lines += ["| model | case | time | CPU (user+sys) | source GB/s | `cp` | × cp | peak RSS | target |",
              "|---|---|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        gb = r["source_bytes"] / 1e9
        scale = 2 if label.startswith("2×") else 1
        for dtype, c in r["cases"].items():
            target = TARGETS[dtype] * scale
            verdict = "met" if c["seconds"] <= target else f"missed by {c['seconds'] - target:.2f} s"
            if dtype == "auto" and scale == 1:
                verdict += f"; ≤ 4× cp: {'met' if c['seconds'] <= 4 * c['cp'] else 'missed'}"
            rss_ok = "met" if c["rss_mib"] * 2**20 <= 200e6 else "missed"
            lines.append(f"| {label} ({gb:.2f} GB) | convert --dtype {dtype} | {c['seconds']:.2f} s | {c['cpu']:.2f} s | "
                         f"{gb / c['seconds']:.2f} | {c['cp']:.2f} s | {c['seconds'] / c['cp']:.1f} | "
                         f"{c['rss_mib']:.0f} MiB ({rss_ok}) | ≤ {target:.1f} s: {verdict} |")
        v = r["verify"]
        lines.append(f"| {label} | verify | {v['seconds']:.2f} s | {v['cpu']:.2f} s | {v['gbps']:.1f} (archive) | — | — | "
                     f"{v['rss_mib']:.0f} MiB | ≥ 3 GB/s: {'met' if v['gbps'] >= 3 else 'missed'} |")
        lines.append(f"| {label} | inspect start-up | {r['inspect_seconds']:.2f} s | — | — | — | — | — | "
                     f"≤ 0.3 s: {'met' if r['inspect_seconds'] <= 0.3 else 'missed'} |")
    return "\n".join(lines)


def build_in_child(make, root: Path, layers: int) -> Path:
    """Build a checkpoint in a spawned process: building holds ~1 GB of arrays, and a child forked
    later would start with this process's peak RSS (Linux ru_maxrss survives fork and exec), which
    would then be reported as the conversion's."""
    import multiprocessing

    proc = multiprocessing.get_context("spawn").Process(target=make, args=(root, layers))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise SystemExit(f"building {root} failed")
    return root


MOE_TARGET = 1.3  # × the dense model's time for the same bytes (issue 12)


def moe_report(results: dict[str, dict], dense: dict[str, dict]) -> str:
    """The MoE table: each case next to `cp` and to the dense case of the same label and dtype,
    scaled to the same source bytes."""
    lines = ["", "Mixture of experts (Mixtral-shaped, per-expert Hub layout, stacked into [E, f, hidden]):", "",
             "| model | case | time | CPU (user+sys) | source GB/s | `cp` | × cp | dense, same bytes | × dense | "
             "× dense (CPU) | peak RSS | target |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        gb = r["source_bytes"] / 1e9
        for dtype, c in r["cases"].items():
            d = dense.get(label, {}).get("cases", {}).get(dtype)
            if d:
                scale = r["source_bytes"] / dense[label]["source_bytes"]
                same = d["seconds"] * scale
                ratio = c["seconds"] / same
                dense_text, ratio_text = f"{same:.2f} s", f"{ratio:.2f}"
                cpu_text = f"{c['cpu'] / (d['cpu'] * scale):.2f}"
                verdict = "met" if ratio <= MOE_TARGET else f"missed ({ratio:.2f}×)"
            else:
                dense_text = ratio_text = cpu_text = "—"
                verdict = "no dense run"
            rss_ok = "met" if c["rss_mib"] * 2**20 <= 200e6 else "missed"
            name = "bf16 → bf16" if dtype == "auto" else dtype
            lines.append(f"| MoE {label} ({gb:.2f} GB) | convert {name} | {c['seconds']:.2f} s | {c['cpu']:.2f} s | "
                         f"{gb / c['seconds']:.2f} | {c['cp']:.2f} s | {c['seconds'] / c['cp']:.1f} | {dense_text} | "
                         f"{ratio_text} | {cpu_text} | {c['rss_mib']:.0f} MiB ({rss_ok}) | ≤ {MOE_TARGET}× dense: {verdict} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "thinconv-bench")
    ap.add_argument("--work", type=Path, default=None, help="Where archives go (default: inside --cache).")
    ap.add_argument("--dtypes", default="auto,f16,q8_0,q4_0")
    ap.add_argument("--no-2x", action="store_true", help="Skip the 2× model.")
    ap.add_argument("--no-moe", action="store_true", help="Skip the mixture-of-experts models.")
    ap.add_argument("--moe-dtypes", default="auto,q8_0")
    ap.add_argument("--results", type=Path, default=None, help="Also write the table to this markdown file.")
    args = ap.parse_args()
    work = args.work or args.cache / "work"
    work.mkdir(parents=True, exist_ok=True)

    def bench_sizes(make, name: str, sizes: dict[str, int], dtypes: str, title: str = "") -> dict:
        """Each size's checkpoint (built once, cached) benchmarked; its archives deleted after."""
        results = {}
        for label, layers in sizes.items():
            src = build_in_child(make, args.cache / f"{name}-l{layers}", layers)
            print(f"{title}{label}: {src} …", file=sys.stderr, flush=True)
            results[label] = bench_model(src, work, args.runs, dtypes.split(","))
            for p in work.glob("*.thin"):
                p.unlink()
        return results

    # 24 layers: 2.04× the bytes of 10; 12 MoE layers: 2.09× those of 5
    results = bench_sizes(make_checkpoint, "llama-h2048", {"1×": 10} if args.no_2x else {"1×": 10, "2×": 24},
                          args.dtypes)
    table = report(results, args.runs)
    if not args.no_moe:
        moe_results = bench_sizes(make_moe_checkpoint, "mixtral-h2048-e8", {"1×": 5} if args.no_2x else
                                  {"1×": 5, "2×": 12}, args.moe_dtypes, "MoE ")
        table += "\n" + moe_report(moe_results, results)
    print(table)
    if args.results:
        write_results(args.results, table)


BEGIN, END = "<!-- bench_convert: begin -->", "<!-- bench_convert: end -->"


def write_results(path: Path, table: str) -> None:
    """Replace the tables between the markers in `path`, keeping the prose and other sections
    (the fuzzers' figures live in the same file)."""
    block = f"{BEGIN}\n`python bench/bench_convert.py --results {path}`\n\n{table}\n{END}"
    text = path.read_text() if path.exists() else "# Benchmark results\n\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


if __name__ == "__main__":
    main()
