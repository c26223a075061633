"""A user recipe (--recipes DIR, $THINCONV_RECIPES) that shadows a built-in one is stated in the
convert summary and --json, and the archive records its file's sha256 (in
validation.converter.options.recipe_files, only for user recipes: built-in archives keep their
bytes)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import thinconv
from thinconv.cli import app
from thinconv.recipe import load_registry

runner = CliRunner()
BUILTIN_LLAMA = Path(thinconv.__file__).parent.parent / "recipes" / "llama.toml"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def convert_json(*args, env=None) -> dict:
    r = runner.invoke(app, ["convert", *map(str, args), "--no-probe", "--json"], env=env)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def recorded_options(archive: Path) -> dict:
    with thinconv.open(archive) as a:
        assert a.verify().ok
        return a.manifest["validation"]["converter"]["options"]


def test_builtin_recipe_records_no_recipe_file_and_states_nothing(ckpts, tmp_path):
    s = convert_json(ckpts["llama2"].path, tmp_path / "a.thin")
    assert s["user_recipe"] is None and s["recipe"] == "llama"
    assert "recipe_files" not in recorded_options(tmp_path / "a.thin")
    assert load_registry().get("llama").files == ()


def test_user_recipe_of_a_builtin_name_is_stated_and_its_sha256_recorded(ckpts, tmp_path):
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    mine = recipes / "llama.toml"
    mine.write_text(BUILTIN_LLAMA.read_text() + "\n# my copy\n")
    out = tmp_path / "a.thin"
    s = convert_json(ckpts["llama2"].path, out, "--recipes", recipes)
    assert s["user_recipe"] == {"name": "llama", "path": str(mine), "sha256": sha256(mine),
                                "shadows": ["the built-in recipe llama"]}
    assert recorded_options(out)["recipe_files"] == [{"recipe": "llama", "file": "llama.toml",
                                                      "sha256": sha256(mine)}]
    r = runner.invoke(app, ["convert", str(ckpts["llama2"].path), str(out), "--no-probe", "--force",
                            "--recipes", str(recipes)])
    assert r.exit_code == 0, r.output
    assert (f"note: user recipe llama from {mine} (sha256 {sha256(mine)}); it shadows the built-in recipe llama"
            in r.stdout)


def test_user_recipe_taking_over_an_architecture_is_stated_with_its_chain(ckpts, tmp_path):
    """From $THINCONV_RECIPES, extending the built-in: it shadows llama for LlamaForCausalLM; the
    archive records its own file (the built-in it extends is pinned by the thinconv version)."""
    recipes = tmp_path / "env-recipes"
    recipes.mkdir()
    mine = recipes / "myllama.toml"
    mine.write_text('name = "myllama"\nextends = "llama"\narchitectures = ["LlamaForCausalLM"]\n')
    out = tmp_path / "a.thin"
    s = convert_json(ckpts["llama2"].path, out, env={"THINCONV_RECIPES": str(recipes)})
    assert s["recipe"] == "myllama"
    assert s["user_recipe"] == {"name": "myllama", "path": str(mine), "sha256": sha256(mine),
                                "shadows": ["the built-in recipe llama for LlamaForCausalLM"]}
    assert recorded_options(out)["recipe_files"] == [{"recipe": "myllama", "file": "myllama.toml",
                                                      "sha256": sha256(mine)}]


def test_user_recipes_extending_one_another_record_every_file(ckpts, tmp_path):
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "base.toml").write_text('name = "mybase"\nextends = "llama"\narchitectures = ["LlamaForCausalLM"]\n')
    (recipes / "top.toml").write_text('name = "mytop"\nextends = "mybase"\narchitectures = ["LlamaForCausalLM"]\n')
    s = convert_json(ckpts["llama2"].path, tmp_path / "a.thin", "--recipes", recipes)
    assert s["recipe"] == "mytop"
    assert recorded_options(tmp_path / "a.thin")["recipe_files"] == [
        {"recipe": "mytop", "file": "top.toml", "sha256": sha256(recipes / "top.toml")},
        {"recipe": "mybase", "file": "base.toml", "sha256": sha256(recipes / "base.toml")}]


def test_the_recorded_recipe_file_does_not_depend_on_where_it_lives(ckpts, tmp_path):
    """Same recipe bytes in two folders: byte-identical archives (no path is recorded)."""
    hashes = []
    for where in ("one", "two/deeper"):
        recipes = tmp_path / where
        recipes.mkdir(parents=True)
        shutil.copy(BUILTIN_LLAMA, recipes / "llama.toml")
        hashes.append(convert_json(ckpts["llama2"].path, tmp_path / f"{where.replace('/', '_')}.thin",
                                   "--recipes", recipes)["archive_hash"])
    assert hashes[0] == hashes[1]


@pytest.mark.slow
def test_batch_skips_a_done_job_converted_with_a_user_recipe(ckpts, tmp_path):
    """recipe_files is provenance, not a job option: a rerun finds the archive up to date."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "myllama.toml").write_text('name = "myllama"\nextends = "llama"\narchitectures = ["LlamaForCausalLM"]\n')
    (tmp_path / "jobs.toml").write_text(f'[[job]]\nsource = "{ckpts["llama2"].path}"\nout = "a.thin"\nprobe = false\n')
    args = ["batch", str(tmp_path / "jobs.toml"), "--workers", "1", "--recipes", str(recipes), "--json"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert json.loads(first.stdout)["done"] == 1
    second = runner.invoke(app, args)
    assert json.loads(second.stdout)["skipped"] == 1, second.output
