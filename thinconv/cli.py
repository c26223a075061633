"""The `thinconv` command line: parses arguments, calls the library, renders results.

Exit codes: 0 success, 1 failure (invalid input, failed check), 2 usage error.
"""

from __future__ import annotations

import json
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)
from rich.table import Table

from thinconv.errors import ThinError, UsageError

app = typer.Typer(help="Convert Hugging Face checkpoints into .thin archives, and inspect or verify them.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
# Text is printed as is (messages carry user data: paths, names with [brackets]); the few styled
# lines opt in with markup=True and escape what they interpolate. soft_wrap keeps long lines
# (paths, hashes) whole when output goes to a file or a narrow terminal.
out = Console(markup=False, highlight=False, soft_wrap=True)
err = Console(stderr=True, markup=False, highlight=False, soft_wrap=True)


def fail(message: str, code: int = 1) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", markup=True)
    raise typer.Exit(code)


@contextmanager
def reported() -> Iterator[None]:
    """Turn library errors into one line on stderr and the right exit code."""
    try:
        yield
    except UsageError as e:
        fail(str(e), 2)
    except ThinError as e:
        fail(str(e), 1)
    except KeyboardInterrupt:
        fail("interrupted (no partial output is left behind)", 1)


def byte_progress(enabled: bool = True) -> Progress:
    """A transient progress bar with bytes/s on stderr (only on a terminal); tasks are added by callers."""
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=err, transient=True, disable=not enabled or not err.is_terminal)


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------- inspect / verify

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


# ---------------------------------------------------------------- conversion

class RichProgress:
    """Adapter from the converter's phases to a rich progress bar with bytes/s."""

    def __init__(self, bar: Progress):
        self.bar, self.task = bar, None

    def start(self, phase: str, total: int) -> None:
        if self.task is not None:
            self.bar.remove_task(self.task)
        self.task = self.bar.add_task(phase, total=total)

    def advance(self, n: int) -> None:
        self.bar.advance(self.task, n)


def run_conversion(src: str, output: Path, recipe_name: Optional[str], dtype: str, page_size: str,
                   revision: Optional[str], rope_layout: str, keep: list[str], force: bool, strict: bool,
                   dry_run: bool, as_json: bool, recipes: list[Path], probe: bool = True) -> None:
    import time

    from thinconv.convert import check_output, convert, open_plan
    from thinconv.plan import ConvertOptions, parse_keep, parse_page_size
    from thinconv.recipe import load_registry

    with reported():
        options = ConvertOptions(dtype=dtype, page_size=parse_page_size(page_size), rope_layout=rope_layout,
                                 keep=parse_keep(keep), strict=strict, probe=probe)
        if not dry_run:
            check_output(output, force)
        t0 = time.perf_counter()
        with open_plan(src, options, recipe=recipe_name, revision=revision, registry=load_registry(recipes)) as (ckpt, plan):
            if dry_run:
                render_plan(plan, as_json)
                return
            with byte_progress(enabled=not as_json) as bar:
                result = convert(ckpt, plan, output, force=force, progress=RichProgress(bar))
    seconds = time.perf_counter() - t0
    if as_json:
        print_json({"path": str(result.path), "size": result.size, "page_count": result.page_count,
                    "archive_hash": result.archive_hash, "seconds": round(seconds, 3), "recipe": plan.recipe.name,
                    "warnings": result.warnings, "quant": result.quant_overall})
        return
    dtypes: dict[str, int] = {}
    for t in result.manifest["tensors"]:
        dtypes[t["dtype"]] = dtypes.get(t["dtype"], 0) + 1
    out.print(f"[bold green]wrote[/] {escape(str(result.path))}  {human(result.size)}, {len(result.manifest['tensors'])} tensors "
              f"({', '.join(f'{n} {d}' for d, n in dtypes.items())}), {result.page_count} pages, "
              f"recipe {escape(plan.recipe.name)}, {seconds:.1f} s ({human(int(plan.total_bytes / max(seconds, 1e-9)))}/s)",
              markup=True)
    out.print(f"archive hash {result.archive_hash}")
    q = result.quant_overall
    if q:
        out.print(f"quantization: {q['tensors']} tensors, overall rel_rmse {q['rel_rmse']:.4g} "
                  f"(worst: {q['worst']})")
    for w in result.warnings:
        err.print(f"[yellow]warning:[/] {escape(w)}", markup=True)


