"""`thinconv batch`: jobs files, validation, resumable runs, failure isolation, the report,
sharding, --dry-run / --retry-failed, hub sources downloaded once, and stopping on signals."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import thinconv
from conftest import BIN, assert_one_line_error
from hubcache import populate_hub_cache, use_hub_cache
from thinconv import batch as B
from thinconv.cli import app
from thinconv.errors import JobsFileError, UsageError
from thinconv.format.reader import open_archive

runner = CliRunner()


# ---------------------------------------------------------------- helpers

pytestmark = pytest.mark.slow  # worker processes, signals, subprocesses

def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, int):
        return str(v)
    return json.dumps(str(v))


def write_jobs(path: Path, jobs: list[dict], defaults: dict | None = None) -> Path:
    lines = []
    if defaults:
        lines.append("[defaults]")
        lines += [f"{k} = {toml_value(v)}" for k, v in defaults.items()]
    for job in jobs:
        lines.append("\n[[job]]")
        lines += [f"{k} = {toml_value(v)}" for k, v in job.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def batch(*args, env: dict | None = None):
    r = runner.invoke(app, ["batch", *map(str, args)], env=env)
    if r.exception and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r


def report_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def by_job(lines: list[dict]) -> dict[int, dict]:
    return {rec["job"]: rec for rec in lines}


def stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


def temp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp") or p.name.startswith("."))


@pytest.fixture
def broken(ckpts, tmp_path) -> Path:
    """A checkpoint that validates as a folder but fails to convert (truncated weights)."""
    folder = tmp_path / "broken"
    shutil.copytree(ckpts["llama2"].path, folder)
    w = folder / "model.safetensors"
    w.write_bytes(w.read_bytes()[:300])
    return folder


# ---------------------------------------------------------------- the whole story

def test_batch_isolates_failures_resumes_and_reruns_only_what_changed(ckpts, broken, tmp_path):
    outdir = tmp_path / "out"
    outdir.mkdir()
    jobs = [
        {"source": str(ckpts["llama2"].path), "out": "out/llama2-bf16.thin", "dtype": "bf16"},
        {"source": str(ckpts["llama2"].path), "out": "out/llama2-q8.thin", "dtype": "q8_0"},
        {"source": str(ckpts["llama2"].path), "out": "out/llama2-q4.thin", "dtype": "q4_0",
         "keep": ["ffn_down*=q8_0"]},
        {"source": str(ckpts["qwen2"].path), "out": "out/qwen2.thin", "recipe": "qwen2"},
        {"source": "broken", "out": "out/broken.thin"},
        {"source": str(ckpts["mistral"].path), "out": "out/mistral-q8.thin", "dtype": "q8_0", "page_size": "4KiB"},
    ]
    jobs_file = write_jobs(tmp_path / "jobs.toml", jobs, defaults={"probe": False})
    report = tmp_path / "report.jsonl"

    r = batch(jobs_file, "--workers", "2", "--report", report)
    assert r.exit_code == 1, r.output
    lines = report_lines(report)
    assert sorted(rec["job"] for rec in lines) == [1, 2, 3, 4, 5, 6]
    recs = by_job(lines)
    assert {k: v["status"] for k, v in recs.items()} == {1: "done", 2: "done", 3: "done", 4: "done", 5: "failed",
                                                        6: "done"}
    assert "broken" in recs[5]["error"] and "\n" not in recs[5]["error"]
    assert recs[5]["archive_hash"] is None and not (outdir / "broken.thin").exists()
    assert "job 5 FAILED" in r.output
    dtypes = {1: "bf16", 2: "q8_0", 3: "q4_0", 4: "auto", 6: "q8_0"}
    for k, dtype in dtypes.items():
        rec = recs[k]
        out = Path(rec["out"])
        assert out == (tmp_path / jobs[k - 1]["out"]).resolve()
        with open_archive(out) as a:
            assert a.verify().ok
            conv = a.manifest["validation"]["converter"]
            assert conv["options"]["dtype"] == dtype and conv["options"]["probe"] is False
            assert rec["archive_hash"] == a.header.archive_hash.hex()
            assert rec["bytes_in"] == sum(f["size"] for f in a.manifest["validation"]["source"]["files"])
        assert rec["bytes_out"] == out.stat().st_size
        assert rec["error"] is None and rec["seconds"] >= 0
    with open_archive(outdir / "llama2-q4.thin") as a:
        assert {t["dtype"] for t in a.manifest["tensors"] if t["role"] == "ffn_down.weight"} == {"q8_0"}
        assert a.manifest["validation"]["converter"]["options"]["keep"] == [["ffn_down*", "q8_0"]]
    with open_archive(outdir / "mistral-q8.thin") as a:
        assert a.manifest["runtime"]["page_size"] == 4096
    with open_archive(outdir / "qwen2.thin") as a:
        assert a.manifest["validation"]["converter"]["recipe"] == "qwen2"
    assert temp_files(outdir) == []
    before = {p.name: stamp(p) for p in outdir.iterdir()}

    # A rerun skips the done jobs (their files untouched) and redoes the failed one.
    r = batch(jobs_file, "--workers", "2", "--report", report)
    assert r.exit_code == 1, r.output
    recs = by_job(report_lines(report))
    assert {k: v["status"] for k, v in recs.items()} == {1: "skipped", 2: "skipped", 3: "skipped", 4: "skipped",
                                                        5: "failed", 6: "skipped"}
    assert recs[2]["archive_hash"] and recs[2]["bytes_out"] == (outdir / "llama2-q8.thin").stat().st_size
    assert {p.name: stamp(p) for p in outdir.iterdir()} == before

    # A changed option reruns only that job; its archive is replaced, the others stay as they are.
    jobs[1]["dtype"] = "q4_1"
    write_jobs(jobs_file, jobs, defaults={"probe": False})
    r = batch(jobs_file, "--workers", "1", "--report", report)
    assert r.exit_code == 1, r.output
    recs = by_job(report_lines(report))
    assert {k: v["status"] for k, v in recs.items()} == {1: "skipped", 2: "done", 3: "skipped", 4: "skipped",
                                                        5: "failed", 6: "skipped"}
    after = {p.name: stamp(p) for p in outdir.iterdir()}
    assert after["llama2-q8.thin"] != before["llama2-q8.thin"]
    assert {k: v for k, v in after.items() if k != "llama2-q8.thin"} == \
        {k: v for k, v in before.items() if k != "llama2-q8.thin"}
    with open_archive(outdir / "llama2-q8.thin") as a:
        assert a.manifest["validation"]["converter"]["options"]["dtype"] == "q4_1" and a.verify().ok

    # --retry-failed: only the failed job runs (now fixed); the other report lines are kept.
    shutil.rmtree(broken)
    shutil.copytree(ckpts["llama2"].path, broken)
    r = batch(jobs_file, "--workers", "1", "--report", report, "--retry-failed")
    assert r.exit_code == 0, r.output
    lines = report_lines(report)
    assert [rec["job"] for rec in lines].count(5) == 1 and len(lines) == 6
    recs = by_job(lines)
    assert recs[5]["status"] == "done" and recs[2]["status"] == "done" and recs[1]["status"] == "skipped"
    assert "1 failed job to retry" in r.output
    with open_archive(outdir / "broken.thin") as a:
        assert a.verify().ok
    assert temp_files(outdir) == []


def test_retry_failed_needs_a_report(ckpts, tmp_path):
    jobs_file = write_jobs(tmp_path / "jobs.toml", [{"source": str(ckpts["llama2"].path), "out": "a.thin"}])
    r = batch(jobs_file, "--retry-failed")
    assert r.exit_code == 2 and "--report" in r.stderr
    r = batch(jobs_file, "--retry-failed", "--report", tmp_path / "none.jsonl")
    assert r.exit_code == 2 and "no such report" in r.stderr
    assert not (tmp_path / "a.thin").exists()


# ---------------------------------------------------------------- the fingerprint

def test_thinconv_version_mismatch_reruns(ckpts, tmp_path, monkeypatch):
    jobs_file = write_jobs(tmp_path / "jobs.toml", [{"source": str(ckpts["qwen3"].path), "out": "q.thin",
                                                      "probe": False}])
    report = tmp_path / "r.jsonl"
    assert batch(jobs_file, "--workers", "1", "--report", report).exit_code == 0
    (job,) = B.load_jobs(jobs_file)
    assert B.archive_mismatch(job) is None
    first = stamp(tmp_path / "q.thin")
    monkeypatch.setattr(thinconv, "__version__", "0.0.1")
    assert "made by thinconv 0.1.0, this is 0.0.1" in B.archive_mismatch(job)
    r = batch(jobs_file, "--workers", "1", "--report", report)
    assert r.exit_code == 0, r.output
    assert report_lines(report)[0]["status"] == "done"
    assert stamp(tmp_path / "q.thin") != first


def test_local_source_changes_are_detected(ckpts, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ckpts["llama2"].path, src)
    jobs_file = write_jobs(tmp_path / "jobs.toml", [{"source": "src", "out": "a.thin", "probe": False,
                                                      "recipe": "llama"}])
    (job,) = B.load_jobs(jobs_file)
    assert B.archive_mismatch(job) == "no archive yet"
    assert batch(jobs_file, "--workers", "1").exit_code == 0
    assert B.archive_mismatch(job) is None
    # a source file newer than the archive (make's rule)
    made = (tmp_path / "a.thin").stat().st_mtime
    os.utime(src / "model.safetensors", (made + 10, made + 10))
    assert "model.safetensors is newer than the archive" in B.archive_mismatch(job)
    os.utime(src / "model.safetensors", (made - 10, made - 10))
    assert B.archive_mismatch(job) is None
    # config.json edited in place, same size, old mtime
    cfg = (src / "config.json").read_text()
    edited = cfg.replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 2e-05')
    assert edited != cfg and len(edited) == len(cfg)
    (src / "config.json").write_text(edited)
    os.utime(src / "config.json", (made - 10, made - 10))
    assert B.archive_mismatch(job) == "source config.json differs"
    (src / "config.json").write_text(cfg)
    os.utime(src / "config.json", (made - 10, made - 10))
    # a new file the conversion reads (a tokenizer)
    (src / "tokenizer.json").write_text("{}")
    os.utime(src / "tokenizer.json", (made - 10, made - 10))
    assert B.archive_mismatch(job) == "source files differ (names or sizes)"
    (src / "tokenizer.json").unlink()
    # another recipe named by the job
    other = B.Job(job.index, job.source, job.out, job.options, "mistral")
    assert "recipe 'llama'" in B.archive_mismatch(other)


def test_a_file_that_is_not_an_archive_is_never_replaced(ckpts, tmp_path):
    (tmp_path / "precious.thin").write_bytes(b"not an archive, keep me")
    jobs_file = write_jobs(tmp_path / "jobs.toml", [{"source": str(ckpts["llama2"].path), "out": "precious.thin"}])
    report = tmp_path / "r.jsonl"
    r = batch(jobs_file, "--workers", "1", "--report", report)
    assert r.exit_code == 1
    assert "is not a .thin archive" in report_lines(report)[0]["error"]
    assert (tmp_path / "precious.thin").read_bytes() == b"not an archive, keep me"


def test_a_corrupted_archive_is_redone(ckpts, tmp_path):
    jobs_file = write_jobs(tmp_path / "jobs.toml", [{"source": str(ckpts["llama2"].path), "out": "a.thin",
                                                      "probe": False}])
    report = tmp_path / "r.jsonl"
    assert batch(jobs_file, "--workers", "1").exit_code == 0
    data = bytearray((tmp_path / "a.thin").read_bytes())
    data[-100] ^= 0xFF  # a page byte: the manifest still matches, a checksum does not
    (tmp_path / "a.thin").write_bytes(bytes(data))
    r = batch(jobs_file, "--dry-run")
    assert "job 1 run:" in r.output and "checksum mismatch" in r.output
    r = batch(jobs_file, "--workers", "1", "--report", report)
    assert r.exit_code == 0, r.output
    assert report_lines(report)[0]["status"] == "done"
    # the log says why a job that looked up to date was redone: which page failed
    lines = r.output.splitlines()
    start = next(k for k, ln in enumerate(lines) if ln.startswith("job 1 start:"))
    assert "(up to date: verifying it)" in lines[start]
    assert re.fullmatch(r"job 1 redo: archive fails verification: page '[^']+' at offset \d+: checksum mismatch "
                        r"\(data corrupted\); converting it again", lines[start + 1]), lines
    assert lines[start + 2].startswith("job 1 done:")
    with open_archive(tmp_path / "a.thin") as a:
        assert a.verify().ok


# ---------------------------------------------------------------- the jobs file

def test_malformed_jobs_file_is_rejected_before_anything_runs(ckpts, tmp_path):
    (tmp_path / "out").mkdir()
    jobs_file = tmp_path / "jobs.toml"
    jobs_file.write_text(f"""
