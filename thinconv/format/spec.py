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

# thinconv embeds no source file larger than this (a converter limit, FORMAT.md §2.6); assets are
# copied in bounded chunks whatever their size or the page size.
MAX_ASSET_SIZE = 2 * 1024**3

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


def _static(scaling: Any) -> bool:
    return (None if scaling is None else scaling.get("type")) in STATIC_ROPE_SCALINGS


def rope_freqs_present(model: dict) -> bool:
    """`rope_freqs` exists exactly when the scaling has a static table."""
    return _static(model["rope"]["scaling"])


def rope_freqs_sliding_present(model: dict) -> bool:
    """`rope_freqs_sliding`: a sliding-layer RoPE whose scaling has a static table (addendum §2)."""
    sliding = schema.value(model, "rope.sliding")
    return sliding is not None and _static(sliding.get("scaling"))


# ---------------------------------------------------------------- tensor roles

@dataclass(frozen=True)
class Role:
    """One tensor role (spec §2.2, addendum §4): where it sits in decode order, whether a model has
    it, and the shape its dimensions imply. Adding a role is one row of ROLE_TABLE."""

    name: str  # e.g. "attn_q.bias"; a layer tensor is named blk.L.<name>
    place: str  # "before" the layers, "layer", or "after" them (decode order)
    shape: Callable[[dict], list[int]]  # from the model's dimensions ([out, in]; [E, out, in] for experts)
    matrix: bool = True  # matrices may be cast or quantized; the rest are f32 and one page
    present: Callable[[dict, int | None], bool] = lambda m, layer: True  # (model, layer) → has it
    flag: str | None = None  # the `model` key that decides `present`, for messages
    absent_because: str = "not part of this model"  # why a model lacks it (for messages)
    dims: str = "hidden_size {hidden_size}"  # what its shape means, for messages
    rope_rows: bool = False  # rows rotate by RoPE: permuted for the interleaved layout (§2.1)
    f32: bool = False  # a matrix that always stays f32 (the MoE routers)

    @property
    def per_layer(self) -> bool:
        return self.place == "layer"

    @property
    def experts(self) -> bool:
        """A 3-D [E, rows, cols] expert tensor: pages never straddle two experts."""
        return self.name.endswith("_exps.weight")


def _v(path: str) -> Callable[[dict], Any]:
    return lambda m: schema.value(m, path)


def _when(test: Callable[[dict, int | None], bool], flag: str, absent_because: str) -> dict:
    return {"present": test, "flag": flag, "absent_because": absent_because}


def _flag(path: str, absent_because: str) -> dict:
    """Role fields for a tensor that exists exactly when boolean key `path` is true."""
    return _when(lambda m, layer: schema.value(m, path), path, absent_because)


def _sparse(m: dict, layer: int | None) -> bool:
    moe = schema.value(m, "moe")
    return moe is not None and layer is not None and moe["layers"][layer]


def _dense(m: dict, layer: int | None) -> bool:
    return not _sparse(m, layer)


def _shared_expert(m: dict, layer: int | None, gate: bool = False) -> bool:
    se = _sparse(m, layer) and m["moe"]["shared_expert"]
    return bool(se) and (se["gate"] if gate else True)


def _q_rows(m: dict) -> int:
    return m["num_attention_heads"] * m["head_dim"]


def _kv_rows(m: dict) -> int:
    return m["num_kv_heads"] * m["head_dim"]


def _qk_norm_rows(m: dict, heads: int) -> list[int]:
    wide = schema.value(m, "attention.qk_norm_weights") == "per_head" or \
        schema.value(m, "attention.qk_norm_scope") == "full"
    return [heads * m["head_dim"] if wide else m["head_dim"]]


def _pre_norm(m: dict, layer: int | None) -> bool:
    return schema.value(m, "block.pre_norm")


def _ffn_norm(m: dict, layer: int | None) -> bool:
    return schema.value(m, "block.pre_norm") and not schema.value(m, "block.shared_norm")


