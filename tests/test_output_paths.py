"""Issue 17, "Output paths" and "Reading outside the source": an output must be a regular file or
absent, and never a file the command reads (directly, through a symlink or a hard link), --force or
not — for convert, pack, unpack and batch jobs; a source file is a regular file inside the source
folder (a symlink only when it resolves inside it). Each refusal is one line, exit 1, and nothing
is written or changed."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from thinconv.cli import app
from thinconv.errors import PackError
from thinconv.format.writer import check_output

runner = CliRunner()


def refused(args: list, *needles: str) -> str:
    """Run the command; assert exit 1 with one `error:` line holding every needle; return it."""
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.is_symlink()}


@pytest.fixture
def src(llama_copy) -> Path:
    (llama_copy.path / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    return llama_copy.path


# ---------------------------------------------------------------- convert: outputs it reads

@pytest.mark.parametrize("target", ["model.safetensors", "config.json", "tokenizer.json"])
@pytest.mark.parametrize("how", ["direct", "symlink", "hardlink"])
def test_convert_refuses_to_write_onto_a_file_it_reads(src, tmp_path, target, how):
    before = snapshot(src)
    if how == "direct":
        out = src / target
    elif how == "symlink":
        out = tmp_path / "out.thin"
        out.symlink_to(src / target)
    else:
        out = tmp_path / "out.thin"
        os.link(src / target, out)
    refused(["convert", src, out, "--force", "--no-probe"], "which this command reads")
    assert snapshot(src) == before
    assert not list(tmp_path.glob(".out.thin.*")) and not list(src.glob(".*.tmp"))


def test_convert_refuses_a_device_or_fifo_output(src, tmp_path):
    dev = tmp_path / "null.thin"
    dev.symlink_to("/dev/null")
    refused(["convert", src, dev, "--force", "--no-probe"], "not a regular file")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    fifo = tmp_path / "fifo.thin"
    os.mkfifo(fifo)
    refused(["convert", src, fifo, "--force", "--no-probe"], "not a regular file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_dev_null_itself_is_refused_before_anything_is_written():
    """`thinconv convert SRC /dev/null --force` as root turned /dev/null into a regular file; the
    check that refuses it runs before any work (tested here without a conversion behind it)."""
    with pytest.raises(PackError, match="not a regular file"):
        check_output(Path("/dev/null"), True)
    r = runner.invoke(app, ["convert", "no-such-folder", "/dev/null", "--force", "--dry-run"])
    assert r.exit_code == 1 and "not a regular file" in r.stderr, r.output
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


# ---------------------------------------------------------------- pack and unpack

@pytest.fixture
def staging(src, tmp_path) -> Path:
    archive = tmp_path / "a.thin"
    assert runner.invoke(app, ["convert", str(src), str(archive), "--no-probe"]).exit_code == 0
    assert runner.invoke(app, ["unpack", str(archive), str(tmp_path / "staging")]).exit_code == 0
    return tmp_path / "staging"


def test_pack_refuses_to_write_onto_its_manifest_or_a_page_file(staging, tmp_path):
    before = snapshot(staging)
    page = next(p for p in (staging / "pages").rglob("*") if p.is_file())
    refused(["pack", staging, staging / "manifest.json", "--force"], "which this command reads")
    refused(["pack", staging, page, "--force"], "which this command reads")
    link = tmp_path / "link.thin"
    link.symlink_to(page)
    refused(["pack", staging, link, "--force"], "which this command reads")
    dev = tmp_path / "null.thin"
    dev.symlink_to("/dev/null")
    refused(["pack", staging, dev, "--force"], "not a regular file")
    assert snapshot(staging) == before


def test_unpack_refuses_a_destination_holding_the_archive_or_not_a_folder(staging, tmp_path):
    archive = tmp_path / "a.thin"
    data = archive.read_bytes()
    refused(["unpack", archive, tmp_path, "--force"], "the archive being unpacked")
    refused(["unpack", archive, archive, "--force"], "the archive being unpacked")
    dev = tmp_path / "null"
    dev.symlink_to("/dev/null")
    refused(["unpack", archive, dev, "--force"], "not a directory")
    assert archive.read_bytes() == data


# ---------------------------------------------------------------- reading outside the source

def test_tokenizer_symlinked_outside_the_folder_is_refused(src, tmp_path):
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$secret:19000:0:99999:7:::\n")
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to(secret)
    refused(["convert", src, tmp_path / "o.thin", "--no-probe"], "tokenizer.json", "links outside the checkpoint")
    assert not (tmp_path / "o.thin").exists()


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_a_fifo_or_dev_zero_as_tokenizer_is_refused_in_one_line(src, tmp_path, kind):
    (src / "tokenizer.json").unlink()
    if kind == "fifo":
        os.mkfifo(src / "tokenizer.json")
        refused(["convert", src, tmp_path / "o.thin", "--no-probe"], "tokenizer.json", "not a regular file")
    else:
        (src / "tokenizer.json").symlink_to("/dev/zero")
        refused(["convert", src, tmp_path / "o.thin", "--no-probe"], "tokenizer.json")
    assert not (tmp_path / "o.thin").exists()


def test_a_shard_symlinked_outside_the_folder_is_refused(src, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(src / "model.safetensors", outside)
    (src / "model.safetensors").symlink_to(outside)
    refused(["convert", src, tmp_path / "o.thin", "--no-probe"], "model.safetensors", "links outside the checkpoint")


def test_symlinks_that_stay_inside_the_folder_are_followed(src, tmp_path):
    (src / "blobs").mkdir()
    shutil.move(src / "model.safetensors", src / "blobs" / "weights")
    (src / "model.safetensors").symlink_to("blobs/weights")
    shutil.move(src / "tokenizer.json", src / "blobs" / "tok")
    (src / "tokenizer.json").symlink_to(src / "blobs" / "tok")
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "o.thin"), "--no-probe", "--json"])
    assert r.exit_code == 0, r.output


# ---------------------------------------------------------------- batch jobs

@pytest.mark.slow
def test_batch_jobs_refuse_outputs_they_read_or_devices(src, tmp_path):
    dev = tmp_path / "null.thin"
    dev.symlink_to("/dev/null")
    jobs = tmp_path / "jobs.toml"
    jobs.write_text("".join(f'[[job]]\nsource = "{src}"\nout = "{out}"\nprobe = false\n\n'
                            for out in (src / "model.safetensors", dev, tmp_path / "ok.thin")))
    before = snapshot(src)
    r = runner.invoke(app, ["batch", str(jobs), "--workers", "1", "--json"])
    assert r.exit_code == 1, r.output
    results = json.loads(r.stdout)
    assert (results["done"], results["failed"]) == (1, 2)
    assert snapshot(src) == before and stat.S_ISCHR(os.stat("/dev/null").st_mode)