[defaults]
probe = false

[[job]]
source = "{ckpts['llama2'].path}"
out = "out/ok.thin"

[[job]]
source = "{ckpts['llama2'].path}"
out = "out/bad-dtype.thin"
dtype = "q9_9"

[[job]]
source = "{ckpts['llama2'].path}"
out = "out/typo.thin"
dtpye = "bf16"
strict = "yes"

[[job]]
source = "{ckpts['llama2'].path}"
out = "out/ok.thin"

[[job]]
source = "{ckpts['llama2'].path}"
out = "missing-folder/x.thin"
keep = ["ffn_down*"]

[[job]]
out = "out/no-source.thin"
revision = "main"

[[job]]
source = "{ckpts['llama2'].path}"
out = "out/rev.thin"
revision = "main"
recipe = "no-such-recipe"
page_size = "12 parsecs"
""")
    r = batch(jobs_file, "--workers", "1", "--report", tmp_path / "r.jsonl")
    assert r.exit_code == 2, r.output
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    expected = [
        ("job 2 (out/bad-dtype.thin)", "field 'dtype'", "q9_9"),
        ("job 3 (out/typo.thin)", "unknown field 'dtpye'"),
        ("job 3 (out/typo.thin)", "field 'strict'", "true or false"),
        ("job 4 (out/ok.thin)", "field 'out'", "also the output of job 1"),
        ("job 5 (missing-folder/x.thin)", "field 'keep'", "ROLE_GLOB=DTYPE"),
        ("job 5 (missing-folder/x.thin)", "field 'out'", "missing-folder does not exist"),
        ("job 6 (out/no-source.thin)", "field 'source': missing"),
        ("job 7 (out/rev.thin)", "field 'recipe'", "no-such-recipe"),
        ("job 7 (out/rev.thin)", "field 'page_size'", "12 parsecs"),
        ("job 7 (out/rev.thin)", "field 'revision'", "only to hub repo ids"),
    ]
    for needles in expected:
        assert any(all(n in ln for n in needles) and ln.startswith("error: jobs.toml: ") for ln in errors), \
            (needles, errors)
    assert len(errors) == len(expected), errors
    assert "Traceback" not in r.output
    assert list((tmp_path / "out").iterdir()) == [] and not (tmp_path / "r.jsonl").exists()


@pytest.mark.parametrize("text, needles", [
    ("[[job]]\nsource = 'x'\nout = \n", ["not valid TOML"]),
    ("[defaults]\nout = 'a.thin'\ndtype = 'q7'\n[[job]]\nsource = 'SRC'\nout = 'b.thin'\n",
     ["defaults: unknown field 'out'", "defaults: field 'dtype'"]),
    ("jobs = []\n", ["unknown top-level key 'jobs'"]),
    ("", ["no jobs"]),
    ("[[job]]\nsource = 'SRC'\nout = 'a.thin'\nrevision = 'v1'\n", ["job 1 (a.thin): field 'revision'",
                                                                     "only to hub repo ids"]),
    ("[[job]]\nsource = 'no/such/folder'\nout = 'a.thin'\n", ["job 1 (a.thin): field 'source'", "no such folder"]),
    ("[[job]]\nsource = 'SRC'\nout = '.'\n", ["field 'out'", "is a folder"]),
    ("[[job]]\nsource = 'SRC'\nout = 'a.thin'\nkeep = ['*norm.weight=q8_0']\n", ["field 'keep'", "1-D roles"]),
])
def test_jobs_file_problems(ckpts, tmp_path, text, needles):
    jobs_file = tmp_path / "jobs.toml"
    jobs_file.write_text(text.replace("SRC", str(ckpts["llama2"].path)))
    with pytest.raises(JobsFileError) as e:
        B.load_jobs(jobs_file)
    for n in needles:
        assert any(n in p for p in e.value.problems), (n, e.value.problems)
    assert all(p.startswith("jobs.toml: ") for p in e.value.problems)
    r = batch(jobs_file)
    assert r.exit_code == 2 and "nothing was run" in r.stderr


def test_jsonl_jobs_file_matches_toml(ckpts, tmp_path):
    src = str(ckpts["llama2"].path)
    toml = write_jobs(tmp_path / "jobs.toml", [{"source": src, "out": "a.thin", "dtype": "q8_0"},
                                               {"source": src, "out": "b.thin", "keep": ["ffn_*=q4_0"],
                                                "page_size": 8192, "strict": True}],
                      defaults={"probe": False, "rope_layout": "interleaved"})
    jsonl = tmp_path / "jobs.jsonl"
    jsonl.write_text("\n".join(json.dumps(x) for x in [
        {"defaults": {"probe": False, "rope_layout": "interleaved"}},
        {"source": src, "out": "a.thin", "dtype": "q8_0"},
        {"source": src, "out": "b.thin", "keep": ["ffn_*=q4_0"], "page_size": 8192, "strict": True}]) + "\n")
    assert B.load_jobs(toml) == B.load_jobs(jsonl)
    a, b = B.load_jobs(jsonl)
    assert a.out == tmp_path / "a.thin" and a.options.dtype == "q8_0" and a.options.rope_layout == "interleaved"
    assert b.options.keep == (("ffn_*", "q4_0"),) and b.options.page_size == 8192 and b.options.strict
    jsonl.write_text(json.dumps({"source": src, "out": "a.thin"}) + "\n" + json.dumps({"defaults": {}}) + "\n[1]\n")
    with pytest.raises(JobsFileError) as e:
        B.load_jobs(jsonl)
    assert any("line 2" in p and "defaults line must be the first" in p for p in e.value.problems)
    assert any("line 3" in p and "expected a JSON object" in p for p in e.value.problems)


# ---------------------------------------------------------------- --dry-run

def test_dry_run_lists_run_and_skip_and_writes_nothing(ckpts, tmp_path):
    src = str(ckpts["llama2"].path)
    jobs_file = write_jobs(tmp_path / "jobs.toml", [{"source": src, "out": "a.thin"}, {"source": src, "out": "b.thin",
                                                                                       "dtype": "q8_0"}],
                           defaults={"probe": False})
    assert batch(jobs_file, "--workers", "1").exit_code == 0
    (tmp_path / "b.thin").unlink()
    stale = tmp_path / ".b.thin.abcd1234.tmp"
    stale.write_bytes(b"left by a kill")
    before = sorted(p.name for p in tmp_path.iterdir())
    r = batch(jobs_file, "--dry-run", "--report", tmp_path / "r.jsonl")
    assert r.exit_code == 0, r.output
    assert "job 1 skip:" in r.output and "job 2 run:" in r.output and "no archive yet" in r.output
    assert "1 to run, 1 to skip" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_stale_temp_files_are_removed_on_start(ckpts, tmp_path):
    jobs_file = write_jobs(tmp_path / "jobs.toml", [{"source": str(ckpts["llama2"].path), "out": "a[1].thin",
                                                      "probe": False}])
    stale = [tmp_path / ".a[1].thin.x8Hq2_z1.tmp", tmp_path / ".a[1].thin.0000.tmp"]
    for s in stale:
        s.write_bytes(b"partial")
    other = tmp_path / ".b.thin.x8Hq2_z1.tmp"  # not this batch's output
    other.write_bytes(b"someone else's")
    r = batch(jobs_file, "--workers", "1")
    assert r.exit_code == 0, r.output
    assert not any(s.exists() for s in stale) and other.exists()
    assert "removed a stale temp file" in r.output


# ---------------------------------------------------------------- sharding

def slurm_array(task: int, spec: str) -> dict[str, str]:
    """The environment Slurm gives array task `task` of ``--array=spec`` (ranges, lists, ``:step``),
    as measured on Slurm 22.05: MIN / MAX are the smallest / largest task ids, COUNT the number of
    tasks, STEP the step of a single ``a-b:s`` range and 1 otherwise."""
    ids, step = [], 1
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part)
        lo, hi, st = int(m.group(1)), int(m.group(2) or m.group(1)), int(m.group(3) or 1)
        ids += range(lo, hi + 1, st)
        step = st if "," not in spec else 1
    assert task in ids
    return {"SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_MIN": str(min(ids)),
            "SLURM_ARRAY_TASK_MAX": str(max(ids)), "SLURM_ARRAY_TASK_STEP": str(step),
            "SLURM_ARRAY_TASK_COUNT": str(len(ids))}


def test_parse_shard():
    assert B.parse_shard("0/1") == (0, 1) and B.parse_shard(" 3 / 8 ") == (3, 8)
    for bad in ("4/4", "1/0", "-1/2", "a/b", "2", ""):
        with pytest.raises(UsageError):
            B.parse_shard(bad)
    # the index is the task id itself; the count of a whole 0..N-1 array is its size
    assert B.parse_shard("auto", slurm_array(5, "0-7")) == (5, 8)
    assert B.parse_shard("auto", slurm_array(0, "0")) == (0, 1)
    assert B.parse_shard("auto", slurm_array(7, "0-7")) == (7, 8)
    assert B.resolve_shard("auto", slurm_array(5, "0-7")).origin == "Slurm array task 5, 8 shards from the array 0-7"
    # resubmitting some tasks of a 0-7 array: the count comes from $THINCONV_SHARDS or --shards,
    # and the index stays the task id (the old (ID - MIN) / STEP made tasks 1,3 shards 0/2 and 1/2)
    for task in (1, 3):
        assert B.parse_shard("auto", {**slurm_array(task, "1,3"), "THINCONV_SHARDS": "8"}) == (task, 8)
        assert B.parse_shard("auto", slurm_array(task, "1,3"), shards=8) == (task, 8)
    assert B.parse_shard("auto", {**slurm_array(2, "2"), "THINCONV_SHARDS": "4"}) == (2, 4)
    assert B.parse_shard("auto", {**slurm_array(12, "10-17"), "THINCONV_SHARDS": "18"}) == (12, 18)
    assert B.parse_shard("auto", {**slurm_array(2, "0-2"), "THINCONV_SHARDS": "8"}) == (2, 8)  # given beats inferred
    assert B.parse_shard("auto", {**slurm_array(2, "0-2"), "THINCONV_SHARDS": "8"}, shards=4) == (2, 4)
    assert B.resolve_shard("auto", {**slurm_array(3, "1,3"), "THINCONV_SHARDS": "8"}).origin == \
        "Slurm array task 3, 8 shards from $THINCONV_SHARDS"
    assert B.parse_shard("auto", {"JOB_COMPLETION_INDEX": "2", "THINCONV_SHARDS": "4"}) == (2, 4)
    assert B.parse_shard("auto", {"JOB_COMPLETION_INDEX": "2"}, shards=3) == (2, 3)
    # ambiguous or wrong: exit 2 with one line saying what to set
    for env, needle in [({}, "neither"), ({"JOB_COMPLETION_INDEX": "2"}, "THINCONV_SHARDS is not"),
                        ({"JOB_COMPLETION_INDEX": "4", "THINCONV_SHARDS": "4"}, "index 4 is not a shard of 0..3"),
                        ({**slurm_array(1, "0-7"), "SLURM_ARRAY_TASK_ID": "x"}, "expected an integer"),
                        ({"SLURM_ARRAY_TASK_ID": "1"}, r"\(MIN=unset MAX=unset STEP=unset COUNT=unset\)"),
                        ({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "8"}, "set \\$THINCONV_SHARDS"),
                        (slurm_array(1, "1,3"), r"array \(MIN=1 MAX=3 STEP=1 COUNT=2\) is not the whole range"),
                        (slurm_array(2, "2"), r"MIN=2 MAX=2 STEP=1 COUNT=1"),
                        (slurm_array(2, "0,2"), r"MIN=0 MAX=2 STEP=1 COUNT=2"),
                        (slurm_array(12, "10-17"), "MIN=10"),
                        (slurm_array(6, "0-14:2"), "STEP=2"),
                        ({**slurm_array(5, "0-7"), "THINCONV_SHARDS": "4"}, "task 5 is not a shard of 0..3"),
                        ({**slurm_array(0, "0-7"), "THINCONV_SHARDS": "0"}, "expected N ≥ 1")]:
        with pytest.raises(UsageError, match=needle) as e:
            B.parse_shard("auto", env)
        assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match="goes with --shard auto"):
        B.parse_shard("1/4", {}, shards=4)


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8])
def test_assign_shards_covers_every_job_once_and_balances(count):
    sizes = [700, None, 30, 30, 30, 5000, 1200, None, 1, 1, 900, 64, 64, 64, 2500, 10]
    owner = B.assign_shards(sizes, count)
    assert owner == B.assign_shards(list(sizes), count)  # deterministic
    assert len(owner) == len(sizes) and all(0 <= s < count for s in owner)
    known = [s for s in sizes if s is not None]
    weights = [s if s is not None else round(sum(known) / len(known)) for s in sizes]
    loads = [sum(w for w, s in zip(weights, owner) if s == k) for k in range(count)]
    # greedy largest-first: no shard exceeds another by more than the largest job, and the
    # heaviest shard is within LPT's 4/3 of the best possible (at least max(largest job, mean))
    assert max(loads) - min(loads) <= max(weights)
    assert max(loads) <= 4 / 3 * max(max(weights), sum(weights) / count)
    if count == 3:  # the 5000 job alone; the rest split evenly
        assert sorted(loads) == [3551, 3557, 5000]


def test_shards_together_run_every_job_exactly_once(ckpts, tmp_path):
    kinds = ["llama2", "qwen3", "llama3", "qwen2", "mistral"]
    jobs_file = write_jobs(tmp_path / "jobs.toml", [{"source": str(ckpts[k].path), "out": f"{k}.thin"}
                                                    for k in kinds], defaults={"probe": False})
    jobs = B.load_jobs(jobs_file)
    for n in (2, 3, 4):
        parts = [B.shard_jobs(jobs, i, n) for i in range(n)]
        flat = [j.index for p in parts for j in p]
        assert sorted(flat) == [1, 2, 3, 4, 5]
    seen = []
    for i in range(2):
        report = tmp_path / f"report-{i}.jsonl"
        env = slurm_array(i, "0-1")  # sbatch --array=0-1
        r = batch(jobs_file, "--shard", "auto", "--workers", "1", "--report", report, env=env)
        assert r.exit_code == 0, r.output
        assert f"shard {i}/2 (Slurm array task {i}, 2 shards from the array 0-1)" in r.output
        seen += [rec["job"] for rec in report_lines(report)]
        assert all(rec["status"] == "done" for rec in report_lines(report))
    assert sorted(seen) == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in tmp_path.glob("*.thin")) == sorted(f"{k}.thin" for k in kinds)
    r = batch(jobs_file, "--shard", "auto", env={"SLURM_ARRAY_TASK_ID": None, "JOB_COMPLETION_INDEX": None})
    assert r.exit_code == 2 and "--shard auto" in r.stderr


NO_SCHEDULER = {k: None for k in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_MAX",
                                  "SLURM_ARRAY_TASK_STEP", "SLURM_ARRAY_TASK_COUNT", "JOB_COMPLETION_INDEX",
                                  "THINCONV_SHARDS")}


def test_resubmitting_some_array_tasks_runs_exactly_their_shards(ckpts, tmp_path):
    """sbatch --array=0-3, then tasks 1 and 3 again (their archives deleted): with the count given they
    run shards 1/4 and 3/4 — exactly the missing jobs; without it they stop (exit 2, one line)."""
    src = str(ckpts["llama2"].path)
    dtypes = ["bf16", "f16", "q8_0", "q4_0", "q4_1", "f32", "auto", "bf16"]
    jobs_file = write_jobs(tmp_path / "jobs.toml", [{"source": src, "out": f"j{k}.thin", "dtype": d,
                                                     "page_size": 4096 * (1 + k)} for k, d in enumerate(dtypes, 1)],
                           defaults={"probe": False})
    jobs = B.load_jobs(jobs_file)
    owner = {j.index: s for s in range(4) for j in B.shard_jobs(jobs, s, 4)}
    for task in range(4):
        r = batch(jobs_file, "--shard", "auto", "--workers", "1", "--report", tmp_path / f"report-{task}.jsonl",
                  env={**NO_SCHEDULER, **slurm_array(task, "0-3")})
        assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.glob("*.thin")) == sorted(f"j{k}.thin" for k in range(1, 9))
    missing = sorted(k for k, s in owner.items() if s in (1, 3))
    assert missing and len(missing) < 8
    for k in missing:
        (tmp_path / f"j{k}.thin").unlink()
    kept = {p.name: stamp(p) for p in tmp_path.glob("*.thin")}

    # sbatch --array=1,3 without the count: nothing runs, one line says what to set
    for task in (1, 3):
        r = batch(jobs_file, "--shard", "auto", "--report", tmp_path / f"report-{task}.jsonl",
                  env={**NO_SCHEDULER, **slurm_array(task, "1,3")})
        assert r.exit_code == 2, r.output
        assert_one_line_error(r.stderr, "MIN=1 MAX=3 STEP=1 COUNT=2", "THINCONV_SHARDS")
    assert {p.name: stamp(p) for p in tmp_path.glob("*.thin")} == kept

    # with THINCONV_SHARDS=4 (the first submission's count), or --shards 4
    ran = []
    for task, how in ((1, "env"), (3, "option")):
        env = {**NO_SCHEDULER, **slurm_array(task, "1,3")}
        args = ["--shards", "4"] if how == "option" else []
        if how == "env":
            env["THINCONV_SHARDS"] = "4"
        report = tmp_path / f"report-{task}.jsonl"
        r = batch(jobs_file, "--shard", "auto", *args, "--workers", "1", "--report", report, env=env)
        assert r.exit_code == 0, r.output
        assert f"shard {task}/4 (Slurm array task {task}, 4 shards from " in r.output
        recs = report_lines(report)
        assert {rec["job"] for rec in recs} == {k for k, s in owner.items() if s == task}
        ran += [rec["job"] for rec in recs if rec["status"] == "done"]
    assert sorted(ran) == missing
    assert {p.name: stamp(p) for p in tmp_path.glob("*.thin") if p.name in kept} == kept
    assert sorted(p.name for p in tmp_path.glob("*.thin")) == sorted(f"j{k}.thin" for k in range(1, 9))


# ---------------------------------------------------------------- hub sources

HUB_REPO = "tiny-org/batch-llama"
COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


def test_hub_source_is_downloaded_once_and_pinned(ckpts, tmp_path, monkeypatch):
    import huggingface_hub

    home = tmp_path / "hf"
    populate_hub_cache(home, HUB_REPO, ckpts["sharded"].path, commit=COMMIT_A)
    use_hub_cache(monkeypatch, home)
    calls: list[tuple[str, str, tuple]] = []
    real = huggingface_hub.snapshot_download

    def counting(repo_id, *a, revision=None, allow_patterns=None, **k):
        calls.append((repo_id, revision, tuple(allow_patterns or ())))
        return real(repo_id, *a, revision=revision, allow_patterns=allow_patterns, **k)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", counting)
    jobs = [{"source": HUB_REPO, "out": f"hub-{d}.thin", "dtype": d} for d in ("bf16", "q8_0", "q4_0")]
    jobs.append({"source": str(ckpts["llama2"].path), "out": "local.thin"})
    jobs_file = write_jobs(tmp_path / "jobs.toml", jobs, defaults={"probe": False})
    report = tmp_path / "r.jsonl"
    r = batch(jobs_file, "--workers", "2", "--report", report)
    assert r.exit_code == 0, r.output
    shard_fetches = [c for c in calls if any(p.endswith(".safetensors") for p in c[2])]
    assert len(shard_fetches) == 1 and shard_fetches[0][:2] == (HUB_REPO, COMMIT_A), calls
    assert len([c for c in calls if c[2] == ("config.json",)]) == 1  # one resolution of main
    assert f"downloading {HUB_REPO}@{COMMIT_A}" in r.output
    for d in ("bf16", "q8_0", "q4_0"):
        with open_archive(tmp_path / f"hub-{d}.thin") as a:
            src = a.manifest["validation"]["source"]
            assert (src["repo_id"], src["commit"]) == (HUB_REPO, COMMIT_A)
            assert src["revision"] == "main"  # as the job asked: the archive `thinconv convert` writes
            assert a.verify().ok
    # a rerun skips everything and downloads nothing
    calls.clear()
    r = batch(jobs_file, "--workers", "2", "--report", report)
    assert r.exit_code == 0, r.output
    assert {rec["status"] for rec in report_lines(report)} == {"skipped"}
    assert not [c for c in calls if any(p.endswith(".safetensors") for p in c[2])]
    # the model is updated (main → a new commit): its jobs rerun, the local one stays skipped
    populate_hub_cache(home, HUB_REPO, ckpts["sharded"].path, commit=COMMIT_B)
    r = batch(jobs_file, "--workers", "2", "--report", report)
    assert r.exit_code == 0, r.output
    recs = by_job(report_lines(report))
    assert [recs[k]["status"] for k in (1, 2, 3, 4)] == ["done", "done", "done", "skipped"]
    with open_archive(tmp_path / "hub-q8_0.thin") as a:
        assert a.manifest["validation"]["source"]["commit"] == COMMIT_B


def test_unresolvable_hub_source_fails_only_its_jobs(ckpts, tmp_path, monkeypatch):
    use_hub_cache(monkeypatch, tmp_path / "empty-hf")
    jobs_file = write_jobs(tmp_path / "jobs.toml", [{"source": "tiny-org/not-cached", "out": "x.thin"},
                                                    {"source": str(ckpts["llama2"].path), "out": "y.thin"}],
                           defaults={"probe": False})
    report = tmp_path / "r.jsonl"
    r = batch(jobs_file, "--workers", "1", "--report", report)
    assert r.exit_code == 1
    recs = by_job(report_lines(report))
    assert recs[1]["status"] == "failed" and "tiny-org/not-cached" in recs[1]["error"]
    assert "HF_HUB_OFFLINE" in recs[1]["error"]
    assert recs[2]["status"] == "done" and (tmp_path / "y.thin").is_file()


# ---------------------------------------------------------------- stopping on a signal

SLOW_TRANSFORM = '''
import os, time

def slow(rows, *, name, start, end, model):
    time.sleep(float(os.environ.get("SLOWTHIN_SECONDS", "0.4")))
    return rows
'''


@pytest.fixture
def slow_env(tmp_path) -> dict:
    """A transform package (found through an entry point) and a recipe using it, so that a job
    is still running when the signal comes."""
    plug = tmp_path / "plug"
    info = plug / "slowthin-0.1.dist-info"
    info.mkdir(parents=True)
    (plug / "slowthin.py").write_text(SLOW_TRANSFORM)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: slowthin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[thinconv.transforms]\nslow = slowthin:slow\n")
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "slowllama.toml").write_text('name = "slowllama"\nextends = "llama"\n'
                                            'architectures = ["LlamaForCausalLM"]\n'
                                            '[transforms]\n"ffn_down.weight" = "slow"\n')
    return {"PYTHONPATH": str(plug), "THINCONV_RECIPES": str(recipes), "SLOWTHIN_SECONDS": "0.4"}


@pytest.mark.parametrize("how", ["SIGTERM to the batch", "SIGINT to the process group",
                                 "SIGTERM to the process group"])
def test_killed_batch_leaves_no_partial_file_and_a_rerun_completes(ckpts, tmp_path, slow_env, how):
    out = tmp_path / "out"
    out.mkdir()
    src = str(ckpts["llama2"].path)
    jobs_file = write_jobs(tmp_path / "jobs.toml", [
        {"source": src, "out": "out/fast.thin", "recipe": "llama"},
        {"source": src, "out": "out/slow1.thin", "recipe": "slowllama", "dtype": "q8_0"},
        {"source": src, "out": "out/slow2.thin", "recipe": "slowllama", "dtype": "q4_0"},
    ], defaults={"probe": False})
    report = tmp_path / "r.jsonl"
    env = {**os.environ, **slow_env, "COLUMNS": "200"}
    proc = subprocess.Popen([str(BIN), "batch", str(jobs_file), "--workers", "1", "--report", str(report)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (report.exists() and report.read_text().count("\n") >= 1):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no report line within 60 s"
            time.sleep(0.02)
        time.sleep(0.3)  # the second job is converting now
        if how == "SIGTERM to the batch":
            proc.send_signal(signal.SIGTERM)
        else:  # the batch and its workers get the signal at once (Ctrl-C, kill -- -PGID, proctrack/linuxproc)
            os.killpg(proc.pid, signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == (143 if how.startswith("SIGTERM") else 130), (stdout, stderr)
    assert "stopped by a signal" in stderr and "Traceback" not in stderr
    recs = by_job(report_lines(report))
    assert recs[1]["status"] == "done"
    assert recs[2] == {**recs[2], "status": "failed", "error": "interrupted"}
    assert 3 not in recs
    assert sorted(p.name for p in out.iterdir()) == ["fast.thin"]  # no temp file, no partial archive
    fast = stamp(out / "fast.thin")

    r = subprocess.run([str(BIN), "batch", str(jobs_file), "--workers", "2", "--report", str(report)],
                       capture_output=True, text=True, env={**env, "SLOWTHIN_SECONDS": "0"}, timeout=120)
    assert r.returncode == 0, r.stderr
    recs = by_job(report_lines(report))
    assert [recs[k]["status"] for k in (1, 2, 3)] == ["skipped", "done", "done"]
    assert stamp(out / "fast.thin") == fast
    assert sorted(p.name for p in out.iterdir()) == ["fast.thin", "slow1.thin", "slow2.thin"]
    for name in ("slow1.thin", "slow2.thin"):
        with open_archive(out / name) as a:
            assert a.verify().ok and a.manifest["validation"]["converter"]["recipe"] == "slowllama"


# ---------------------------------------------------------------- workers

def test_default_workers_fit_cores_and_memory(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(B.workers, "available_memory", lambda: 64 * 1024**3)
    assert B.default_workers() == 8
    monkeypatch.setattr(B.workers, "available_memory", lambda: 5 * 1024**3)
    assert B.default_workers() == 2
    monkeypatch.setattr(B.workers, "available_memory", lambda: 1024**3)
    assert B.default_workers() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(B.workers, "available_memory", lambda: None)
    assert B.default_workers() == 1


def test_workers_stop_when_the_batch_is_killed_hard(ckpts, tmp_path, slow_env):
    """SIGKILL cannot be handled by the batch itself: its workers notice (the pipe to the parent
    breaks; on Linux also a parent-death signal), stop and remove their temp files; the next run
    removes any temp file left and completes."""
    out = tmp_path / "out"
    out.mkdir()
    src = str(ckpts["llama2"].path)
    jobs_file = write_jobs(tmp_path / "jobs.toml", [
        {"source": src, "out": "out/fast.thin", "recipe": "llama"},
        {"source": src, "out": "out/slow.thin", "recipe": "slowllama"},
    ], defaults={"probe": False})
    report = tmp_path / "r.jsonl"
    env = {**os.environ, **slow_env}
    proc = subprocess.Popen([str(BIN), "batch", str(jobs_file), "--workers", "1", "--report", str(report)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (report.exists() and report.read_text().count("\n") >= 1):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.3)
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(2.5)  # the slow job would have finished by now had its worker run on
    assert sorted(p.name for p in out.iterdir()) == ["fast.thin"]
    assert [rec["job"] for rec in report_lines(report)] == [1]
    r = subprocess.run([str(BIN), "batch", str(jobs_file), "--workers", "1", "--report", str(report)],
                       capture_output=True, text=True, env={**env, "SLOWTHIN_SECONDS": "0"}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert [rec["status"] for rec in report_lines(report)] == ["skipped", "done"]


def test_report_folder_missing_is_a_usage_error(ckpts, tmp_path):
    jobs_file = write_jobs(tmp_path / "jobs.toml", [{"source": str(ckpts["llama2"].path), "out": "a.thin"}])
    r = batch(jobs_file, "--report", tmp_path / "nope" / "r.jsonl")
    assert r.exit_code == 2 and "--report" in r.stderr and "Traceback" not in r.output
    assert not (tmp_path / "a.thin").exists()


def test_live_view_renders_running_jobs_and_failures(tmp_path):
    from rich.console import Console

    from thinconv import cli
    from thinconv.plan import ConvertOptions

    view = cli.LiveBatchView(3)
    job = B.Job(1, "org/model", tmp_path / "m-q8.thin", ConvertOptions(dtype="q8_0"), hub=True)
    view.job_started(job, "no archive yet")
    view.job_progress(job, "verifying", 1 << 20, 4 << 20)
    view.job_progress(job, "converting", 2 << 20, 4 << 20)
    view.finished["failed"] += 1
    console = Console(record=True, width=160, file=open(os.devnull, "w"))
    console.print(view.render())
    text = console.export_text()
    assert "org/model" in text and "m-q8.thin" in text and "converting" in text and "2.0 MiB / 4.0 MiB 50 %" in text
    assert "1/3 finished: 0 done, 0 skipped, 1 failed; 1 running" in text
    assert view.running[1]["before"] == 1 << 20  # bytes of the finished phase count towards bytes/s
