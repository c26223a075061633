"""Manifest structure validation (spec §2): every rule, every error, each with its key path."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from thinconv import strictjson
from thinconv.errors import ThinFormatError, clipped, listed, shown
from thinconv.format import dtypes, schema, spec

_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass
class ValidationReport:
    """All problems found, each as (key path, message). Empty means valid."""

    errors: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def add(self, path: str, message: str) -> None:
        self.errors.append((path, message))

    def lines(self) -> list[str]:
        return [f"{path}: {message}" if path else message for path, message in self.errors]

    def raise_if_invalid(self, what: str = "manifest", cls: type[Exception] = ThinFormatError) -> None:
        if self.errors:
            n = len(self.errors)
            raise cls(f"{what} is invalid ({n} error{'s' * (n > 1)}): " + listed(self.lines(), 3, "; ", None))


def parse_manifest(data: bytes, where: str = "manifest") -> Any:
    """Decode manifest bytes strictly: UTF-8, JSON, no duplicate keys, no NaN/Infinity, no
    overflowing number (thinconv.strictjson)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ThinFormatError(f"{where}: not UTF-8 (byte {e.start})") from None
    return strictjson.loads(text, where, ThinFormatError)


# -- small typed checks; each returns whether the value passed so callers can skip dependents --

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


class _Checker:
    def __init__(self, report: ValidationReport):
        self.r = report

    def obj(self, v: Any, path: str, keys: tuple[str, ...] | None = None, optional: tuple[str, ...] = ()) -> bool:
        if not isinstance(v, dict):
            self.r.add(path, f"expected an object, got {_kind(v)}")
            return False
        if keys is not None:
            for k in keys:
                if k not in v:
                    self.r.add(_join(path, k), "missing")
            for k in sorted(set(v) - set(keys) - set(optional)):
                self.r.add(_join(path, k), "unknown key")
        return True

    def int(self, v: Any, path: str, lo: int | None = None, hi: int | None = None, null: bool = False) -> bool:
        if v is None and null:
            return True
        if not _is_int(v):
            self.r.add(path, f"expected an integer{' or null' * null}, got {_kind(v)}")
            return False
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f"≥ {lo}" if hi is None else f"in [{lo}, {hi}]"
            self.r.add(path, f"expected an integer {rng}, got {v}")
            return False
        return True

    def num(self, v: Any, path: str, positive: bool = False, null: bool = False) -> bool:
        if v is None and null:
            return True
        if not _is_num(v):
            self.r.add(path, f"expected a number{' or null' * null}, got {_kind(v)}")
            return False
        if positive and v <= 0:
            self.r.add(path, f"expected a positive number, got {v}")
            return False
        return True

    def bool(self, v: Any, path: str) -> bool:
        if not isinstance(v, bool):
            self.r.add(path, f"expected true or false, got {_kind(v)}")
            return False
        return True

    def str(self, v: Any, path: str, choices: tuple | None = None, null: bool = False) -> bool:
        if v is None and null:
            return True
        if not isinstance(v, str) or not v:
            self.r.add(path, f"expected a non-empty string{' or null' * null}, got {_kind(v)}")
            return False
        if choices is not None and v not in choices:
            self.r.add(path, f"expected one of {', '.join(map(repr, choices))}, got {shown(v)}")
            return False
        return True

    def eq(self, v: Any, path: str, want: Any) -> bool:
        if type(v) is not type(want) or v != want:
            self.r.add(path, f"expected {json.dumps(want)}, got {_short(v)}")
            return False
        return True

    def list(self, v: Any, path: str) -> bool:
        if not isinstance(v, list):
            self.r.add(path, f"expected a list, got {_kind(v)}")
            return False
        return True


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean {str(v).lower()}"
    if isinstance(v, (int, float)):
        return f"number {v}"
    if isinstance(v, str):
        return f"string {_short(v)}"
    return {dict: "an object", list: "a list"}.get(type(v), type(v).__name__)


