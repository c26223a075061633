"""Issue 17, "Tracebacks and unbounded work on malformed input": each case a fuzzer found is here,
refused with one short line naming the field (exit 1, or a failed `verify`), no traceback, and in
bounded memory (tracemalloc) and time — and the fuzzers themselves at a small budget.

Archives are made by editing the manifest of a valid tiny archive and laying it out again with
its hashes fixed up (test_format_layout.with_manifest), so every edit reaches the validator and
verify's computed checks. Checkpoints are copies of examples/tiny-llama with one edit.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import load_safetensors_file, write_safetensors
from factory import make_archive_inputs, tiny_model
from test_format_layout import canonical, from_inputs, with_manifest
from thinconv.cli import app
from thinconv.errors import MAX_MESSAGE, listed, one_line

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny-llama"
MEMORY = 64 * 2**20  # bytes a refusal may allocate (tracemalloc); the bugs took 470 MB to 24 GB
SECONDS = 20  # a refusal is immediate; the bugs ran 30 s to minutes (a bound, not a benchmark)

runner = CliRunner()
MANIFEST, SOURCES, _ = make_archive_inputs(tiny_model(), page_size=4096)
BUF = from_inputs(MANIFEST, SOURCES)


def _invoke(*args) -> tuple[object, int]:
    """Run the CLI in-process: (result, peak bytes allocated), within SECONDS."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        r = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "250", "NO_COLOR": "1"})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < SECONDS
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return r, peak


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


# ---------------------------------------------------------------- archives: verify and inspect

def _model_edit(**changes):
    def edit(m):
        for path, value in changes.items():
            obj = m["model"]
            *parents, last = path.split("__")
            for k in parents:
                obj = obj[k]
            obj[last] = value
        return canonical(m)
    return edit


def _yarn(**params):
    return _model_edit(rope__theta=params.pop("theta", 10000.0),
                       rope__scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, **params})


def _raw(old: bytes, new: bytes):
    def edit(m):
        text = canonical(m)
        assert old in text
        return text.replace(old, new, 1)
    return edit


def _num_layers(n: int, layer_types: bool):
    def edit(m):
        m["model"]["num_layers"] = n
        if layer_types:
            m["model"]["attention"]["layer_types"] = ["full"] * n
        else:
            del m["model"]["attention"]["layer_types"]
        return canonical(m)
    return edit


def _huge_vocab(m):
    """vocab_size and both vocabulary tensors claim 2^40 rows, pages included: consistent within the
    manifest, contradicted by the page table (the file is 60 KiB)."""
    n = 2**40
    m["model"]["vocab_size"] = n
    for t in m["tensors"]:
        if t["name"] in ("token_embd.weight", "output.weight"):
            t["shape"] = [n, 8]
    for p in m["pages"]:
        if p.get("tensor") in ("token_embd.weight", "output.weight"):
            p["rows"], p["size"] = [0, n], n * 32
    return canonical(m)


# name → (manifest edit, what the one line must name). Every case must fail `verify`.
ARCHIVES = {
    "norm_eps_1e400": (_raw(b'"eps":1e-05', b'"eps":1e400'), ["manifest", "1e400", "overflows"]),
    "shape_of_4299_digits": (_raw(b'"shape":[12,8]', b'"shape":[' + b"9" * 4299 + b",8]"), ["4299 digits"]),
    "yarn_theta_1": (_yarn(theta=1.0), ["model.rope", "ZeroDivisionError"]),
    "yarn_math_domain": (_yarn(beta_fast=1e308), ["model.rope", "math domain"]),
    "yarn_overflow": (_yarn(factor=1e308), ["model.rope", "not finite"]),
    "yarn_beta_slow_list": (_yarn(beta_slow=[1]), ["model.rope", "list"]),
    "yarn_beta_slow_string": (_yarn(beta_slow="x"), ["model.rope", "'x'"]),
    "num_layers_1e9": (_num_layers(10**9, layer_types=False), ["model.attention.layer_types", "missing"]),
    "num_layers_1e9_one_type": (_model_edit(num_layers=10**9), ["layer_types", "num_layers = 1000000000"]),
    "num_layers_1e5_with_types": (_num_layers(10**5, layer_types=True), ["model.num_layers", "only 13 tensors"]),
    "dims_beyond_the_file": (_huge_vocab, ["token_embd.weight", "page table says"]),
    # rope_freqs (the true table for theta 10000) contradicts model.rope, whose table overflows:
    "rope_theta_1e-300": (_model_edit(rope__theta=1e-300), ["model.rope", "not finite"]),
    "rope_linear_factor_0": (_model_edit(rope__scaling={"type": "linear", "factor": 0.0}), ["model.rope"]),
    "rope_theta_1e308": (_model_edit(rope__theta=1e308), ["model.rope", "not finite"]),
}


