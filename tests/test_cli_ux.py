"""One CLI, the same everywhere (issue 15, item 4): help, --version, -h, completion; --json on every
command with one vocabulary and a JSON error object; binary units; whole hashes; inspect's text; --dry-run
failing as the real run; the tensors kept wider than asked; hub ids without a network; truncated files and
safetensors files; and the README's shell commands, run as written."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from typer.testing import CliRunner

from conftest import BIN, run_cli
from hubcache import populate_hub_cache, use_hub_cache
from thinconv import cli
from thinconv.cli.app import BinarySpeedColumn, byte_progress, human

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny-llama"
runner = CliRunner()
PY_LITERALS = re.compile(r"\bNone\b|\bTrue\b|\bFalse\b|\[\d|\[\]|\['")


@pytest.fixture(scope="module")
def app():
    """The CLI with its per-recipe sub-commands, as `main()` registers them."""
    if not any(c.name == "qwen2" for c in cli.app.registered_commands):
        cli.register_recipe_commands([])
    return cli.app


def invoke(app, *args, columns: int = 200, **env):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": str(columns), "NO_COLOR": "1", **env},
                         prog_name="thinconv")


@pytest.fixture(scope="module")
def tiny(app, tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("ux")
    paths = {"bf16": base / "tiny.thin", "q4_0": base / "tiny-q4.thin"}
    for args in ([EXAMPLE, paths["bf16"]], [EXAMPLE, paths["q4_0"], "--dtype", "q4_0", "--no-probe"]):
        r = invoke(app, "convert", *args)
        assert r.exit_code == 0, r.output
    return paths


# ---------------------------------------------------------------- help, --version, -h, completion

def _commands(command, path=()):
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _commands(sub, (*path, name))


def test_version_and_short_help(app):
    from thinconv import __version__

    r = invoke(app, "--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"thinconv {__version__}"
    for args in (["-h"], ["--help"], ["inspect", "-h"], ["recipe", "check", "-h"]):
        r = invoke(app, *args)
        assert r.exit_code == 0 and "Usage: thinconv" in r.stdout, args


def test_every_help_is_plain_and_ends_with_examples(app):
    root = typer.main.get_command(app)
    seen = 0
    for path, command in _commands(root):
        r = invoke(app, *path, "--help", columns=250)
        assert r.exit_code == 0, (path, r.output)
        text = r.stdout
        usage = next(line for line in text.splitlines() if "Usage:" in line)
        assert "{" not in usage and "<" not in usage, (path, usage)
        assert not re.search(r"<(bool|str|int|float|path|list|tuple)\b", text), (path, text)
        tail = text[text.index("Examples:"):].splitlines()[1:]
        shown = [line.strip() for line in tail if line.strip().startswith("thinconv ")]
        assert 2 <= len(shown) <= 3, (path, tail)
        for param in command.params:
            if param.name != "help":
                assert (getattr(param, "help", None) or "").strip(), (path, param.name)
        seen += 1
    assert seen >= 19  # root, 9 commands, recipe + recipe check, one per built-in recipe


def test_usage_line_names_arguments(app):
    r = invoke(app, "convert", "--help")
    assert "Usage: thinconv convert [OPTIONS] SRC OUTPUT" in r.stdout
    assert "--keep" in r.stdout and "ROLE_GLOB=DTYPE" in r.stdout and "--page-size" in r.stdout and "SIZE" in r.stdout


@pytest.mark.slow
def test_shell_completion():
    r = run_cli("--help")
    assert "--install-completion" in r.stdout and "--show-completion" in r.stdout
    r = run_cli("--show-completion", "bash")
    assert r.returncode == 0 and "_thinconv_completion" in r.stdout, r.stderr


# ---------------------------------------------------------------- --json everywhere, one vocabulary

def _keys(value) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


def test_json_on_every_command(app, tiny, tmp_path):
    src = tiny["bf16"]
    jobs = tmp_path / "zoo.toml"
    jobs.write_text(f'[defaults]\nsource = "{EXAMPLE}"\nprobe = false\n\n[[job]]\nout = "zoo.thin"\n')
    runs = {
        "convert": ["convert", EXAMPLE, tmp_path / "c.thin", "--dtype", "q8_0", "--no-probe"],
        "dry-run": ["convert", EXAMPLE, tmp_path / "d.thin", "--dry-run"],
        "llama": ["llama", EXAMPLE, tmp_path / "l.thin", "--no-probe"],
        "inspect": ["inspect", tmp_path / "c.thin"],
        "verify": ["verify", src],
        "unpack": ["unpack", src, tmp_path / "staged"],
        "pack": ["pack", tmp_path / "staged", tmp_path / "p.thin"],
        "recipes": ["recipes"],
        "recipe check": ["recipe", "check", "llama", EXAMPLE],
        "check": ["check", src],
        "run": ["run", src, "--prompt", "Once upon a time", "--max-new-tokens", "4"],
        "batch --dry-run": ["batch", jobs, "--dry-run"],
        "batch": ["batch", jobs],
    }
    got = {}
    for what, args in runs.items():
        r = invoke(app, *args, "--json")
        assert r.exit_code == 0, (what, r.output)
        got[what] = json.loads(r.stdout)  # exactly one JSON object on stdout
    keys = set().union(*(_keys(v) for v in got.values()))
    assert not keys & {"file_size", "bytes_out", "quant_worst", "hash", "filesize"}
    conv, ins, pack, batch = got["convert"], got["inspect"], got["pack"], got["batch"]
    assert (conv["size"], conv["archive_hash"]) == (ins["size"], ins["archive_hash"])
    assert conv["quant"] == {**ins["quant"], "rel_rmse": pytest.approx(ins["quant"]["rel_rmse"], rel=1e-12)}
    data = src.read_bytes()
    assert (pack["size"], pack["archive_hash"]) == (len(data), data[56:88].hex())
    assert got["unpack"]["page_count"] == pack["page_count"]
    job = batch["results"][0]
    zoo = (tmp_path / "zoo.thin").read_bytes()
    assert batch["ok"] and job["status"] == "done" and (job["size"], job["archive_hash"]) == (len(zoo), zoo[56:88].hex())
    assert got["batch --dry-run"]["jobs"][0]["action"] == "run"
    assert got["verify"]["ok"] and got["check"]["ok"] and got["recipe check"]["ok"]
    assert got["run"]["tokens"] and isinstance(got["run"]["text"], str)
    assert got["dry-run"]["kept_wider"] and got["llama"]["recipe"] == "llama"


def test_json_errors(app, tiny, tmp_path):
    exists = tmp_path / "exists.thin"
    exists.write_bytes(b"x")
    bad_jobs = tmp_path / "bad.toml"
    bad_jobs.write_text('[[job]]\nsource = "x"\n\n[[job]]\nout = "y.thin"\nwat = 1\n')
    cases = [
        (["convert", EXAMPLE, exists], 1, "pack", "already exists"),
        (["convert", EXAMPLE, tmp_path / "n" / "x.thin"], 1, "pack", "does not exist"),
        (["convert", EXAMPLE, tmp_path / "x.thin", "--dtype", "q5"], 2, "usage", "--dtype"),
        (["convert"], 2, "usage", "SRC"),
        (["inspect", "--nope", tiny["bf16"]], 2, "usage", "--nope"),
        (["inspect", EXAMPLE / "model.safetensors"], 1, "format", "safetensors"),
        (["convert", tmp_path / "absent", tmp_path / "x.thin"], 1, "checkpoint", "absent"),
        (["recipe", "check", "nosuchrecipe", EXAMPLE], 1, "recipe", "nosuchrecipe"),
        (["pack", tmp_path / "nostage", tmp_path / "p.thin"], 1, "pack", "nostage"),
        (["check", tiny["bf16"], "--prompt", "a", "--tokens", "1"], 2, "usage", "--prompt or --tokens"),
        (["batch", bad_jobs], 2, "jobs_file", "problem"),
    ]
    for args, code, kind, needle in cases:
        plain = invoke(app, *args)
        r = invoke(app, *args, "--json")
        assert r.exit_code == plain.exit_code == code, (args, r.output, plain.output)
        assert r.stderr == "", (args, r.stderr)
        e = json.loads(r.stdout)["error"]
        assert e["kind"] == kind and e["exit_code"] == code and needle in e["message"], (args, e)
        if kind == "jobs_file":
            assert len(e["problems"]) >= 2
        else:
            assert needle in plain.stderr and plain.stdout == ""


# ---------------------------------------------------------------- units, hashes

def test_units_are_binary_everywhere(app, tiny):
    assert human(1536) == "1.5 KiB" and human(3 << 20) == "3.0 MiB" and human(512) == "512 B"
    bar = byte_progress(enabled=True)
    task = bar.add_task("x", total=3 << 20)
    bar.update(task, completed=3 << 19)
    rendered = " ".join(str(c.render(bar.tasks[0])) for c in bar.columns[2:4])
    assert "1.5/3.0 MiB" in rendered and "kB" not in rendered and " MB" not in rendered
    assert str(BinarySpeedColumn().render(SimpleNamespace(finished_speed=None, speed=2048.0))) == "2.0 KiB/s"
    r = invoke(app, "convert", EXAMPLE, tiny["bf16"].with_name("u.thin"), "--no-probe")
    assert re.search(r"\d KiB, .*\(\d+\.\d (KiB|MiB|GiB)/s\)", r.stdout) and not re.search(r"\d (kB|MB|GB)\b", r.output)
    r = invoke(app, "verify", tiny["bf16"])
    assert "KiB checked" in r.stdout


def test_hashes_are_printed_whole(app, tiny, tmp_path):
    from thinconv.batch.report import JobResult
    from thinconv.cli.batch_cmd import batch_result_line

    data = tiny["bf16"].read_bytes()
    full = data[56:88].hex()
    assert invoke(app, "unpack", tiny["bf16"], tmp_path / "s").exit_code == 0
    r = invoke(app, "pack", tmp_path / "s", tmp_path / "p.thin")
    assert r.exit_code == 0 and f"archive hash {full}" in r.stdout and "…" not in r.stdout
    line = batch_result_line(JobResult(1, "src", "o.thin", "done", 1.0, 10, len(data), full))
    assert full in line and "…" not in line
    assert full in invoke(app, "inspect", tiny["bf16"]).stdout


# ---------------------------------------------------------------- inspect's text

def test_inspect_text_has_no_python_literals(app, tiny):
    for path in tiny.values():
        r = invoke(app, "inspect", path, "--tensors")
        assert r.exit_code == 0 and not PY_LITERALS.search(r.stdout), r.stdout
        assert "qkv_bias no" in r.stdout and "sliding_window none" in r.stdout and "pad none" in r.stdout
        assert "eos 1 or 2" in r.stdout


@pytest.fixture(scope="module")
def families(app, tmp_path_factory):
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import Gemma2Config, MixtralConfig

    from families import build

    base = tmp_path_factory.mktemp("fam")
    configs = {
        "gemma2": Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, vocab_size=384, max_position_embeddings=128,
                               sliding_window=8, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                               query_pre_attn_scalar=16),
        "mixtral": MixtralConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=384, max_position_embeddings=128,
                                 num_local_experts=4, num_experts_per_tok=2),
    }
    out = {}
    for name, cfg in configs.items():
        out[name] = base / f"{name}.thin"
        r = invoke(app, "convert", build(cfg, base / name), out[name], "--no-probe")
        assert r.exit_code == 0, r.output
    return out


def test_inspect_shows_the_model_vocabulary(app, families):
    r = invoke(app, "inspect", families["gemma2"])
    text = r.stdout
    assert not PY_LITERALS.search(text), text
    for line in ("norm          rmsnorm, eps 1e-06, weight offset 1", "mlp           gated gelu_tanh",
                 "block         post-norms", "scales        embedding × 8, logits soft-cap 30",
                 "sliding_window 8", "sliding on 1 of 2 layers", "soft-cap 50"):
        assert line in text, line
    s = json.loads(invoke(app, "inspect", families["gemma2"], "--json").stdout)
    assert s["logits"] == {"scale": 1, "softcap": 30.0} and s["attention"]["softcap"] == 50.0
    assert s["norm"]["weight_offset"] == 1 and s["block"]["post_norm"] is True and s["moe"] is None
    assert s["layers"] == {"total": 2, "sliding": 1, "rope": 2, "sparse": 0}
    text = invoke(app, "inspect", families["mixtral"]).stdout
    assert "moe           4 experts, 2 per token, expert ffn 64, softmax scoring, norm_topk_prob yes, sparse on 2 " \
           "of 2 layers" in text and not PY_LITERALS.search(text)
    s = json.loads(invoke(app, "inspect", families["mixtral"], "--json").stdout)
    assert s["moe"]["num_experts"] == 4 and s["layers"]["sparse"] == 2


def test_inspect_renders_sliding_rope_and_shared_experts(families, capsys):
    """Keys no built-in recipe writes yet (rope.sliding, moe.shared_expert), rendered from the summary."""
    from thinconv.cli.archive_cmds import render_summary
    from thinconv.format.reader import open_archive
    from thinconv.summary import summarize

    with open_archive(families["mixtral"]) as a:
        s = summarize(a)
    s["rope"]["sliding"] = {"theta": 10000.0, "scaling": None, "attention_factor": 1.0}
    s["moe"]["shared_expert"] = {"intermediate_size": 32, "gate": True}
    s["layers"]["rope"] = 1
    render_summary(s, tensors=False)
    text = capsys.readouterr().out
    assert "rope sliding  theta 10000, scaling none, attention_factor 1" in text
    assert "shared expert ffn 32 (gated)" in text and "on 1 of 2 layers" in text
    assert not PY_LITERALS.search(text)


# ---------------------------------------------------------------- --dry-run

def test_dry_run_fails_as_the_real_run(app, tmp_path):
    exists = tmp_path / "o.thin"
    exists.write_bytes(b"keep")
    for out in (exists, tmp_path / "missing" / "o.thin"):
        for extra in ([], ["--json"]):
            real = invoke(app, "convert", EXAMPLE, out, "--no-probe", *extra)
            dry = invoke(app, "convert", EXAMPLE, out, "--no-probe", "--dry-run", *extra)
            assert real.exit_code == dry.exit_code == 1
            assert (real.stdout, real.stderr) == (dry.stdout, dry.stderr)
    assert exists.read_bytes() == b"keep" and sorted(p.name for p in tmp_path.iterdir()) == ["o.thin"]


def test_dry_run_table_is_whole_when_not_a_terminal(app, tmp_path):
    r = invoke(app, "convert", EXAMPLE, tmp_path / "o.thin", "--dry-run", "--dtype", "q4_0", columns=40)
    assert r.exit_code == 0, r.output
    plan = json.loads(invoke(app, "convert", EXAMPLE, tmp_path / "o.thin", "--dry-run", "--json").stdout)
    for t in plan["tensors"]:
        assert t["name"] in r.stdout and all(s in r.stdout for s in t["source"]), t["name"]
    assert "…" not in r.stdout
    assert "kept wider than asked: 7 tensors" in r.stdout


# ---------------------------------------------------------------- tensors kept wider than asked

def test_convert_names_every_tensor_kept_wider(app, tmp_path):
    r = invoke(app, "convert", EXAMPLE, tmp_path / "q4.thin", "--dtype", "q4_0", "--no-probe")
    assert r.exit_code == 0, r.output
    assert "kept wider than asked: 7 tensors" in r.stdout
    assert "q8_0: token_embd.weight (the output head is never stored below q8_0)" in r.stdout
    assert ("f32: rope_freqs, blk.{0-1}.attn_norm.weight, blk.{0-1}.ffn_norm.weight, output_norm.weight (1-D "
            "tensors (norms, biases, rope tables) are always stored f32)") in r.stdout
    j = json.loads(invoke(app, "convert", EXAMPLE, tmp_path / "q4.thin", "--dtype", "q4_0", "--no-probe", "--force",
                          "--json").stdout)
    assert {k["tensor"] for k in j["kept_wider"]} == {"rope_freqs", "token_embd.weight", "blk.0.attn_norm.weight",
                                                      "blk.1.attn_norm.weight", "blk.0.ffn_norm.weight",
                                                      "blk.1.ffn_norm.weight", "output_norm.weight"}
    assert all(k["asked"] == "q4_0" for k in j["kept_wider"])
    # bf16 asked of a bf16 source: only the f32 1-D tensors are wider
    j = json.loads(invoke(app, "convert", EXAMPLE, tmp_path / "b.thin", "--no-probe", "--json").stdout)
    assert {k["dtype"] for k in j["kept_wider"]} == {"f32"} and len(j["kept_wider"]) == 5


def test_cols_not_a_multiple_of_32_are_named(app, tmp_path):
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import LlamaConfig

    from families import build

    src = build(LlamaConfig(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=384, max_position_embeddings=64,
                            tie_word_embeddings=False), tmp_path / "odd", dtype="bf16")
    r = invoke(app, "convert", src, tmp_path / "o.thin", "--dtype", "q8_0", "--no-probe", "--json")
    assert r.exit_code == 0, r.output
    wider = {k["tensor"]: k for k in json.loads(r.stdout)["kept_wider"]}
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_up.weight", "token_embd.weight"):
        assert wider[name]["dtype"] == "bf16" and "multiple of 32" in wider[name]["reason"], name
    assert "blk.0.ffn_down.weight" not in wider  # 64 cols: quantized as asked
    r = invoke(app, "convert", src, tmp_path / "o.thin", "--dtype", "q8_0", "--no-probe", "--force")
    assert "bf16: blk.0.attn_q.weight" in r.stdout or "blk.0.attn_q.weight" in r.stdout
    assert "48 cols is not a multiple of 32" in r.stdout


def test_kept_wider_reasons_from_the_recipe():
    """The recipe's own choices: a role it does not quantize, and its keep rules."""
    from thinconv.summary import kept_wider

    def tp(name, role, dtype, shape=(64, 64), note=None):
        return SimpleNamespace(name=name, role=role, dtype=dtype, shape=list(shape), note=note, source_dtype="bf16")

    recipe = SimpleNamespace(name="r", keep=(("ffn_down*", "q8_0"),), is_quantizable=lambda role: role != "attn_v.weight")
    plan = SimpleNamespace(options=SimpleNamespace(dtype="q4_0", keep=()), recipe=recipe,
                           model={"tie_word_embeddings": False},
                           tensors=[tp("blk.0.attn_v.weight", "attn_v.weight", "bf16"),
                                    tp("blk.0.ffn_down.weight", "ffn_down.weight", "q8_0"),
                                    tp("blk.0.ffn_up.weight", "ffn_up.weight", "q4_0"),
                                    tp("output.weight", "output.weight", "q8_0")])
    got = {k["tensor"]: k["reason"] for k in kept_wider(plan)}
    assert got == {"blk.0.attn_v.weight": "recipe r does not quantize attn_v.weight",
                   "blk.0.ffn_down.weight": "recipe r keeps ffn_down*=q8_0",
                   "output.weight": "the output head is never stored below q8_0"}
    plan.options.keep = (("ffn_down*", "q8_0"),)  # asked by the user: not wider than asked
    assert "blk.0.ffn_down.weight" not in {k["tensor"] for k in kept_wider(plan)}


