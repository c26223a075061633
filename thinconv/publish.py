"""Publishing archives to the Hugging Face Hub, with a generated model card.

The card (README.md) has YAML front matter the Hub reads — `base_model` (the source repo id),
`base_model_relation: quantized` for block-quantized archives, `library_name: thinconv`, `tags`,
`pipeline_tag` — and a `thinconv:` block with the provenance (source repo, revision and commit,
dtype, archive hash, recipe, the quantization summary and the check result). The body says what
the file is, how to run it, the per-tensor quantization error (validation.quant) and the check.

A check result is either run by `upload --check` (the reference decoder against the probe stored
in the archive: the result belongs to the file uploaded, and a failed check stops the upload) or
read from a file with `--check-result FILE`, the JSON `thinconv check ARCHIVE --json` prints
(e.g. a check `--against` the source in transformers, run beforehand).

`upload` verifies the archive completely, then creates the repo (exist_ok) and uploads the archive
and then README.md through `huggingface_hub.HfApi`, authenticated with $HF_TOKEN (or the token
`hf auth login` stored). A card written next to a local archive (`convert --model-card`) is
`<archive without .thin>.README.md`, beside it: out.thin → out.README.md.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from thinconv.errors import PublishError, ThinError
from thinconv.format.reader import Archive, open_archive

REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
CARD_SUFFIX = ".README.md"


def check_repo_id(repo_id: str) -> str:
    """`repo_id` if it is a Hub model id ORG/NAME, else a PublishError."""
    if not REPO_ID.fullmatch(repo_id or "") or ".." in repo_id or repo_id.endswith((".git", ".")):
        raise PublishError(f"repo id {repo_id!r}: expected ORG/NAME (letters, digits, '-', '_', '.')")
    return repo_id


def card_path(archive_path: str | os.PathLike) -> Path:
    """Where `convert --model-card` writes the card of a local archive: out.thin → out.README.md."""
    p = Path(archive_path)
    stem = p.name[:-5] if p.name.endswith(".thin") else p.name
    return p.with_name(stem + CARD_SUFFIX)


def read_check_result(path: str | os.PathLike) -> dict:
    """A saved `thinconv check --json` result (one line of error if it is not one)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise PublishError(f"{path}: cannot read ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise PublishError(f"{path}: not JSON ({e})") from None
    need = ("ok", "dtype_class", "reference", "positions", "max_abs_diff", "top1_agreement", "mean_kl")
    if not isinstance(data, dict) or any(k not in data for k in need):
        raise PublishError(f"{path}: not a `thinconv check --json` result (expected the keys {', '.join(need)})")
    return data


def run_probe_check(archive: Archive) -> dict:
    """`thinconv check ARCHIVE --json` against the archive's stored probe."""
    from thinconv.check import run_check

    probe = archive.manifest["validation"].get("probe")
    if not probe:
        raise PublishError(f"{archive.path.name} has no validation.probe (converted with --no-probe): "
                           f"pass --check-result FILE from `thinconv check --against SRC --json`")
    return run_check(archive, probe["tokens"], None).to_json()


# ---------------------------------------------------------------- the card

def quant_summary(archive: Archive) -> dict | None:
    """Parameter-weighted rel_rmse over the quantized tensors, the worst one, and the count."""
    q = {n: v for n, v in (archive.manifest["validation"].get("quant") or {}).items() if v.get("rel_rmse") is not None}
    if not q:
        return None
    sizes = {t["name"]: math.prod(t["shape"]) for t in archive.manifest["tensors"]}
    total = sum(sizes[n] for n in q)
    worst = max(q.items(), key=lambda kv: kv[1]["rel_rmse"])[0]
    return {"tensors": len(q), "rel_rmse": sum(v["rel_rmse"] * sizes[n] for n, v in q.items()) / total,
            "worst": worst, "worst_rel_rmse": q[worst]["rel_rmse"]}


def _dtype(archive: Archive) -> str:
    """The matrices' dtype (the most common one), e.g. q8_0 or bf16."""
    counts: dict[str, int] = {}
    for t in archive.manifest["tensors"]:
        if len(t["shape"]) >= 2:
            counts[t["dtype"]] = counts.get(t["dtype"], 0) + 1
    return max(sorted(counts), key=counts.get) if counts else "f32"


def card_metadata(archive: Archive, check: dict | None = None) -> dict[str, Any]:
    """The YAML front matter of the card, as a dict."""
    from thinconv.format import dtypes

    v = archive.manifest["validation"]
    src = v.get("source") or {}
    conv = v.get("converter") or {}
    model = archive.model
    dtype = _dtype(archive)
    quantized = dtypes.is_block(dtype)
    tags = ["thinconv", "thin", model["architecture"], dtype] + (["quantized"] if quantized else [])
    meta: dict[str, Any] = {}
    if src.get("repo_id"):
        meta["base_model"] = src["repo_id"]
        if quantized:
            meta["base_model_relation"] = "quantized"
    meta.update({"library_name": "thinconv", "pipeline_tag": "text-generation", "tags": tags})
    block: dict[str, Any] = {
        "file": archive.path.name,
        "format": "thin", "format_version": archive.manifest["format_version"],
        "archive_hash": archive.header.archive_hash.hex(),
        "dtype": dtype,
        "source_repo": src.get("repo_id"), "source_revision": src.get("revision"), "source_commit": src.get("commit"),
        "source_architecture": model["source_architecture"],
        "converter": f"{conv.get('name', 'thinconv')} {conv.get('version', '?')}", "recipe": conv.get("recipe"),
        "rope_layout": model["rope"]["layout"],
        "quantization": quant_summary(archive),
    }
    if check is not None:
        block["check"] = {k: check[k] for k in ("ok", "reference", "dtype_class", "positions", "max_abs_diff",
                                                "max_rel_diff", "top1_agreement", "mean_kl", "max_kl") if k in check}
    meta["thinconv"] = block
    return meta


def model_card(archive: Archive, *, repo_id: str | None = None, check: dict | None = None) -> str:
    """README.md for the archive: YAML front matter (see `card_metadata`) and a body saying what it
    is, how to run it, its quantization error per tensor and the check result."""
    from huggingface_hub import ModelCardData

    meta = card_metadata(archive, check)
    t = meta["thinconv"]
    m = archive.model
    name = archive.path.name
    data = ModelCardData(**meta)
    lines = ["---", data.to_yaml().rstrip("\n"), "---", ""]
    title = repo_id or (t["source_repo"] and f"{t['source_repo']} ({t['dtype']})") or name
    lines += [f"# {title}", ""]
    repo = t["source_repo"]
    origin = f"[{repo}](https://huggingface.co/{repo})" if repo else "a local checkpoint"
    lines += [f"`{name}` is {origin} converted to a **.thin** archive by {t['converter']} "
              f"(recipe `{t['recipe']}`): one file holding the weights in {t['dtype']}, what every tensor means, the "
              f"tokenizer and config, in verified 4096-aligned pages a runtime can mmap (format THIN "
              f"v{t['format_version']}, described in thinconv's FORMAT.md).", ""]
    lines += ["| | |", "|---|---|",
              f"| source | {t['source_repo'] or 'local folder'} |",
              f"| source revision | {t['source_revision'] or '—'} |",
              f"| source commit | {t['source_commit'] or '—'} |",
              f"| architecture | {m['architecture']} ({m['source_architecture']}): {m['num_layers']} layers, hidden "
              f"{m['hidden_size']}, heads {m['num_attention_heads']}/{m['num_kv_heads']} × {m['head_dim']}, vocab "
              f"{m['vocab_size']}, context {m['max_position_embeddings']} |",
              f"| dtype | {t['dtype']} (norms and biases f32) |",
              f"| RoPE layout | {t['rope_layout']} |",
              f"| archive hash | `{t['archive_hash']}` |", ""]
    file = f"{repo_id}" if repo_id else "ORG/NAME"
    lines += ["## How to run it", "", "```sh", "pip install thinconv  # or, in a clone of thinconv: pip install -e .",
              f"hf download {file} {name} --local-dir .",
              f"thinconv verify {name}  # every checksum",
              f"thinconv run {name} --prompt \"Once upon a time\"  # greedy generation from the archive alone",
              f"thinconv check {name}  # logits against the probe stored at conversion",
              f"thinconv export {name} hf/ --to safetensors  # back to a transformers folder",
              f"thinconv export {name} model.gguf --to gguf  # for llama.cpp (Llama, Mistral, Qwen2, Qwen3)",
              "```", "", "```python", "import thinconv", "",
              f"with thinconv.open(\"{name}\") as a:",
              "    w = a.dequantize(\"blk.0.attn_q.weight\")   # float32 numpy array", "```", ""]
    lines += ["## Quantization error", ""]
    q = t["quantization"]
    if q is None:
        lines += ["No tensor is block-quantized: every weight is stored in a float dtype.", ""]
    else:
        per = archive.manifest["validation"]["quant"]
        lines += [f"{q['tensors']} tensors block-quantized; parameter-weighted rel_rmse {q['rel_rmse']:.4g}, worst "
                  f"`{q['worst']}` ({q['worst_rel_rmse']:.4g}). Per tensor, against the source values (rel_rmse = "
                  f"rmse / rms of the source):", "", "<details><summary>every quantized tensor</summary>", "",
                  "| tensor | rel_rmse | rmse | max abs error |", "|---|---:|---:|---:|"]
        for tname, v in sorted(per.items(), key=lambda kv: -(kv[1].get("rel_rmse") or 0)):
            if v.get("rel_rmse") is None:
                lines.append(f"| `{tname}` | — | — | — ({v.get('note', 'not quantized')}) |")
            else:
                lines.append(f"| `{tname}` | {v['rel_rmse']:.4g} | {v['rmse']:.4g} | {v['max_abs_err']:.4g} |")
        lines += ["", "</details>", ""]
    lines += ["## Check", ""]
    c = t.get("check")
    if c is None:
        lines += [f"Not run for this card. `thinconv check {name}` compares the archive's logits with the probe "
                  f"stored at conversion (`--against SRC` compares with transformers on the source).", ""]
    else:
        transformers = c.get("reference") == "transformers"
        against = "transformers on the source" if transformers else "the probe stored at conversion"
        lines += [f"`thinconv check` against {against}, {c.get('positions')} positions: "
                  f"**{'PASS' if c.get('ok') else 'FAIL'}** ({c.get('dtype_class')} bounds) — max |Δlogit| "
                  f"{c.get('max_abs_diff', float('nan')):.3g}, top-1 agreement "
                  f"{100 * c.get('top1_agreement', float('nan')):.1f} %, mean KL "
                  f"{c.get('mean_kl', float('nan')):.3g}.", ""]
    return "\n".join(lines)


def write_model_card(archive_path: str | os.PathLike, *, repo_id: str | None = None, check: dict | None = None,
                     path: str | os.PathLike | None = None) -> Path:
    """Write the card of a local archive beside it (`card_path`), atomically; returns its path."""
    out = Path(path) if path is not None else card_path(archive_path)
    with open_archive(archive_path) as a:
        text = model_card(a, repo_id=repo_id, check=check)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise PublishError(f"writing {out} failed ({e.strerror or e})") from None
    return out


# ---------------------------------------------------------------- upload

@dataclass
class UploadResult:
    repo_id: str
    url: str  # the repo's page
    files: list[str]  # path_in_repo of each file uploaded
    check: dict | None


def upload(archive_path: str | os.PathLike, repo_id: str, *, token: str | None = None, private: bool = False,
           run_check: bool = False, check: dict | None = None, path_in_repo: str | None = None) -> UploadResult:
    """Verify the archive, create `repo_id` if needed and upload the archive, then its model card
    as README.md. `token` defaults to $HF_TOKEN (then huggingface_hub's stored login)."""
    check_repo_id(repo_id)
    archive_path = Path(archive_path)
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise PublishError(f"cannot upload to {repo_id}: HF_HUB_OFFLINE is set")
    with open_archive(archive_path) as a:
        report = a.verify()
        if not report.ok:
            raise PublishError(f"{archive_path.name} is invalid, not uploaded: {report.failures[0]}")
        if run_check:
            check = run_probe_check(a)
            if not check["ok"]:
                why = "; ".join(check["failures"])
                raise PublishError(f"{archive_path.name}: check against its probe failed ({why}); not uploaded")
        card = model_card(a, repo_id=repo_id, check=check)
    name = path_in_repo or archive_path.name
    from huggingface_hub import HfApi

    api = HfApi(token=token or os.environ.get("HF_TOKEN") or None)
    step = "creating the repo"
    try:
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        step = f"uploading {name}"
        api.upload_file(path_or_fileobj=str(archive_path), path_in_repo=name, repo_id=repo_id, repo_type="model",
                        commit_message=f"Upload {name} (thinconv)")
        step = "uploading README.md"
        api.upload_file(path_or_fileobj=card.encode("utf-8"), path_in_repo="README.md", repo_id=repo_id,
                        repo_type="model", commit_message=f"Model card for {name} (thinconv)")
    except ThinError:
        raise
    except Exception as e:  # noqa: BLE001 - huggingface_hub and its HTTP stack raise many types; report one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise PublishError(f"{repo_id}: {step} failed ({type(e).__name__}: {first})") from None
    return UploadResult(repo_id, str(url), [name, "README.md"], check)
