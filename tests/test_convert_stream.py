"""The one-pass streaming converter: pages land at their final offsets, the data region moves
when the data_off estimate misses (both directions, both ways of moving), the probe follows the
stream, and a failure at any page leaves nothing behind and no thread running."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import thinconv.convert as convert_mod
import thinconv.format.writer as writer_mod
from conftest import leftovers
from thinconv.probe import conversion_probe
from thinconv.checkpoint import open_checkpoint
from thinconv.convert import StreamGate, convert
from thinconv.errors import ConversionError
from thinconv.format import spec
from thinconv.format.reader import open_archive
from thinconv.format.writer import move_data
from thinconv.plan import ConvertOptions, plan_conversion
from thinconv.recipe import load_registry

REGISTRY = load_registry([])


def _convert(src: Path, out: Path, **opts):
    with open_checkpoint(src) as ck:
        plan = plan_conversion(ck, REGISTRY.for_architecture(ck.config["architectures"]), ConvertOptions(**opts))
        return convert(ck, plan, out)


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("thinconv")}


@pytest.fixture(scope="module")
def reference(ckpts, tmp_path_factory) -> dict[str, Path]:
    """llama2 (untied, several pages per tensor) and qwen2 (tied, interleaved), converted normally."""
    root = tmp_path_factory.mktemp("ref")
    out = {}
    for kind, opts in (("llama2", {"page_size": 4096}), ("qwen2", {"page_size": 4096, "rope_layout": "interleaved"})):
        out[kind] = root / f"{kind}.thin"
        res = _convert(ckpts[kind].path, out[kind], **opts)
        assert res.layout_shift == "none"  # the estimate holds on these models
    return out


# ---------------------------------------------------------------- data_off estimate misses

@pytest.mark.parametrize("pages_off", [3, -2, -1, 1], ids=["too-high-3", "too-low-2", "too-low-1", "too-high-1"])
@pytest.mark.parametrize("way", ["fallocate", "copy"])
def test_estimate_miss_gives_the_same_archive(ckpts, reference, tmp_path, monkeypatch, pages_off, way):
    real = convert_mod.plan_layout

    def estimate(manifest):  # only the converter's estimate goes through this name
        return SimpleNamespace(data_off=real(manifest).data_off + pages_off * spec.ALIGNMENT)

    monkeypatch.setattr(convert_mod, "plan_layout", estimate)
    if way == "copy":
        def unsupported(*args):
            raise OSError(errno.EOPNOTSUPP, "not supported")

        monkeypatch.setattr(writer_mod, "_fallocate", unsupported)
    out = tmp_path / "shifted.thin"
    res = _convert(ckpts["llama2"].path, out, page_size=4096)
    if way == "fallocate" and res.layout_shift == "copy":
        pytest.skip("this filesystem cannot collapse/insert ranges; the copy case covers it")
    assert res.layout_shift == way
    assert out.read_bytes() == reference["llama2"].read_bytes()
    assert leftovers(tmp_path) == ["shifted.thin"]


@pytest.mark.parametrize("delta_pages", [-3, -1, 1, 2])
@pytest.mark.parametrize("way", ["fallocate", "copy"])
def test_move_data(tmp_path, monkeypatch, delta_pages, way):
    if way == "copy":
        monkeypatch.setattr(writer_mod, "_fallocate", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOTSUP, "no")))
        monkeypatch.setattr(writer_mod, "CHUNK", 3 * 4096)  # several overlapping steps
    old = 5 * 4096
    new = old + delta_pages * 4096
    payload = np.random.default_rng(1).integers(0, 256, 10 * 4096 + 123, dtype=np.uint8).tobytes()
    path = tmp_path / "f"
    with open(path, "wb") as f:
        f.write(b"\xff" * old)  # stale bytes before the region must end up zero where data was
        f.write(payload)
    fd = os.open(path, os.O_RDWR)
    try:
        how = move_data(fd, old, new, old + len(payload))
    finally:
        os.close(fd)
    if way == "fallocate" and how == "copy":
        pytest.skip("this filesystem cannot collapse/insert ranges")
    assert how == way
    data = path.read_bytes()
    assert len(data) == new + len(payload)
    assert data[new:] == payload
    if delta_pages > 0:  # the vacated range reads as zeros
        assert data[old:new] == bytes(new - old)


def test_move_data_no_shift(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 8192)
    fd = os.open(path, os.O_RDWR)
    try:
        assert move_data(fd, 4096, 4096, 8192) == "none"
    finally:
        os.close(fd)
    assert path.read_bytes() == b"x" * 8192


# ---------------------------------------------------------------- the probe follows the stream

@pytest.mark.parametrize("kind", ["llama2", "qwen2"])
def test_streamed_probe_equals_a_standalone_probe(ckpts, tmp_path, kind):
    """Small pages (many gate steps), tied (qwen2: the head is re-read at the end) and interleaved."""
    opts = {"page_size": 4096, "rope_layout": "interleaved" if kind == "qwen2" else "half", "probe": True}
    out = tmp_path / "p.thin"
    with open_checkpoint(ckpts[kind].path) as ck:
        plan = plan_conversion(ck, REGISTRY.for_architecture(ck.config["architectures"]), ConvertOptions(**opts))
        convert(ck, plan, out)
        standalone, note = conversion_probe(ck, plan)
    assert note is None
    with open_archive(out) as a:
        assert a.manifest["validation"]["probe"] == standalone


def test_gate_holds_the_probe_behind_the_stream(ckpts):
    with open_checkpoint(ckpts["llama2"].path) as ck:
        plan = plan_conversion(ck, REGISTRY.for_architecture(ck.config["architectures"]), ConvertOptions(page_size=4096))
    gate = StreamGate(plan, lag=1)
    names = [t.name for t in plan.tensors]
    first = {n: sum(len(t.pages) for t in plan.tensors[:i]) for i, n in enumerate(names)}
    target = next(t for t in plan.tensors if len(t.pages) >= 3)
    got = []

    def probe():
        gate.wait_rows(target.name, target.pages[1][1])  # rows in its second page
        got.append("read")

    th = threading.Thread(target=probe)
    th.start()
    k = first[target.name] + 1  # the ordinal of that page
    for i in range(k):
        gate.page_done(i)
    time.sleep(0.05)
    assert got == []  # not yet written
    assert gate.may_start(k + 1) and not gate.may_start(k + 2)  # the stream may run `lag` pages ahead
    gate.page_done(k)
    th.join(5)
    assert got == ["read"]
    assert gate.may_start(len(plan.tensors) * 100)  # asset pages never wait for the probe


# ---------------------------------------------------------------- failures mid-stream

@pytest.mark.parametrize("error", [ConversionError("boom at a page"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
@pytest.mark.parametrize("at", [0, 7])
def test_failure_at_a_page_leaves_nothing(ckpts, tmp_path, monkeypatch, error, at):
    real = convert_mod.PageMaker.make
    calls = []

    def make(self, tp, start, end, emit):
        calls.append(tp.name)
        if len(calls) == at + 1:
            raise error
        return real(self, tp, start, end, emit)

    monkeypatch.setattr(convert_mod.PageMaker, "make", make)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(type(error)):
        _convert(ckpts["llama2"].path, out_dir / "o.thin", page_size=4096, probe=True)
    assert leftovers(out_dir) == []
    assert _threads() == set()  # page workers and the probe thread are gone


def test_probe_failure_fails_the_conversion(ckpts, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise MemoryError("probe ran out of memory")

    monkeypatch.setattr(convert_mod, "conversion_probe", broken)
    with pytest.raises(MemoryError):
        _convert(ckpts["llama2"].path, tmp_path / "o.thin", probe=True)
    assert leftovers(tmp_path) == []
    assert _threads() == set()


def test_page_of_the_wrong_size_is_refused(ckpts, tmp_path, monkeypatch):
    real = convert_mod.PageMaker.make

    def short(self, tp, start, end, emit):
        if tp.name.endswith("attn_v.weight"):
            return real(self, tp, start, end, lambda chunk: emit(chunk[:-2]))
        return real(self, tp, start, end, emit)

    monkeypatch.setattr(convert_mod.PageMaker, "make", short)
    with pytest.raises(ConversionError, match=r"page blk\.0\.attn_v\.weight#0: produced \d+ bytes, the plan says"):
        _convert(ckpts["llama2"].path, tmp_path / "o.thin")
    assert leftovers(tmp_path) == []


def test_no_partial_pages_in_an_archive_written_in_one_pass(ckpts, reference):
    """Everything the reader checks (every page checksum included) holds for streamed archives."""
    for path in reference.values():
        with open_archive(path) as a:
            report = a.verify()
            assert report.ok, report.failures
            assert report.bytes_checked == sum(p.size for p in a.pages)


@pytest.mark.slow
def test_conversion_imports_neither_transformers_nor_torch(ckpts, tmp_path):
    """A default conversion (probe included) needs numpy, not the reference frameworks."""
    import subprocess
    import sys

    code = ("import sys\nfrom thinconv.cli import main\n"
            f"sys.argv = ['thinconv', 'convert', {str(ckpts['qwen2'].path)!r}, {str(tmp_path / 'o.thin')!r}]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('HEAVY=' + ','.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("HEAVY="), r.stdout
    with open_archive(tmp_path / "o.thin") as a:
        assert "probe" in a.manifest["validation"]


def test_platforms_without_pwrite_give_the_same_archive(ckpts, reference, tmp_path, monkeypatch):
    """Windows has no os.pwrite / os.pread: seek + write under a lock, and the copying shift."""
    monkeypatch.setattr(writer_mod, "_pwrite", writer_mod._pwrite_by_seek)
    monkeypatch.setattr(writer_mod, "_pread", writer_mod._pread_by_seek)
    monkeypatch.setattr(writer_mod, "_fallocate", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSYS, "no")))
    real = convert_mod.plan_layout
    monkeypatch.setattr(convert_mod, "plan_layout",
                        lambda m: SimpleNamespace(data_off=real(m).data_off + spec.ALIGNMENT))  # force a shift
    out = tmp_path / "w.thin"
    res = _convert(ckpts["llama2"].path, out, page_size=4096)
    assert res.layout_shift == "copy"
    assert out.read_bytes() == reference["llama2"].read_bytes()
