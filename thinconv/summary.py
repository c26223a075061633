"""What `thinconv inspect` shows, as plain data (the CLI renders it; `--json` prints it)."""

from __future__ import annotations

from collections import defaultdict

from thinconv.format.reader import Archive


def summarize(archive: Archive, *, with_tensors: bool = False, worst: int = 5) -> dict:
    """A JSON-ready summary of an opened archive."""
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
    quant = validation.get("quant", {})
    out = {
        "path": str(archive.path),
        "file_size": archive.file_size,
        "archive_hash": archive.header.archive_hash.hex(),
        "format_version": m["format_version"],
        "page_count": len(m["pages"]),
        "model": {k: model[k] for k in ("architecture", "source_architecture", "hidden_size", "num_layers",
                                        "num_attention_heads", "num_kv_heads", "head_dim", "vocab_size",
                                        "intermediate_size", "max_position_embeddings", "tie_word_embeddings")},
        "rope": model["rope"],
        "attention": {k: v for k, v in model["attention"].items() if k != "layer_types"},
        "special_tokens": model["special_tokens"],
        "tensor_count": len(m["tensors"]),
        "tensor_bytes": sum(v["bytes"] for v in by_dtype.values()),
        "by_role": [{"role": r, "dtype": d, **v} for (r, d), v in by_role.items()],
        "by_dtype": [{"dtype": d, **v} for d, v in by_dtype.items()],
        "assets": [{"name": a["name"], "size": a["size"]} for a in m["assets"]],
        "converter": validation.get("converter"),
        "source": {k: v for k, v in validation.get("source", {}).items() if k != "files"} or None,
        "quant_worst": sorted(({"tensor": n, **q} for n, q in quant.items() if q.get("rel_rmse") is not None),
                              key=lambda q: -q["rel_rmse"])[:worst],
    }
    if with_tensors:
        out["tensors"] = tensors
    return out
