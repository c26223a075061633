"""THIN v0 constants and the small pure functions every reader and writer shares.

Everything here is fixed by ../shared/spec/thin-v0.md (FORMAT.md in this repo restates it).
No I/O, no third-party imports: a runtime author can read this file alone.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Any, Callable

from thinconv.format import schema
from thinconv.format.dtypes import BLOCK_SIZE, row_bytes  # noqa: F401 - part of the shared vocabulary

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

TOP_LEVEL_KEYS = ("alignment", "assets", "format", "format_version", "model", "pages", "runtime", "tensors", "validation")

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


def page_id(owner: str, k: int) -> str:
    return f"{owner}#{k}"


def rope_freqs_present(model: dict) -> bool:
    """`rope_freqs` exists exactly when the scaling has a static table."""
    scaling = model["rope"]["scaling"]
    return (None if scaling is None else scaling.get("type")) in STATIC_ROPE_SCALINGS


# ---------------------------------------------------------------- tensor roles

@dataclass(frozen=True)
class Role:
    """One tensor role (spec §2.2): where it sits in decode order, whether the model has it, and
    the shape its dimensions imply. Adding a role is one row of ROLE_TABLE."""

    name: str  # e.g. "attn_q.bias"; a layer tensor is named blk.L.<name>
    place: str  # "before" the layers, "layer", or "after" them (decode order)
    shape: Callable[[dict], list[int]]  # from the model's dimensions ([out, in] for matrices)
    matrix: bool = True  # matrices may be cast or quantized; the rest are f32 and one page
    present: Callable[[dict], bool] = lambda m: True  # whether a model with these flags has it
    flag: str | None = None  # the `model` key that decides `present`, for messages
    absent_because: str = "not part of this model"  # why a model lacks it (for messages)
    dims: str = "hidden_size {hidden_size}"  # what its shape means, for messages
    rope_rows: bool = False  # rows rotate by RoPE: permuted for the interleaved layout (§2.1)

    @property
    def per_layer(self) -> bool:
        return self.place == "layer"


def _flag(path: str, absent_because: str) -> dict:
    """Role fields for a tensor that exists exactly when boolean key `path` is true."""
    return {"present": lambda m: schema.value(m, path), "flag": path, "absent_because": absent_because}


def _q_rows(m: dict) -> int:
    return m["num_attention_heads"] * m["head_dim"]


def _kv_rows(m: dict) -> int:
    return m["num_kv_heads"] * m["head_dim"]


_Q = "num_attention_heads {num_attention_heads} × head_dim {head_dim}"
_KV = "num_key_value_heads {num_kv_heads} × head_dim {head_dim}"
_QKV_BIAS = _flag("attention.qkv_bias", "no q/k/v bias")
_QK_NORM = _flag("attention.qk_norm", "no q/k norm")

ROLE_TABLE: tuple[Role, ...] = (
    Role("rope_freqs", "before", lambda m: [m["rope"]["rotary_dim"] // 2], matrix=False, present=rope_freqs_present,
         flag="rope.scaling"),
    Role("token_embd.weight", "before", lambda m: [m["vocab_size"], m["hidden_size"]],
         dims="vocab_size {vocab_size} × hidden_size {hidden_size}"),
    Role("output_norm.weight", "after", lambda m: [m["hidden_size"]], matrix=False),
    Role("output.weight", "after", lambda m: [m["vocab_size"], m["hidden_size"]],
         present=lambda m: not m["tie_word_embeddings"], flag="tie_word_embeddings",
         dims="vocab_size {vocab_size} × hidden_size {hidden_size}"),
    Role("attn_norm.weight", "layer", lambda m: [m["hidden_size"]], matrix=False),
    Role("attn_q.weight", "layer", lambda m: [_q_rows(m), m["hidden_size"]], dims=_Q, rope_rows=True),
    Role("attn_q.bias", "layer", lambda m: [_q_rows(m)], matrix=False, rope_rows=True, **_QKV_BIAS),
    Role("attn_k.weight", "layer", lambda m: [_kv_rows(m), m["hidden_size"]], dims=_KV, rope_rows=True),
    Role("attn_k.bias", "layer", lambda m: [_kv_rows(m)], matrix=False, rope_rows=True, **_QKV_BIAS),
    Role("attn_v.weight", "layer", lambda m: [_kv_rows(m), m["hidden_size"]], dims=_KV),
    Role("attn_v.bias", "layer", lambda m: [_kv_rows(m)], matrix=False, **_QKV_BIAS),
    Role("attn_q_norm.weight", "layer", lambda m: [m["head_dim"]], matrix=False, dims="head_dim {head_dim}",
         rope_rows=True, **_QK_NORM),
    Role("attn_k_norm.weight", "layer", lambda m: [m["head_dim"]], matrix=False, dims="head_dim {head_dim}",
         rope_rows=True, **_QK_NORM),
    Role("attn_output.weight", "layer", lambda m: [m["hidden_size"], _q_rows(m)],
         dims="hidden_size {hidden_size} × (num_attention_heads {num_attention_heads} × head_dim {head_dim})"),
    Role("attn_output.bias", "layer", lambda m: [m["hidden_size"]], matrix=False,
         **_flag("attention.o_bias", "no output-projection bias")),
    Role("ffn_norm.weight", "layer", lambda m: [m["hidden_size"]], matrix=False),
    Role("ffn_gate.weight", "layer", lambda m: [m["intermediate_size"], m["hidden_size"]],
         dims="intermediate_size {intermediate_size} × hidden_size {hidden_size}"),
    Role("ffn_up.weight", "layer", lambda m: [m["intermediate_size"], m["hidden_size"]],
         dims="intermediate_size {intermediate_size} × hidden_size {hidden_size}"),
    Role("ffn_down.weight", "layer", lambda m: [m["hidden_size"], m["intermediate_size"]],
         dims="hidden_size {hidden_size} × intermediate_size {intermediate_size}"),
)
ROLE: dict[str, Role] = {r.name: r for r in ROLE_TABLE}
LAYER_ROLES = tuple(r.name for r in ROLE_TABLE if r.per_layer)
GLOBAL_ROLES = tuple(r.name for r in ROLE_TABLE if not r.per_layer)
ROLES = GLOBAL_ROLES + LAYER_ROLES
# Roles that are matrices (the rest — norms, biases, rope_freqs — are 1-D and always f32).
MATRIX_ROLES = tuple(r for r in ROLES if ROLE[r].matrix)


def layer_roles(model: dict) -> list[str]:
    """The per-layer roles a model with these flags has, in decode order."""
    return [r.name for r in ROLE_TABLE if r.per_layer and r.present(model)]


def tensor_names(model: dict) -> list[str]:
    """Every tensor name a model must have, in decode order (spec §2.2)."""
    names = [r.name for r in ROLE_TABLE if r.place == "before" and r.present(model)]
    roles = layer_roles(model)
    for layer in range(model["num_layers"]):
        names += [f"blk.{layer}.{r}" for r in roles]
    return names + [r.name for r in ROLE_TABLE if r.place == "after" and r.present(model)]


def split_name(name: str) -> tuple[str, int | None]:
    """`blk.3.attn_q.weight` → ("attn_q.weight", 3); `token_embd.weight` → (…, None)."""
    m = re.fullmatch(r"blk\.(0|[1-9][0-9]*)\.(.+)", name)
    if m:
        return m.group(2), int(m.group(1))
    return name, None


def expected_shape(model: dict, role: str) -> list[int]:
    """The shape the model's dimensions imply for a role ([out, in] for matrices)."""
    return ROLE[role].shape(model)
