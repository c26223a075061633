"""`inspect`, `verify`, `pack`, `unpack`: commands on archives (library imports are lazy: start-up time)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from thinconv.cli.app import (app, byte_progress, err, examples, fail, human, out, print_json, print_table,
                              render_removed_temps, reported)
from thinconv.errors import MAX_LINE, ThinError, ThinFormatError, one_line

ARCHIVE = typer.Argument(..., metavar="ARCHIVE", help="A .thin archive.")
JSON = typer.Option(False, "--json", help="Print one JSON object (README: JSON output).")


def yes_no(v) -> str:
    return "yes" if v else "no"


def num(v) -> str:
    """A number as a user writes it: 10000, 0.125, 1e-05; none for null."""
    if v is None:
        return "none"
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() and abs(v) < 1e15 else f"{v:g}"
    return str(v)


def tokens_text(v) -> str:
    if v is None:
        return "none"
    if isinstance(v, list):
        return "none" if not v else v[0] if len(v) == 1 else ", ".join(map(str, v[:-1])) + f" or {v[-1]}"
    return str(v)


def open_failure(path: Path, e: ThinError) -> str:
    """The open error of `path`, saying what the file is when it is no archive at all (a
    safetensors file or a checkpoint folder) or when it is a truncated one."""
    from thinconv.format.reader import truncation

    if path.is_dir():
        if any(path.glob("*.safetensors")) or (path / "config.json").is_file():
            return (f"{path}: is a checkpoint folder, not a .thin archive; convert it with "
                    f"`thinconv convert {path} OUT.thin`")
        return f"{path}: is a folder, not a .thin archive"
    if _is_safetensors(path):
        return (f"{path}: is a safetensors file, not a .thin archive; convert the checkpoint folder holding it "
                f"with `thinconv convert {path.parent} OUT.thin`")
    cut = truncation(path) if path.is_file() else None
    if cut is not None:
        size, expected, exact = cut
        return f"{e}; the file is truncated: {size} bytes of {'' if exact else 'at least '}{expected}"
    return str(e)


def _is_safetensors(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    n = int.from_bytes(head[:8], "little") if len(head) == 9 else 0
    return 0 < n < 100 << 20 and head[8:9] == b"{"


@app.command(epilog=examples("thinconv inspect tiny.thin", "thinconv inspect tiny.thin --tensors",
                             "thinconv inspect tiny.thin --json"))
def inspect(archive: Path = ARCHIVE, as_json: bool = JSON,
            tensors: bool = typer.Option(False, "--tensors", help="List every tensor.")) -> None:
    """Summarize an archive: model, tensors by role and dtype, pages, size, archive hash."""
    from thinconv.format.reader import open_archive
    from thinconv.summary import summarize

    try:
        a = open_archive(archive)
    except ThinFormatError as e:
        fail(open_failure(archive, e), 1, "format")
    with reported(), a:
        s = summarize(a, with_tensors=tensors)
    if as_json:
        print_json(s)
        return
    render_summary(s, tensors)


def render_summary(s: dict, tensors: bool) -> None:
    _render_model(s)
    _render_provenance(s)
    _render_tables(s, tensors)


def _render_model(s: dict) -> None:
    m = s["model"]
    L = s["layers"]
    out.print(f"[bold]{escape(s['path'])}[/]  {human(s['size'])}, {s['page_count']} pages, THIN v{s['format_version']}",
              markup=True)
    out.print(f"archive hash  {s['archive_hash']}")
    out.print(f"model         {m['architecture']} ({m['source_architecture']}): {m['num_layers']} layers, hidden "
              f"{m['hidden_size']}, heads {m['num_attention_heads']}/{m['num_kv_heads']} × {m['head_dim']}, "
              f"ffn {m['intermediate_size']}, vocab {m['vocab_size']}, ctx {m['max_position_embeddings']}"
              f"{', tied head' if m['tie_word_embeddings'] else ''}")
    n, mlp = s["norm"], s["mlp"]
    out.print(f"norm          {n['type']}, eps {num(n['eps'])}"
              f"{', weight offset ' + num(n['weight_offset']) if n['weight_offset'] else ''}"
              f"{', with bias' if n['bias'] else ''}")
    out.print(f"mlp           {mlp['type']} {mlp['activation']}{', with bias' if mlp['bias'] else ''}")
    b = s["block"]
    block = [x for x in ("parallel residual" if b["residual"] == "parallel" else None,
                         "shared norm" if b["shared_norm"] else None,
                         "no pre-norms" if not b["pre_norm"] else None,
                         "post-norms" if b["post_norm"] else None,
                         f"residual scale {num(b['residual_scale'])}" if b["residual_scale"] != 1 else None) if x]
    if block:
        out.print("block         " + ", ".join(block))
    scales = [x for x in (f"embedding × {num(s['embedding']['scale'])}" if s["embedding"]["scale"] != 1 else None,
                          f"logits × {num(s['logits']['scale'])}" if s["logits"]["scale"] != 1 else None,
                          f"logits soft-cap {num(s['logits']['softcap'])}" if s["logits"]["softcap"] else None) if x]
    if scales:
        out.print("scales        " + ", ".join(scales))
    r, a = s["rope"], s["attention"]
    on = "" if L["rope"] == L["total"] else f", on {L['rope']} of {L['total']} layers"
    out.print(f"rope          {_rope_text(r)}, rotary_dim {r['rotary_dim']}, layout {r['layout']}{on}")
    if r.get("sliding"):
        out.print(f"rope sliding  {_rope_text(r['sliding'])} (layers with a sliding window)")
    att = [f"qkv_bias {yes_no(a['qkv_bias'])}", f"o_bias {yes_no(a['o_bias'])}", f"qk_norm {yes_no(a['qk_norm'])}",
           f"sliding_window {num(a['sliding_window'])}", f"scale {a['scale']:.6g}"]
    if a["sliding_window"] is not None and L["sliding"] != L["total"]:
        att.append(f"sliding on {L['sliding']} of {L['total']} layers")
    if a.get("softcap"):
        att.append(f"soft-cap {num(a['softcap'])}")
    if a.get("qk_norm_weights", "shared") != "shared":
        att.append(f"qk_norm weights {a['qk_norm_weights'].replace('_', ' ')}")
    if a.get("qk_norm_scope", "head") != "head":
        att.append(f"qk_norm scope {a['qk_norm_scope']}")
    out.print("attention     " + ", ".join(att))
    moe = s["moe"]
    if moe:
        shared = moe.get("shared_expert")
        out.print(f"moe           {moe['num_experts']} experts, {moe['num_experts_per_tok']} per token, expert ffn "
                  f"{moe['expert_intermediate_size']}, {moe['scoring']} scoring, norm_topk_prob "
                  f"{yes_no(moe['norm_topk_prob'])}, sparse on {L['sparse']} of {L['total']} layers"
                  + (f", shared expert ffn {shared['intermediate_size']}{' (gated)' if shared['gate'] else ''}"
                     if shared else ""))


def _render_provenance(s: dict) -> None:
    st = s["special_tokens"]
    out.print(f"tokens        bos {tokens_text(st['bos'])}, eos {tokens_text(st['eos'])}, pad {tokens_text(st['pad'])}")
    if s["converter"]:
        from thinconv.summary import source_label

        c = s["converter"]
        out.print(f"converted by  {c['name']} {c['version']} (recipe {c['recipe']}) from {source_label(s['source'])}")
    if s["source_files"] is not None:
        f = s["source_files"]
        hub = bool((s["source"] or {}).get("repo_id"))
        if f["sha256"]:
            hashes = f"sha256 of {f['sha256']} (the hub cache's LFS blob names; never computed)"
        elif hub:
            hashes = "no sha256 (only LFS blobs of a hub cache carry one; thinconv never hashes files)"
        else:
            hashes = "no sha256 (a local folder's files are never hashed; its path is not recorded)"
        out.print(f"source files  {f['count']} by name and size; {hashes}")


def _render_tables(s: dict, tensors: bool) -> None:
    table = Table(title=f"{s['tensor_count']} tensors, {human(s['tensor_bytes'])}", title_justify="left")
    for col in ("role", "dtype", "count", "bytes"):
        table.add_column(col, justify="right" if col in ("count", "bytes") else "left")
    for row in s["by_role"]:
        table.add_row(row["role"], row["dtype"], str(row["count"]), human(row["bytes"]))
    print_table(table)
    if s["assets"]:
        out.print("assets        " + ", ".join(f"{x['name']} ({human(x['size'])})" for x in s["assets"]))
    if s["quant"]:
        q = Table(title=f"largest quantization error ({s['quant']['tensors']} quantized tensors, overall rel_rmse "
                        f"{s['quant']['rel_rmse']:.4g})", title_justify="left")
        for col in ("tensor", "rel_rmse", "rmse", "max_abs_err"):
            q.add_column(col)
        for row in s["quant"]["largest"]:
            q.add_row(row["tensor"], f"{row['rel_rmse']:.4g}", f"{row['rmse']:.4g}", f"{row['max_abs_err']:.4g}")
        print_table(q)
    if tensors:
        t = Table(title="tensors", title_justify="left")
        for col in ("name", "dtype", "shape", "bytes", "pages"):
            t.add_column(col)
        for row in s["tensors"]:
            t.add_row(row["name"], row["dtype"], "×".join(map(str, row["shape"])), human(row["bytes"]), str(row["pages"]))
        print_table(t)


def _rope_text(r: dict) -> str:
    scaling = "none" if r["scaling"] is None else r["scaling"]["type"]
    return f"theta {num(r['theta'])}, scaling {scaling}, attention_factor {num(r['attention_factor'])}"


@app.command(epilog=examples("thinconv verify tiny.thin", "thinconv verify tiny.thin --json"))
def verify(archive: Path = ARCHIVE, as_json: bool = JSON) -> None:
    """Check everything: structure, manifest, every page checksum, the archive hash, padding.
    Exit 0 valid, 1 invalid (every problem is listed)."""
    from thinconv.format.reader import open_archive

    failures: list[str] = []
    checked = 0
    try:
        a = open_archive(archive)
    except ThinError as e:
        failures = [open_failure(archive, e)]
    else:
        with a:
            total = sum(p.size for p in a.pages)
            with byte_progress(enabled=not as_json) as bar:
                task = bar.add_task("verifying", total=total)
                report = a.verify(progress=lambda n: bar.advance(task, n))
            failures, checked = report.failures, report.bytes_checked
    failures = [one_line(f, MAX_LINE - len("FAIL ")) for f in failures]
    if as_json:
        print_json({"path": str(archive), "ok": not failures, "failures": failures, "bytes_checked": checked})
    elif failures:
        for f in failures:
            err.print(f"[bold red]FAIL[/] {escape(f)}", markup=True)
        err.print(f"{archive}: INVALID ({len(failures)} problem{'s' * (len(failures) > 1)})")
    else:
        out.print(f"{archive}: OK ({human(checked)} checked)")
    raise typer.Exit(1 if failures else 0)


# ---------------------------------------------------------------- pack / unpack

@app.command("pack", epilog=examples("thinconv unpack tiny.thin staging/ && thinconv pack staging/ again.thin",
                                     "thinconv pack staging/ again.thin --force --json"))
def pack_cmd(staging: Path = typer.Argument(..., metavar="STAGING", help="A folder holding manifest.json and "
                                            "pages/<id> files (as unpack writes them)."),
             output: Path = typer.Argument(..., metavar="OUTPUT", help="The .thin archive to write."),
             force: bool = typer.Option(False, "--force", help="Overwrite an existing output."),
             as_json: bool = JSON) -> None:
    """Pack a staging folder into an archive, through the validating packer."""
    from thinconv.format.staging import pack_staging

    with reported(), byte_progress(enabled=not as_json) as bar:
        task = bar.add_task("packing", total=None)
        result = pack_staging(staging, output, force=force, progress=lambda n: bar.advance(task, n))
    if as_json:
        print_json({"path": str(result.path), "size": result.size, "page_count": result.page_count,
                    "archive_hash": result.archive_hash, "removed_temp_files": [str(p) for p in result.removed_temps]})
        return
    out.print(f"wrote {result.path} ({human(result.size)}, {result.page_count} pages)")
    out.print(f"archive hash {result.archive_hash}")
    render_removed_temps(result.removed_temps)


@app.command(epilog=examples("thinconv unpack tiny.thin staging/", "thinconv unpack tiny.thin staging/ --force --json"))
def unpack(archive: Path = ARCHIVE,
           dest: Path = typer.Argument(..., metavar="DEST", help="Folder to write manifest.json and pages/ into."),
           force: bool = typer.Option(False, "--force", help="Replace a non-empty destination folder."),
           as_json: bool = JSON) -> None:
    """Write an archive back out as a staging folder (pack reproduces it byte for byte)."""
    from thinconv.format.reader import open_archive
    from thinconv.format.staging import unpack as unpack_archive

    with reported(), open_archive(archive) as a:
        n = unpack_archive(a, dest, force=force)
    if as_json:
        print_json({"path": str(dest), "manifest": str(Path(dest) / "manifest.json"), "page_count": n})
        return
    out.print(f"wrote {dest}/manifest.json and {n} page files")
