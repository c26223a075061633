"""What the commands report, as plain data: `inspect`'s summary of an archive, `convert`'s summary
of a conversion (the CLI renders them; `--json` prints them; `thinconv.convert` returns the
latter). One vocabulary of keys (README, "JSON output"): `path`, `size` (a file's size in
bytes), `archive_hash` (64 hex digits), `page_count`, `tensor_count`, `quant` (the quantization
summary, or null), `warnings`, `seconds`.

Only the format core is imported here (no numpy): `inspect` stays quick to start.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Any, Optional, TypedDict

from thinconv.format import dtypes, schema, spec
from thinconv.format.reader import Archive


class QuantSummary(TypedDict):
    """The quantization summary (`quant`) of `convert --json`, `inspect --json` and `thinconv.convert`."""

    tensors: int  # quantized tensors with an error figure
    rel_rmse: float  # parameter-weighted mean rel_rmse over them
    worst: str  # the tensor with the largest rel_rmse
    largest: list[dict]  # the (up to 5) largest: {"tensor", "rel_rmse", "rmse", "max_abs_err"}, worst first


class KeptWider(TypedDict):
    """A tensor stored in a wider dtype than the conversion asked for, and why."""

    tensor: str
    dtype: str  # what it is stored as
    asked: str  # what --dtype / --keep asked for it
    reason: str


class SourceSummary(TypedDict):
    """Where a conversion's checkpoint came from (validation.source, without the file list)."""

    repo_id: Optional[str]  # null for a local folder
    revision: Optional[str]
    commit: Optional[str]


class UserRecipe(TypedDict):
    """The user recipe (--recipes DIR, $THINCONV_RECIPES) a conversion ran, and what it shadows."""

    name: str
    path: str  # the recipe file
    sha256: str  # of that file (recorded in validation.converter.options.recipe_files)
    shadows: list[str]  # e.g. "the built-in recipe llama"; [] when it stands in for none


class ConvertSummary(TypedDict):
    """What `thinconv convert --json` prints and `thinconv.convert()` returns."""

    path: str
    size: int
    archive_hash: str
    page_count: int
    tensor_count: int
    dtypes: dict[str, int]  # stored dtype → number of tensors
    recipe: str
    source: SourceSummary
    seconds: float
    kept_wider: list[KeptWider]
    quant: Optional[QuantSummary]
    warnings: list[str]
    removed_temp_files: list[str]  # stale temp files of this output a killed earlier run left, removed
    user_recipe: Optional[UserRecipe]  # null for a built-in recipe


def quant_summary(manifest: dict, worst: int = 5) -> Optional[QuantSummary]:
    """The quantization summary of a manifest, or None when no tensor was quantized."""
    q = {n: v for n, v in manifest["validation"].get("quant", {}).items() if v.get("rel_rmse") is not None}
    if not q:
        return None
    sizes = {t["name"]: math.prod(t["shape"]) for t in manifest["tensors"]}
    total = sum(sizes.get(n, 0) for n in q) or 1
    ranked = sorted(q, key=lambda n: -q[n]["rel_rmse"])
    return {"tensors": len(q), "rel_rmse": sum(v["rel_rmse"] * sizes.get(n, 0) for n, v in q.items()) / total,
            "worst": ranked[0],
            "largest": [{"tensor": n, **{k: q[n].get(k) for k in ("rel_rmse", "rmse", "max_abs_err")}}
                        for n in ranked[:worst]]}


def _with_defaults(model: dict, parent: str) -> Any:
    """model[parent] with every optional key at its default (schema), or None for an absent
    nullable object (moe, rope.sliding)."""
    key = schema.BY_PATH[parent]
    node = schema.value(model, parent)
    if node is None:
        return None
    out = {}
    for child in schema.children(parent):
        if child.type == "object":
            out[child.name] = _with_defaults(model, child.path)
        elif child.type not in ("layers", "layer_flags"):
            out[child.name] = schema.value(model, child.path)
        elif child.name in node:
            out[child.name] = node[child.name]
    return out if key.type == "object" else node