# ---------------------------------------------------------------- sources: hub without a network, local folders

def _hub_env(home: Path) -> dict:
    # No HF_HUB_OFFLINE, and a Hub that refuses connections at once (no network here anyway).
    return {"HF_HOME": str(home), "HF_HUB_OFFLINE": None, "TRANSFORMERS_OFFLINE": None, "HF_HUB_CACHE": None,
            "HUGGINGFACE_HUB_CACHE": None, "HF_TOKEN": None, "HF_ENDPOINT": "http://127.0.0.1:9"}


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.slow
def test_hub_without_network_is_one_line_and_quick(tmp_path):
    """huggingface_hub retries a missing file five times (1+2+4+8+8 = 23 s of back-off) when the Hub cannot be
    reached; thinconv probes once and works from the cache alone."""
    commit = "a" * 40
    complete = tmp_path / "complete"
    populate_hub_cache(complete, "org/tiny", EXAMPLE, commit=commit)
    partial = tmp_path / "partial"
    snapshot = populate_hub_cache(partial, "org/tiny", EXAMPLE, commit=commit)
    (snapshot / "model.safetensors").unlink()

    t0 = time.monotonic()
    r = run_cli("convert", "org/tiny", tmp_path / "p.thin", "--no-probe", env=_hub_env(partial))
    seconds = time.monotonic() - t0
    assert r.returncode == 1 and seconds < 15, (seconds, r.stderr)
    [line] = _lines(r.stderr)
    assert line.startswith("error: org/tiny@") and "HF_HUB_OFFLINE=1" in line and "Retry" not in r.stderr

    r = run_cli("convert", "org/absent", tmp_path / "a.thin", "--no-probe", env=_hub_env(partial))
    [line] = _lines(r.stderr)
    assert r.returncode == 1 and "not in the local cache" in line and "HF_HUB_OFFLINE=1" in line

    t0 = time.monotonic()
    r = run_cli("convert", "org/tiny", tmp_path / "c.thin", "--no-probe", env=_hub_env(complete))
    seconds = time.monotonic() - t0
    assert r.returncode == 0 and seconds < 15, (seconds, r.stderr)
    [line] = _lines(r.stderr)  # the one note; the conversion goes on from the cache
    assert line.startswith("warning: cannot reach the Hub") and "HF_HUB_OFFLINE=1" in line
    assert f"source org/tiny main @ {commit}" in r.stdout


