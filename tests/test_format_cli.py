"""`thinconv inspect / verify / pack / unpack`: exit codes, messages, JSON fields, no heavy imports."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from factory import make_archive_inputs, tiny_model
from test_format_layout import base_archive, parse, with_manifest, write
from thinconv.cli import app
from thinconv.format import pack

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "250", "NO_COLOR": "1"}
HEAVY = ("torch", "transformers", "huggingface_hub")

VALIDATION = {
    "converter": {"name": "thinconv", "version": "0.1.0", "recipe": "llama"},
    "source": {"repo_id": "org/tiny", "revision": "main", "commit": "c0ffee" * 6 + "abcd",
               "files": [{"name": "model.safetensors", "size": 10, "sha256": None}]},
    "quant": {"token_embd.weight": {"rmse": 0.1, "max_abs_err": 0.5, "rel_rmse": 0.01},
              "output.weight": {"rmse": 0.3, "max_abs_err": 0.9, "rel_rmse": 0.2},
              "blk.0.ffn_up.weight": {"rmse": None, "max_abs_err": None, "rel_rmse": None, "note": "kept"}},
}


def run(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "250", "NO_COLOR": "1"})


def thinconv(*args, **kw) -> subprocess.CompletedProcess:
    """The real console entry point (main(): recipe sub-commands, SIGXFSZ) in a fresh interpreter."""
    return subprocess.run([sys.executable, "-c", "from thinconv.cli import main; main()", *map(str, args)],
                          capture_output=True, text=True, env=ENV, timeout=60, **kw)


@pytest.fixture
def archive(tmp_path) -> tuple[Path, dict, object]:
    manifest, sources, _ = make_archive_inputs(tiny_model(), dtype="bf16", page_size=64,
                                               assets={"config.json": b'{"a": 1}', "tokenizer.json": b"[]"})
    manifest["validation"] = copy.deepcopy(VALIDATION)
    path = tmp_path / "a.thin"
    return path, manifest, pack(manifest, sources, path)


def _corrupt(path: Path, offsets: list[int]) -> None:
    data = bytearray(path.read_bytes())
    for off in offsets:
        data[off] ^= 0xFF
    path.write_bytes(bytes(data))


# -- verify ----------------------------------------------------------------------------------------

def test_verify_ok(archive):
    path, _, _ = archive
    r = run("verify", path)
    assert r.exit_code == 0, r.output
    assert f"{path}: OK" in r.stdout and r.stderr.strip() == ""


def test_verify_lists_each_corrupt_page(archive):
    path, manifest, _ = archive
    parts = parse(path.read_bytes())
    bad = [parts.recs[2], parts.recs[9]]
    _corrupt(path, [r.offset for r in bad])
    r = run("verify", path)
    assert r.exit_code == 1
    fails = [line for line in r.stderr.splitlines() if line.startswith("FAIL")]
    assert fails == [f"FAIL page {x.id.decode()!r} at offset {x.offset}: checksum mismatch (data corrupted)"
                     for x in bad]
    assert "INVALID (2 problems)" in r.stderr
    j = run("verify", "--json", path)
    assert j.exit_code == 1
    out = json.loads(j.stdout)
    assert out["ok"] is False and len(out["failures"]) == 2 and out["path"] == str(path)
    assert out["bytes_checked"] == sum(p["size"] for p in manifest["pages"])


def test_verify_json_ok(archive):
    path, manifest, _ = archive
    r = run("verify", "--json", path)
    assert r.exit_code == 0
    assert json.loads(r.stdout) == {"path": str(path), "ok": True, "failures": [],
                                    "bytes_checked": sum(p["size"] for p in manifest["pages"])}


@pytest.mark.parametrize("args", [("verify",), ("verify", "--nope", "x"), ("inspect",), ("inspect", "a", "b"),
                                  ("pack", "only-one"), ("unpack",)])
def test_usage_errors_exit_2(args):
    assert run(*args).exit_code == 2


def test_verify_unopenable(tmp_path):
    r = run("verify", tmp_path / "missing.thin")
    assert r.exit_code == 1 and "cannot open" in r.stderr
    write(tmp_path, b"GGUF" + bytes(100), "g.thin")
    r = run("verify", tmp_path / "g.thin")
    assert r.exit_code == 1 and "bad magic" in r.stderr and "not a THIN archive" in r.stderr


@pytest.mark.slow
def test_truncated_file_one_line_no_traceback(archive):
    path, _, _ = archive
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5])
    r = thinconv("inspect", path)
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: a.thin: ") and "runs past the end of the file" in lines[0]
    r = thinconv("verify", path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    fails = [line for line in r.stderr.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 1 and "runs past the end of the file" in fails[0]


# -- inspect ---------------------------------------------------------------------------------------

def test_inspect_json(archive):
    path, manifest, result = archive
    r = run("inspect", "--json", path)
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    model = manifest["model"]
    sizes = {p["id"]: p["size"] for p in manifest["pages"]}
    assert s["path"] == str(path) and s["size"] == path.stat().st_size == result.size
    assert s["archive_hash"] == result.archive_hash and s["format_version"] == 0
    assert s["page_count"] == len(manifest["pages"]) and s["tensor_count"] == len(manifest["tensors"])
    assert s["tensor_bytes"] == sum(sizes[p] for t in manifest["tensors"] for p in t["pages"])
    assert s["model"] == {k: model[k] for k in s["model"]} and set(s["model"]) >= {"architecture", "hidden_size",
                                                                                    "num_layers", "vocab_size"}
    assert s["rope"] == model["rope"] and s["special_tokens"] == model["special_tokens"]
    assert "layer_types" not in s["attention"] and s["attention"]["scale"] == model["attention"]["scale"]
    assert {d["dtype"]: d["count"] for d in s["by_dtype"]} == {"f32": 4, "bf16": 9}
    assert sum(d["bytes"] for d in s["by_role"]) == s["tensor_bytes"]
    assert s["assets"] == [{"name": "config.json", "size": 8}, {"name": "tokenizer.json", "size": 2}]
    assert s["converter"] == VALIDATION["converter"]
    assert s["source"] == {k: v for k, v in VALIDATION["source"].items() if k != "files"}
    assert [q["tensor"] for q in s["quant"]["largest"]] == ["output.weight", "token_embd.weight"]
    assert "tensors" not in s


@pytest.mark.slow
def test_inspect_tensors(archive):
    path, manifest, _ = archive
    r = run("inspect", "--json", "--tensors", path)
    rows = json.loads(r.stdout)["tensors"]
    assert [t["name"] for t in rows] == [t["name"] for t in manifest["tensors"]]
    emb = rows[1]
    assert emb == {"name": "token_embd.weight", "dtype": "bf16", "shape": [12, 8], "bytes": 12 * 8 * 2, "pages": 3,
                   "source": ["token_embd.weight"]}
    text = thinconv("inspect", "--tensors", path)
    assert text.returncode == 0
    for t in manifest["tensors"]:
        assert t["name"] in text.stdout
    assert "12×8" in text.stdout


def test_inspect_text(archive):
    path, _, result = archive
    r = thinconv("inspect", path)
    assert r.returncode == 0 and r.stderr == ""
    assert result.archive_hash in r.stdout and "llama (LlamaForCausalLM)" in r.stdout
    commit = VALIDATION["source"]["commit"]  # the revision and the whole commit (a hash a user may copy)
    assert f"converted by  thinconv 0.1.0 (recipe llama) from org/tiny main @ {commit}" in r.stdout


# -- pack / unpack ----------------------------------------------------------------------------------

def test_unpack_pack_cli_round_trip(archive, tmp_path):
    path, manifest, _ = archive
    staged = tmp_path / "staged"
    r = run("unpack", path, staged)
    assert r.exit_code == 0, r.output
    assert f"{len(manifest['pages'])} page files" in r.stdout
    out = tmp_path / "b.thin"
    r = run("pack", staged, out)
    assert r.exit_code == 0, r.output
    assert out.read_bytes() == path.read_bytes()

    # refusing to overwrite without --force; the existing file is untouched
    out.write_bytes(b"precious")
    r = run("pack", staged, out)
    assert r.exit_code == 1 and "already exists (use --force to overwrite)" in r.stderr
    assert out.read_bytes() == b"precious"
    r = run("pack", "--force", staged, out)
    assert r.exit_code == 0 and out.read_bytes() == path.read_bytes()

    r = run("unpack", path, staged)
    assert r.exit_code == 1 and "is not empty (use --force to replace it)" in r.stderr
    assert run("unpack", "--force", path, staged).exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.thin", "b.thin", "staged"]


def test_pack_cli_refuses_invalid_staging(archive, tmp_path):
    path, _, _ = archive
    staged = tmp_path / "staged"
    assert run("unpack", path, staged).exit_code == 0
    m = json.loads((staged / "manifest.json").read_text())
    m["format_version"] = 1
    m["tensors"][2]["hints"]["access"] = "sometimes"
    (staged / "manifest.json").write_text(json.dumps(m))
    r = run("pack", staged, tmp_path / "c.thin")
    assert r.exit_code == 1
    assert "manifest is invalid (2 errors): format_version: " in r.stderr and "tensors[2].hints.access" in r.stderr
    assert not (tmp_path / "c.thin").exists()


# -- start-up: no heavy imports -----------------------------------------------------------------------

PROBE = """
import sys
from thinconv.cli import main
sys.argv = ["thinconv", *sys.argv[1:]]
try:
    main()