def _short(v: Any) -> str:
    try:
        s = json.dumps(v, ensure_ascii=False, default=str)
    except RecursionError:  # parse_manifest accepts nesting up to about the recursion limit
        return "a deeply nested value"
    return clipped(s, 60)


# -- the manifest sections --

def _check_model(c: _Checker, m: Any) -> bool:
    """`model` against its schema (format/schema.py), then the rules between keys. Returns whether
    tensors can be checked against it: nothing under `model` was reported."""
    before = len(c.r.errors)
    if c.obj(m, "model"):
        _check_object(c, m, m, "", "model")
        _check_model_rules(c, m)
    return len(c.r.errors) == before


def _check_object(c: _Checker, model: dict, node: dict, parent: str, where: str) -> None:
    """One object of the schema: required keys present, no unknown key, each key's value."""
    keys = schema.children(parent)
    for k in keys:
        if k.name not in node and not k.optional:
            c.r.add(_join(where, k.name), "missing")
    for extra in sorted(set(node) - {k.name for k in keys}):
        c.r.add(_join(where, extra), "unknown key")
    for k in keys:
        if k.name in node:
            _check_key(c, model, k, node[k.name], _join(where, k.name))


def _check_key(c: _Checker, model: dict, key: schema.Key, v: Any, path: str) -> None:
    before = len(c.r.errors)
    if key.type == "object":
        if not (v is None and key.nullable) and c.obj(v, path):
            _check_object(c, model, v, key.path, path)
    elif key.type == "str":
        c.str(v, path, key.choices or None, null=key.nullable)
    elif key.type == "int":
        c.int(v, path, lo=key.minimum, null=key.nullable)
    elif key.type == "number":
        c.num(v, path, positive=key.positive, null=key.nullable)
    elif key.type == "bool":
        c.bool(v, path)
    elif key.type in ("layers", "layer_flags"):
        _check_layers(c, model, key, v, path)
    elif key.type in ("token", "tokens"):
        vocab = model.get("vocab_size") if _is_int(model.get("vocab_size")) else None
        hi = vocab - 1 if vocab else None
        if key.type == "token":
            c.int(v, path, lo=0, hi=hi, null=key.nullable)
        elif c.list(v, path):
            for i, t in enumerate(v):
                c.int(t, f"{path}[{i}]", lo=0, hi=hi)
    elif key.type == "scaling":
        _check_scaling(c, v, path)
    else:  # a schema row this validator does not know how to check
        raise AssertionError(f"schema key {key.path}: unknown type {key.type!r}")
    if len(c.r.errors) == before and schema.is_default(key, v):
        c.r.add(path, f"is the default ({_short(v)}): a writer omits it")


def _check_layers(c: _Checker, model: dict, key: schema.Key, v: Any, path: str) -> None:
    """A list with one entry per layer: strings among `choices`, or booleans."""
    if not c.list(v, path):
        return
    n = model.get("num_layers")
    if _is_int(n) and n >= 1 and len(v) != n:
        c.r.add(path, f"has {len(v)} entries, expected num_layers = {n}")
    # No key path built per entry (there may be 10^6): the first few that fail are reported.
    bad = [i for i, x in enumerate(v) if not (x in key.choices if key.choices else isinstance(x, bool))]
    for i in bad[:3]:
        c.str(v[i], f"{path}[{i}]", key.choices) if key.choices else c.bool(v[i], f"{path}[{i}]")
    if len(bad) > 3:
        c.r.add(path, f"{len(bad) - 3} more entries like these")


def _check_scaling(c: _Checker, sc: Any, path: str) -> None:
    """rope.scaling: null, or the source's parameters with the kind in `type` (never "default")."""
    if sc is None or not c.obj(sc, path):
        return
    if c.str(sc.get("type"), f"{path}.type") and sc["type"] == "default":
        c.r.add(f"{path}.type", "'default' scaling must be written as scaling: null")
    for k in ("rope_theta", "rope_type"):
        if k in sc:
            c.r.add(f"{path}.{k}", "must not be repeated inside scaling")