def test_revision_and_file_hashes_in_inspect(app, tmp_path, monkeypatch):
    commit = "b" * 40
    home = tmp_path / "hf"
    populate_hub_cache(home, "org/tiny", EXAMPLE, commit=commit)
    (home / "hub" / "models--org--tiny" / "refs" / "v1").write_text(commit)
    use_hub_cache(monkeypatch, home)
    out = tmp_path / "v1.thin"
    r = invoke(app, "convert", "org/tiny", out, "--revision", "v1", "--no-probe")
    assert r.exit_code == 0, r.output
    assert f"source org/tiny v1 @ {commit}" in r.stdout
    text = invoke(app, "inspect", out).stdout
    assert f"from org/tiny v1 @ {commit}" in text
    assert "source files  5 by name and size; sha256 of 1 (the hub cache's LFS blob names" in text
    s = json.loads(invoke(app, "inspect", out, "--json").stdout)
    assert s["source"] == {"repo_id": "org/tiny", "revision": "v1", "commit": commit}
    assert s["source_files"] == {"count": 5, "sha256": 1}

    local = tmp_path / "local.thin"
    assert invoke(app, "convert", EXAMPLE, local, "--no-probe").exit_code == 0
    text = invoke(app, "inspect", local).stdout
    assert "from a local folder" in text
    assert "source files  5 by name and size; no sha256 (a local folder's files are never hashed" in text