@pytest.fixture
def hostile_archive(request, tmp_path) -> tuple[Path, list[str]]:
    edit, needles = ARCHIVES[request.param]
    path = tmp_path / "hostile.thin"
    path.write_bytes(with_manifest(BUF, edit(copy.deepcopy(MANIFEST))))
    return path, needles


@pytest.mark.parametrize("hostile_archive", sorted(ARCHIVES), indirect=True)
def test_verify_refuses_hostile_archive(hostile_archive):
    path, needles = hostile_archive
    r, peak = _invoke("verify", path)
    assert r.exit_code == 1, r.output
    lines = _lines(r.stderr)
    assert lines[0].startswith("FAIL ") and lines[-1] == f"{path}: INVALID ({len(lines) - 1} problem" + \
        ("s)" if len(lines) > 2 else ")")
    assert "Traceback" not in r.output
    assert all(len(ln) <= MAX_MESSAGE for ln in lines), lines
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert peak < MEMORY, f"{peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("hostile_archive", sorted(ARCHIVES), indirect=True)
def test_inspect_hostile_archive_is_one_line_or_a_summary(hostile_archive):
    """inspect shows what the manifest says (it does not evaluate RoPE: verify does); a manifest it
    cannot read is one `error:` line. Never a traceback, never unbounded work."""
    path, needles = hostile_archive
    r, peak = _invoke("inspect", path)
    assert peak < MEMORY, f"{peak / 2**20:.0f} MiB"
    if "model.rope" in needles:  # structurally valid: inspect summarizes it
        assert r.exit_code == 0, r.output
        return
    assert r.exit_code == 1
    line, = _lines(r.stderr)
    assert line.startswith("error: ") and len(line) <= MAX_MESSAGE
    for n in needles:
        assert n in line, (n, line)


def test_hostile_archive_json_error_is_short(tmp_path):
    """--json carries the same clipped one-line message."""
    m = copy.deepcopy(MANIFEST)
    m["model"]["hidden_size"] = 9  # every tensor's shape now contradicts the model: 12 errors
    path = tmp_path / "h.thin"
    path.write_bytes(with_manifest(BUF, canonical(m)))
    r, _ = _invoke("inspect", path, "--json")
    message = json.loads(r.stdout)["error"]["message"]
    assert r.exit_code == 1 and len(message) <= MAX_MESSAGE and "\n" not in message
    assert "(12 errors)" in message and "and 9 more" in message
    r, _ = _invoke("verify", path, "--json")
    failure, = json.loads(r.stdout)["failures"]
    assert len(failure) <= MAX_MESSAGE and "and 9 more" in failure


# ---------------------------------------------------------------- checkpoints: convert

def _config(**changes) -> str:
    config = json.loads((EXAMPLE / "config.json").read_text())
    config.update(changes)
    return json.dumps(config, indent=2)


def _rope(**params) -> str:
    return _config(rope_parameters=params)


def _nested(depth: int) -> str:
    return _config()[:-2] + ', "deep": ' + "[" * depth + "]" * depth + "}"


def _duplicate_key() -> str:
    return _config()[:-2] + ',\n  "hidden_size": 64\n}'


