"""Every manifest-structure rule validate_manifest checks (spec §2), each broken alone.

Each case mutates a valid manifest so that exactly one rule breaks (dependent fields are fixed
up: page sizes, page ids, pages[] entries), then checks three consumers agree and name the key
path: validate_manifest (the exact set of paths reported), open_archive on a crafted archive
holding that manifest (lengths and hash fixed up), and pack (PackError, no output).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import blake3
import numpy as np
import pytest

from factory import make_archive_inputs, tiny_model
from test_format_layout import canonical, from_inputs, with_manifest, write
from thinconv.errors import PackError, ThinFormatError
from thinconv.format import open_archive, pack, validate_manifest
from thinconv.format.manifest import ValidationReport

VALIDATION = {
    "converter": {"name": "thinconv", "version": "0.1.0", "recipe": "llama"},
    "source": {"repo_id": "org/tiny", "revision": "main", "commit": None,
               "files": [{"name": "model.safetensors", "size": 10, "sha256": None},
                         {"name": "config.json", "size": 2, "sha256": "ab" * 32}]},
    "stats": {"token_embd.weight": {"min": -1.0, "max": 1.0, "mean": 0.0, "std": 1.0, "nan": 0, "inf": 0}},
    "quant": {"token_embd.weight": {"rmse": 0.1, "max_abs_err": 0.2, "rel_rmse": None, "note": "kept"}},
    "probe": {},
}


def _inputs(kind: str):
    if kind == "f32":
        m, s, _ = make_archive_inputs(tiny_model(), dtype="f32", page_size=4096)
    elif kind == "paged":  # token_embd.weight in 6 pages of 2 rows
        m, s, _ = make_archive_inputs(tiny_model(), dtype="f32", page_size=64)
    elif kind == "assets":
        m, s, _ = make_archive_inputs(tiny_model(), dtype="f32",
                                      assets={"config.json": b'{"a": 1}', "tokenizer.json": b'{"t": [1, 2]}'})
    elif kind == "q8":  # hidden 32 so token_embd.weight can be q8_0 (row = 34 bytes)
        model = tiny_model(hidden_size=32, intermediate_size=32, head_dim=16, rope={
            "theta": 10000.0, "rotary_dim": 16, "layout": "half", "scaling": None, "attention_factor": 1.0})
        m, s, _ = make_archive_inputs(model, dtype="f32")
        t = _t(m, "token_embd.weight")
        t.update(dtype="q8_0", quant={"scheme": "q8_0", "block_size": 32, "block_bytes": 34, "source_dtype": "bf16"})
        data = np.random.default_rng(1).integers(0, 256, 12 * 34, dtype=np.uint8).tobytes()
        s["token_embd.weight#0"] = data
        _p(m, "token_embd.weight#0").update(size=len(data), checksum=blake3.blake3(data).hexdigest())
    else:
        raise KeyError(kind)
    m["validation"] = copy.deepcopy(VALIDATION)
    return m, s


BASES: dict[str, tuple[dict, dict, bytes]] = {}


def base(kind: str) -> tuple[dict, dict, bytes]:
    """(manifest, sources, archive bytes) of a valid archive; manifests are deep-copied by callers."""
    if kind not in BASES:
        m, s = _inputs(kind)
        BASES[kind] = (m, s, from_inputs(m, s))
    return BASES[kind]


def _t(m: dict, name: str) -> dict:
    return next(t for t in m["tensors"] if t["name"] == name)


def _ti(m: dict, name: str) -> int:
    return next(i for i, t in enumerate(m["tensors"]) if t["name"] == name)


def _p(m: dict, pid: str) -> dict:
    return next(p for p in m["pages"] if p["id"] == pid)


def _pi(m: dict, pid: str) -> int:
    return next(i for i, p in enumerate(m["pages"]) if p["id"] == pid)


def _drop_tensor(m: dict, name: str) -> None:
    t = m["tensors"].pop(_ti(m, name))
    m["pages"] = [p for p in m["pages"] if p["id"] not in t["pages"]]


def _add_tensor(m: dict, after: str, name: str, shape: list[int]) -> None:
    role, layer = name.split(".", 2)[2] if name.startswith("blk.") else name, 0 if name.startswith("blk.") else None
    size = 4 * int(np.prod(shape))
    m["tensors"].insert(_ti(m, after) + 1, {
        "name": name, "role": role, "layer": layer, "source": [name], "shape": shape, "dtype": "f32", "quant": None,
        "hints": {"placement": "device", "access": "elementwise"}, "pages": [f"{name}#0"]})
    last = _t(m, after)["pages"][-1]
    m["pages"].insert(_pi(m, last) + 1, {"id": f"{name}#0", "tensor": name, "rows": [0, shape[0]], "size": size,
                                         "checksum": blake3.blake3(bytes(size)).hexdigest()})


def _swap(lst: list, i: int, j: int) -> None:
    lst[i], lst[j] = lst[j], lst[i]


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """A mutation setting (or deleting, value=DEL) a dotted path; [i] indexes lists. Keys that
    hold dots themselves (tensor names under validation.stats) spell them as \\x00."""

    def mutate(m: dict) -> None:
        keys = [k.replace("\x00", ".") for k in path.replace("[", ".[").split(".")]
        obj = m
        for k in keys[:-1]:
            obj = obj[int(k[1:-1])] if k.startswith("[") else obj[k]
        last = keys[-1]
        key = int(last[1:-1]) if last.startswith("[") else last
        if value is DEL:
            del obj[key]
        else:
            obj[key] = copy.deepcopy(value)

    return mutate


DEL = object()
HEX = "0" * 64


@dataclass
class Case:
    id: str
    mutate: Callable[[dict], Any]
    path: str | tuple[str, ...]  # the key path(s) the errors must name
    fragment: str
    exact: bool = True  # the reported paths are exactly `path` (no other rule broke)
    kind: str = "f32"


def _attn(**kw):
    att = {"qkv_bias": False, "o_bias": False, "qk_norm": False, "sliding_window": None, "layer_types": ["full"],
           "scale": 0.5}
    att.update(kw)
    return _set("model.attention", att)


def _rope(**kw):
    rope = {"theta": 10000.0, "rotary_dim": 4, "layout": "half", "scaling": None, "attention_factor": 1.0}
    rope.update(kw)
    return _set("model.rope", rope)


def _shape_6x16(m):
    _t(m, "token_embd.weight")["shape"] = [6, 16]
    _p(m, "token_embd.weight#0")["rows"] = [0, 6]


def _norm_f16(m):
    _t(m, "blk.0.attn_norm.weight")["dtype"] = "f16"
    _p(m, "blk.0.attn_norm.weight#0")["size"] = 16


def _q8_on_8_cols(m):
    _t(m, "token_embd.weight").update(dtype="q8_0", quant={"scheme": "q8_0", "block_size": 32, "block_bytes": 34,
                                                           "source_dtype": "f32"})


def _norm_two_pages(m):
    name = "blk.0.attn_norm.weight"
    _t(m, name)["pages"] = [f"{name}#0", f"{name}#1"]
    i = _pi(m, f"{name}#0")
    m["pages"][i].update(rows=[0, 4], size=16)
    m["pages"].insert(i + 1, {"id": f"{name}#1", "tensor": name, "rows": [4, 8], "size": 16, "checksum": HEX})


def _page_id_k1(m):
    _t(m, "token_embd.weight")["pages"] = ["token_embd.weight#1"]
    _p(m, "token_embd.weight#0")["id"] = "token_embd.weight#1"


def _swap_gate_up(m):
    i, j = _ti(m, "blk.0.ffn_gate.weight"), _ti(m, "blk.0.ffn_up.weight")
    _swap(m["tensors"], i, j)
    _swap(m["pages"], _pi(m, "blk.0.ffn_gate.weight#0"), _pi(m, "blk.0.ffn_up.weight#0"))


def _two_layers(m):
    m["model"]["num_layers"] = 2
    m["model"]["attention"]["layer_types"] = ["full", "full"]


def _rename_tensor(m, old, new, role):
    t = _t(m, old)
    t.update(name=new, role=role, pages=[f"{new}#0"])
    _p(m, f"{old}#0").update(id=f"{new}#0", tensor=new)


def _gap(m):  # paged: token_embd.weight#2 should start at row 4
    _p(m, "token_embd.weight#2").update(rows=[5, 6], size=32)


def _short_cover(m):
    t = _t(m, "token_embd.weight")
    t["pages"].pop()
    m["pages"].pop(_pi(m, "token_embd.weight#5"))


def _extra_page(m):
    m["pages"].append({"id": "extra#0", "asset": "config.json", "size": 1, "checksum": HEX})


def _asset_name(m):
    a = m["assets"][1]
    a.update(name="tokenizer.bin", pages=["tokenizer.bin#0"])
    _p(m, "tokenizer.json#0").update(id="tokenizer.bin#0", asset="tokenizer.bin")


def _asset_page_k1(m):
    m["assets"][0]["pages"] = ["config.json#1"]
    _p(m, "config.json#0")["id"] = "config.json#1"


def _no_config(m):
    m["assets"].pop(0)
    m["pages"].pop(_pi(m, "config.json#0"))


def _dup_asset(m):
    a = m["assets"][1]
    a.update(name="config.json", pages=["config.json#0"])
    _p(m, "tokenizer.json#0").update(id="config.json#0", asset="config.json")


def _empty_asset(m):
    a = m["assets"][1]
    a.update(size=0, pages=[])
    m["pages"].pop(_pi(m, "tokenizer.json#0"))


INT_KEYS = ("hidden_size", "intermediate_size", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim",
            "vocab_size", "max_position_embeddings")

CASES = [
    # top level
    Case("top_missing", _set("runtime", DEL), "runtime", "missing"),
    Case("top_unknown", _set("extra", 1), "extra", "unknown key"),
    Case("format", _set("format", "THIN"), "format", 'expected "thin"'),
    Case("format_version", _set("format_version", 1), "format_version", "expected 0"),
    Case("format_version_bool", _set("format_version", False), "format_version", "expected 0"),
    Case("format_version_float", _set("format_version", 0.0), "format_version", "expected 0"),
    Case("alignment", _set("alignment", 8192), "alignment", "expected 4096"),
    Case("alignment_float", _set("alignment", 4096.0), "alignment", "expected 4096"),
    Case("not_object", lambda m: Replace([m]), "", "expected an object, got a list"),
    Case("runtime_type", _set("runtime", []), "runtime", "expected an object"),
    Case("tensors_type", _set("tensors", {}), "tensors", "expected a list", exact=False),
    Case("assets_type", _set("assets", {}), "assets", "expected a list", exact=False),
    Case("pages_type", _set("pages", {}), "pages", "expected a list"),
    Case("validation_type", _set("validation", []), "validation", "expected an object"),
    # model: presence and types
    Case("model_type", _set("model", []), "model", "expected an object"),
    Case("model_missing", _set("model.head_dim", DEL), "model.head_dim", "missing"),
    Case("model_unknown", _set("model.foo", 1), "model.foo", "unknown key"),
    Case("architecture", _set("model.architecture", ""), "model.architecture", "non-empty string"),
    Case("source_architecture", _set("model.source_architecture", 5), "model.source_architecture", "string"),
    *[Case(f"int_{k}_zero", _set(f"model.{k}", 0), f"model.{k}", "≥ 1, got 0") for k in INT_KEYS],
    Case("int_string", _set("model.hidden_size", "8"), "model.hidden_size", "expected an integer"),
    Case("int_bool", _set("model.num_layers", True), "model.num_layers", "expected an integer"),
    Case("int_float", _set("model.vocab_size", 12.0), "model.vocab_size", "expected an integer"),
    Case("tie_type", _set("model.tie_word_embeddings", "false"), "model.tie_word_embeddings", "true or false"),
    Case("kv_divides", _set("model.num_kv_heads", 3), "model.num_kv_heads", "does not divide", exact=False),
    Case("norm_type", _set("model.norm.type", "groupnorm"), "model.norm.type", "'rmsnorm', 'layernorm'"),
    Case("norm_eps_zero", _set("model.norm.eps", 0), "model.norm.eps", "positive"),
    Case("norm_eps_str", _set("model.norm.eps", "1e-5"), "model.norm.eps", "expected a number"),
    Case("norm_extra", _set("model.norm.shift", False), "model.norm.shift", "unknown key"),
    Case("norm_explicit_default", _set("model.norm.bias", False), "model.norm.bias", "is the default"),
    Case("norm_bias_rms", _set("model.norm.bias", True), "model.norm.bias", "need norm.type 'layernorm'"),
    Case("norm_obj", _set("model.norm", "rmsnorm"), "model.norm", "expected an object"),
    Case("mlp_type", _set("model.mlp.type", "swiglu"), "model.mlp.type", "'gated', 'plain'"),
    Case("mlp_activation", _set("model.mlp.activation", "relu"), "model.mlp.activation", "'silu', 'gelu'"),
    Case("qkv_bias_int", _set("model.attention.qkv_bias", 0), "model.attention.qkv_bias", "true or false"),
    Case("o_bias_null", _set("model.attention.o_bias", None), "model.attention.o_bias", "true or false"),
    Case("qk_norm_str", _set("model.attention.qk_norm", "no"), "model.attention.qk_norm", "true or false"),
    Case("window_zero", _set("model.attention.sliding_window", 0), "model.attention.sliding_window", "≥ 1"),
    Case("window_str", _set("model.attention.sliding_window", "4"), "model.attention.sliding_window", "or null"),
    Case("sliding_no_window", _attn(layer_types=["sliding"]), "model.attention.layer_types[0]",
         "'sliding' but sliding_window is null"),
    Case("layer_types_len", _attn(layer_types=["full", "full"]), "model.attention.layer_types", "has 2 entries"),
    Case("layer_types_value", _attn(layer_types=["local"]), "model.attention.layer_types[0]", "'full', 'sliding'"),
    Case("layer_types_type", _attn(layer_types="full"), "model.attention.layer_types", "expected a list"),
    Case("scale_zero", _set("model.attention.scale", 0.0), "model.attention.scale", "positive"),
    Case("scale_missing", _set("model.attention.scale", DEL), "model.attention.scale", "missing"),
    Case("attention_extra", _set("model.attention.window", 4), "model.attention.window", "unknown key"),
    Case("theta_zero", _set("model.rope.theta", 0), "model.rope.theta", "positive"),
    Case("theta_str", _set("model.rope.theta", "1e4"), "model.rope.theta", "expected a number"),
    Case("rotary_odd", _set("model.rope.rotary_dim", 3), "model.rope.rotary_dim", "must be even"),
    Case("rotary_big", _set("model.rope.rotary_dim", 8), "model.rope.rotary_dim", "exceeds head_dim 4"),
    Case("rotary_zero", _set("model.rope.rotary_dim", 0), "model.rope.rotary_dim", "≥ 2"),
    Case("rope_layout", _set("model.rope.layout", "full"), "model.rope.layout", "'half', 'interleaved'"),
    Case("attention_factor", _set("model.rope.attention_factor", 0), "model.rope.attention_factor", "positive"),
    Case("rope_missing", _set("model.rope.layout", DEL), "model.rope.layout", "missing"),
    Case("scaling_default", _rope(scaling={"type": "default"}), "model.rope.scaling.type", "scaling: null"),
    Case("scaling_theta", _rope(scaling={"type": "linear", "factor": 2.0, "rope_theta": 1e4}),
         "model.rope.scaling.rope_theta", "must not be repeated"),
    Case("scaling_str", _rope(scaling="linear"), "model.rope.scaling", "expected an object"),
    Case("scaling_no_type", _rope(scaling={"factor": 2.0}), "model.rope.scaling.type", "non-empty string"),
    Case("bos_range", _set("model.special_tokens.bos", 12), "model.special_tokens.bos", "in [0, 11], got 12"),
    Case("bos_negative", _set("model.special_tokens.bos", -1), "model.special_tokens.bos", "got -1"),
    Case("pad_str", _set("model.special_tokens.pad", "0"), "model.special_tokens.pad", "integer or null"),
    Case("eos_type", _set("model.special_tokens.eos", 2), "model.special_tokens.eos", "expected a list"),
    Case("eos_range", _set("model.special_tokens.eos", [2, 12]), "model.special_tokens.eos[1]", "got 12"),
    Case("eos_item", _set("model.special_tokens.eos", ["2"]), "model.special_tokens.eos[0]", "expected an integer"),
    Case("special_missing", _set("model.special_tokens.pad", DEL), "model.special_tokens.pad", "missing"),
    # tensors[]: fields
    Case("tensor_type", _set("tensors[2]", "blk.0.attn_norm.weight"), "tensors[2]", "expected an object", exact=False),
    Case("tensor_missing", _set("tensors[1].hints", DEL), "tensors[1].hints", "missing"),
    Case("tensor_unknown", _set("tensors[1].offset", 0), "tensors[1].offset", "unknown key"),
    Case("name_type", _set("tensors[1].name", 5), "tensors[1].name", "non-empty string", exact=False),
    Case("role_mismatch", _set("tensors[3].role", "attn_k.weight"), "tensors[3].role", "expected 'attn_q.weight'"),
    Case("role_unknown", lambda m: _rename_tensor(m, "blk.0.attn_q.weight", "blk.0.attn_x.weight", "attn_x.weight"),
         "tensors[3].role", "unknown role 'attn_x.weight'", exact=False),
    Case("layer_mismatch", _set("tensors[2].layer", 1), "tensors[2].layer", "expected 0"),
    Case("layer_bool", _set("tensors[2].layer", False), "tensors[2].layer", "expected 0"),
    Case("layer_float", _set("tensors[2].layer", 0.0), "tensors[2].layer", "expected 0"),
    Case("layer_global", _set("tensors[1].layer", 0), "tensors[1].layer", "expected null"),
    Case("source_type", _set("tensors[1].source", "token_embd.weight"), "tensors[1].source", "expected a list"),
    Case("source_item", _set("tensors[1].source", [5]), "tensors[1].source[0]", "non-empty string"),
    Case("rope_freqs_source", _set("tensors[0].source", ["inv_freq"]), "tensors[0].source", "derived"),
    Case("shape_type", _set("tensors[1].shape", "12x8"), "tensors[1].shape", "expected a list"),
    Case("shape_rank", _set("tensors[1].shape", [12, 8, 1, 1]), "tensors[1].shape", "1 to 3 positive integers"),
    Case("shape_zero", _set("tensors[1].shape", [12, 0]), "tensors[1].shape", "1 to 3 positive integers"),
    Case("shape_float", _set("tensors[1].shape", [12, 8.0]), "tensors[1].shape", "1 to 3 positive integers"),
    Case("shape_model", _shape_6x16, "tensors[1].shape", "expected [12, 8] from model dimensions, got [6, 16]"),
    Case("dtype_unknown", _set("tensors[1].dtype", "f64"), "tensors[1].dtype", "expected one of"),
    Case("dtype_1d", _norm_f16, "tensors[2].dtype", "1-D tensors are f32"),
    Case("dtype_block_cols", _q8_on_8_cols, "tensors[1].dtype", "q8_0 needs cols % 32 == 0, got 8 cols"),
    Case("quant_null", _set("tensors[1].quant", None), "tensors[1].quant", "expected an object", kind="q8"),
    Case("quant_scheme", _set("tensors[1].quant.scheme", "q4_0"), "tensors[1].quant.scheme", '"q8_0"', kind="q8"),
    Case("quant_block_size", _set("tensors[1].quant.block_size", 16), "tensors[1].quant.block_size", "32", kind="q8"),
    Case("quant_block_bytes", _set("tensors[1].quant.block_bytes", 32), "tensors[1].quant.block_bytes", "34",
         kind="q8"),
    Case("quant_source_dtype", _set("tensors[1].quant.source_dtype", "f64"), "tensors[1].quant.source_dtype",
         "expected one of", kind="q8"),
    Case("quant_missing", _set("tensors[1].quant.source_dtype", DEL), "tensors[1].quant.source_dtype", "missing",
         kind="q8"),
    Case("quant_on_float", _set("tensors[1].quant", {"scheme": "q8_0", "block_size": 32, "block_bytes": 34,
                                                     "source_dtype": "f32"}), "tensors[1].quant", "must be null"),
    Case("hints_placement", _set("tensors[1].hints.placement", "gpu"), "tensors[1].hints.placement", "'host'"),
    Case("hints_access", _set("tensors[1].hints.access", "random"), "tensors[1].hints.access", "'gather'"),
    Case("hints_type", _set("tensors[1].hints", None), "tensors[1].hints", "expected an object"),
    Case("hints_extra", _set("tensors[1].hints.cache", True), "tensors[1].hints.cache", "unknown key"),
    Case("tensor_no_pages", _set("tensors[1].pages", []), "tensors[1].pages", "at least one page", exact=False),
    Case("tensor_page_id", _page_id_k1, "tensors[1].pages[0]", '"token_embd.weight#0"'),
    Case("tensor_1d_pages", _norm_two_pages, "tensors[2].pages", "1-D tensors are one page, got 2"),
    # tensors[]: the set and order the model implies
    Case("dup_tensor", _set("tensors[12].name", "blk.0.ffn_down.weight"), "tensors", "duplicate tensor names",
         exact=False),
    Case("set_missing", lambda m: _drop_tensor(m, "blk.0.ffn_up.weight"), "tensors",
         "missing for this model's flags: blk.0.ffn_up.weight"),
    Case("set_extra_tied", _set("model.tie_word_embeddings", True), "tensors",
         "not expected for this model's flags: output.weight"),
    Case("set_extra_bias", lambda m: _add_tensor(m, "blk.0.attn_q.weight", "blk.0.attn_q.bias", [8]), "tensors",
         "not expected for this model's flags: blk.0.attn_q.bias"),
    Case("set_qkv_bias", _attn(qkv_bias=True), "tensors",
         "missing for this model's flags: blk.0.attn_q.bias, blk.0.attn_k.bias, blk.0.attn_v.bias"),
    Case("set_o_bias", _attn(o_bias=True), "tensors", "missing for this model's flags: blk.0.attn_output.bias"),
    Case("set_qk_norm", _attn(qk_norm=True), "tensors",
         "missing for this model's flags: blk.0.attn_q_norm.weight, blk.0.attn_k_norm.weight"),
    Case("set_dynamic_rope", _rope(scaling={"type": "dynamic", "factor": 2.0}), "tensors",
         "not expected for this model's flags: rope_freqs"),
    Case("set_layers", _two_layers, "tensors", "missing for this model's flags: blk.1.attn_norm.weight"),
    Case("order", _swap_gate_up, "tensors[8]", "out of decode order: expected 'blk.0.ffn_gate.weight'"),
    # pages[]
    Case("page_type", _set("pages[1]", []), "pages[1]", "expected an object"),
    Case("page_missing", _set("pages[1].checksum", DEL), "pages[1].checksum", "missing"),
    Case("page_unknown", _set("pages[1].offset", 4096), "pages[1].offset", "unknown key"),
    Case("page_id_charset", _set("pages[1].id", "token_embd.weight 0"), ("pages[1].id", "pages[1]"),
         "must be 1-255 characters of [A-Za-z0-9._#:/-]"),
    Case("page_id_long", _set("pages[1].id", "x" * 256), ("pages[1].id", "pages[1]"), "1-255 characters"),
    Case("page_dup", lambda m: m["pages"].__setitem__(2, copy.deepcopy(m["pages"][1])), ("pages[2].id", "pages[2]"),
         "duplicate page id 'token_embd.weight#0'"),
    Case("page_size_zero", _set("pages[1].size", 0), "pages[1].size", "≥ 1, got 0"),
    Case("page_size_str", _set("pages[1].size", "384"), "pages[1].size", "expected an integer"),
    Case("page_size_float", _set("pages[1].size", 384.0), "pages[1].size", "expected an integer"),
    Case("page_checksum_upper", _set("pages[1].checksum", "AB" * 32), "pages[1].checksum", "64 lowercase hex"),
    Case("page_checksum_short", _set("pages[1].checksum", "ab" * 31 + "a"), "pages[1].checksum", "64 lowercase hex"),
    Case("page_both_owners", _set("pages[1].asset", "config.json"), "pages[1]", "exactly one of"),
    Case("page_no_owner", _set("pages[1].tensor", DEL), "pages[1]", "exactly one of"),
    Case("page_order", lambda m: _swap(m["pages"], 3, 4), ("pages[3]", "pages[4]"), "(decode order)"),
    Case("page_owner", _set("pages[1].tensor", "output.weight"), "pages[1]", "of tensor 'token_embd.weight' here"),
    Case("asset_page_rows", _set("pages[13].rows", [0, 1]), "pages[13].rows", "asset pages have no rows"),
    Case("rows_missing", _set("pages[1].rows", DEL), "pages[1].rows", "expected [start, end)"),
    Case("rows_type", _set("pages[1].rows", ["0", 12]), "pages[1].rows", "expected [start, end)"),
    Case("rows_len", _set("pages[1].rows", [0, 12, 1]), "pages[1].rows", "expected [start, end)"),
    Case("rows_gap", _gap, "pages[3].rows", "expected rows starting at 4", kind="paged"),
    Case("rows_empty", _set("pages[6].rows", [10, 10]), "pages[6].rows", "end > start", exact=False, kind="paged"),
    Case("rows_past_end", lambda m: _p(m, "token_embd.weight#5").update(rows=[10, 13], size=96), "pages[6].rows",
         "end 13 is past dim 0 = 12", exact=False, kind="paged"),
    Case("rows_short", _short_cover, "tensor token_embd.weight", "pages cover rows [0, 10), expected [0, 12)",
         kind="paged"),
    Case("page_size_rows", _set("pages[1].size", 385), "pages[1].size", "expected 384 (12 rows × 32 bytes), got 385"),
    Case("page_unowned", _extra_page, "pages[14].id", "\"extra#0\" is owned by no tensor or asset"),
    Case("page_unlisted", lambda m: m["pages"].pop(), "pages", "page 'config.json#0' of 'config.json' is not listed"),
    Case("pages_empty", _set("pages", []), "pages", "an archive has at least one page", exact=False),
    # assets[]
    Case("asset_type", _set("assets[0]", "config.json"), "assets[0]", "expected an object", exact=False),
    Case("asset_missing", _set("assets[0].media_type", DEL), "assets[0].media_type", "missing"),
    Case("asset_unknown", _set("assets[0].sha256", HEX), "assets[0].sha256", "unknown key"),
    Case("asset_name", _asset_name, "assets[1].name", "'tokenizer.json'", kind="assets"),
    Case("asset_media_type", _set("assets[0].media_type", ""), "assets[0].media_type", "non-empty string"),
    Case("asset_size_type", _set("assets[0].size", "40"), "assets[0].size", "expected an integer"),
    Case("asset_size", lambda m: m["assets"][0].update(size=m["assets"][0]["size"] + 1), "asset config.json",
         "pages hold 39 bytes, size says 40"),
    Case("asset_page_id", _asset_page_k1, "assets[0].pages[0]", '"config.json#0"'),
    Case("asset_config_required", _no_config, "assets", "config.json is required", kind="assets"),
    Case("asset_dup", _dup_asset, "assets", "duplicate asset names", exact=False, kind="assets"),
    # validation
    Case("validation_unknown", _set("validation.extra", {}), "validation.extra", "unknown key"),
    Case("converter_null", _set("validation.converter", None), "validation.converter", "expected an object"),
    Case("converter_missing", _set("validation.converter.recipe", DEL), "validation.converter.recipe", "missing"),
    Case("converter_version", _set("validation.converter.version", 1), "validation.converter.version", "string"),
    Case("source_null", _set("validation.source", None), "validation.source", "expected an object"),
    Case("source_repo", _set("validation.source.repo_id", 5), "validation.source.repo_id", "string or null"),
    Case("source_files", _set("validation.source.files", "x"), "validation.source.files", "expected a list"),
    Case("source_file_obj", _set("validation.source.files[0]", "x"), "validation.source.files[0]", "an object"),
    Case("source_file_sha", _set("validation.source.files[1].sha256", "AB" * 32),
         "validation.source.files[1].sha256", "64 lowercase hex digits or null"),
    Case("source_file_size", _set("validation.source.files[0].size", -1), "validation.source.files[0].size", "≥ 0"),
    Case("stats_null", _set("validation.stats", None), "validation.stats", "expected an object"),
    Case("stats_unknown_tensor", _set("validation.stats.foo", VALIDATION["stats"]["token_embd.weight"]),
         "validation.stats.foo", "names no tensor of this archive"),
    Case("stats_min", _set("validation.stats.token_embd\x00weight.min", "x"), "validation.stats.token_embd.weight.min",
         "expected a number"),
    Case("stats_nan", _set("validation.stats.token_embd\x00weight.nan", -1), "validation.stats.token_embd.weight.nan",
         "≥ 0"),
    Case("stats_missing", _set("validation.stats.token_embd\x00weight.std", DEL),
         "validation.stats.token_embd.weight.std", "missing"),
    Case("quant_entry_extra", _set("validation.quant.token_embd\x00weight.bits", 8),
         "validation.quant.token_embd.weight.bits", "unknown key"),
    Case("quant_entry_type", _set("validation.quant.token_embd\x00weight.rmse", [0.1]),
         "validation.quant.token_embd.weight.rmse", "expected a number or null"),
    Case("probe_type", _set("validation.probe", []), "validation.probe", "expected an object"),
]


class Replace:
    """Returned by a mutation that replaces the whole manifest."""

    def __init__(self, value: Any):
        self.value = value


def _mutated(case: Case) -> Any:
    m = copy.deepcopy(base(case.kind)[0])
    out = case.mutate(m)
    return out.value if isinstance(out, Replace) else m


def _paths(case: Case) -> set[str]:
    return {case.path} if isinstance(case.path, str) else set(case.path)


def _check_report(report: ValidationReport, case: Case) -> None:
    paths = {p for p, _ in report.errors}
    assert any(p in _paths(case) and case.fragment in msg for p, msg in report.errors), report.lines()
    if case.exact:
        assert paths == _paths(case), report.lines()


def _check_message(text: str, case: Case) -> None:
    """The one line names the first errors (issue 17: at most a few, then "and N more"); the full
    list is the report's, checked by _check_report."""
    assert "manifest is invalid" in text
    lines = validate_manifest(_mutated(case)).lines()
    for line in lines[:3]:
        assert line in text, text
    if len(lines) > 3:
        assert text.endswith(f"; and {len(lines) - 3} more"), text
    else:
        for p in _paths(case):
            if p:
                assert f"{p}: " in text, text
        assert case.fragment in text, text