# ---------------------------------------------------------------- files that are not (whole) archives

def test_verify_and_inspect_say_truncated(app, tiny, tmp_path):
    data = tiny["bf16"].read_bytes()
    for keep, expected in ((len(data) - 100, f"{len(data) - 100} bytes of {len(data)}"),
                           (50, "50 bytes of at least 88"), (200, "200 bytes of at least ")):
        path = tmp_path / f"cut{keep}.thin"
        path.write_bytes(data[:keep])
        r = invoke(app, "verify", path)
        fails = [line for line in r.stderr.splitlines() if line.startswith("FAIL")]
        assert r.exit_code == 1 and len(fails) == 1 and "the file is truncated" in fails[0] and expected in fails[0]
        j = json.loads(invoke(app, "verify", path, "--json").stdout)
        assert not j["ok"] and "truncated" in j["failures"][0]
        r = invoke(app, "inspect", path)
        assert r.exit_code == 1 and "truncated" in r.stderr and len(_lines(r.stderr)) == 1


def test_inspect_a_safetensors_file_or_a_checkpoint(app):
    for target in (EXAMPLE / "model.safetensors", EXAMPLE):
        for command in ("inspect", "verify"):
            r = invoke(app, command, target)
            assert r.exit_code == 1
            assert "thinconv convert" in r.stderr and "not a .thin archive" in r.stderr
    r = invoke(app, "inspect", EXAMPLE / "model.safetensors")
    assert "is a safetensors file" in r.stderr