def _check_model_rules(c: _Checker, m: dict) -> None:
    """Rules between keys (each checked only when the keys it reads are themselves valid)."""
    for rule in (_dims_rules, _rope_rules, _window_rules, _variant_rules, _moe_rules):
        rule(c, m)


def _obj(m: dict, key: str) -> dict:
    return m.get(key) if isinstance(m.get(key), dict) else {}


def _dims_rules(c: _Checker, m: dict) -> None:
    heads, kv = m.get("num_attention_heads"), m.get("num_kv_heads")
    if _is_int(heads) and _is_int(kv) and heads >= 1 and kv >= 1 and heads % kv:
        c.r.add("model.num_kv_heads", f"{kv} does not divide num_attention_heads {heads}")


def _rope_rules(c: _Checker, m: dict) -> None:
    rd, head_dim = _obj(m, "rope").get("rotary_dim"), m.get("head_dim")
    if _is_int(rd) and rd >= 2:
        if rd % 2:
            c.r.add("model.rope.rotary_dim", f"must be even, got {rd}")
        if _is_int(head_dim) and head_dim >= 1 and rd > head_dim:
            c.r.add("model.rope.rotary_dim", f"{rd} exceeds head_dim {head_dim}")
    types = _obj(m, "attention").get("layer_types")
    if isinstance(_obj(m, "rope").get("sliding"), dict) and isinstance(types, list) and "sliding" not in types:
        c.r.add("model.rope.sliding", "no layer is 'sliding' (omit it)")


def _window_rules(c: _Checker, m: dict) -> None:
    att = _obj(m, "attention")
    window, types = att.get("sliding_window"), att.get("layer_types")
    if window is None and "sliding_window" in att and isinstance(types, list):
        for i, t in enumerate(types):
            if t == "sliding":
                c.r.add(f"model.attention.layer_types[{i}]", "is 'sliding' but sliding_window is null")


def _variant_rules(c: _Checker, m: dict) -> None:
    """Keys that only mean something next to another key's value."""
    norm, block, att = _obj(m, "norm"), _obj(m, "block"), _obj(m, "attention")
    if norm.get("bias") is True and norm.get("type") != "layernorm":
        c.r.add("model.norm.bias", "norm biases need norm.type 'layernorm'")
    if block.get("shared_norm") is True:
        if block.get("residual") != "parallel":
            c.r.add("model.block.shared_norm", "needs block.residual 'parallel'")
        if block.get("pre_norm") is False:
            c.r.add("model.block.shared_norm", "a shared norm needs block.pre_norm (there is no norm to share)")
    for key in ("qk_norm_weights", "qk_norm_scope"):
        if key in att and att.get("qk_norm") is False:
            c.r.add(f"model.attention.{key}", "needs attention.qk_norm true")
    if att.get("qk_norm_weights") == "per_head" and att.get("qk_norm_scope") == "full":
        c.r.add("model.attention.qk_norm_weights", "per_head weights and a full-width scope exclude each other")


def _moe_rules(c: _Checker, m: dict) -> None:
    moe = _obj(m, "moe")
    e, k = moe.get("num_experts"), moe.get("num_experts_per_tok")
    if _is_int(e) and _is_int(k) and e >= 1 and k > e:
        c.r.add("model.moe.num_experts_per_tok", f"{k} exceeds num_experts {e}")
    layers = moe.get("layers")
    if isinstance(layers, list) and layers and not any(x is True for x in layers):
        c.r.add("model.moe.layers", "no layer is sparse (omit moe)")