def _norm_bias(test: Callable[[dict, int | None], bool]) -> Callable[[dict, int | None], bool]:
    return lambda m, layer: schema.value(m, "norm.bias") and test(m, layer)


def _dense_mlp(gated: bool = False, bias: bool = False) -> Callable[[dict, int | None], bool]:
    return lambda m, layer: (_dense(m, layer) and (not gated or schema.value(m, "mlp.type") == "gated")
                             and (not bias or schema.value(m, "mlp.bias")))


_E = "moe.num_experts {moe_experts}"
_H = "hidden_size {hidden_size}"
_I = "intermediate_size {intermediate_size}"
_Q = "num_attention_heads {num_attention_heads} × head_dim {head_dim}"
_KV = "num_key_value_heads {num_kv_heads} × head_dim {head_dim}"
_QKV_BIAS = _flag("attention.qkv_bias", "no q/k/v bias")
_QK_NORM = _flag("attention.qk_norm", "no q/k norm")
_PRE = _when(_pre_norm, "block.pre_norm", "no pre-norms (block.pre_norm false)")
_NORM_BIAS = _when(_norm_bias(_pre_norm), "norm.bias", "no norm biases")
_FFN_NORM = _when(_ffn_norm, "block.shared_norm", "the MLP shares attn_norm, or there are no pre-norms")
_POST = _flag("block.post_norm", "no post-norms")
_MOE = _when(_sparse, "moe.layers", "not a sparse (mixture-of-experts) layer")
_SHEXP = _when(_shared_expert, "moe.shared_expert", "no shared expert on this layer")
_GATED = _when(_dense_mlp(gated=True), "mlp.type", "a plain MLP has no gate, and sparse layers use experts")
_DENSE = _when(_dense_mlp(), "moe.layers", "a sparse layer uses experts")
_GATE_BIAS = _when(_dense_mlp(gated=True, bias=True), "mlp.bias", "no MLP biases")
_MLP_BIAS = _when(_dense_mlp(bias=True), "mlp.bias", "no MLP biases")


def _moe(m: dict, key: str) -> int:
    moe = m["moe"]
    return moe["shared_expert"][key] if key == "intermediate_size" else moe[key]


