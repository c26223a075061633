"""Durability and leftovers of the writers: the order of fsync / link / rename / directory fsync in
`pack` and `convert` (output absent, and present with --force), and the stale temp files a killed
earlier run left — removed by the next `convert` / `pack` of that output (and said so), never
while a running writer still holds them (flock)."""

from __future__ import annotations

import fcntl
import json
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import thinconv
from conftest import BIN, make_llama
from factory import make_archive_inputs
from thinconv.cli import app
from thinconv.format import pack
from thinconv.format.temps import remove_stale_temps

runner = CliRunner()


# ---------------------------------------------------------------- the order of durable steps

class SyscallLog:
    """Records os.fsync (file or directory, by path), os.link, os.rename and os.replace, in order."""

    def __init__(self, monkeypatch):
        self.events: list[tuple] = []
        real = {name: getattr(os, name) for name in ("fsync", "link", "rename", "replace")}

        def fsync(fd):
            st = os.fstat(fd)
            path = os.readlink(f"/proc/self/fd/{fd}")
            self.events.append(("fsync_dir" if stat.S_ISDIR(st.st_mode) else "fsync", path))
            return real["fsync"](fd)

        def move(name):
            def call(src, dst, *args, **kwargs):
                self.events.append((name, os.path.abspath(src), os.path.abspath(dst)))
                return real[name](src, dst, *args, **kwargs)
            return call

        monkeypatch.setattr(os, "fsync", fsync)
        for name in ("link", "rename", "replace"):
            monkeypatch.setattr(os, name, move(name))


def assert_durable_order(events: list[tuple], out: Path) -> None:
    """The temp holding the archive is fsynced, then linked / renamed / replaced onto `out`, then
    out's folder is fsynced — in that order, with nothing moved onto `out` before its data is on disk."""
    out = os.path.abspath(out)
    moves = [i for i, e in enumerate(events) if e[0] in ("link", "rename", "replace") and e[2] == out]
    assert len(moves) == 1, f"expected one move onto {out}: {events}"
    m = moves[0]
    temp = events[m][1]
    data_syncs = [i for i, e in enumerate(events) if e == ("fsync", temp)]
    assert data_syncs and data_syncs[-1] < m, f"{temp} was moved onto {out} before it was fsynced: {events}"
    dir_syncs = [i for i, e in enumerate(events) if e == ("fsync_dir", os.path.dirname(out))]
    assert dir_syncs and dir_syncs[-1] > m, f"the folder of {out} was not fsynced after the move: {events}"


@pytest.mark.parametrize("present", [False, True], ids=["absent", "present-force"])
def test_pack_fsyncs_data_then_renames_then_fsyncs_the_folder(tmp_path, monkeypatch, present):
    manifest, sources, _ = make_archive_inputs()
    out = tmp_path / "a.thin"
    if present:
        out.write_bytes(b"old")
    log = SyscallLog(monkeypatch)
    pack(manifest, sources, out, force=present)
    assert_durable_order(log.events, out)
    assert [e[0] for e in log.events if e[0] in ("link", "replace")] == (["replace"] if present else ["link"])


@pytest.mark.parametrize("present", [False, True], ids=["absent", "present-force"])
def test_convert_fsyncs_data_then_renames_then_fsyncs_the_folder(ckpts, tmp_path, monkeypatch, present):
    out = tmp_path / "a.thin"
    if present:
        out.write_bytes(b"old")
    log = SyscallLog(monkeypatch)
    thinconv.convert(ckpts["llama2"].path, out, force=present, probe=False)
    assert_durable_order(log.events, out)
    assert out.read_bytes()[:4] != b"old"


def test_the_order_check_rejects_a_rename_before_the_fsync(tmp_path, monkeypatch):
    """The mutant the issue found passing every test: the temp renamed into place, then fsynced."""
    manifest, sources, _ = make_archive_inputs()
    out = tmp_path / "a.thin"
    log = SyscallLog(monkeypatch)
    pack(manifest, sources, out)
    events = list(log.events)
    move = next(e for e in events if e[0] in ("link", "replace"))
    data = next(e for e in events if e[0] == "fsync")
    mutant = [e for e in events if e != data]
    mutant.insert(mutant.index(move) + 1, data)
    with pytest.raises(AssertionError, match="before it was fsynced"):
        assert_durable_order(mutant, out)
    no_dir_sync = [e for e in events if e[0] != "fsync_dir"]
    with pytest.raises(AssertionError, match="not fsynced after the move"):
        assert_durable_order(no_dir_sync, out)


# ---------------------------------------------------------------- stale temp files

def held(path: Path):
    """Open `path` and flock it, as a running writer holds its temp file."""
    f = open(path, "rb")
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    return f


