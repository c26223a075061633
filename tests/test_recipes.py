"""Recipes: the built-in four, `extends`, user recipes (--recipes DIR, $THINCONV_RECIPES) with their
sub-commands, `thinconv recipe check`, invalid recipe files, and registered Python transforms."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import Ckpt, Thin, assert_one_line_error, expected_names, hf_source_name, interleave_reference, \
    leftovers, run_cli, write_safetensors
from thinconv.checkpoint import open_checkpoint
from thinconv.cli import app
from thinconv.convert import convert
from thinconv.errors import ConversionError, RecipeError
from thinconv.plan import ConvertOptions, plan_conversion
from thinconv.recipe import load_registry
from thinconv.transforms import register_transform

runner = CliRunner()
BUILTIN = Path(__file__).resolve().parent.parent / "recipes"

# The worked example of recipes/adding-an-architecture.md §3, verbatim.
ACME_TOML = '''\
name = "acme"
extends = "llama"
description = "Acme LM: Llama with renamed tensors and q/k/v bias"
architectures = ["AcmeForCausalLM"]

[metadata]
qkv_bias = true
o_bias = false

[tensors]
"token_embd.weight" = "transformer.wte.weight"
"blk.{L}.attn_norm.weight" = "transformer.h.{L}.ln_1.weight"
"blk.{L}.attn_q.weight" = "transformer.h.{L}.attn.q.weight"
"blk.{L}.attn_q.bias" = "transformer.h.{L}.attn.q.bias"
"blk.{L}.attn_k.weight" = "transformer.h.{L}.attn.k.weight"
"blk.{L}.attn_k.bias" = "transformer.h.{L}.attn.k.bias"
"blk.{L}.attn_v.weight" = "transformer.h.{L}.attn.v.weight"
"blk.{L}.attn_v.bias" = "transformer.h.{L}.attn.v.bias"
"blk.{L}.attn_output.weight" = "transformer.h.{L}.attn.o.weight"
"blk.{L}.ffn_norm.weight" = "transformer.h.{L}.ln_2.weight"
"blk.{L}.ffn_gate.weight" = "transformer.h.{L}.mlp.w1.weight"
"blk.{L}.ffn_up.weight" = "transformer.h.{L}.mlp.w3.weight"
"blk.{L}.ffn_down.weight" = "transformer.h.{L}.mlp.w2.weight"
"output_norm.weight" = "transformer.ln_f.weight"
"output.weight" = "lm_head.weight"
'''
ACME_NAMES = {
    "model.embed_tokens.weight": "transformer.wte.weight", "model.norm.weight": "transformer.ln_f.weight",
    "lm_head.weight": "lm_head.weight", "input_layernorm.weight": "ln_1.weight",
    "post_attention_layernorm.weight": "ln_2.weight", "self_attn.q_proj.weight": "attn.q.weight",
    "self_attn.k_proj.weight": "attn.k.weight", "self_attn.v_proj.weight": "attn.v.weight",
    "self_attn.o_proj.weight": "attn.o.weight", "mlp.gate_proj.weight": "mlp.w1.weight",
    "mlp.up_proj.weight": "mlp.w3.weight", "mlp.down_proj.weight": "mlp.w2.weight",
}


def _acme_name(hf: str) -> str:
    if hf in ACME_NAMES:
        return ACME_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"transformer.h.{layer}.{ACME_NAMES[rest]}"


@pytest.fixture
def acme(llama_copy: Ckpt, tmp_path) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """(checkpoint, recipe folder, source tensors): the Llama-2 fixture renamed the Acme way, with
    q/k/v biases added and config.json claiming AcmeForCausalLM."""
    rng = np.random.default_rng(5)
    tensors = {_acme_name(k): v for k, v in llama_copy.tensors.items()}
    for layer in range(2):
        for p in "qkv":
            tensors[f"transformer.h.{layer}.attn.{p}.bias"] = rng.standard_normal(32).astype(np.float32)
    (llama_copy.path / "model.safetensors").unlink()
    write_safetensors(llama_copy.path / "model.safetensors", tensors)
    cfg = json.loads((llama_copy.path / "config.json").read_text())
    cfg["architectures"] = ["AcmeForCausalLM"]
    cfg["model_type"] = "acme"
    (llama_copy.path / "config.json").write_text(json.dumps(cfg, indent=2))
    recipes = tmp_path / "thin-recipes"
    recipes.mkdir()
    (recipes / "acme.toml").write_text(ACME_TOML)
    return llama_copy.path, recipes, tensors


def _acme_model(llama_model: dict) -> dict:
    return {**llama_model, "architecture": "acme", "source_architecture": "AcmeForCausalLM",
            "attention": {**llama_model["attention"], "qkv_bias": True}}


# ---------------------------------------------------------------- the built-in recipes

def test_recipes_lists_every_builtin():
    r = runner.invoke(app, ["recipes", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    rows = {x["name"]: x for x in d["recipes"]}
    shipped = sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "recipes").glob("*.toml"))
    assert sorted(rows) == shipped and {"llama", "mistral", "qwen2", "qwen3"} <= set(rows)
    assert rows["llama"]["architectures"] == ["LlamaForCausalLM"] and rows["llama"]["extends"] == []
    for name, arch in (("mistral", "MistralForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")):
        assert rows[name]["architectures"] == [arch] and rows[name]["extends"] == ["llama"]
        assert rows[name]["path"] == f"recipes/{name}.toml"
    assert d["overrides"] == []
    r = runner.invoke(app, ["recipes"], env={"COLUMNS": "250"})
    assert r.exit_code == 0
    for name in ("llama", "mistral", "qwen2", "qwen3", "Qwen3ForCausalLM"):
        assert name in r.stdout


def test_extends_merges():
    reg = load_registry()
    llama, qwen3, mistral = reg.get("llama"), reg.get("qwen3"), reg.get("mistral")
    assert qwen3.chain == ("qwen3", "llama")
    # tensors: the parent's, plus the child's
    assert {t.canonical for t in qwen3.tensors} == {t.canonical for t in llama.tensors} | \
        {"blk.{L}.attn_q_norm.weight", "blk.{L}.attn_k_norm.weight"}
    assert qwen3.sources_for("blk.3.attn_q_norm.weight") == ["model.layers.3.self_attn.q_norm.weight"]
    assert qwen3.sources_for("blk.3.ffn_up.weight") == ["model.layers.3.mlp.up_proj.weight"]
    # lists: ignore is appended to, quantizable inherited
    assert qwen3.ignore == llama.ignore and qwen3.quantizable == llama.quantizable
    assert qwen3.is_ignored("model.layers.7.self_attn.rotary_emb.inv_freq")
    # metadata: key by key
    assert (qwen3.metadata.qk_norm, qwen3.metadata.head_dim_default, qwen3.metadata.sliding_window) == \
        (True, 128, "use_sliding_window")
    assert qwen3.metadata.qkv_bias == "attention_bias" == llama.metadata.qkv_bias  # inherited
    assert (mistral.metadata.qkv_bias, mistral.metadata.sliding_window) == (False, "always")
    assert not llama.metadata.qk_norm


def test_extends_in_a_user_recipe(tmp_path):
    """Tables merge key by key ("" drops a tensor), `ignore` is appended to, scalars and lists replace."""
    (tmp_path / "child.toml").write_text('''
name = "child"
extends = "qwen3"
architectures = ["ChildForCausalLM"]
ignore = ["model.extra.{L}.buffer"]
quantizable = ["ffn_up.weight", "ffn_down.weight"]
[tensors]
"blk.{L}.attn_k_norm.weight" = ""
"output.weight" = ["lm_head.a.weight", "lm_head.b.weight"]
[metadata]
head_dim_default = 64
[keep]
"ffn_down.weight" = "q8_0"
''')
    (tmp_path / "grandchild.toml").write_text('''
name = "grandchild"
extends = "child"
architectures = ["GrandChildForCausalLM"]
[keep]
"ffn_up.weight" = "f32"
[transforms]
"ffn_gate.weight" = "some_fix"
''')
    reg = load_registry([tmp_path])
    child, gc = reg.get("child"), reg.get("grandchild")
    assert child.chain == ("child", "qwen3", "llama") and gc.chain == ("grandchild", "child", "qwen3", "llama")
    canon = {t.canonical for t in child.tensors}
    assert "blk.{L}.attn_q_norm.weight" in canon and "blk.{L}.attn_k_norm.weight" not in canon
    assert child.sources_for("output.weight") == ["lm_head.a.weight", "lm_head.b.weight"]
    assert child.ignore == reg.get("llama").ignore + ("model.extra.{L}.buffer",)
    assert child.quantizable == ("ffn_up.weight", "ffn_down.weight")
    assert child.metadata.head_dim_default == 64 and child.metadata.qk_norm is True
    # [keep] and [transforms] are tables too: they merge key by key down the chain
    assert dict(gc.keep) == {"ffn_down.weight": "q8_0", "ffn_up.weight": "f32"}
    assert dict(gc.transforms) == {"ffn_gate.weight": "some_fix"}
    assert gc.sources_for("output.weight") == ["lm_head.a.weight", "lm_head.b.weight"]


# ---------------------------------------------------------------- user recipes

def test_user_recipe_copy_of_llama_via_recipes_dir(llama_copy: Ckpt, tmp_path):
    """The llama recipe copied under a new name, claiming a made-up architecture."""
    recipes = tmp_path / "mine"
    recipes.mkdir()
    text = (BUILTIN / "llama.toml").read_text()
    text = text.replace('name = "llama"', 'name = "madeup"').replace('["LlamaForCausalLM"]', '["MadeUpForCausalLM"]')
    (recipes / "madeup.toml").write_text(text)
    cfg = json.loads((llama_copy.path / "config.json").read_text())
    cfg["architectures"] = ["MadeUpForCausalLM"]
    (llama_copy.path / "config.json").write_text(json.dumps(cfg))
    # without the recipe folder, nothing handles it
    r = runner.invoke(app, ["convert", str(llama_copy.path), str(tmp_path / "x.thin"), "--no-probe"])
    assert r.exit_code == 1
    assert_one_line_error(r.stderr, "MadeUpForCausalLM", "not handled by any recipe")
    out = tmp_path / "m.thin"
    r = runner.invoke(app, ["convert", str(llama_copy.path), str(out), "--no-probe", "--recipes", str(recipes)])
    assert r.exit_code == 0, r.output
    thin = Thin.read(out)
    assert thin.manifest["model"] == {**llama_copy.model, "architecture": "madeup",
                                      "source_architecture": "MadeUpForCausalLM"}
    assert thin.manifest["validation"]["converter"]["recipe"] == "madeup"
    assert thin.raw("blk.1.ffn_down.weight") == llama_copy.tensors["model.layers.1.mlp.down_proj.weight"].tobytes()
    r = runner.invoke(app, ["recipes", "--json", "--recipes", str(recipes)])
    rows = {x["name"]: x for x in json.loads(r.stdout)["recipes"]}
    assert rows["madeup"]["path"] == str(recipes / "madeup.toml")
    # the sub-command, from the real entry point (it registers recipes named on its command line)
    out2 = tmp_path / "m2.thin"
    r = run_cli("madeup", llama_copy.path, out2, "--no-probe", "--recipes", recipes)
    assert r.returncode == 0, r.stderr
    assert out2.read_bytes() == out.read_bytes()


@pytest.mark.slow
def test_acme_worked_example(acme, ckpts, tmp_path):
    """recipes/adding-an-architecture.md §3, step by step, with $THINCONV_RECIPES."""
    src, recipes, tensors = acme
    # 1. the closest recipe shows the gap
    r = runner.invoke(app, ["recipe", "check", "llama", str(src)])
    assert r.exit_code == 1
    assert "source tensor(s) not mapped by the recipe nor ignored: transformer.h.0.attn.k.bias" in r.stderr
    assert "required tensor(s) missing from the checkpoint: token_embd.weight (from model.embed_tokens.weight)" \
        in r.stderr
    # 3. check the new recipe by its file
    r = runner.invoke(app, ["recipe", "check", str(recipes / "acme.toml"), str(src)])
    assert r.exit_code == 0, r.output
    assert "OK" in r.stdout and "recipe acme" in r.stdout
    env = {"THINCONV_RECIPES": str(recipes)}
    r = run_cli("--help", env=env)
    assert " acme " in r.stdout
    out = tmp_path / "acme.thin"
    r = run_cli("acme", src, out, "--no-probe", env=env)
    assert r.returncode == 0, r.stderr
    thin = Thin.read(out)
    model = _acme_model(ckpts["llama2"].model)
    assert thin.manifest["model"] == model
    assert [t["name"] for t in thin.manifest["tensors"]] == expected_names(model)
    for t in thin.manifest["tensors"]:
        if t["name"] == "rope_freqs":
            continue
        want = tensors[t["source"][0]]
        assert thin.array(t["name"]).tobytes() == want.astype(np.float32).tobytes(), t["name"]
    assert thin.tensor_entry("blk.1.attn_k.bias")["source"] == ["transformer.h.1.attn.k.bias"]
    # the same through `convert` (recipe picked by architecture) with the env var
    r = run_cli("convert", src, tmp_path / "acme2.thin", "--no-probe", env=env)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "acme2.thin").read_bytes() == out.read_bytes()


def test_later_recipe_folder_wins_an_architecture(tmp_path, monkeypatch):
    """Discovery order: built-in, then $THINCONV_RECIPES, then --recipes; later wins on an architecture —
    also when the later recipe overrides a built-in by name."""
    env_dir, cli_dir = tmp_path / "env", tmp_path / "cli"
    env_dir.mkdir()
    cli_dir.mkdir()
    (env_dir / "zed.toml").write_text('name = "zed"\nextends = "llama"\narchitectures = ["ZedForCausalLM"]\n')
    (cli_dir / "llama.toml").write_text((BUILTIN / "llama.toml").read_text().replace(
        '["LlamaForCausalLM"]', '["LlamaForCausalLM", "ZedForCausalLM"]'))
    monkeypatch.setenv("THINCONV_RECIPES", str(env_dir))
    reg = load_registry([cli_dir])
    assert reg.get("llama").path == str(cli_dir / "llama.toml")
    assert reg.for_architecture(["ZedForCausalLM"]).name == "llama"
    assert any("llama" in note and str(cli_dir) in note for note in reg.shadowed)
    # and the other way round: the --recipes folder's own recipe beats the env one
    (cli_dir / "llama.toml").unlink()
    (cli_dir / "zed2.toml").write_text('name = "zed2"\nextends = "llama"\narchitectures = ["ZedForCausalLM"]\n')
    assert load_registry([cli_dir]).for_architecture(["ZedForCausalLM"]).name == "zed2"


# ---------------------------------------------------------------- recipe check

def test_recipe_check_ok(ckpt: Ckpt):
    r = runner.invoke(app, ["recipe", "check", ckpt.model["architecture"], str(ckpt.path), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["ok"] and d["problems"] == [] and d["unmapped"] == [] and d["missing"] == []
    assert d["mapped"] == len(expected_names(ckpt.model)) - 1  # all but rope_freqs
    r = runner.invoke(app, ["recipe", "check", ckpt.model["architecture"], str(ckpt.path)])
    assert r.exit_code == 0 and "OK" in r.stdout


def test_recipe_check_reports_every_problem(llama_copy: Ckpt):
    """One extra tensor, one missing, one shape contradicting config.json: all three reported, exit 1."""
    t = dict(llama_copy.tensors)
    t["model.layers.0.mlp.bonus.weight"] = np.zeros((2, 2), np.float32)
    del t["model.layers.1.self_attn.o_proj.weight"]
    t["model.layers.0.mlp.down_proj.weight"] = np.zeros((32, 48), np.float32)
    write_safetensors(llama_copy.path / "model.safetensors", t)
    r = runner.invoke(app, ["recipe", "check", "llama", str(llama_copy.path), "--json"])
    assert r.exit_code == 1
    d = json.loads(r.stdout)
    assert not d["ok"] and d["unmapped"] == ["model.layers.0.mlp.bonus.weight"]
    assert d["missing"] == ["blk.1.attn_output.weight (from model.layers.1.self_attn.o_proj.weight)"]
    shape = [p for p in d["problems"] if "model.layers.0.mlp.down_proj.weight" in p]
    assert len(shape) == 1 and "[32, 48]" in shape[0] and "[32, 64]" in shape[0] and "intermediate_size 64" in shape[0]
    assert len(d["problems"]) == 3
    r = runner.invoke(app, ["recipe", "check", "llama", str(llama_copy.path)])
    assert r.exit_code == 1
    problems = [ln for ln in r.stderr.splitlines() if ln.startswith("problem: ")]
    assert len(problems) == 3 and "Traceback" not in r.stderr
    assert "model.layers.0.mlp.bonus.weight" in problems[0] and "blk.1.attn_output.weight" in problems[1]


def test_recipe_check_compares_a_tied_head(llama_copy: Ckpt):
    """`recipe check` (unlike planning) compares a head shipped by a tied model with the embeddings."""
    cfg = json.loads((llama_copy.path / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (llama_copy.path / "config.json").write_text(json.dumps(cfg))
    r = runner.invoke(app, ["recipe", "check", "llama", str(llama_copy.path), "--json"])
    assert r.exit_code == 1
    assert json.loads(r.stdout)["problems"] == [
        "config.json ties the output head to the embeddings (tie_word_embeddings), but lm_head.weight differs "
        "from model.embed_tokens.weight"]
    t = dict(llama_copy.tensors)
    t["lm_head.weight"] = t["model.embed_tokens.weight"]
    write_safetensors(llama_copy.path / "model.safetensors", t)
    r = runner.invoke(app, ["recipe", "check", "llama", str(llama_copy.path), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["ok"]


def test_recipe_check_wrong_family_and_unknown_recipe(ckpts):
    r = runner.invoke(app, ["recipe", "check", "llama", str(ckpts["qwen3"].path), "--json"])
    assert r.exit_code == 1
    d = json.loads(r.stdout)
    assert any("q_norm" in u for u in d["unmapped"])
    r = runner.invoke(app, ["recipe", "check", "nosuch", str(ckpts["qwen3"].path)])
    assert r.exit_code == 1
    assert_one_line_error(r.stderr, "no recipe named 'nosuch'", "llama, mistral", "qwen2, qwen2_moe, qwen3")


# ---------------------------------------------------------------- invalid recipe files

BAD = {
    "bad_toml": ('name = "bad"\narchitectures = ["X"\n', ["invalid TOML"]),
    "unknown_key": ('name = "u"\narchitectures = ["X"]\nmapping = 1\n[tensors]\n"token_embd.weight" = "e"\n',
                    ["mapping", "unknown key"]),
    "bad_canonical": ('name = "c"\narchitectures = ["X"]\n[tensors]\n"blk.{L}.attn_qq.weight" = "model.{L}.q"\n',
                      ["tensors.'blk.{L}.attn_qq.weight'", "not a canonical THIN name"]),
    "global_with_layer": ('name = "g"\narchitectures = ["X"]\n[tensors]\n"blk.{L}.token_embd.weight" = "m.{L}.e"\n',
                          ["tensors.'blk.{L}.token_embd.weight'", "not a canonical THIN name"]),
    "layer_mismatch": ('name = "l"\narchitectures = ["X"]\n[tensors]\n"blk.{L}.attn_q.weight" = "model.q.weight"\n',
                       ["tensors.'blk.{L}.attn_q.weight'", "{L}", "model.q.weight"]),
    "layer_in_global": ('name = "l2"\narchitectures = ["X"]\n[tensors]\n"token_embd.weight" = "model.{L}.e"\n',
                        ["tensors.'token_embd.weight'", "{L}"]),
    "cycle": ('name = "cyc_a"\nextends = "cyc_b"\narchitectures = ["X"]\n', ["extends", "cycle", "cyc_a", "cyc_b"]),
    "unknown_extends": ('name = "orphan"\nextends = "nope"\narchitectures = ["X"]\n', ["extends", "'nope'"]),
    "bad_metadata": ('name = "m"\nextends = "llama"\narchitectures = ["X"]\n[metadata]\nqk_nrom = true\n',
                     ["metadata", "qk_nrom"]),
    "bad_name": ('name = "My Recipe"\narchitectures = ["X"]\n[tensors]\n"token_embd.weight" = "e"\n', ["name"]),
    "no_architectures": ('name = "na"\n[tensors]\n"token_embd.weight" = "e"\n', ["architectures"]),
    "quantize_norm": ('name = "q"\nextends = "llama"\narchitectures = ["X"]\nquantizable = ["*norm.weight"]\n',
                      ["quantizable", "*norm.weight"]),
    "keep_dtype": ('name = "k"\nextends = "llama"\narchitectures = ["X"]\n[keep]\n"ffn_*" = "q3_k"\n',
                   ["keep", "q3_k"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_invalid_recipe_file(case, tmp_path):
    text, needles = BAD[case]
    path = tmp_path / f"{case}.toml"
    path.write_text(text)
    if case == "cycle":
        (tmp_path / "cyc_b.toml").write_text('name = "cyc_b"\nextends = "cyc_a"\narchitectures = ["Y"]\n')
    with pytest.raises(RecipeError) as e:
        load_registry([tmp_path])
    msg = str(e.value)
    assert "\n" not in msg
    assert str(tmp_path) in msg and (f"{case}.toml" in msg or "cyc_b.toml" in msg)
    for n in needles:
        assert n in msg, (n, msg)
    # the CLI: one line, exit 1, for listing and for converting
    r = runner.invoke(app, ["recipes", "--recipes", str(tmp_path)])
    assert r.exit_code == 1
    assert_one_line_error(r.stderr, *needles)
    r = runner.invoke(app, ["convert", "whatever", str(tmp_path / "o.thin"), "--recipes", str(tmp_path)])
    assert r.exit_code == 1
    assert_one_line_error(r.stderr, *needles)


@pytest.mark.slow
def test_invalid_recipe_via_env_in_a_subprocess(tmp_path, ckpts):
    """A broken $THINCONV_RECIPES recipe: the CLI still starts, and says what is wrong in one line."""
    (tmp_path / "broken.toml").write_text('name = "broken"\narchitectures = ["X"]\nfrobnicate = true\n')
    r = run_cli("convert", ckpts["llama2"].path, tmp_path / "o.thin", env={"THINCONV_RECIPES": str(tmp_path)})
    assert r.returncode == 1
    assert_one_line_error(r.stderr, str(tmp_path / "broken.toml"), "frobnicate")
    assert leftovers(tmp_path) == ["broken.toml"]


def test_missing_recipe_folder(tmp_path):
    r = runner.invoke(app, ["recipes", "--recipes", str(tmp_path / "nope")])
    assert r.exit_code == 1
    assert_one_line_error(r.stderr, str(tmp_path / "nope"), "does not exist")


# ---------------------------------------------------------------- registered transforms

@register_transform("test_negate_and_shift")
def _negate_and_shift(rows, *, name, start, end, model):
    assert model["architecture"] == "neg" and end - start == rows.shape[0]
    return -rows.astype(np.float32) + 0.5


@register_transform("test_bad_shape")
def _bad_shape(rows, *, name, start, end, model):
    return rows[1:]


def _transform_recipe(tmp_path: Path, transform: str) -> Path:
    d = tmp_path / "tr"
    d.mkdir(exist_ok=True)
    (d / "neg.toml").write_text(f'name = "neg"\nextends = "llama"\narchitectures = ["LlamaForCausalLM"]\n'
                                f'[transforms]\n"ffn_up.weight" = "{transform}"\n"attn_norm.weight" = "{transform}"\n')
    return d


def _convert(src: Path, out: Path, recipes: Path, **opts):
    reg = load_registry([recipes])
    with open_checkpoint(src) as ck:
        plan = plan_conversion(ck, reg.for_architecture(ck.config["architectures"]), ConvertOptions(**opts))
        return convert(ck, plan, out)


@pytest.mark.parametrize("kind", ["llama3", "llama2"])
def test_registered_transform_is_applied(ckpts, kind, tmp_path):
    c = ckpts[kind]
    d = _transform_recipe(tmp_path, "test_negate_and_shift")
    res = _convert(c.path, tmp_path / "t.thin", d, page_size=4096)  # several pages per ffn_up
    thin = Thin.read(res.path)
    assert thin.manifest["model"]["architecture"] == "neg"
    for t in thin.manifest["tensors"]:
        if t["name"] == "rope_freqs":
            continue
        src = c.tensors[hf_source_name(t["name"])]
        got = thin.array(t["name"])
        if t["role"] in ("ffn_up.weight", "attn_norm.weight"):
            want = (-src.astype(np.float32) + 0.5).astype(got.dtype)
            assert t["dtype"] == ("f32" if src.ndim == 1 else c.dtype)
        else:
            want = src.astype(got.dtype)
        assert got.tobytes() == want.tobytes(), t["name"]
    assert len(thin.tensor_entry("blk.0.ffn_up.weight")["pages"]) > 1 or c.dtype == "bf16"


def test_unregistered_or_bad_transform(ckpts, tmp_path):
    d = _transform_recipe(tmp_path, "test_never_registered")
    with pytest.raises(RecipeError, match="test_never_registered.*not registered"):
        _convert(ckpts["llama2"].path, tmp_path / "a.thin", d)
    shutil.rmtree(d)
    d = _transform_recipe(tmp_path, "test_bad_shape")
    with pytest.raises(ConversionError, match=r"test_bad_shape.*changed the shape of blk\.0\.attn_norm\.weight rows \[0, 32\)"):
        _convert(ckpts["llama2"].path, tmp_path / "b.thin", d)
    assert leftovers(tmp_path) == ["tr"]


# ---------------------------------------------------------------- several source tensors for one canonical tensor

def test_sources_concatenated_along_rows(llama_copy: Ckpt, tmp_path):
    """A recipe listing two sources concatenates them on dim 0 — across page boundaries, and before
    the interleave permutation (which must see the whole tensor's head structure)."""
    t = dict(llama_copy.tensors)
    for layer in range(2):
        p = f"model.layers.{layer}."
        k, g = t.pop(p + "self_attn.k_proj.weight"), t.pop(p + "mlp.gate_proj.weight")
        t[p + "self_attn.k_a.weight"], t[p + "self_attn.k_b.weight"] = k[:5], k[5:]  # not on a head boundary
        t[p + "mlp.gate_a.weight"], t[p + "mlp.gate_b.weight"] = g[:20], g[20:]  # inside the first 4 KiB page
    write_safetensors(llama_copy.path / "model.safetensors", t)
    cfg = json.loads((llama_copy.path / "config.json").read_text())
    cfg["architectures"] = ["SplitForCausalLM"]
    (llama_copy.path / "config.json").write_text(json.dumps(cfg))
    d = tmp_path / "split"
    d.mkdir()
    (d / "split.toml").write_text('''
name = "split"
extends = "llama"
architectures = ["SplitForCausalLM"]
[tensors]
"blk.{L}.attn_k.weight" = ["model.layers.{L}.self_attn.k_a.weight", "model.layers.{L}.self_attn.k_b.weight"]
"blk.{L}.ffn_gate.weight" = ["model.layers.{L}.mlp.gate_a.weight", "model.layers.{L}.mlp.gate_b.weight"]
''')
    res = _convert(llama_copy.path, tmp_path / "s.thin", d, page_size=4096, rope_layout="interleaved")
    thin = Thin.read(res.path)
    src = llama_copy.tensors
    for layer in range(2):
        gate = thin.tensor_entry(f"blk.{layer}.ffn_gate.weight")
        assert gate["source"] == [f"model.layers.{layer}.mlp.gate_a.weight", f"model.layers.{layer}.mlp.gate_b.weight"]
        assert len(gate["pages"]) == 2
        assert thin.raw(f"blk.{layer}.ffn_gate.weight") == src[f"model.layers.{layer}.mlp.gate_proj.weight"].tobytes()
        k = src[f"model.layers.{layer}.self_attn.k_proj.weight"].reshape(4, 8, 32)  # (heads, head_dim, hidden)
        want = np.empty_like(k)
        want[:, 0::2], want[:, 1::2] = k[:, :4], k[:, 4:]  # new row 2i = old i, 2i+1 = old i + 4
        assert np.array_equal(thin.array(f"blk.{layer}.attn_k.weight"), want.reshape(32, 32))
    r = runner.invoke(app, ["verify", str(res.path)])
    assert r.exit_code == 0
    # a part with the wrong width is named in the shape error
    t["model.layers.1.mlp.gate_b.weight"] = np.zeros((44, 31), np.float32)
    write_safetensors(llama_copy.path / "model.safetensors", t)
    with pytest.raises(ConversionError, match=r"gate_a\.weight, model\.layers\.1\.mlp\.gate_b\.weight "
                                              r"\(blk\.1\.ffn_gate\.weight\) has shape \[\[20, 32\], \[44, 31\]\]"):
        _convert(llama_copy.path, tmp_path / "s2.thin", d)


@register_transform("test_add_row_index")
def _add_row_index(rows, *, name, start, end, model):
    index = np.arange(start, end, dtype=np.float32)
    return rows.astype(np.float32) + (index[:, None] if rows.ndim == 2 else index)


@pytest.mark.parametrize("kind", ["llama2", "qwen3"])
def test_transform_sees_source_rows_before_the_interleave(ckpts, kind, tmp_path):
    """A transform gets rows in source order with their source row numbers (docs: "a page's rows in
    source order"); the interleave permutation applies to its result, as it would to the source."""
    c = ckpts[kind]
    d = tmp_path / "tr"
    d.mkdir()
    family = c.model["architecture"]
    (d / "rowidx.toml").write_text(f'name = "rowidx"\nextends = "{family}"\narchitectures = ["{c.arch}"]\n'
                                   '[transforms]\n"attn_q.weight" = "test_add_row_index"\n'
                                   '"attn_k*" = "test_add_row_index"\n')
    res = _convert(c.path, tmp_path / "r.thin", d, rope_layout="interleaved", page_size=4096)
    thin = Thin.read(res.path)
    hd = c.model["head_dim"]
    names = ("blk.0.attn_q.weight", "blk.1.attn_k.weight") + (("blk.1.attn_k_norm.weight",) if kind == "qwen3" else ())
    for name in names:
        src = c.tensors[hf_source_name(name)].astype(np.float32)
        rows = np.arange(src.shape[0], dtype=np.float32)
        fixed = src + (rows[:, None] if src.ndim == 2 else rows)
        want = interleave_reference(fixed, hd, hd).astype(thin.array(name).dtype)
        assert thin.array(name).tobytes() == want.tobytes(), name


def test_reserved_recipe_names_are_exactly_the_cli_commands():
    """recipe.RESERVED_NAMES keeps recipes from shadowing a command; it must track the CLI's list."""
    from thinconv.cli import app
    from thinconv.recipe import RESERVED_NAMES, load_registry

    commands = {c.name or c.callback.__name__ for c in app.registered_commands}
    commands |= {g.name for g in app.registered_groups}
    assert commands - set(load_registry().recipes) == RESERVED_NAMES