ROLE_TABLE: tuple[Role, ...] = (
    Role("rope_freqs", "before", lambda m: [m["rope"]["rotary_dim"] // 2], matrix=False,
         present=lambda m, layer: rope_freqs_present(m), flag="rope.scaling"),
    Role("rope_freqs_sliding", "before", lambda m: [m["rope"]["rotary_dim"] // 2], matrix=False,
         present=lambda m, layer: rope_freqs_sliding_present(m), flag="rope.sliding"),
    Role("token_embd.weight", "before", lambda m: [m["vocab_size"], m["hidden_size"]],
         dims="vocab_size {vocab_size} × hidden_size {hidden_size}"),
    Role("output_norm.weight", "after", lambda m: [m["hidden_size"]], matrix=False),
    Role("output_norm.bias", "after", lambda m: [m["hidden_size"]], matrix=False,
         **_when(lambda m, layer: schema.value(m, "norm.bias"), "norm.bias", "no norm biases")),
    Role("output.weight", "after", lambda m: [m["vocab_size"], m["hidden_size"]],
         present=lambda m, layer: not m["tie_word_embeddings"], flag="tie_word_embeddings",
         dims="vocab_size {vocab_size} × hidden_size {hidden_size}"),
    Role("attn_norm.weight", "layer", lambda m: [m["hidden_size"]], matrix=False, **_PRE),
    Role("attn_norm.bias", "layer", lambda m: [m["hidden_size"]], matrix=False, **_NORM_BIAS),
    Role("attn_q.weight", "layer", lambda m: [_q_rows(m), m["hidden_size"]], dims=_Q, rope_rows=True),
    Role("attn_q.bias", "layer", lambda m: [_q_rows(m)], matrix=False, rope_rows=True, **_QKV_BIAS),
    Role("attn_k.weight", "layer", lambda m: [_kv_rows(m), m["hidden_size"]], dims=_KV, rope_rows=True),
    Role("attn_k.bias", "layer", lambda m: [_kv_rows(m)], matrix=False, rope_rows=True, **_QKV_BIAS),
    Role("attn_v.weight", "layer", lambda m: [_kv_rows(m), m["hidden_size"]], dims=_KV),
    Role("attn_v.bias", "layer", lambda m: [_kv_rows(m)], matrix=False, **_QKV_BIAS),
    Role("attn_q_norm.weight", "layer", lambda m: _qk_norm_rows(m, m["num_attention_heads"]), matrix=False,
         dims="head_dim {head_dim} (× num_attention_heads {num_attention_heads} when per head or full width)",
         rope_rows=True, **_QK_NORM),
    Role("attn_k_norm.weight", "layer", lambda m: _qk_norm_rows(m, m["num_kv_heads"]), matrix=False,
         dims="head_dim {head_dim} (× num_key_value_heads {num_kv_heads} when per head or full width)",
         rope_rows=True, **_QK_NORM),
    Role("attn_output.weight", "layer", lambda m: [m["hidden_size"], _q_rows(m)],
         dims="hidden_size {hidden_size} × (num_attention_heads {num_attention_heads} × head_dim {head_dim})"),
    Role("attn_output.bias", "layer", lambda m: [m["hidden_size"]], matrix=False,
         **_flag("attention.o_bias", "no output-projection bias")),
    Role("attn_post_norm.weight", "layer", lambda m: [m["hidden_size"]], matrix=False, **_POST),
    Role("ffn_norm.weight", "layer", lambda m: [m["hidden_size"]], matrix=False, **_FFN_NORM),
    Role("ffn_norm.bias", "layer", lambda m: [m["hidden_size"]], matrix=False,
         **_when(_norm_bias(_ffn_norm), "norm.bias", "no norm biases")),
    Role("ffn_gate_inp.weight", "layer", lambda m: [_moe(m, "num_experts"), m["hidden_size"]], f32=True,
         dims=f"{_E} × {_H}", **_MOE),
    Role("ffn_gate_exps.weight", "layer",
         lambda m: [_moe(m, "num_experts"), _moe(m, "expert_intermediate_size"), m["hidden_size"]],
         dims=f"{_E} × moe.expert_intermediate_size {{moe_f}} × {_H}", **_MOE),
    Role("ffn_up_exps.weight", "layer",
         lambda m: [_moe(m, "num_experts"), _moe(m, "expert_intermediate_size"), m["hidden_size"]],
         dims=f"{_E} × moe.expert_intermediate_size {{moe_f}} × {_H}", **_MOE),
    Role("ffn_down_exps.weight", "layer",
         lambda m: [_moe(m, "num_experts"), m["hidden_size"], _moe(m, "expert_intermediate_size")],
         dims=f"{_E} × {_H} × moe.expert_intermediate_size {{moe_f}}", **_MOE),
    Role("ffn_gate_inp_shexp.weight", "layer", lambda m: [1, m["hidden_size"]], f32=True,
         **_when(lambda m, layer: _shared_expert(m, layer, gate=True), "moe.shared_expert.gate",
                 "no gate on the shared expert")),
    Role("ffn_gate_shexp.weight", "layer", lambda m: [_moe(m, "intermediate_size"), m["hidden_size"]],
         dims=f"moe.shared_expert.intermediate_size {{moe_fs}} × {_H}", **_SHEXP),
    Role("ffn_up_shexp.weight", "layer", lambda m: [_moe(m, "intermediate_size"), m["hidden_size"]],
         dims=f"moe.shared_expert.intermediate_size {{moe_fs}} × {_H}", **_SHEXP),
    Role("ffn_down_shexp.weight", "layer", lambda m: [m["hidden_size"], _moe(m, "intermediate_size")],
         dims=f"{_H} × moe.shared_expert.intermediate_size {{moe_fs}}", **_SHEXP),
    Role("ffn_gate.weight", "layer", lambda m: [m["intermediate_size"], m["hidden_size"]], dims=f"{_I} × {_H}",
         **_GATED),
    Role("ffn_gate.bias", "layer", lambda m: [m["intermediate_size"]], matrix=False, **_GATE_BIAS),
    Role("ffn_up.weight", "layer", lambda m: [m["intermediate_size"], m["hidden_size"]], dims=f"{_I} × {_H}",
         **_DENSE),
    Role("ffn_up.bias", "layer", lambda m: [m["intermediate_size"]], matrix=False, **_MLP_BIAS),
    Role("ffn_down.weight", "layer", lambda m: [m["hidden_size"], m["intermediate_size"]], dims=f"{_H} × {_I}",
         **_DENSE),
    Role("ffn_down.bias", "layer", lambda m: [m["hidden_size"]], matrix=False, **_MLP_BIAS),
    Role("ffn_post_norm.weight", "layer", lambda m: [m["hidden_size"]], matrix=False, **_POST),
)
ROLE: dict[str, Role] = {r.name: r for r in ROLE_TABLE}
DERIVED_ROLES = ("rope_freqs", "rope_freqs_sliding")  # computed from `model`, never read from a checkpoint
LAYER_ROLES = tuple(r.name for r in ROLE_TABLE if r.per_layer)
GLOBAL_ROLES = tuple(r.name for r in ROLE_TABLE if not r.per_layer)
ROLES = GLOBAL_ROLES + LAYER_ROLES
# Roles that are matrices (the rest — norms, biases, rope_freqs — are 1-D and always f32).
MATRIX_ROLES = tuple(r for r in ROLES if ROLE[r].matrix)


def layer_roles(model: dict, layer: int = 0) -> list[str]:
    """The roles layer `layer` of a model with these flags has, in decode order."""
    return [r.name for r in ROLE_TABLE if r.per_layer and r.present(model, layer)]


def tensor_names(model: dict) -> list[str]:
    """Every tensor name a model must have, in decode order (spec §2.2)."""
    names = [r.name for r in ROLE_TABLE if r.place == "before" and r.present(model, None)]
    for layer in range(model["num_layers"]):
        names += [f"blk.{layer}.{r}" for r in layer_roles(model, layer)]
    return names + [r.name for r in ROLE_TABLE if r.place == "after" and r.present(model, None)]


def dims_text(model: dict, role: str) -> str:
    """What a role's shape means, with this model's values (for messages)."""
    moe = schema.value(model, "moe") or {}
    se = moe.get("shared_expert") or {}
    return ROLE[role].dims.format(**model, moe_experts=moe.get("num_experts"), moe_f=moe.get("expert_intermediate_size"),
                                  moe_fs=se.get("intermediate_size"))


def split_name(name: str) -> tuple[str, int | None]:
    """`blk.3.attn_q.weight` → ("attn_q.weight", 3); `token_embd.weight` → (…, None)."""
    m = re.fullmatch(r"blk\.(0|[1-9][0-9]*)\.(.+)", name)
    if m:
        return m.group(2), int(m.group(1))
    return name, None


def expected_shape(model: dict, role: str) -> list[int]:
    """The shape the model's dimensions imply for a role ([out, in] for matrices, [E, out, in] for experts)."""
    return ROLE[role].shape(model)


def rows_and_cols(shape: list[int]) -> tuple[int, int]:
    """A tensor as the 2-D matrix its pages tile: [rows, cols] (1-D: [n, 1]; 3-D [E, r, c]: [E·r, c])."""
    if len(shape) == 1:
        return shape[0], 1
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows, shape[-1]