def summarize(archive: Archive, *, with_tensors: bool = False, worst: int = 5) -> dict:
    """A JSON-ready summary of an opened archive (what `inspect --json` prints)."""
    m = archive.manifest
    sizes = {p["id"]: p["size"] for p in m["pages"]}
    model = m["model"]
    by_role: dict[tuple[str, str], dict] = defaultdict(lambda: {"count": 0, "bytes": 0})
    by_dtype: dict[str, dict] = defaultdict(lambda: {"count": 0, "bytes": 0})
    tensors = []
    for t in m["tensors"]:
        nbytes = sum(sizes[pid] for pid in t["pages"])
        for key, table in (((t["role"], t["dtype"]), by_role), (t["dtype"], by_dtype)):
            table[key]["count"] += 1
            table[key]["bytes"] += nbytes
        if with_tensors:
            tensors.append({"name": t["name"], "dtype": t["dtype"], "shape": t["shape"], "bytes": nbytes,
                            "pages": len(t["pages"]), "source": t["source"]})
    validation = m["validation"]
    src = validation.get("source", {})
    files = src.get("files", [])
    out = {
        "path": str(archive.path),
        "size": archive.file_size,
        "archive_hash": archive.header.archive_hash.hex(),
        "format_version": m["format_version"],
        "page_count": len(m["pages"]),
        "model": {k: model[k] for k in ("architecture", "source_architecture", "hidden_size", "num_layers",
                                        "num_attention_heads", "num_kv_heads", "head_dim", "vocab_size",
                                        "intermediate_size", "max_position_embeddings", "tie_word_embeddings")},
        "rope": model["rope"],
        "attention": {k: v for k, v in model["attention"].items() if k != "layer_types"},
        "norm": _with_defaults(model, "norm"),
        "mlp": _with_defaults(model, "mlp"),
        "block": _with_defaults(model, "block"),
        "embedding": _with_defaults(model, "embedding"),
        "logits": _with_defaults(model, "logits"),
        "moe": _with_defaults(model, "moe"),
        "layers": _layer_counts(model),
        "special_tokens": model["special_tokens"],
        "tensor_count": len(m["tensors"]),
        "tensor_bytes": sum(v["bytes"] for v in by_dtype.values()),
        "by_role": [{"role": r, "dtype": d, **v} for (r, d), v in by_role.items()],
        "by_dtype": [{"dtype": d, **v} for d, v in by_dtype.items()],
        "assets": [{"name": a["name"], "size": a["size"]} for a in m["assets"]],
        "converter": validation.get("converter"),
        "source": {k: v for k, v in src.items() if k != "files"} or None,
        "source_files": {"count": len(files), "sha256": sum(f.get("sha256") is not None for f in files)}
        if "source" in validation else None,
        "quant": quant_summary(m, worst),
    }
    if with_tensors:
        out["tensors"] = tensors
    return out


def _layer_counts(model: dict) -> dict:
    """How many layers are sliding, have RoPE, and are sparse (MoE): per-layer lists as counts."""
    n = model["num_layers"]
    kinds = model["attention"].get("layer_types") or ["full"] * n
    moe = model.get("moe")
    return {"total": n, "sliding": sum(k == "sliding" for k in kinds),
            "rope": sum(bool(x) for x in schema.value(model, "rope.layers")),
            "sparse": sum(bool(x) for x in moe["layers"]) if moe else 0}


def source_label(source: Optional[dict]) -> str:
    """`org/name v1 @ <commit>` for a hub source (the commit whole), `a local folder` otherwise."""
    source = source or {}
    repo, rev, commit = source.get("repo_id"), source.get("revision"), source.get("commit")
    if not repo:
        return "a local folder"
    if commit and rev and rev != commit:
        return f"{repo} {rev} @ {commit}"
    return f"{repo} @ {commit}" if commit else (f"{repo} {rev}" if rev else repo)


# ---------------------------------------------------------------- conversion

_BITS = {d: dtypes.get(d).nbytes * 8 / dtypes.get(d).block_size for d in dtypes.ARCHIVE_DTYPES}


def _natural(source_dtype: str) -> str:
    """What `--dtype auto` stores a source dtype as (as plan._choose_dtype)."""
    if source_dtype in dtypes.FLOAT_DTYPES:
        return source_dtype
    return "f32" if source_dtype == "f64" else "bf16"