# name → (config.json text, what the one line must name)
CHECKPOINTS = {
    "rope_theta_1e-300": (_rope(rope_type="default", rope_theta=1e-300), ["config.json", "rope_theta", "1e-300",
                                                                          "not finite"]),
    "linear_factor_0": (_rope(rope_type="linear", rope_theta=10000.0, factor=0.0), ["config.json", "rope_parameters",
                                                                                   "linear"]),
    "yarn_theta_1": (_rope(rope_type="yarn", rope_theta=1.0, factor=4.0, original_max_position_embeddings=64),
                     ["config.json", "rope_theta", "theta 1.0", "yarn", "ZeroDivisionError"]),
    "yarn_beta_slow_list": (_rope(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=64,
                                  beta_slow=[1]), ["config.json", "beta_slow", "[1]"]),
    "yarn_beta_slow_string": (_rope(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=64,
                                    beta_slow="x"), ["config.json", "beta_slow", "'x'"]),
    "nested_1000_deep": (_nested(1000), ["config.json", "nested too deeply"]),
    "nested_100000_deep": (_nested(100000), ["config.json", "nested too deeply"]),
    "architectures_of_ints": (_config(architectures=[1]), ["config.json", "'architectures'", "list of class names"]),
    "architectures_a_string": (_config(architectures="Qwen2ForCausalLM"), ["config.json", "'architectures'",
                                                                           "got Qwen2ForCausalLM"]),
    "num_hidden_layers_2e63": (_config(num_hidden_layers=2**63), ["num_hidden_layers", str(2**63), "20 tensors"]),
    "num_hidden_layers_1e5": (_config(num_hidden_layers=10**5), ["num_hidden_layers", "100000", "20 tensors"]),
    "num_hidden_layers_1e6": (_config(num_hidden_layers=10**6), ["num_hidden_layers", "1000000", "20 tensors"]),
    "num_hidden_layers_1e7": (_config(num_hidden_layers=10**7), ["num_hidden_layers", "10000000", "20 tensors"]),
    "head_dim_2e40": (_config(head_dim=2**40), ["config.json", "head_dim", str(2**40), "largest tensor"]),
    "duplicate_key": (_duplicate_key(), ["config.json", "duplicate key 'hidden_size'"]),
    "number_1e400": (_config()[:-2] + ',\n  "rms_norm_eps": 1e400\n}', ["config.json", "1e400"]),
    "hidden_act_a_list": (_config(hidden_act=["silu"]), ["config.json", "hidden_act", "['silu']"]),
    "list_of_3000_where_a_flag_belongs": (_config(mlp_bias=["llama3"] * 3000), ["config.json", "mlp_bias", "..."]),
}


@pytest.fixture
def hostile_checkpoint(request, tmp_path) -> tuple[Path, list[str]]:
    text, needles = CHECKPOINTS[request.param]
    src = tmp_path / "src"
    shutil.copytree(EXAMPLE, src)
    (src / "config.json").write_text(text)
    return src, needles


@pytest.mark.parametrize("hostile_checkpoint", sorted(CHECKPOINTS), indirect=True)
def test_convert_refuses_hostile_config(hostile_checkpoint, tmp_path):
    src, needles = hostile_checkpoint
    out = tmp_path / "o.thin"
    r, peak = _invoke("convert", src, out, "--no-probe")
    assert r.exit_code == 1, r.output
    line, = _lines(r.stderr)
    assert line.startswith("error: ") and len(line) <= MAX_MESSAGE, line
    for n in needles:
        assert n in line, (n, line)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert peak < MEMORY, f"{peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("nesting", ["[", "{a = "])
def test_recipe_nested_5000_deep(tmp_path, nesting):
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    close = "]" if nesting == "[" else "}"
    inner = "" if nesting == "[" else "1"
    (recipes / "deep.toml").write_text('name = "deep"\narchitectures = ["DeepForCausalLM"]\nx = '
                                       + nesting * 5000 + inner + close * 5000 + "\n")
    for args in (["recipes"], ["convert", EXAMPLE, tmp_path / "o.thin", "--no-probe"]):
        r, _ = _invoke(*args, "--recipes", recipes)
        assert r.exit_code == 1, r.output
        line, = _lines(r.stderr)
        assert line == f"error: {recipes / 'deep.toml'}: invalid TOML (nested too deeply)"


def test_safetensors_shape_of_huge_dimensions(tmp_path):
    """A header shape whose product has thousands of digits: refused without multiplying it out."""
    src = tmp_path / "src"
    shutil.copytree(EXAMPLE, src)
    path = src / "model.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = "model.norm.weight"
    header[name]["shape"] = [2**64 - 1] * 300
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])
    r, _ = _invoke("convert", src, tmp_path / "o.thin", "--no-probe")
    assert r.exit_code == 1
    line, = _lines(r.stderr)
    assert name in line and "2^64 bytes" in line and len(line) <= MAX_MESSAGE


# ---------------------------------------------------------------- messages: a few items, then "and N more"

def test_listed_and_one_line():
    assert listed(["a", "b"]) == "a, b"
    assert listed(list("abcdef")) == "a, b, c and 3 more"
    assert listed(["x; y", "z", "w"], 1, "; ") == "x; y; and 2 more"
    text = "where: " + "x" * 1000 + " expected this"
    clipped = one_line(text)
    assert len(clipped) == MAX_MESSAGE and clipped.startswith("where: ") and clipped.endswith("expected this")
    assert one_line("a\nb") == "a b"