def _check_tensor(c: _Checker, t: Any, path: str, model: dict | None) -> None:
    keys = ("name", "role", "layer", "source", "shape", "dtype", "quant", "hints", "pages")
    if not c.obj(t, path, keys):
        return
    name = t.get("name")
    role = None  # the role the name implies: the one the shape is checked against
    if c.str(name, f"{path}.name"):
        role, layer = spec.split_name(name)
        if t.get("role") != role:
            c.r.add(f"{path}.role", f"expected {shown(role)} for tensor {shown(name)}, got {_short(t.get('role'))}")
        elif role not in spec.ROLES:
            c.r.add(f"{path}.role", f"unknown role {shown(role)}")
        got_layer = t.get("layer")
        # `layer` is a JSON integer or null: 1.0 or true must not pass for 1.
        if got_layer != layer or not (got_layer is None or _is_int(got_layer)):
            c.r.add(f"{path}.layer", f"expected {json.dumps(layer)} for tensor {shown(name)}, got {_short(t.get('layer'))}")
    src = t.get("source")
    if c.list(src, f"{path}.source"):
        for i, s in enumerate(src):
            c.str(s, f"{path}.source[{i}]")
        if name == "rope_freqs" and src:
            c.r.add(f"{path}.source", "rope_freqs is derived: expected []")
    shape = t.get("shape")
    shape_ok = c.list(shape, f"{path}.shape") and _shape_ok(shape)
    if isinstance(shape, list) and not shape_ok:
        c.r.add(f"{path}.shape", f"expected 1 to 3 positive integers, got {_short(shape)}")
    dtype = t.get("dtype")
    dtype_ok = c.str(dtype, f"{path}.dtype", dtypes.ARCHIVE_DTYPES)
    if shape_ok and dtype_ok:
        if len(shape) == 1 and dtype != "f32":
            c.r.add(f"{path}.dtype", f"1-D tensors are f32, got {dtype!r}")
        elif role in spec.ROLE and spec.ROLE[role].f32 and dtype != "f32":
            c.r.add(f"{path}.dtype", f"{role} (a router) is f32, got {dtype!r}")
        if dtypes.is_block(dtype) and shape[-1] % dtypes.BLOCK_SIZE:
            c.r.add(f"{path}.dtype", f"{dtype} needs cols % 32 == 0, got {shape[-1]} cols")
        if model is not None and role in spec.ROLES:
            want = spec.expected_shape(model, role)
            if shape != want:
                c.r.add(f"{path}.shape", f"expected {want} from model dimensions, got {shape}")
    quant = t.get("quant")
    if dtype_ok and dtypes.is_block(dtype):
        if c.obj(quant, f"{path}.quant", ("scheme", "block_size", "block_bytes", "source_dtype")):
            c.eq(quant.get("scheme"), f"{path}.quant.scheme", dtype)
            c.eq(quant.get("block_size"), f"{path}.quant.block_size", dtypes.BLOCK_SIZE)
            c.eq(quant.get("block_bytes"), f"{path}.quant.block_bytes", dtypes.get(dtype).nbytes)
            c.str(quant.get("source_dtype"), f"{path}.quant.source_dtype", dtypes.QUANT_SOURCE_DTYPES)
    elif quant is not None:
        c.r.add(f"{path}.quant", f"must be null for dtype {_short(dtype)}")
    hints = t.get("hints")
    if c.obj(hints, f"{path}.hints", ("placement", "access")):
        c.str(hints.get("placement"), f"{path}.hints.placement", spec.PLACEMENTS)
        c.str(hints.get("access"), f"{path}.hints.access", spec.ACCESSES)
    pages = t.get("pages")
    if c.list(pages, f"{path}.pages"):
        if not pages:
            c.r.add(f"{path}.pages", "a tensor has at least one page")
        if isinstance(name, str):
            for k, pid in enumerate(pages):
                c.eq(pid, f"{path}.pages[{k}]", spec.page_id(name, k))
        if shape_ok and len(shape) == 1 and len(pages) > 1:
            c.r.add(f"{path}.pages", f"1-D tensors are one page, got {len(pages)}")


def _shape_ok(shape: Any) -> bool:
    return isinstance(shape, list) and 1 <= len(shape) <= 3 and all(_is_int(d) and d >= 1 for d in shape)


def _check_asset(c: _Checker, a: Any, path: str) -> None:
    if not c.obj(a, path, ("name", "media_type", "size", "pages")):
        return
    name = a.get("name")
    if c.str(name, f"{path}.name", spec.ASSET_NAMES):
        if c.list(a.get("pages"), f"{path}.pages"):
            for k, pid in enumerate(a["pages"]):
                c.eq(pid, f"{path}.pages[{k}]", spec.page_id(name, k))
    c.str(a.get("media_type"), f"{path}.media_type")
    c.int(a.get("size"), f"{path}.size", lo=0)