def kept_wider(plan) -> list[KeptWider]:
    """Every tensor a plan stores in a wider dtype than asked (by --dtype, or a --keep rule that
    matches it), with the reason: 1-D tensors and routers stay f32, a recipe does not quantize the
    role, the output head is never below q8_0, a recipe's own keep rule, or rows that do not split
    into 32-value blocks."""
    o = plan.options
    recipe = plan.recipe
    head = "token_embd.weight" if plan.model["tie_word_embeddings"] else "output.weight"
    out: list[KeptWider] = []
    for tp in plan.tensors:
        asked = o.dtype
        user_keep = None
        for glob, kept in o.keep:
            if re.fullmatch(_glob_re(glob), tp.role):
                asked, user_keep = kept, glob
        if asked == "auto":
            asked = _natural(tp.source_dtype)
        if asked == tp.dtype or _BITS[tp.dtype] <= _BITS.get(asked, 0):
            continue
        if len(tp.shape) == 1:
            reason = "1-D tensors (norms, biases, rope tables) are always stored f32"
        elif spec.ROLE[tp.role].f32:
            reason = f"{tp.role} is always stored f32"
        elif tp.note:
            reason = tp.note
        elif dtypes.is_block(asked) and not recipe.is_quantizable(tp.role):
            reason = f"recipe {recipe.name} does not quantize {tp.role}"
        elif tp.role == head and asked in ("q4_0", "q4_1") and tp.dtype == "q8_0" and user_keep is None:
            reason = "the output head is never stored below q8_0"
        else:
            rule = next((f"{g}={k}" for g, k in reversed(recipe.keep)
                         if k == tp.dtype and re.fullmatch(_glob_re(g), tp.role)), None)
            reason = f"recipe {recipe.name} keeps {rule}" if rule else f"stored {tp.dtype} by the recipe"
        out.append({"tensor": tp.name, "dtype": tp.dtype, "asked": asked, "reason": reason})
    return out


def _glob_re(glob: str) -> str:
    import fnmatch

    return fnmatch.translate(glob)


def conversion_summary(result, plan, seconds: Optional[float] = None) -> ConvertSummary:
    """The summary of a finished conversion: what `convert --json` prints and `thinconv.convert`
    returns (`result` a ConvertResult, `plan` the Plan it ran; `seconds` defaults to the result's)."""
    m = result.manifest
    counts: dict[str, int] = {}
    for t in m["tensors"]:
        counts[t["dtype"]] = counts.get(t["dtype"], 0) + 1
    src = m["validation"].get("source", {})
    return {"path": str(result.path), "size": result.size, "archive_hash": result.archive_hash,
            "page_count": result.page_count, "tensor_count": len(m["tensors"]), "dtypes": counts,
            "recipe": plan.recipe.name,
            "source": {"repo_id": src.get("repo_id"), "revision": src.get("revision"), "commit": src.get("commit")},
            "seconds": round(result.seconds if seconds is None else seconds, 3),
            "kept_wider": kept_wider(plan), "quant": quant_summary(m), "warnings": list(result.warnings),
            "removed_temp_files": [str(p) for p in result.removed_temps], "user_recipe": user_recipe(plan.recipe)}


def user_recipe(recipe) -> Optional[UserRecipe]:
    """What `convert` says about a user recipe (None for a built-in one, even when a user file
    overrides a recipe it extends: that is stated for the file's own recipe, and recorded)."""
    if not recipe.user:
        return None
    return {"name": recipe.name, "path": recipe.path, "sha256": recipe.files[0][2], "shadows": list(recipe.shadows)}


def compact_names(names: list[str]) -> str:
    """Tensor names with their layers folded: `blk.{0-31}.attn_norm.weight, output_norm.weight`
    (every name is still there: the layer set is spelled out)."""
    groups: dict[str, list[int]] = {}
    order: list[str] = []
    for n in names:
        mm = re.fullmatch(r"blk\.(\d+)\.(.+)", n)
        key, layer = (mm.group(2), int(mm.group(1))) if mm else (n, -1)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(layer)
    parts = []
    for key in order:
        layers = sorted(groups[key])
        if layers == [-1]:
            parts.append(key)
        elif len(layers) == 1:
            parts.append(f"blk.{layers[0]}.{key}")
        else:
            parts.append(f"blk.{{{_ranges(layers)}}}.{key}")
    return ", ".join(parts)


def _ranges(xs: list[int]) -> str:
    out, start = [], xs[0]
    for a, b in zip(xs, xs[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)
