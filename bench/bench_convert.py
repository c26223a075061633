"""Conversion throughput and peak memory on a synthetic ~1 GB Llama-shaped bf16 checkpoint.

Prints, per output dtype (without the probe, then once with it): wall time, GB/s of source read, parameters/s and the peak RSS of the
converting process (a subprocess, so each figure stands alone). Not a test: run it by hand.

    python bench/bench_convert.py [--layers 8] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np


def make_checkpoint(root: Path, layers: int, hidden: int = 2048, inter: int = 5632, heads: int = 16,
                    kv: int = 4, vocab: int = 32000) -> int:
    from safetensors.numpy import save_file

    hd = hidden // heads
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2}
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    tensors = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": w(hidden), "lm_head.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": w(hidden), p + "post_attention_layernorm.weight": w(hidden),
                        p + "self_attn.q_proj.weight": w(heads * hd, hidden), p + "self_attn.k_proj.weight": w(kv * hd, hidden),
                        p + "self_attn.v_proj.weight": w(kv * hd, hidden), p + "self_attn.o_proj.weight": w(hidden, heads * hd),
                        p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
                        p + "mlp.down_proj.weight": w(hidden, inter)})
    save_file(tensors, str(root / "model.safetensors"))
    return sum(t.size for t in tensors.values())


def run(cmd: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS MiB of the child)."""
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - t0
    return seconds, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dtypes", default="auto,f16,q8_0,q4_0")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR", "/tmp")) as tmp:
        ckpt = Path(tmp) / "ckpt"
        params = make_checkpoint(ckpt, args.layers)
        size = (ckpt / "model.safetensors").stat().st_size
        print(f"checkpoint: {params / 1e6:.0f} M params, {size / 1e9:.2f} GB bf16")
        # warm the page cache so figures measure the converter, not the disk
        subprocess.run(["cat", str(ckpt / "model.safetensors")], stdout=subprocess.DEVNULL, check=True)
        for run in args.dtypes.split(",") + ["auto+probe"]:
            dtype, probe = run.split("+")[0], run.endswith("+probe")
            out = Path(tmp) / f"out-{dtype}.thin"
            # RUSAGE_CHILDREN is a max over all children so far: measure each in a fresh wrapper.
            code = ("import resource,subprocess,sys,time;t=time.perf_counter();"
                    f"subprocess.run({[sys.executable, '-m', 'thinconv.cli', 'convert', str(ckpt), str(out), '--dtype', dtype, '--force', '--probe' if probe else '--no-probe', '--json']!r},check=True,stdout=subprocess.DEVNULL);"
                    "print(time.perf_counter()-t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss/1024)")
            res = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
            seconds, rss = map(float, res.stdout.split())
            print(f"{run:10s} {seconds:6.2f} s  {size / seconds / 1e9:5.2f} GB/s source  "
                  f"{params / seconds / 1e6:6.1f} M params/s  peak RSS {rss:6.0f} MiB  "
                  f"output {out.stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