except SystemExit:
    pass
print("HEAVY=" + ",".join(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)
"""


@pytest.mark.slow
@pytest.mark.parametrize("command", [["inspect"], ["inspect", "--json", "--tensors"], ["verify"]])
def test_no_heavy_imports(archive, command):
    path, _, _ = archive
    r = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *command, str(path)], capture_output=True,
                       text=True, env=ENV, timeout=60)
    assert r.stderr.strip().splitlines()[-1] == "HEAVY=", r.stderr


def test_importtime_has_no_heavy_modules():
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", "import thinconv.cli, thinconv.format"],
                       capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 0
    names = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in r.stderr.splitlines() if "|" in line}
    assert "thinconv" in names and not names & set(HEAVY)


# -- messages are printed verbatim, not as rich markup ('[/x]' used to raise MarkupError, '[bold]' vanished) --

@pytest.mark.slow
@pytest.mark.parametrize("key", ["[/x]", "[bold]x"])
def test_messages_are_not_markup(tmp_path, key):
    buf, m, _, _ = base_archive()
    m = copy.deepcopy(m)
    m["validation"] = {"stats": {key: {"min": 0, "max": 0, "mean": 0, "std": 0, "nan": 0, "inf": 0}}}
    path = write(tmp_path, with_manifest(buf, m))
    for command in ("inspect", "verify"):
        r = thinconv(command, path)
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert f"validation.stats.{key}: names no tensor" in r.stderr


def test_reader_loads_numpy_only_for_tensor_reads(archive):
    """open / summarize (what inspect runs) do not import numpy; tensor() does (and so does
    verify, which reads rope_freqs to check it against model.rope)."""
    path, _, _ = archive
    code = f"""
import sys
from thinconv.format import open_archive
from thinconv.summary import summarize
with open_archive({str(path)!r}) as a:
    summarize(a, with_tensors=True)
    before = "numpy" in sys.modules or "ml_dtypes" in sys.modules
    a.tensor("token_embd.weight")
print(before, "ml_dtypes" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert r.stdout.split() == ["False", "True"], r.stderr