def test_500_unmapped_tensors_is_one_short_line(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(EXAMPLE, src)
    tensors = load_safetensors_file(src / "model.safetensors")
    extra = {f"model.layers.0.mlp.extra_{i:03d}.weight": tensors["model.norm.weight"] for i in range(500)}
    write_safetensors(src / "model.safetensors", {**tensors, **extra})
    r, _ = _invoke("convert", src, tmp_path / "o.thin", "--no-probe")
    assert r.exit_code == 1
    line, = _lines(r.stderr)
    assert len(line) <= MAX_MESSAGE
    assert "500 source tensor(s) not mapped" in line and "model.layers.0.mlp.extra_000.weight" in line
    assert "extra_002.weight and 497 more" in line and "extra_499" not in line


def test_unknown_architectures_listed_briefly(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(EXAMPLE, src)
    (src / "config.json").write_text(_config(architectures=[f"Fancy{i}ForCausalLM" for i in range(300)]))
    r, _ = _invoke("convert", src, tmp_path / "o.thin", "--no-probe")
    assert r.exit_code == 1
    line, = _lines(r.stderr)
    assert len(line) - len(str(src)) <= MAX_MESSAGE  # the user's path aside
    assert "architecture Fancy0ForCausalLM, Fancy1ForCausalLM and 298 more is not handled" in line
    assert re.search(r"add one with --recipes DIR or \$THINCONV_RECIPES \(guide: [^()]+adding-an-architecture.md\)$", line)


# ---------------------------------------------------------------- assets: bounded chunks, a size limit

def test_asset_streamed_in_bounded_memory(tmp_path):
    """A 300 MB tokenizer.json with --page-size 1GiB: the conversion's peak RSS stays far below the
    asset's size (it read the whole page at once: 373 MB before). Measured in a child, as VmHWM
    (ru_maxrss would carry this test process's own peak over fork and exec)."""
    src = tmp_path / "src"
    shutil.copytree(EXAMPLE, src)
    size = 300 * 2**20
    with open(src / "tokenizer.json", "wb") as f:
        f.truncate(size)  # sparse: no disk or page cache to prepare
    out = tmp_path / "o.thin"
    code = ("import sys\nfrom thinconv.cli import main\nsys.argv = ['thinconv', 'convert', sys.argv[1], "
            "sys.argv[2], '--no-probe', '--page-size', '1GiB']\ntry:\n    main()\nexcept SystemExit as e:\n"
            "    assert not e.code, e.code\n"
            "print(next(int(ln.split()[1]) * 1024 for ln in open('/proc/self/status') if ln.startswith('VmHWM')))\n")
    r = subprocess.run([sys.executable, "-c", code, str(src), str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    peak = int(r.stdout.split()[-1])
    assert peak < size / 2, f"peak RSS {peak / 2**20:.0f} MiB for a {size // 2**20} MiB asset"
    from thinconv.format import open_archive

    with open_archive(out) as a:
        assert a.verify().ok
        info = next(x for x in a.manifest["assets"] if x["name"] == "tokenizer.json")
        assert info["size"] == size and len(info["pages"]) == 1


def test_asset_beyond_the_limit_is_refused(tmp_path):
    from thinconv.format.spec import MAX_ASSET_SIZE

    src = tmp_path / "src"
    shutil.copytree(EXAMPLE, src)
    with open(src / "tokenizer.json", "wb") as f:
        f.truncate(MAX_ASSET_SIZE + 1)
    r, _ = _invoke("convert", src, tmp_path / "o.thin")
    assert r.exit_code == 1
    line, = _lines(r.stderr)
    assert line == (f"error: {src / 'tokenizer.json'}: {MAX_ASSET_SIZE + 1} bytes, beyond the 2 GiB an embedded file "
                    f"may have (FORMAT.md §2.6)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


# ---------------------------------------------------------------- the fuzzers, at a small budget

@pytest.fixture(scope="module")
def bench_path():
    sys.path.insert(0, str(ROOT / "bench"))
    yield
    sys.path.remove(str(ROOT / "bench"))


@pytest.mark.parametrize("script, cases", [("fuzz_archives", 300), ("fuzz_checkpoints", 150)])
def test_fuzzer_small_budget(bench_path, script, cases):
    """A few hundred mutated archives / checkpoints: every one rejected cleanly or accepted (a
    converted one verifies), none crashes, none over 5 s or 500 MB. The large runs: bench/RESULTS.md."""
    import importlib

    tally = importlib.import_module(script).fuzz(cases, seed=0)
    counts = tally.counts
    assert counts["crashed"] == 0, tally.crashes
    assert counts["over_time"] == 0 and counts["over_memory"] == 0, (tally.slow, tally.heavy)
    assert counts["rejected"] + counts["accepted"] == cases
    assert counts["rejected"] > cases // 2 and counts["accepted"] > 0  # the mutations do reach both outcomes