def render_plan(plan, as_json: bool) -> None:
    d = plan.describe()
    if as_json:
        print_json(d)
        return
    table = Table(title=f"plan: recipe {d['recipe']}, {len(d['tensors'])} tensors, {d['page_count']} pages, "
                        f"{human(d['bytes'])} (dry run: nothing read or written)", title_justify="left")
    for col in ("name", "source", "shape", "dtype", "bytes", "pages"):
        table.add_column(col)
    for t in d["tensors"]:
        dt = t["dtype"] if t["dtype"] == t["source_dtype"] else f"{t['source_dtype']} → {t['dtype']}"
        table.add_row(t["name"], ", ".join(t["source"]) or "(derived)", "×".join(map(str, t["shape"])),
                      dt + (" *" if "note" in t else ""), human(t["bytes"]), str(t["pages"]))
    out.print(table)
    for t in d["tensors"]:
        if "note" in t:
            out.print(f"* {t['name']}: {t['note']}")
    if d["assets"]:
        out.print("assets: " + ", ".join(a["name"] for a in d["assets"]))
    if d["ignored"]:
        out.print("ignored source tensors: " + ", ".join(d["ignored"]))


def make_convert_command(recipe_name: Optional[str], help_text: str):
    def command(
        src: str = typer.Argument(..., help="A local checkpoint folder or a Hugging Face repo id (org/name)."),
        output: Path = typer.Argument(..., help="The .thin archive to write."),
        dtype: str = typer.Option("auto", "--dtype", help="auto (source dtype) | bf16 | f16 | f32 | q8_0 | q4_0 | q4_1"),
        page_size: str = typer.Option("16MiB", "--page-size", help="Largest page; big tensors split by whole rows."),
        revision: Optional[str] = typer.Option(None, "--revision", help="Hub branch, tag or commit."),
        rope_layout: str = typer.Option("half", "--rope-layout", help="half (HF rotate_half) | interleaved"),
        keep: list[str] = typer.Option([], "--keep", help="ROLE_GLOB=DTYPE override, repeatable (e.g. 'ffn_down*=q8_0')."),
        force: bool = typer.Option(False, "--force", help="Overwrite an existing output."),
        strict: bool = typer.Option(False, "--strict", help="Fail on NaN/Inf weights."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the full plan without reading tensor data."),
        as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
        recipes: list[Path] = typer.Option([], "--recipes", help="Extra recipe folder (repeatable)."),
        probe: bool = typer.Option(True, "--probe/--no-probe", help="Store reference logits (validation.probe)."),
    ) -> None:
        run_conversion(src, output, recipe_name, dtype, page_size, revision, rope_layout, keep, force, strict,
                       dry_run, as_json, recipes, probe)

    command.__doc__ = help_text
    return command


app.command("convert")(make_convert_command(None, "Convert a checkpoint, picking the recipe from config.json's architectures."))

recipe_app = typer.Typer(help="Work with recipes.", no_args_is_help=True)
app.add_typer(recipe_app, name="recipe")


@app.command("recipes")
def list_recipes(recipes: list[Path] = typer.Option([], "--recipes", help="Extra recipe folder (repeatable)."),
                 as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """List the recipes available (built-in, $THINCONV_RECIPES, --recipes)."""
    from thinconv.recipe import load_registry

    with reported():
        reg = load_registry(recipes)
    rows = [{"name": r.name, "architectures": list(r.architectures), "extends": list(r.chain[1:]), "path": r.path,
             "description": r.description} for r in reg.recipes.values()]
    if as_json:
        print_json({"recipes": rows, "overrides": reg.shadowed})
        return
    table = Table(title="recipes", title_justify="left")
    for col in ("name", "architectures", "extends", "from", "description"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], ", ".join(r["architectures"]), " → ".join(r["extends"]), r["path"], r["description"])
    out.print(table)
    for note in reg.shadowed:
        out.print(f"note: {note}")


@recipe_app.command("check")
def check_recipe(recipe: str = typer.Argument(..., help="A recipe name, or the path of a recipe .toml file."),
                 src: str = typer.Argument(..., help="A checkpoint folder or hub repo id."),
                 revision: Optional[str] = typer.Option(None, "--revision"),
                 recipes: list[Path] = typer.Option([], "--recipes", help="Extra recipe folder (repeatable)."),
                 as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Dry-run a recipe against a checkpoint: unmapped tensors, missing roles, shape mismatches."""
    import os

    from thinconv.checkpoint.source import open_checkpoint
    from thinconv.errors import RecipeError
    from thinconv.plan import map_checkpoint
    from thinconv.recipe import load_registry

    with reported():
        if recipe.endswith(".toml"):
            import tomllib

            path = Path(recipe)
            registry = load_registry(recipes, extra_files=[path])
            try:
                name = tomllib.loads(path.read_text(encoding="utf-8")).get("name", "")
            except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
                raise RecipeError(f"{path}: cannot read ({e})") from None
            chosen = registry.get(name)
        else:
            chosen = load_registry(recipes).get(recipe)
        with open_checkpoint(src, revision=revision, token=os.environ.get("HF_TOKEN")) as ckpt:
            report = map_checkpoint(ckpt, chosen)
    result = {"recipe": chosen.name, "ok": not report.problems, "mapped": len(report.mapped),
              "ignored": report.ignored, "unmapped": report.unmapped, "missing": report.missing,
              "problems": report.problems}
    if as_json:
        print_json(result)
    else:
        out.print(f"recipe {chosen.name} on {src}: {len(report.mapped)} tensors mapped, {len(report.ignored)} ignored")
        for p in report.problems:
            err.print(f"[bold red]problem:[/] {escape(p)}", markup=True)
        if not report.problems:
            out.print("[green]OK[/]: every source tensor is mapped or ignored, every required tensor is present, "
                      "shapes agree with config.json", markup=True)
    raise typer.Exit(1 if report.problems else 0)


def _register_recipe_commands(argv: list[str]) -> None:
    """One sub-command per recipe (thinconv llama SRC OUT …), including user recipes named by
    $THINCONV_RECIPES or --recipes on this command line."""
    from thinconv.errors import RecipeError
    from thinconv.recipe import RESERVED_NAMES, load_registry

    if argv and argv[0] in RESERVED_NAMES:
        return  # keep start-up fast: these commands never need the recipe sub-commands
    extra = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--recipes"]
    extra += [a.split("=", 1)[1] for a in argv if a.startswith("--recipes=")]
    try:
        registry = load_registry(extra)
    except RecipeError:
        return  # a broken user recipe: `thinconv recipes` / `convert` report it when run
    for r in registry.recipes.values():
        app.command(r.name)(make_convert_command(r.name, f"Convert a {', '.join(r.architectures)} checkpoint "
                                                         f"(recipe {r.name}: {r.description})."))


# ---------------------------------------------------------------- batch

class PlainBatchLog:
    """One line per batch event on stdout (when it is not a terminal: logs, CI, schedulers)."""

    def __enter__(self) -> "PlainBatchLog":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def line(self, text: str) -> None:
        out.print(text)
        sys.stdout.flush()

    def message(self, text: str) -> None:
        self.line(text)

    def job_started(self, job, reason: str) -> None:
        self.line(f"job {job.index} start: {job.source} → {job.out} ({reason})")

    def job_progress(self, job, phase: str, done: int, total: int) -> None:
        pass

    def job_finished(self, job, result) -> None:
        self.line(batch_result_line(result))


def batch_result_line(r) -> str:
    if r.status == "failed":
        return f"job {r.job} FAILED: {r.error}"
    what = "done" if r.status == "done" else "skipped (up to date)"
    return (f"job {r.job} {what}: {r.out} {human(r.bytes_out or 0)} in {r.seconds:.1f} s, archive hash "
            f"{(r.archive_hash or '')[:16]}…" + "".join(f"\n  warning: {w}" for w in r.warnings))


class LiveBatchView(PlainBatchLog):
    """A rich live table on a terminal: one row per running job (phase, bytes, bytes/s), overall
    progress and failures so far; finished jobs scroll above it as lines."""

    def __init__(self, total: int) -> None:
        import time

        from rich.live import Live

        self.clock = time.monotonic
        self.total, self.t0 = total, self.clock()
        self.running: dict[int, dict] = {}
        self.finished = {"done": 0, "skipped": 0, "failed": 0}
        self.live = Live(console=out, refresh_per_second=4, get_renderable=self.render, transient=True)

    def __enter__(self) -> "LiveBatchView":
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)

    def line(self, text: str) -> None:
        self.live.console.print(text)

    def job_started(self, job, reason: str) -> None:
        self.running[job.index] = {"job": job, "phase": "starting", "done": 0, "total": 0, "before": 0,
                                   "t0": self.clock()}

    def job_progress(self, job, phase: str, done: int, total: int) -> None:
        row = self.running.get(job.index)
        if row is None:
            return
        if phase != row["phase"]:
            row["before"] += row["done"]
        row.update(phase=phase, done=done, total=total)

    def job_finished(self, job, result) -> None:
        self.running.pop(job.index, None)
        self.finished[result.status] += 1
        style = {"done": "green", "skipped": "cyan", "failed": "bold red"}[result.status]
        self.live.console.print(f"[{style}]{escape(batch_result_line(result))}[/]", markup=True)

    def render(self):
        from rich.console import Group
        from rich.text import Text

        table = Table(title_justify="left", expand=False)
        for col in ("job", "source", "out", "phase", "progress", "speed"):
            table.add_column(col, justify="right" if col in ("job", "progress", "speed") else "left")
        now = self.clock()
        for index, row in sorted(self.running.items()):
            job = row["job"]
            rate = (row["before"] + row["done"]) / max(now - row["t0"], 1e-3)
            pct = f"{100 * row['done'] / row['total']:.0f} %" if row["total"] else ""
            table.add_row(str(index), job.source, job.out.name, row["phase"],
                          f"{human(row['done'])} / {human(row['total'])} {pct}", f"{human(int(rate))}/s")
        f = self.finished
        n = sum(f.values())
        footer = Text(f"{n}/{self.total} finished: {f['done']} done, {f['skipped']} skipped, {f['failed']} failed; "
                      f"{len(self.running)} running; {now - self.t0:.0f} s",
                      style="bold red" if f["failed"] else "")
        return Group(table, footer) if self.running else footer


@app.command("batch")
def batch_cmd(jobs_file: Path = typer.Argument(..., help="Jobs file, TOML or JSON Lines (schema: "
                                               "docs/batch.md)."),
              workers: Optional[int] = typer.Option(None, "--workers", help="Parallel conversions (default: what "
                                                    "fits the cores and memory)."),
              shard: Optional[str] = typer.Option(None, "--shard", help="I/N: run only shard I of N (0 ≤ I < N); "
                                                  "auto: from $SLURM_ARRAY_TASK_ID or $JOB_COMPLETION_INDEX."),
              report: Optional[Path] = typer.Option(None, "--report", help="Write a JSON Lines report: one line "
                                                    "per finished job."),
              dry_run: bool = typer.Option(False, "--dry-run", help="List what would run and what would be "
                                           "skipped; write nothing."),
              retry_failed: bool = typer.Option(False, "--retry-failed", help="Run only the jobs the previous "
                                                "--report FILE lists as failed."),
              recipes: list[Path] = typer.Option([], "--recipes", help="Extra recipe folder (repeatable).")) -> None:
    """Run many conversions from a jobs file: parallel, resumable (done jobs are skipped), shardable
    across a cluster. Exit 0 all succeeded, 1 some failed, 2 bad jobs file, 130/143 stopped by
    SIGINT/SIGTERM."""
    from thinconv.batch import (failed_outs, load_jobs, parse_shard, plan_batch, read_report, run_batch,
                                shard_jobs, stop_on_signals)
    from thinconv.errors import JobsFileError
    from thinconv.recipe import load_registry

    with reported():
        registry = load_registry(recipes)
        try:
            jobs = load_jobs(jobs_file, registry=registry)
        except JobsFileError as e:
            for problem in e.problems:
                err.print(f"[bold red]error:[/] {escape(problem)}", markup=True)
            err.print(f"{jobs_file}: {len(e.problems)} problem{'s' * (len(e.problems) > 1)}; nothing was run")
            raise typer.Exit(2)
        if workers is not None and workers < 1:
            raise UsageError(f"--workers {workers}: expected ≥ 1")
        if retry_failed and report is None:
            raise UsageError("--retry-failed needs --report FILE (the previous run's report, rewritten by this run)")
        selected = jobs
        if shard is not None:
            index, count = parse_shard(shard)
            selected = shard_jobs(jobs, index, count)
            out.print(f"shard {index}/{count}: {len(selected)} of {len(jobs)} jobs")
        keep_lines = None
        if retry_failed:
            previous = read_report(report)
            failed = failed_outs(previous)
            selected = [j for j in selected if str(j.out) in failed]
            rerun = {str(j.out) for j in selected}
            keep_lines = [rec for rec in previous if rec["out"] not in rerun]
            out.print(f"--retry-failed: {len(selected)} failed job{'s' * (len(selected) != 1)} to retry")
        if dry_run:
            plans = plan_batch(selected, observer=PlainBatchLog())
            for p in plans:
                out.print(f"job {p.job.index} {p.action}: {p.job.source} → {p.job.out} ({p.reason})")
            counts = {a: sum(p.action == a for p in plans) for a in ("run", "skip", "fail")}
            out.print(f"dry run: {counts['run']} to run, {counts['skip']} to skip, {counts['fail']} failing; "
                      f"nothing was written")
            return
        view = LiveBatchView(len(selected)) if out.is_terminal else PlainBatchLog()
        with stop_on_signals() as stop, view:
            summary = run_batch(selected, workers=workers, report=report, keep_lines=keep_lines,
                                recipe_dirs=recipes, observer=view, stop=stop)
    line = (f"batch: {len(selected)} job{'s' * (len(selected) != 1)}: {summary.count('done')} done, "
            f"{summary.count('skipped')} skipped, {summary.count('failed')} failed in {summary.seconds:.1f} s")
    if summary.interrupted:
        err.print(f"{line}; stopped by a signal, {summary.not_started} not started (no partial archive is left; "
                  f"rerun to finish)")
        raise typer.Exit(stop.exit_code)
    out.print(line)
    raise typer.Exit(1 if summary.count("failed") else 0)


# ---------------------------------------------------------------- check / run

@app.command()
def check(archive: Path = typer.Argument(..., help="A .thin archive."),
          against: Optional[str] = typer.Option(None, "--against", help="Source checkpoint (folder or hub id) to "
                                                "compare with under transformers; default: the archive's probe."),
          prompt: Optional[str] = typer.Option(None, "--prompt", help="Text, tokenized with the embedded tokenizer."),
          tokens: Optional[str] = typer.Option(None, "--tokens", help="Comma-separated token ids."),
          steps: Optional[int] = typer.Option(None, "--steps", help="Positions to compare (default: longer than "
                                              "any sliding window)."),
          revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision of --against."),
          strict: bool = typer.Option(False, "--strict", help="Also hold q4 archives to a KL bound."),
          as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Prove the archive computes what the source computes: per-position logit differences,
    top-1 agreement and KL, judged against bounds for the archive's dtype class."""
    import os

    from thinconv.check import archive_tokenizer, default_tokens, parse_tokens, run_check
    from thinconv.format.reader import open_archive

    with reported(), open_archive(archive) as a:
        if prompt is not None and tokens is not None:
            raise UsageError("give --prompt or --tokens, not both")
        if steps is not None and steps < 1:
            raise UsageError(f"--steps {steps}: expected ≥ 1")
        if tokens is not None:
            ids = parse_tokens(tokens, a.model["vocab_size"])
        elif prompt is not None:
            ids = archive_tokenizer(a).encode(prompt).ids
        elif against is None and a.manifest["validation"].get("probe"):
            ids = a.manifest["validation"]["probe"]["tokens"]
        else:
            ids = default_tokens(a.model, steps)
        if steps is not None:
            ids = ids[:steps]
        if against is not None:
            from thinconv.checkpoint.source import open_checkpoint

            with open_checkpoint(against, revision=revision, token=os.environ.get("HF_TOKEN")) as ckpt:
                result = run_check(a, ids, ckpt, strict_q4=strict)
        else:
            result = run_check(a, ids, None, strict_q4=strict)
    if as_json:
        print_json(result.to_json())
        raise typer.Exit(0 if result.ok else 1)
    how = " (computed layer by layer: the model exceeds the decode memory budget)" if result.engine == "prefill" else ""
    table = Table(title=f"{archive}: {result.dtype_class} archive vs {result.reference}{how}",
                  title_justify="left")
    for col in ("pos", "max |Δlogit|", "rel", "top-1", "KL"):
        table.add_column(col, justify="right")
    for p in result.positions:
        table.add_row(str(p.position), f"{p.max_abs:.3g}", f"{p.max_rel:.3g}", "✓" if p.top1_match else "✗",
                      f"{p.kl:.3g}")
    out.print(table)
    s = result.summary()
    out.print(f"overall: max |Δlogit| {s['max_abs_diff']:.3g} (rel {s['max_rel_diff']:.3g}), top-1 "
              f"{100 * s['top1_agreement']:.1f} %, mean KL {s['mean_kl']:.3g}, max KL {s['max_kl']:.3g}")
    if not result.thresholds:
        out.print(f"{result.dtype_class}: reported only (use --strict to apply a bound)")
    elif result.ok:
        out.print(f"[bold green]PASS[/] within the {result.dtype_class} bounds "
                  f"({', '.join(f'{k} {v:g}' for k, v in result.thresholds.items())})", markup=True)
    else:
        for f in result.failures:
            err.print(f"[bold red]FAIL[/] {escape(f)}", markup=True)
    raise typer.Exit(0 if result.ok else 1)


@app.command()
def run(archive: Path = typer.Argument(..., help="A .thin archive."),
        prompt: str = typer.Option(..., "--prompt", help="Text to continue."),
        max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Tokens to generate at most.")) -> None:
    """Greedy generation with the reference decoder and the embedded tokenizer (the archive alone)."""
    from thinconv.check import ArchiveProvider, archive_tokenizer
    from thinconv.decoder import Decoder
    from thinconv.format.reader import open_archive

    with reported(), open_archive(archive) as a:
        tok = archive_tokenizer(a)
        ids = tok.encode(prompt).ids
        if not ids:
            raise UsageError("--prompt encodes to no tokens")
        decoder = Decoder(ArchiveProvider(a))
        sys.stdout.write(prompt)
        sys.stdout.flush()
        # Decode prompt + new tokens together (a tokenizer may attach a space or half a
        # character to a token's neighbour) and print only what follows the prompt's text;
        # a trailing U+FFFD is a character still being completed by the next token.
        shown = len(tok.decode(ids, skip_special_tokens=True))
        seq = list(ids)
        text = ""
        for t in decoder.generate(ids, max_new_tokens):
            seq.append(t)
            text = tok.decode(seq, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
        sys.stdout.write(text[shown:])
        sys.stdout.write("\n")


def main() -> None:
    # A file-size limit (RLIMIT_FSIZE) must surface as an error we clean up after, not a kill.
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _register_recipe_commands(sys.argv[1:])
    app()


if __name__ == "__main__":
    main()