def _check_pages(c: _Checker, m: dict) -> None:
    """pages[]: one owner each, decode order, rows tiling dim 0, sizes = rows × row bytes."""
    pages = m.get("pages")
    if not c.list(pages, "pages"):
        return
    tensors = [t for t in m.get("tensors", []) if isinstance(t, dict)] if isinstance(m.get("tensors"), list) else []
    assets = [a for a in m.get("assets", []) if isinstance(a, dict)] if isinstance(m.get("assets"), list) else []
    # Expected page order: each tensor's pages in tensors[] order, then each asset's.
    owners: list[tuple[str, str, dict]] = []
    for t in tensors:
        if isinstance(t.get("pages"), list):
            owners += [("tensor", pid, t) for pid in t["pages"]]
    for a in assets:
        if isinstance(a.get("pages"), list):
            owners += [("asset", pid, a) for pid in a["pages"]]
    seen: set = set()
    row_cursor: dict[str, int] = {}
    asset_bytes: dict[str, int] = {}
    for i, pg in enumerate(pages):
        path = f"pages[{i}]"
        if not c.obj(pg, path, ("id", "size", "checksum"), optional=("tensor", "asset", "rows")):
            continue
        pid = pg.get("id")
        if c.str(pid, f"{path}.id") and not spec.ID_PATTERN.fullmatch(pid):
            c.r.add(f"{path}.id", f"{shown(pid)} must be 1-255 characters of [A-Za-z0-9._#:/-]")
        if isinstance(pid, str):
            if pid in seen:
                c.r.add(f"{path}.id", f"duplicate page id {shown(pid)}")
            seen.add(pid)
        size_ok = c.int(pg.get("size"), f"{path}.size", lo=1)
        cs = pg.get("checksum")
        if not (isinstance(cs, str) and _HEX64.fullmatch(cs)):
            c.r.add(f"{path}.checksum", f"expected 64 lowercase hex digits, got {_short(cs)}")
        kinds = [k for k in ("tensor", "asset") if k in pg]
        if len(kinds) != 1:
            c.r.add(path, f"needs exactly one of 'tensor' / 'asset', got {kinds or 'neither'}")
            continue
        kind = kinds[0]
        if i >= len(owners):
            c.r.add(f"{path}.id", f"{_short(pid)} is owned by no tensor or asset")
            continue
        want_kind, want_id, owner = owners[i]
        if pid != want_id or kind != want_kind or pg.get(kind) != owner.get("name"):
            c.r.add(path, f"expected page {shown(want_id)} of {want_kind} {shown(owner.get('name'))} here (decode order), "
                          f"got {_short(pid)} of {kind} {_short(pg.get(kind))}")
            continue
        if not isinstance(owner.get("name"), str):
            continue  # the owner's bad name is reported with the owner; it cannot key the tallies below
        if kind == "asset":
            if "rows" in pg:
                c.r.add(f"{path}.rows", "asset pages have no rows")
            if size_ok:
                asset_bytes[owner["name"]] = asset_bytes.get(owner["name"], 0) + pg["size"]
            continue
        _check_tensor_page(c, pg, path, owner, row_cursor, size_ok)
    if len(pages) < len(owners):
        for _, pid, owner in owners[len(pages):]:
            c.r.add("pages", f"page {shown(pid)} of {shown(owner.get('name'))} is not listed")
    if not pages:
        c.r.add("pages", "an archive has at least one page")
    for t in tensors:
        shape, name = t.get("shape"), t.get("name")
        if isinstance(name, str) and name in row_cursor and _shape_ok(shape) and \
                row_cursor[name] != spec.rows_and_cols(shape)[0]:
            c.r.add(f"tensor {name[:80]}", f"pages cover rows [0, {row_cursor[name]}), "
                                      f"expected [0, {spec.rows_and_cols(shape)[0]})")
    for a in assets:
        if isinstance(a.get("name"), str) and (a["name"] in asset_bytes or a.get("pages") == []):
            got = asset_bytes.get(a.get("name"), 0)
            if _is_int(a.get("size")) and got != a["size"]:
                c.r.add(f"asset {a['name'][:80]}", f"pages hold {got} bytes, size says {a['size']}")


