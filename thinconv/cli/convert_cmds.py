"""`convert` and the per-recipe commands, `recipes`, `recipe check` (library imports are lazy:
start-up time)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from thinconv.cli.app import (RichProgress, app, byte_progress, err, examples, human, out, print_json, print_table,
                              recipe_app, render_removed_temps, reported)
from thinconv.errors import RecipeError


def run_conversion(src: str, output: Path, recipe_name: Optional[str], dtype: str, page_size: str,
                   revision: Optional[str], rope_layout: str, keep: list[str], force: bool, strict: bool,
                   dry_run: bool, as_json: bool, recipes: list[Path], probe: bool = True,
                   allow_config_keys: tuple[str, ...] = ()) -> None:
    from thinconv.api import convert
    from thinconv.convert import open_plan
    from thinconv.format.writer import check_output
    from thinconv.plan import ConvertOptions, parse_keep, parse_page_size
    from thinconv.recipe import load_registry

    with reported():
        if dry_run:  # everything the real run would check, and fail on, before writing
            options = ConvertOptions(dtype=dtype, page_size=parse_page_size(page_size), rope_layout=rope_layout,
                                     keep=parse_keep(keep), strict=strict, probe=probe,
                                     allow_config_keys=tuple(allow_config_keys))
            check_output(output, force)
            with open_plan(src, options, recipe=recipe_name, revision=revision,
                           registry=load_registry(recipes)) as (_, plan):
                render_plan(plan, as_json)
            return
        with byte_progress(enabled=not as_json) as bar:
            summary = convert(src, output, dtype=dtype, page_size=page_size, keep=keep, rope_layout=rope_layout,
                              recipe=recipe_name, revision=revision, force=force, strict=strict, probe=probe,
                              allow_config_keys=allow_config_keys, recipes=recipes, progress=RichProgress(bar))
    if as_json:
        print_json(summary)
        return
    render_conversion(summary)


def render_conversion(s: dict) -> None:
    """The text summary of a conversion (the same data as `--json`)."""
    from thinconv.summary import compact_names, source_label

    out.print(f"[bold green]wrote[/] {escape(s['path'])}  {human(s['size'])}, {s['tensor_count']} tensors "
              f"({', '.join(f'{n} {d}' for d, n in s['dtypes'].items())}), {s['page_count']} pages, "
              f"recipe {escape(s['recipe'])}, {s['seconds']:.1f} s ({human(s['size'] / max(s['seconds'], 1e-3))}/s)",
              markup=True)
    if s["source"]["repo_id"]:
        out.print(f"source {source_label(s['source'])}")
    out.print(f"archive hash {s['archive_hash']}")
    render_kept_wider(s["kept_wider"], compact_names)
    q = s["quant"]
    if q:
        out.print(f"quantization: {q['tensors']} tensors, overall rel_rmse {q['rel_rmse']:.4g} "
                  f"(worst: {q['worst']})")
    for w in s["warnings"]:
        err.print(f"[yellow]warning:[/] {escape(w)}", markup=True)
    render_removed_temps(s["removed_temp_files"])
    u = s["user_recipe"]
    if u:
        shadows = f"; it shadows {' and '.join(u['shadows'])}" if u["shadows"] else ""
        out.print(f"note: user recipe {u['name']} from {u['path']} (sha256 {u['sha256']}){shadows}")


def render_kept_wider(kept: list[dict], compact_names) -> None:
    """One line per (stored dtype, reason): every tensor kept wider than asked is named."""
    if not kept:
        return
    groups: dict[tuple[str, str], list[str]] = {}
    for k in kept:
        groups.setdefault((k["dtype"], k["reason"]), []).append(k["tensor"])
    out.print(f"kept wider than asked: {len(kept)} tensor{'s' * (len(kept) != 1)}")
    for (dtype, reason), names in groups.items():
        out.print(f"  {dtype}: {compact_names(names)} ({reason})")


def render_plan(plan, as_json: bool) -> None:
    from thinconv.summary import compact_names, kept_wider

    d = plan.describe()
    d["kept_wider"] = kept_wider(plan)
    if as_json:
        print_json(d)
        return
    wider = {k["tensor"] for k in d["kept_wider"]}
    table = Table(title=f"plan: recipe {d['recipe']}, {len(d['tensors'])} tensors, {d['page_count']} pages, "
                        f"{human(d['bytes'])} (dry run: nothing read or written)", title_justify="left")
    for col in ("name", "source", "shape", "dtype", "bytes", "pages"):
        table.add_column(col)
    for t in d["tensors"]:
        dt = t["dtype"] if t["dtype"] == t["source_dtype"] else f"{t['source_dtype']} → {t['dtype']}"
        table.add_row(t["name"], ", ".join(t["source"]) or "(derived)", "×".join(map(str, t["shape"])),
                      dt + (" *" if t["name"] in wider else ""), human(t["bytes"]), str(t["pages"]))
    print_table(table)
    render_kept_wider(d["kept_wider"], compact_names)
    for t in d["tensors"]:
        if "note" in t:
            out.print(f"* {t['name']}: {t['note']}")
    if d["assets"]:
        out.print("assets: " + ", ".join(a["name"] for a in d["assets"]))
    if d["ignored"]:
        out.print("ignored source tensors: " + ", ".join(d["ignored"]))


JSON = typer.Option(False, "--json", help="Print one JSON object (README: JSON output).")
RECIPES = typer.Option([], "--recipes", metavar="DIR", help="Extra recipe folder (repeatable).")


def make_convert_command(recipe_name: Optional[str], help_text: str):
    def command(
        src: str = typer.Argument(..., metavar="SRC", help="A local checkpoint folder or a Hugging Face repo id "
                                  "(org/name)."),
        output: Path = typer.Argument(..., metavar="OUTPUT", help="The .thin archive to write."),
        dtype: str = typer.Option("auto", "--dtype", metavar="DTYPE", help="auto (the source dtype; bf16 for an fp8 "
                                  "source) | bf16 | f16 | f32 | q8_0 | q4_0 | q4_1"),
        page_size: str = typer.Option("16MiB", "--page-size", metavar="SIZE", help="Largest page (bytes, or e.g. "
                                      "4MiB); big tensors split by whole rows."),
        revision: Optional[str] = typer.Option(None, "--revision", metavar="REV", help="Hub branch, tag or commit."),
        rope_layout: str = typer.Option("half", "--rope-layout", metavar="LAYOUT",
                                        help="half (HF rotate_half) | interleaved"),
        keep: list[str] = typer.Option([], "--keep", metavar="ROLE_GLOB=DTYPE",
                                       help="Store matching roles in DTYPE (repeatable; e.g. 'ffn_down*=q8_0')."),
        force: bool = typer.Option(False, "--force", help="Overwrite an existing output."),
        strict: bool = typer.Option(False, "--strict", help="Fail on NaN/Inf weights."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the full plan without reading tensor data "
                                     "(fails where the real run would)."),
        as_json: bool = JSON,
        recipes: list[Path] = RECIPES,
        probe: bool = typer.Option(True, "--probe/--no-probe", help="Store reference logits (validation.probe)."),
        allow_config_key: list[str] = typer.Option([], "--allow-config-key", metavar="KEY",
                                                   help="A config.json key the recipe does not understand, converted "
                                                        "anyway on your responsibility (repeatable)."),
        upload_repo: Optional[str] = typer.Option(None, "--upload-repo", metavar="ORG/NAME", help="Then publish the "
                                                  "archive to this Hub repo with a model card (see `thinconv upload`)."),
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


def convert_examples(name: str) -> str:
    src = "examples/tiny-llama" if name in ("convert", "llama") else f"./my-{name}-checkpoint"
    return examples(f"thinconv {name} {src} tiny.thin --force",
                    f"thinconv {name} {src} tiny-q8.thin --dtype q8_0 --keep 'ffn_down*=bf16' --force",
                    f"thinconv {name} ORG/NAME out.thin --revision main --dry-run")


app.command("convert", epilog=convert_examples("convert"))(
    make_convert_command(None, "Convert a checkpoint, picking the recipe from config.json's architectures."))

app.add_typer(recipe_app, name="recipe")


@app.command("recipes", epilog=examples("thinconv recipes", "thinconv recipes --recipes my-recipes/ --json"))
def list_recipes(recipes: list[Path] = RECIPES, as_json: bool = JSON) -> None:
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
    print_table(table)
    for note in reg.shadowed:
        out.print(f"note: {note}")


@recipe_app.command("check", epilog=examples("thinconv recipe check llama examples/tiny-llama",
                                             "thinconv recipe check my-recipe.toml ./ckpt --json"))
def check_recipe(recipe: str = typer.Argument(..., metavar="RECIPE", help="A recipe name, or the path of a recipe "
                                              ".toml file."),
                 src: str = typer.Argument(..., metavar="SRC", help="A checkpoint folder or hub repo id."),
                 revision: Optional[str] = typer.Option(None, "--revision", metavar="REV",
                                                        help="Hub branch, tag or commit of SRC."),
                 recipes: list[Path] = RECIPES, as_json: bool = JSON) -> None:
    """Dry-run a recipe against a checkpoint: unmapped tensors, missing roles, shape mismatches.
    Exit 0 when it would convert, 1 when not."""
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
        app.command(r.name, epilog=convert_examples(r.name))(
            make_convert_command(r.name, f"Convert a {', '.join(r.architectures)} checkpoint "
                                         f"(recipe {r.name}: {r.description})."))
