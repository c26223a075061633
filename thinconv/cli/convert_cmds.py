"""`convert` and the per-recipe commands, `recipes`, `recipe check` (library imports are lazy:
start-up time)."""

from __future__ import annotations

import os
import time
import tomllib
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from thinconv.cli.app import app, byte_progress, err, human, out, print_json, recipe_app, reported
from thinconv.errors import RecipeError


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
                   dry_run: bool, as_json: bool, recipes: list[Path], probe: bool = True,
                   allow_config_keys: tuple[str, ...] = ()) -> None:
    from thinconv.convert import convert, open_plan
    from thinconv.format.writer import check_output
    from thinconv.plan import ConvertOptions, parse_keep, parse_page_size
    from thinconv.recipe import load_registry

    with reported():
        options = ConvertOptions(dtype=dtype, page_size=parse_page_size(page_size), rope_layout=rope_layout,
                                 keep=parse_keep(keep), strict=strict, probe=probe,
                                 allow_config_keys=tuple(allow_config_keys))
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
        dtype: str = typer.Option("auto", "--dtype", help="auto (the source dtype; bf16 for an fp8 source) | bf16 | f16 "
                                                          "| f32 | q8_0 | q4_0 | q4_1"),
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
        allow_config_key: list[str] = typer.Option([], "--allow-config-key", help="A config.json key the recipe does not "
                                                   "understand, converted anyway on your responsibility (repeatable)."),
        upload_repo: Optional[str] = typer.Option(None, "--upload-repo", help="Then publish the archive to this Hub "
                                                  "repo (ORG/NAME) with a model card (see `thinconv upload`)."),
        model_card: bool = typer.Option(False, "--model-card", help="Also write the model card beside the output "
                                        "(out.thin → out.README.md)."),
    ) -> None:
        from thinconv.cli.export_cmds import after_convert, check_publish_options

        check_publish_options(upload_repo)
        run_conversion(src, output, recipe_name, dtype, page_size, revision, rope_layout, keep, force, strict,
                       dry_run, as_json, recipes, probe, tuple(allow_config_key))
        if not dry_run:
            after_convert(output, upload_repo, model_card, as_json)

    command.__doc__ = help_text
    return command


app.command("convert")(make_convert_command(None, "Convert a checkpoint, picking the recipe from config.json's architectures."))

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
    from thinconv.checkpoint.source import open_checkpoint
    from thinconv.mapping import map_checkpoint
    from thinconv.recipe import load_registry

    with reported():
        if recipe.endswith(".toml"):
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


def register_recipe_commands(argv: list[str]) -> None:
    """One sub-command per recipe (thinconv llama SRC OUT …), including user recipes named by
    $THINCONV_RECIPES or --recipes on this command line."""
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