def test_bases_are_valid(tmp_path):
    for kind in ("f32", "paged", "assets", "q8"):
        m, s, buf = base(kind)
        assert validate_manifest(m).ok, (kind, validate_manifest(m).lines())
        with open_archive(write(tmp_path, buf, f"{kind}.thin")) as a:
            assert a.verify().ok
        pack(m, s, tmp_path / f"{kind}.packed.thin")
        assert (tmp_path / f"{kind}.packed.thin").read_bytes() == buf


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule(case: Case, tmp_path):
    m = _mutated(case)
    _check_report(validate_manifest(m), case)
    # The reader: the same manifest inside an otherwise valid archive (lengths and hash fixed up).
    _, sources, buf = base(case.kind)
    path = write(tmp_path, with_manifest(buf, canonical(m)))
    with pytest.raises(ThinFormatError) as e:
        open_archive(path)
    _check_message(str(e.value), case)
    assert "\n" not in str(e.value)
    # The packer refuses it before writing anything.
    out = tmp_path / "out.thin"
    with pytest.raises(PackError) as e:
        pack(m, sources, out)
    _check_message(str(e.value), case)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.thin"]


@pytest.mark.parametrize("mutate,kind", [
    (_attn(sliding_window=4, layer_types=["sliding"]), "f32"),
    (_rope(scaling={"type": "linear", "factor": 2.0}), "f32"),
    (_rope(scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}), "f32"),
    (_set("validation", {}), "f32"),
    (_set("validation.quant.token_embd\x00weight", {"rmse": None, "max_abs_err": None, "rel_rmse": None}), "f32"),
    (_set("model.special_tokens", {"bos": None, "eos": [], "pad": 11}), "f32"),
    (_empty_asset, "assets"),
    (_set("runtime", {"anything": [1, {"goes": None}]}), "f32"),
])
def test_valid_variants(mutate, kind):
    """Counterparts of the rules: what the spec allows must pass (a validator that rejects all passes nothing)."""
    m = copy.deepcopy(base(kind)[0])
    mutate(m)
    assert validate_manifest(m).ok, validate_manifest(m).lines()