def _check_tensor_page(c: _Checker, pg: dict, path: str, t: dict, row_cursor: dict, size_ok: bool) -> None:
    rows = pg.get("rows")
    name = t.get("name")
    if not (isinstance(rows, list) and len(rows) == 2 and all(_is_int(r) for r in rows)):
        c.r.add(f"{path}.rows", f"expected [start, end), got {_short(rows)}")
        return
    start, end = rows
    expected_start = row_cursor.get(name, 0)
    if start != expected_start or end <= start:
        c.r.add(f"{path}.rows", f"expected rows starting at {expected_start} with end > start, got {rows}")
        if end > start:
            row_cursor[name] = end  # resync, so one gap or overlap is one error, not one per later page
        return
    row_cursor[name] = end
    shape, dtype = t.get("shape"), t.get("dtype")
    # An invalid shape or dtype is reported with the tensor; sizes cannot be derived from it.
    if not _shape_ok(shape) or dtype not in dtypes.ARCHIVE_DTYPES:
        return
    n_rows, cols = spec.rows_and_cols(shape)
    if end > n_rows:
        c.r.add(f"{path}.rows", f"end {end} is past dim 0 = {n_rows} of {shown(name)}")
        return
    if len(shape) == 3 and start // shape[1] != (end - 1) // shape[1]:
        c.r.add(f"{path}.rows", f"{rows} straddles experts {start // shape[1]} and {(end - 1) // shape[1]} "
                                f"({shape[1]} rows each): a page never holds rows of two experts")
    if dtypes.is_block(dtype) and cols % dtypes.BLOCK_SIZE:
        return
    want = (end - start) * dtypes.row_bytes(dtype, cols)
    if size_ok and pg["size"] != want:
        c.r.add(f"{path}.size", f"expected {want} ({end - start} rows × {dtypes.row_bytes(dtype, cols)} bytes), got {pg['size']}")


def _check_validation(c: _Checker, v: Any, names: set[str]) -> None:
    p = "validation"
    if not c.obj(v, p, (), optional=("converter", "source", "stats", "quant", "probe", "lossy")):
        return
    # Sections may be absent, but a present one has its type: readers (e.g. summarize) rely on it.
    conv = v.get("converter")
    if "converter" in v and c.obj(conv, f"{p}.converter", ("name", "version", "recipe"), optional=("options",)):
        for k in ("name", "version", "recipe"):
            c.str(conv.get(k), f"{p}.converter.{k}")
        if "options" in conv:
            c.obj(conv["options"], f"{p}.converter.options")  # free-form: the converter's own settings
    src = v.get("source")
    if "source" in v and c.obj(src, f"{p}.source", ("repo_id", "revision", "commit", "files"),
                               optional=("quantization",)):
        if "quantization" in src:  # the source checkpoint's own quantization (thinconv: block fp8)
            c.obj(src["quantization"], f"{p}.source.quantization")
        for k in ("repo_id", "revision", "commit"):
            c.str(src.get(k), f"{p}.source.{k}", null=True)
        if c.list(src.get("files"), f"{p}.source.files"):
            for i, f in enumerate(src["files"]):
                fp = f"{p}.source.files[{i}]"
                if c.obj(f, fp, ("name", "size", "sha256")):
                    c.str(f.get("name"), f"{fp}.name")
                    c.int(f.get("size"), f"{fp}.size", lo=0)
                    sha = f.get("sha256")
                    if sha is not None and not (isinstance(sha, str) and _HEX64.fullmatch(sha)):
                        c.r.add(f"{fp}.sha256", f"expected 64 lowercase hex digits or null, got {_short(sha)}")
    for section, fields, counts in (("stats", ("min", "max", "mean", "std"), ("nan", "inf")),
                                    ("quant", ("rmse", "max_abs_err", "rel_rmse"), ())):
        table = v.get(section)
        if section not in v or not c.obj(table, f"{p}.{section}"):
            continue
        for name, entry in table.items():
            ep = f"{p}.{section}.{name}"
            if name not in names:
                c.r.add(ep, "names no tensor of this archive")
            if c.obj(entry, ep, fields + counts, optional=("note",) if section == "quant" else ()):
                for k in fields:
                    c.num(entry.get(k), f"{ep}.{k}", null=True)
                for k in counts:
                    c.int(entry.get(k), f"{ep}.{k}", lo=0)
    if "probe" in v:
        c.obj(v["probe"], f"{p}.probe")
    if "lossy" in v and c.obj(v["lossy"], f"{p}.lossy"):  # tensor → what the converter changed in its values
        for name, why in v["lossy"].items():
            if name not in names:
                c.r.add(f"{p}.lossy.{name}", "names no tensor of this archive")
            c.str(why, f"{p}.lossy.{name}")


