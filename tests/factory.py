"""Build small valid manifests and page sources for format tests (no checkpoint involved)."""

from __future__ import annotations

import copy
import json

import blake3
import ml_dtypes
import numpy as np

from thinconv.format import spec
from thinconv.rope import model_rope_freqs
from thinconv.format.writer import split_bytes, split_rows

NP = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


def tiny_model(**overrides) -> dict:
    model = {
        "architecture": "llama", "source_architecture": "LlamaForCausalLM",
        "hidden_size": 8, "intermediate_size": 16, "num_layers": 1, "num_attention_heads": 2,
        "num_kv_heads": 1, "head_dim": 4, "vocab_size": 12, "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        "norm": {"type": "rmsnorm", "eps": 1e-5},
        "mlp": {"type": "gated", "activation": "silu"},
        "attention": {"qkv_bias": False, "o_bias": False, "qk_norm": False, "sliding_window": None,
                      "layer_types": ["full"], "scale": 0.5},
        "rope": {"theta": 10000.0, "rotary_dim": 4, "layout": "half", "scaling": None, "attention_factor": 1.0},
        "special_tokens": {"bos": 1, "eos": [2], "pad": None},
    }
    model.update(overrides)
    return model


def make_archive_inputs(model: dict | None = None, *, dtype: str = "f32", page_size: int = 4096, seed: int = 0,
                        assets: dict[str, bytes] | None = None):
    """(manifest, page sources {id: bytes}, arrays {name: ndarray}) for a valid archive of `model`."""
    model = copy.deepcopy(model or tiny_model())
    rng = np.random.default_rng(seed)
    tensors, pages, sources, arrays = [], [], {}, {}
    for name in spec.tensor_names(model):
        role, layer = spec.split_name(name)
        shape = spec.expected_shape(model, role)
        dt = dtype if len(shape) == 2 else "f32"
        if name == "rope_freqs":  # the real table: `verify` checks it against model.rope
            arr = model_rope_freqs(model)
        else:
            arr = rng.standard_normal(shape).astype(NP[dt])
        arrays[name] = arr
        cols = shape[1] if len(shape) == 2 else 1
        ids = []
        for k, (s, e) in enumerate(split_rows(shape[0], spec.row_bytes(dt, cols), page_size)):
            data = arr[s:e].tobytes()
            pid = spec.page_id(name, k)
            ids.append(pid)
            sources[pid] = data
            pages.append({"id": pid, "tensor": name, "rows": [s, e], "size": len(data),
                          "checksum": blake3.blake3(data).hexdigest()})
        tensors.append({"name": name, "role": role, "layer": layer, "source": [] if name == "rope_freqs" else [name],
                        "shape": shape, "dtype": dt, "quant": None,
                        "hints": {"placement": "device", "access": "matmul" if len(shape) == 2 else "elementwise"},
                        "pages": ids})
    asset_list = []
    for aname, data in (assets or {"config.json": json.dumps({"architectures": ["LlamaForCausalLM"]}).encode()}).items():
        ids = []
        for k, (s, e) in enumerate(split_bytes(len(data), page_size)):
            pid = spec.page_id(aname, k)
            ids.append(pid)
            sources[pid] = data[s:e]
            pages.append({"id": pid, "asset": aname, "size": e - s, "checksum": blake3.blake3(data[s:e]).hexdigest()})
        asset_list.append({"name": aname, "media_type": "application/json", "size": len(data), "pages": ids})
    manifest = {"format": "thin", "format_version": 0, "alignment": 4096, "model": model, "tensors": tensors,
                "pages": pages, "assets": asset_list, "runtime": {}, "validation": {}}
    return manifest, sources, arrays
