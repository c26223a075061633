"""The conversion commands of the CLI: --dry-run / --json plans, per-recipe sub-commands."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import Thin, assert_one_line_error, expected_names, hf_source_name, leftovers, run_cli, \
    write_safetensors
from thinconv import cli
from thinconv.checkpoint.safetensors import SafetensorsFile
from thinconv.checkpoint.source import Checkpoint

runner = CliRunner()
FAMILY = {"llama3": "llama", "llama2": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
          "sharded": "llama"}


@pytest.fixture(scope="module")
def app():
    """The CLI with its per-recipe sub-commands, as `main()` registers them for the built-in recipes."""
    if not any(c.name == "qwen2" for c in cli.app.registered_commands):
        cli.register_recipe_commands([])
    return cli.app


@pytest.fixture
def no_tensor_reads(monkeypatch):
    """Any read of tensor data fails the test."""

    def boom(self, name, *a, **k):
        raise AssertionError(f"tensor data of {name} was read")

    monkeypatch.setattr(Checkpoint, "array", boom)
    monkeypatch.setattr(SafetensorsFile, "array", boom)


def _reference(app, src, tmp_path, *opts) -> Thin:
    out = tmp_path / "ref.thin"
    r = runner.invoke(app, ["convert", str(src), str(out), "--no-probe", *opts])
    assert r.exit_code == 0, r.output
    return Thin.read(out)


# ---------------------------------------------------------------- --dry-run

@pytest.mark.parametrize("opts", [[], ["--dtype", "q4_0", "--page-size", "4KiB", "--keep", "ffn_down*=f32"]])
def test_dry_run_json_is_the_full_plan(app, ckpt, tmp_path, opts, request):
    """The plan matches the archive a real conversion writes, tensor by tensor and page by page,
    and was made without reading any tensor data; nothing is written."""
    ref = _reference(app, ckpt.path, tmp_path, *opts)
    request.getfixturevalue("no_tensor_reads")
    out = tmp_path / "dry.thin"
    r = runner.invoke(app, ["convert", str(ckpt.path), str(out), "--dry-run", "--json", *opts])
    assert r.exit_code == 0, (r.output, r.exception)
    plan = json.loads(r.stdout)
    assert leftovers(tmp_path) == ["ref.thin"]
    m = ref.manifest
    assert plan["recipe"] == FAMILY[ckpt.kind] and plan["model"] == m["model"] == ckpt.model
    assert plan["options"]["dtype"] == (opts[1] if opts else "auto")
    assert [t["name"] for t in plan["tensors"]] == expected_names(ckpt.model)
    by_name = {t["name"]: t for t in m["tensors"]}
    sizes = {p["id"]: p["size"] for p in m["pages"]}
    for t in plan["tensors"]:
        got = by_name[t["name"]]
        assert t["shape"] == got["shape"] and t["dtype"] == got["dtype"] and t["source"] == got["source"]
        assert t["pages"] == len(got["pages"]) and t["bytes"] == sum(sizes[p] for p in got["pages"])
        assert t["role"] == got["role"]
        if t["name"] != "rope_freqs":
            assert t["source_dtype"] == {"float32": "f32", "bfloat16": "bf16"}[
                str(ckpt.tensors[hf_source_name(t["name"])].dtype)]
    assert [(a["name"], a["size"], a["pages"]) for a in plan["assets"]] == \
        [(a["name"], a["size"], len(a["pages"])) for a in m["assets"]]
    assert plan["page_count"] == len(m["pages"])
    assert plan["bytes"] == sum(sizes.values())
    if opts:
        dtypes = {t["role"]: t["dtype"] for t in plan["tensors"]}
        assert dtypes["ffn_down.weight"] == "f32" and dtypes["ffn_up.weight"] == "q4_0"
        assert dtypes["attn_norm.weight"] == "f32"
        head = "token_embd.weight" if ckpt.model["tie_word_embeddings"] else "output.weight"
        assert dtypes[head] == "q8_0"  # the head is never below q8_0


def test_dry_run_table(app, ckpts, tmp_path, no_tensor_reads):
    out = tmp_path / "o.thin"
    out.write_bytes(b"keep me")  # a dry run fails as the real run would without --force, and never touches it
    r = runner.invoke(app, ["convert", str(ckpts["qwen3"].path), str(out), "--dry-run"], env={"COLUMNS": "250"})
    assert r.exit_code == 1 and "already exists (use --force to overwrite)" in r.stderr
    assert out.read_bytes() == b"keep me"
    r = runner.invoke(app, ["convert", str(ckpts["qwen3"].path), str(out), "--dry-run", "--force"],
                      env={"COLUMNS": "250"})
    assert r.exit_code == 0, (r.output, r.exception)
    assert "plan: recipe qwen3" in r.stdout and "dry run: nothing read or written" in r.stdout
    for name in ("rope_freqs", "blk.1.attn_k_norm.weight", "output.weight", "model.layers.1.self_attn.k_norm.weight"):
        assert name in r.stdout
    assert "assets: config.json, generation_config.json" in r.stdout
    assert out.read_bytes() == b"keep me" and leftovers(tmp_path) == ["o.thin"]


def test_dry_run_ignores_tensor_bytes(app, llama_copy, tmp_path, no_tensor_reads):
    """Corrupt every tensor byte (not the header): the plan is the same as for the intact file."""
    before = runner.invoke(app, ["convert", str(llama_copy.path), "x.thin", "--dry-run", "--json"])
    p = llama_copy.path / "model.safetensors"
    data = bytearray(p.read_bytes())
    n = int.from_bytes(data[:8], "little")
    data[8 + n:] = b"\xff" * (len(data) - 8 - n)  # all NaN
    p.write_bytes(bytes(data))
    after = runner.invoke(app, ["convert", str(llama_copy.path), "x.thin", "--dry-run", "--json"])
    assert before.exit_code == after.exit_code == 0
    assert json.loads(before.stdout) == json.loads(after.stdout)


def test_dry_run_still_reports_bad_input(app, llama_copy, tmp_path, no_tensor_reads):
    cfg = json.loads((llama_copy.path / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (llama_copy.path / "config.json").write_text(json.dumps(cfg))
    r = runner.invoke(app, ["convert", str(llama_copy.path), str(tmp_path / "o.thin"), "--dry-run"])
    assert r.exit_code == 1
    assert_one_line_error(r.stderr, "model.layers.0.mlp.gate_proj.weight", "[64, 32]", "[48, 32]",
                          "intermediate_size 48")


# ---------------------------------------------------------------- per-recipe sub-commands

def test_per_recipe_command_equals_convert(app, ckpt, tmp_path):
    ref = _reference(app, ckpt.path, tmp_path)
    out = tmp_path / "sub.thin"
    r = runner.invoke(app, [FAMILY[ckpt.kind], str(ckpt.path), str(out), "--no-probe"])
    assert r.exit_code == 0, r.output
    assert out.read_bytes() == ref.data


@pytest.mark.parametrize("family,kind", [("mistral", "llama2"), ("llama", "qwen2"), ("qwen3", "qwen2")])
def test_per_recipe_command_refuses_other_architectures(app, ckpts, family, kind, tmp_path):
    out = tmp_path / "o.thin"
    r = runner.invoke(app, [family, str(ckpts[kind].path), str(out)])
    assert r.exit_code == 1
    assert_one_line_error(r.stderr, ckpts[kind].arch, f"recipe {family!r}", "thinconv convert")
    assert not out.exists()


@pytest.mark.slow
def test_help_lists_the_recipe_commands():
    """The real entry point registers one sub-command per built-in recipe."""
    r = run_cli("--help")
    assert r.returncode == 0, r.stderr
    for name in ("convert", "recipes", "recipe", "llama", "mistral", "qwen2", "qwen3"):
        assert f" {name} " in r.stdout, name
    r = run_cli("qwen3", "--help")
    assert r.returncode == 0 and "Qwen3ForCausalLM" in r.stdout and "--dry-run" in r.stdout


def test_keep_and_dtype_usage_errors(app, ckpts, tmp_path):
    src = str(ckpts["llama2"].path)
    for args, needle in ((["--dtype", "q5_k"], "--dtype 'q5_k'"), (["--keep", "nonsense"], "ROLE_GLOB=DTYPE"),
                         (["--keep", "zz*=f16"], "matches no role"), (["--rope-layout", "neox"], "--rope-layout"),
                         (["--page-size", "lots"], "--page-size")):
        r = runner.invoke(app, ["convert", src, str(tmp_path / "o.thin"), *args])
        assert r.exit_code == 2, (args, r.output)
        assert_one_line_error(r.stderr, needle)
    assert leftovers(tmp_path) == []


def test_quantized_conversion_reads_back(app, ckpts, tmp_path):
    """Not a quantizer test (see test_quant.py): the converted q8_0 tensors decode close to the source."""
    c = ckpts["llama2"]
    thin = _reference(app, c.path, tmp_path, "--dtype", "q8_0")
    from thinconv.format.reader import open_archive

    with open_archive(tmp_path / "ref.thin") as a:
        assert a.verify().ok
        w = a.dequantize("blk.0.ffn_up.weight")
    src = c.tensors["model.layers.0.mlp.up_proj.weight"]
    assert thin.tensor_entry("blk.0.ffn_up.weight")["quant"] == {"scheme": "q8_0", "block_size": 32,
                                                                 "block_bytes": 34, "source_dtype": "f32"}
    assert np.abs(w - src).max() <= np.abs(src).max() / 127
    q = thin.manifest["validation"]["quant"]["blk.0.ffn_up.weight"]
    assert q["max_abs_err"] == pytest.approx(float(np.abs(w - src).max()), rel=1e-6)


def test_dry_run_of_tied_checkpoint_with_head_reads_no_data(app, llama_copy, tmp_path, request):
    """A tied model that ships lm_head.weight: comparing it with the embeddings reads data, so the
    plan leaves that to the conversion (test_convert_errors checks a differing head is refused)."""
    cfg = json.loads((llama_copy.path / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (llama_copy.path / "config.json").write_text(json.dumps(cfg))
    t = dict(llama_copy.tensors)
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
    write_safetensors(llama_copy.path / "model.safetensors", t)
    request.getfixturevalue("no_tensor_reads")
    r = runner.invoke(app, ["convert", str(llama_copy.path), str(tmp_path / "o.thin"), "--dry-run", "--json"])
    assert r.exit_code == 0, repr(r.exception)
    assert "lm_head.weight" in json.loads(r.stdout)["ignored"]