def validate_model(model: Any) -> ValidationReport:
    """Check a `model` section alone against the schema and the rules between its keys."""
    report = ValidationReport()
    _check_model(_Checker(report), model)
    return report


def validate_manifest(m: Any) -> ValidationReport:
    """Check a decoded manifest against the spec's structure rules; report every error found."""
    report = ValidationReport()
    c = _Checker(report)
    if not c.obj(m, "", spec.TOP_LEVEL_KEYS):
        return report
    c.eq(m.get("format"), "format", "thin")
    c.eq(m.get("format_version"), "format_version", spec.VERSION)
    c.eq(m.get("alignment"), "alignment", spec.ALIGNMENT)
    model_ok = _check_model(c, m.get("model"))
    model = m["model"] if model_ok else None
    c.obj(m.get("runtime"), "runtime")

    tensors = m.get("tensors")
    names: set[str] = set()
    if c.list(tensors, "tensors"):
        for i, t in enumerate(tensors):
            _check_tensor(c, t, f"tensors[{i}]", model)
        got = [t.get("name") for t in tensors if isinstance(t, dict)]
        names = {n for n in got if isinstance(n, str)}
        dup = sorted(n for n, k in Counter(n for n in got if isinstance(n, str)).items() if k > 1)
        if dup:
            report.add("tensors", f"duplicate tensor names: {listed(dup)}")
        if model is not None:
            _check_tensor_set(c, got, model)

    assets = m.get("assets")
    if c.list(assets, "assets"):
        for i, a in enumerate(assets):
            _check_asset(c, a, f"assets[{i}]")
        anames = [a.get("name") for a in assets if isinstance(a, dict)]
        if "config.json" not in anames:
            report.add("assets", "config.json is required")
        if len(set(map(str, anames))) != len(anames):
            report.add("assets", "duplicate asset names")
    _check_pages(c, m)
    _check_validation(c, m.get("validation"), names)
    return report


def _check_tensor_set(c: _Checker, got: list, model: dict) -> None:
    if model["num_layers"] > len(got):  # each layer has tensors: refused before naming them per layer
        c.r.add("model.num_layers", f"is {model['num_layers']}, but the manifest lists only {len(got)} tensors")
        return
    want = spec.tensor_names(model)
    if got == want:
        return
    got_set, want_set = set(map(str, got)), set(want)  # sets: a manifest may list ~10^5 tensors
    missing = [n for n in want if n not in got_set]
    extra = [n for n in got if str(n) not in want_set]
    if missing:
        c.r.add("tensors", f"missing for this model's flags: {listed(missing, 4)}")
    if extra:
        c.r.add("tensors", f"not expected for this model's flags: {listed(extra, 4)}")
    if not missing and not extra:
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)  # None: a duplicate
        c.r.add(f"tensors[{first}]", f"out of decode order: expected {want[first]!r}, got {_short(got[first])}") \
            if first is not None else c.r.add("tensors", f"lists {len(got)} tensors, this model has {len(want)}")