def test_every_error_is_listed(tmp_path):
    m, sources, buf = base("f32")
    m = copy.deepcopy(m)
    m["format"] = "thin2"
    m["model"]["norm"]["eps"] = 0
    m["tensors"][3]["hints"]["placement"] = "gpu"
    m["pages"][5]["checksum"] = "xyz"
    m["assets"][0]["media_type"] = 7
    m["validation"]["stats"]["nope"] = copy.deepcopy(VALIDATION["stats"]["token_embd.weight"])
    want = ["format", "model.norm.eps", "tensors[3].hints.placement", "assets[0].media_type", "pages[5].checksum",
            "validation.stats.nope"]
    report = validate_manifest(m)
    assert [p for p, _ in report.errors] == want
    for text in (_raises(ThinFormatError, open_archive, write(tmp_path, with_manifest(buf, m))),
                 _raises(PackError, pack, m, sources, tmp_path / "o.thin")):
        assert "(6 errors)" in text and text.endswith("; and 3 more")  # issue 17: a few, then how many more
        for p in want[:3]:
            assert f"{p}: " in text
    assert not (tmp_path / "o.thin").exists()


def _raises(cls, fn, *args) -> str:
    with pytest.raises(cls) as e:
        fn(*args)
    return str(e.value)


@pytest.mark.parametrize("name", [["x"], {"x": 1}])
def test_unhashable_names_do_not_crash(name):
    """Owner names of the wrong type are reported, not turned into a TypeError."""
    m = copy.deepcopy(base("assets")[0])
    t = m["tensors"][1]
    t["name"], t["pages"] = name, ["x#0"]
    m["pages"][1].update(id="x#0", tensor=name)
    a = m["assets"][1]
    a["name"], a["pages"] = name, ["y#0"]
    m["pages"][-1].update(id="y#0", asset=name)
    paths = {p for p, _ in validate_manifest(m).errors}
    assert {"tensors[1].name", "assets[1].name"} <= paths


@pytest.mark.slow
def test_junk_or_missing_anywhere_is_reported_not_raised():
    """Replace each node of a valid manifest by junk, or delete it: validation reports, never raises."""
    m0 = base("q8")[0]

    def walk(node, path):
        yield path
        if isinstance(node, dict):
            for k, v in node.items():
                yield from walk(v, path + [k])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                yield from walk(v, path + [i])

    count = 0
    for path in walk(m0, []):
        if not path:
            continue
        for junk in (None, 7, "s", [], {}, [[1]], {"a": {}}, True, DEL):
            m = copy.deepcopy(m0)
            obj = m
            for k in path[:-1]:
                obj = obj[k]
            if junk is DEL:
                del obj[path[-1]]
            else:
                obj[path[-1]] = junk
            validate_manifest(m)  # must not raise (KeyError, TypeError, …)
            count += 1
    assert count > 1000
