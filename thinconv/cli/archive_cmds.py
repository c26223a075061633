"""`inspect`, `verify`, `pack`, `unpack`: commands on archives (library imports are lazy: start-up time)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from thinconv.cli.app import app, byte_progress, err, human, out, print_json, reported
from thinconv.errors import ThinError


@app.command()
def inspect(archive: Path = typer.Argument(..., help="A .thin archive."),
            as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
            tensors: bool = typer.Option(False, "--tensors", help="List every tensor.")) -> None:
    """Summarize an archive: model, tensors by role and dtype, pages, size, archive hash."""
    from thinconv.format.reader import open_archive
    from thinconv.summary import summarize

    with reported(), open_archive(archive) as a:
        s = summarize(a, with_tensors=tensors)
    if as_json:
        print_json(s)
        return
    m = s["model"]
    out.print(f"[bold]{escape(s['path'])}[/]  {human(s['file_size'])}, {s['page_count']} pages, THIN v{s['format_version']}",
              markup=True)
    out.print(f"archive hash  {s['archive_hash']}")
    out.print(f"model         {m['architecture']} ({m['source_architecture']}): {m['num_layers']} layers, hidden "
              f"{m['hidden_size']}, heads {m['num_attention_heads']}/{m['num_kv_heads']} × {m['head_dim']}, "
              f"ffn {m['intermediate_size']}, vocab {m['vocab_size']}, ctx {m['max_position_embeddings']}"
              f"{', tied head' if m['tie_word_embeddings'] else ''}")
    r, a = s["rope"], s["attention"]
    scaling = "none" if r["scaling"] is None else r["scaling"]["type"]
    out.print(f"rope          theta {r['theta']:g}, rotary_dim {r['rotary_dim']}, layout {r['layout']}, scaling "
              f"{scaling}, attention_factor {r['attention_factor']:g}")
    out.print(f"attention     qkv_bias {a['qkv_bias']}, o_bias {a['o_bias']}, qk_norm {a['qk_norm']}, "
              f"sliding_window {a['sliding_window']}, scale {a['scale']:.6g}")
    st = s["special_tokens"]
    out.print(f"tokens        bos {st['bos']}, eos {st['eos']}, pad {st['pad']}")
    if s["converter"]:
        c = s["converter"]
        src = s["source"] or {}
        origin = src.get("repo_id") or "local folder"
        out.print(f"converted by  {c['name']} {c['version']} (recipe {c['recipe']}) from {origin}"
                  f"{' @ ' + src['commit'][:12] if src.get('commit') else ''}")
    table = Table(title=f"{s['tensor_count']} tensors, {human(s['tensor_bytes'])}", title_justify="left")
    for col in ("role", "dtype", "count", "bytes"):
        table.add_column(col, justify="right" if col in ("count", "bytes") else "left")
    for row in s["by_role"]:
        table.add_row(row["role"], row["dtype"], str(row["count"]), human(row["bytes"]))
    out.print(table)
    if s["assets"]:
        out.print("assets        " + ", ".join(f"{x['name']} ({human(x['size'])})" for x in s["assets"]))
    if s["quant_worst"]:
        q = Table(title="largest quantization error", title_justify="left")
        for col in ("tensor", "rel_rmse", "rmse", "max_abs_err"):
            q.add_column(col)
        for row in s["quant_worst"]:
            q.add_row(row["tensor"], f"{row['rel_rmse']:.4g}", f"{row['rmse']:.4g}", f"{row['max_abs_err']:.4g}")
        out.print(q)
    if tensors:
        t = Table(title="tensors", title_justify="left")
        for col in ("name", "dtype", "shape", "bytes", "pages"):
            t.add_column(col)
        for row in s["tensors"]:
            t.add_row(row["name"], row["dtype"], "×".join(map(str, row["shape"])), human(row["bytes"]), str(row["pages"]))
        out.print(t)


@app.command()
def verify(archive: Path = typer.Argument(..., help="A .thin archive."),
           as_json: bool = typer.Option(False, "--json", help="Print the result as JSON.")) -> None:
    """Check everything: structure, manifest, every page checksum, the archive hash, padding."""
    from thinconv.format.reader import open_archive

    failures: list[str] = []
    checked = 0
    try:
        a = open_archive(archive)
    except ThinError as e:
        failures = [str(e)]
    else:
        with a:
            total = sum(p.size for p in a.pages)
            with byte_progress(enabled=not as_json) as bar:
                task = bar.add_task("verifying", total=total)
                report = a.verify(progress=lambda n: bar.advance(task, n))
            failures, checked = report.failures, report.bytes_checked
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

@app.command("pack")
def pack_cmd(staging: Path = typer.Argument(..., help="A folder holding manifest.json and pages/<id> files."),
             output: Path = typer.Argument(..., help="The .thin archive to write."),
             force: bool = typer.Option(False, "--force", help="Overwrite an existing output.")) -> None:
    """Pack a staging folder into an archive, through the validating packer."""
    from thinconv.format.staging import pack_staging

    with reported(), byte_progress() as bar:
        task = bar.add_task("packing", total=None)
        result = pack_staging(staging, output, force=force, progress=lambda n: bar.advance(task, n))
    out.print(f"wrote {result.path} ({human(result.size)}, {result.page_count} pages, archive hash "
              f"{result.archive_hash[:16]}…)")


@app.command()
def unpack(archive: Path = typer.Argument(..., help="A .thin archive."),
           dest: Path = typer.Argument(..., help="Folder to write manifest.json and pages/ into."),
           force: bool = typer.Option(False, "--force", help="Replace a non-empty destination folder.")) -> None:
    """Write an archive back out as a staging folder (pack reproduces it byte for byte)."""
    from thinconv.format.reader import open_archive
    from thinconv.format.staging import unpack as unpack_archive

    with reported(), open_archive(archive) as a:
        n = unpack_archive(a, dest, force=force)
    out.print(f"wrote {dest}/manifest.json and {n} page files")