# ---------------------------------------------------------------- the README, as a new user runs it

def readme_shell_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.findall(r"```sh\n(.*?)```", text, re.S)


def test_readme_shell_blocks_are_found():
    code = "\n".join(readme_shell_blocks())
    for command in ("thinconv convert", "thinconv inspect", "thinconv verify", "thinconv check", "thinconv run",
                    "thinconv pack", "thinconv unpack", "thinconv batch", "thinconv recipes", "thinconv recipe check"):
        assert command in code, command


@pytest.mark.slow
def test_readme_shell_commands_run(tmp_path):
    """Every ```sh block of the README, in order, as one bash script with `set -e`, from a folder that has
    examples/ as the repo root has. Only the install and test lines (a venv, pip, pytest) are left out:
    this test runs inside that venv."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    lines = []
    for block in readme_shell_blocks():
        for line in block.splitlines():
            if re.search(r"python3 -m venv|pip install|python -m pytest", line):
                continue
            lines.append(line)
    script = tmp_path / "readme.sh"
    script.write_text("set -euo pipefail\n" + "\n".join(lines) + "\n")
    env = {**os.environ, "PATH": f"{BIN.parent}{os.pathsep}{os.environ['PATH']}", "HF_HUB_OFFLINE": "1",
           "COLUMNS": "200", "TRANSFORMERS_VERBOSITY": "error"}
    r = subprocess.run(["bash", "-x", str(script)], cwd=tmp_path, capture_output=True, text=True, env=env,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    assert (tmp_path / "tiny.thin").is_file() and (tmp_path / "zoo" / "tiny-q8_0.thin").is_file()
    assert (tmp_path / "again.thin").read_bytes() == (tmp_path / "tiny.thin").read_bytes()
    assert shutil.which("thinconv", path=env["PATH"])