def test_remove_stale_temps_takes_only_abandoned_regular_temps_of_that_output(tmp_path):
    out = tmp_path / "a[1].thin"
    stale = tmp_path / ".a[1].thin.x8Hq2_z1.tmp"
    stale.write_bytes(b"left by kill -9")
    live = tmp_path / ".a[1].thin.livelive.tmp"
    live.write_bytes(b"being written")
    other = tmp_path / ".b.thin.x8Hq2_z1.tmp"
    other.write_bytes(b"another output's")
    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    (tmp_path / ".a[1].thin.link.tmp").symlink_to(target)
    os.mkfifo(tmp_path / ".a[1].thin.fifo.tmp")
    (tmp_path / ".a[1].thin.dir.tmp").mkdir()
    with held(live):
        removed = remove_stale_temps(out)
    assert removed == [stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".a[1].thin.livelive.tmp", ".b.thin.x8Hq2_z1.tmp", "precious", ".a[1].thin.link.tmp",
         ".a[1].thin.fifo.tmp", ".a[1].thin.dir.tmp"])
    assert target.read_bytes() == b"keep"


def test_convert_removes_stale_temps_of_its_output_and_says_so(ckpts, tmp_path):
    out = tmp_path / "out.thin"
    stale = [tmp_path / ".out.thin.k1ll3d.tmp", tmp_path / ".out.thin.0000.tmp"]
    for s in stale:
        s.write_bytes(b"partial archive of a killed run")
    other = tmp_path / ".other.thin.k1ll3d.tmp"
    other.write_bytes(b"not this output's")
    r = runner.invoke(app, ["convert", str(ckpts["llama2"].path), str(out), "--no-probe", "--json"])
    assert r.exit_code == 0, r.output
    assert sorted(json.loads(r.stdout)["removed_temp_files"]) == sorted(map(str, stale))
    assert not any(s.exists() for s in stale) and other.exists()
    stale[0].write_bytes(b"again")
    r = runner.invoke(app, ["convert", str(ckpts["llama2"].path), str(out), "--no-probe", "--force"])
    assert r.exit_code == 0, r.output
    assert f"removed a stale temp file left by an interrupted run: {stale[0]}" in r.stdout
    r = runner.invoke(app, ["convert", str(ckpts["llama2"].path), str(out), "--no-probe", "--force", "--json"])
    assert json.loads(r.stdout)["removed_temp_files"] == []


def test_pack_removes_stale_temps_of_its_output_and_says_so(ckpts, tmp_path):
    archive = tmp_path / "a.thin"
    thinconv.convert(ckpts["llama2"].path, archive, probe=False)
    assert runner.invoke(app, ["unpack", str(archive), str(tmp_path / "staging")]).exit_code == 0
    out = tmp_path / "packed.thin"
    stale = tmp_path / ".packed.thin.k1ll3d.tmp"
    stale.write_bytes(b"partial")
    r = runner.invoke(app, ["pack", str(tmp_path / "staging"), str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["removed_temp_files"] == [str(stale)] and not stale.exists()
    stale.write_bytes(b"partial")
    r = runner.invoke(app, ["pack", str(tmp_path / "staging"), str(out), "--force"])
    assert f"removed a stale temp file left by an interrupted run: {stale}" in r.stdout and not stale.exists()


def test_convert_keeps_a_temp_that_a_writer_holds(ckpts, tmp_path):
    out = tmp_path / "out.thin"
    live = tmp_path / ".out.thin.st1llw.tmp"
    live.write_bytes(b"being written by another conversion")
    with held(live):
        r = runner.invoke(app, ["convert", str(ckpts["llama2"].path), str(out), "--no-probe", "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["removed_temp_files"] == []
        assert live.read_bytes() == b"being written by another conversion"


@pytest.mark.slow
def test_a_concurrent_conversion_of_the_same_output_keeps_its_temp_and_finishes(tmp_path):
    """A second `convert --force` of the same output while the first still writes: the first's
    temp is not taken from it, and both finish with a valid archive."""
    src = make_llama(tmp_path / "src")
    out = tmp_path / "out.thin"
    first = subprocess.Popen([str(BIN), "convert", str(src), str(out), "--dtype", "q4_0", "--no-probe", "--force",
                              "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".out.thin.*.tmp")):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.002)
        theirs = list(tmp_path.glob(".out.thin.*.tmp"))
        r = subprocess.run([str(BIN), "convert", str(src), str(out), "--no-probe", "--force", "--json"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["removed_temp_files"] == []
        assert first.poll() is not None or all(p.exists() for p in theirs)  # still there while it writes
        stdout, stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, stderr
    assert json.loads(stdout)["removed_temp_files"] == []
    assert list(tmp_path.glob(".out.thin.*")) == []
    with thinconv.open(out) as a:
        assert a.verify().ok
