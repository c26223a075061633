"""Source pages do not stay mapped: after a conversion, little of any shard is resident in the
process (the page cache keeps it). Measured on the mapping itself through /proc/self/pagemap, so
the check does not depend on the allocator or on what else the process holds."""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import thinconv
from thinconv.checkpoint.safetensors import SafetensorsFile

pytestmark = pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="needs Linux /proc/self/pagemap")


def resident_bytes(mm) -> int:
    """Bytes of the mapping `mm` present in this process's page tables (bit 63 of each pagemap
    entry; readable without privileges)."""
    probe = np.frombuffer(mm, dtype=np.uint8, count=1)
    base = probe.__array_interface__["data"][0]
    del probe
    pages = (len(mm) + 4095) // 4096
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(base // 4096 * 8)
        data = f.read(pages * 8)
    return 4096 * sum(1 for (entry,) in struct.iter_unpack("<Q", data) if entry >> 63)


def per_expert_mixtral(root: Path, layers: int = 2, hidden: int = 2048, inter: int = 1664, experts: int = 8,
                       vocab: int = 2048) -> Path:
    """A Mixtral checkpoint in the Hub's per-expert layout, 6.8 MB expert tensors in two shards:
    the shape in which neighbouring experts are read at different times."""
    heads, kv = 8, 2
    hd = hidden // heads
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-5, "rope_theta": 1e6, "hidden_act": "silu", "tie_word_embeddings": False,
              "num_local_experts": experts, "num_experts_per_tok": 2, "torch_dtype": "bfloat16"}
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "self_attn.q_proj.weight": (heads * hd, hidden),
                       p + "self_attn.k_proj.weight": (kv * hd, hidden), p + "self_attn.v_proj.weight": (kv * hd, hidden),
                       p + "self_attn.o_proj.weight": (hidden, heads * hd), p + "post_attention_layernorm.weight": (hidden,),
                       p + "block_sparse_moe.gate.weight": (experts, hidden)})
        for e in range(experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            shapes.update({q + "w1.weight": (inter, hidden), q + "w2.weight": (hidden, inter), q + "w3.weight": (inter, hidden)})
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    rng = np.random.default_rng(0)
    names = list(shapes)
    index = {}
    for k, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
        fname = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: (rng.standard_normal(shapes[n], dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
                   for n in part}, str(root / fname))
        index.update({n: fname for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    for shard in root.glob("*.safetensors"):
        # Out of the page cache, so that the conversion's faults read it back the way a cold model
        # is read: through readahead, which builds the large folios the kernel maps whole.
        fd = os.open(shard, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return root


def test_no_source_pages_stay_mapped_after_a_moe_conversion(tmp_path, monkeypatch):
    src = per_expert_mixtral(tmp_path / "mixtral")
    residue: dict[str, int] = {}
    close = SafetensorsFile.close

    def measured_close(self):
        if self._mmap is not None:
            residue[self.path.name] = resident_bytes(self._mmap)
        close(self)

    monkeypatch.setattr(SafetensorsFile, "close", measured_close)
    thinconv.convert(src, tmp_path / "out.thin", probe=False)
    sizes = {p.name: p.stat().st_size for p in src.glob("*.safetensors")}
    assert residue.keys() == sizes.keys(), residue
    for name, nbytes in residue.items():
        # with a 64 KiB drop margin (the fault-around size, not the large folios Linux maps whole),
        # 1.4 MiB of neighbouring experts stayed mapped here
        assert nbytes <= 256 * 1024, f"{name}: {nbytes / 2**20:.1f} MiB of {sizes[name] / 2**20:.0f} MiB still mapped"
    print({k: v // 1024 for k, v in residue.items()}, "KiB resident", file=sys.stderr)
