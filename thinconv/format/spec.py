"""THIN v0 constants and the small pure functions every reader and writer shares.

Everything here is fixed by ../shared/spec/thin-v0.md (FORMAT.md in this repo restates it).
No I/O, no third-party imports: a runtime author can read this file alone.
"""

from __future__ import annotations

import json
import re
import struct
from typing import Any

MAGIC = b"THINv0\0\0"
VERSION = 0
HEADER_LEN = 88
ALIGNMENT = 4096
MAX_MANIFEST_LEN = 64 * 1024 * 1024

# magic, header_len, version, manifest_off, manifest_len, page_table_off, page_count, data_off, archive_hash
HEADER = struct.Struct("<8sIIQQQQQ32s")
assert HEADER.size == HEADER_LEN

# A page-table record is u16 id_len, the id, then this fixed tail.
RECORD_TAIL = struct.Struct("<QQQI32s")  # offset, stored_size, raw_size, flags, checksum
RECORD_MIN_LEN = 2 + 1 + RECORD_TAIL.size
MAX_ID_LEN = 255
ID_PATTERN = re.compile(r"[A-Za-z0-9._#:/-]{1,255}")

FLOAT_DTYPES = {"f32": 4, "f16": 2, "bf16": 2}
BLOCK_DTYPES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
BLOCK_SIZE = 32
# dtypes a quantized tensor may have come from (quant.source_dtype)
SOURCE_DTYPES = ("f32", "f16", "bf16", "f8_e4m3", "f8_e5m2")

TOP_LEVEL_KEYS = ("alignment", "assets", "format", "format_version", "model", "pages", "runtime", "tensors", "validation")

# Per-layer roles in decode order; which of them exist depends on the model's flags.
LAYER_ROLES = (
    "attn_norm.weight",
    "attn_q.weight",
    "attn_q.bias",
    "attn_k.weight",
    "attn_k.bias",
    "attn_v.weight",
    "attn_v.bias",
    "attn_q_norm.weight",
    "attn_k_norm.weight",
    "attn_output.weight",
    "attn_output.bias",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
)
GLOBAL_ROLES = ("rope_freqs", "token_embd.weight", "output_norm.weight", "output.weight")
ROLES = GLOBAL_ROLES + LAYER_ROLES
# Roles that are 2-D matrices (the rest — norms, biases, rope_freqs — are 1-D and always f32).
MATRIX_ROLES = tuple(r for r in ROLES if r.endswith(".weight") and not r.endswith("norm.weight"))

# Scaling types whose inverse frequencies are static, hence stored as `rope_freqs`.
STATIC_ROPE_SCALINGS = (None, "linear", "llama3", "yarn")

ASSET_NAMES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "chat_template.jinja",
)

PLACEMENTS = ("host", "device")
ACCESSES = ("gather", "matmul", "elementwise")


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    """Smallest multiple of `alignment` that is ≥ n."""
    return -(-n // alignment) * alignment


def canonical_json(manifest: Any) -> bytes:
    """The one byte encoding of a manifest (spec §2)."""
    return json.dumps(
        manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def row_bytes(dtype: str, cols: int) -> int:
    """Bytes in one row of `cols` elements (a 1-D tensor's "row" is one element: cols = 1)."""
    if dtype in FLOAT_DTYPES:
        return cols * FLOAT_DTYPES[dtype]
    if dtype in BLOCK_DTYPES:
        return cols // BLOCK_SIZE * BLOCK_DTYPES[dtype]
    raise ValueError(f"unknown dtype {dtype!r}")


def page_id(owner: str, k: int) -> str:
    return f"{owner}#{k}"


def rope_freqs_present(model: dict) -> bool:
    """`rope_freqs` exists exactly when the scaling has a static table."""
    scaling = model["rope"]["scaling"]
    return (None if scaling is None else scaling.get("type")) in STATIC_ROPE_SCALINGS


def layer_roles(model: dict) -> list[str]:
    """The per-layer roles a model with these flags has, in decode order."""
    att = model["attention"]
    present = {
        "attn_q.bias": att["qkv_bias"],
        "attn_k.bias": att["qkv_bias"],
        "attn_v.bias": att["qkv_bias"],
        "attn_q_norm.weight": att["qk_norm"],
        "attn_k_norm.weight": att["qk_norm"],
        "attn_output.bias": att["o_bias"],
    }
    return [r for r in LAYER_ROLES if present.get(r, True)]


def tensor_names(model: dict) -> list[str]:
    """Every tensor name a model must have, in decode order (spec §2.2)."""
    names = ["rope_freqs"] if rope_freqs_present(model) else []
    names.append("token_embd.weight")
    roles = layer_roles(model)
    for layer in range(model["num_layers"]):
        names += [f"blk.{layer}.{r}" for r in roles]
    names.append("output_norm.weight")
    if not model["tie_word_embeddings"]:
        names.append("output.weight")
    return names


def split_name(name: str) -> tuple[str, int | None]:
    """`blk.3.attn_q.weight` → ("attn_q.weight", 3); `token_embd.weight` → (…, None)."""
    m = re.fullmatch(r"blk\.(0|[1-9][0-9]*)\.(.+)", name)
    if m:
        return m.group(2), int(m.group(1))
    return name, None


def expected_shape(model: dict, role: str) -> list[int]:
    """The shape the model's dimensions imply for a role ([out, in] for matrices)."""
    hidden, inter = model["hidden_size"], model["intermediate_size"]
    q_rows = model["num_attention_heads"] * model["head_dim"]
    kv_rows = model["num_kv_heads"] * model["head_dim"]
    vocab = model["vocab_size"]
    return {
        "rope_freqs": [model["rope"]["rotary_dim"] // 2],
        "token_embd.weight": [vocab, hidden],
        "output_norm.weight": [hidden],
        "output.weight": [vocab, hidden],
        "attn_norm.weight": [hidden],
        "attn_q.weight": [q_rows, hidden],
        "attn_q.bias": [q_rows],
        "attn_k.weight": [kv_rows, hidden],
        "attn_k.bias": [kv_rows],
        "attn_v.weight": [kv_rows, hidden],
        "attn_v.bias": [kv_rows],
        "attn_q_norm.weight": [model["head_dim"]],
        "attn_k_norm.weight": [model["head_dim"]],
        "attn_output.weight": [hidden, q_rows],
        "attn_output.bias": [hidden],
        "ffn_norm.weight": [hidden],
        "ffn_gate.weight": [inter, hidden],
        "ffn_up.weight": [inter, hidden],
        "ffn_down.weight": [hidden, inter],
    }[role]
