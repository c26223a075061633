"""Spec §1 rules, each broken alone in crafted bytes: header fields, page-table records, layout,
manifest encoding. Checks open_archive / verify fail with a message naming the offset, field or
page id. Archives are laid out by test_format_layout.assemble (independent of the writer), with
lengths and the archive hash fixed up so only the intended rule breaks.
"""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import replace

import blake3
import pytest

from test_format_layout import (FIELD_OFFSET, Rec, align, assemble, base_archive, canonical, parse, reassemble,
                                set_field, with_manifest, write)
from thinconv.errors import ThinFormatError
from thinconv.format import open_archive, spec

BUF, MANIFEST, SOURCES, _ = base_archive(page_size=64)  # token_embd.weight in 6 pages: gaps between pages
PARTS = parse(BUF)
SIZE = len(BUF)


def _open_error(tmp_path, data: bytes) -> str:
    with pytest.raises(ThinFormatError) as e:
        open_archive(write(tmp_path, data))
    text = str(e.value)
    assert text.startswith("a.thin: ") and "\n" not in text
    return text


def _verify_failures(tmp_path, data: bytes) -> list[str]:
    with open_archive(write(tmp_path, data)) as a:
        return a.verify().failures


def test_base_is_valid(tmp_path):
    assert _verify_failures(tmp_path, BUF) == []
    gaps = [b.offset - (a.offset + a.stored) for a, b in zip(PARTS.recs, PARTS.recs[1:])]
    assert any(gaps), "the base must have padding between pages"


# -- header ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,fmt,value,expect", [
    ("magic", "<8s", b"THINv1\0\0", "bad magic b'THINv1\\x00\\x00' at offset 0"),
    ("magic", "<8s", b"GGUF\0\0\0\0", "at offset 0"),
    ("header_len", "<I", 96, "header_len at offset 8 is 96, expected 88"),
    ("header_len", "<I", 0, "header_len at offset 8 is 0"),
    ("version", "<I", 1, "version at offset 12 is 1"),
    ("version", "<I", 2**32 - 1, "version at offset 12 is 4294967295"),
    ("manifest_off", "<Q", 96, "manifest_off at offset 16 is 96, expected 88"),
    ("manifest_len", "<Q", 0, "manifest_len at offset 24 is 0, expected 1..67108864"),
    ("manifest_len", "<Q", 64 * 2**20 + 1, "manifest_len at offset 24 is 67108865"),
    ("manifest_len", "<Q", 2**64 - 1, "manifest_len at offset 24"),
    ("manifest_len", "<Q", SIZE, f"runs past the end of the file ({SIZE} bytes)"),
    ("page_table_off", "<Q", PARTS.table_off + 1, f"page_table_off at offset 32 is {PARTS.table_off + 1}, "
                                                  f"expected manifest_off + manifest_len = {PARTS.table_off}"),
    ("page_count", "<Q", 0, "page_count at offset 40 is 0"),
    ("page_count", "<Q", 2**64 - 1, "page_count at offset 40 is 18446744073709551615"),
    ("page_count", "<Q", SIZE // 4096 + 2, "page_count at offset 40"),
    ("data_off", "<Q", PARTS.header["data_off"] + 1, "data_off at offset 48"),
    ("data_off", "<Q", 0, "data_off at offset 48 is 0"),
    ("data_off", "<Q", align(SIZE) + 4096, "data_off at offset 48"),
    ("data_off", "<Q", 2**64 - 4096, "data_off at offset 48"),
])
def test_header_field(tmp_path, field, fmt, value, expect):
    assert _open_error(tmp_path, set_field(BUF, FIELD_OFFSET[field], fmt, value)).endswith(expect) or \
        expect in _open_error(tmp_path, set_field(BUF, FIELD_OFFSET[field], fmt, value))


def test_manifest_len_limit_is_inclusive(tmp_path, monkeypatch):
    """manifest_len ≤ 64 MiB: exactly at the limit opens, one byte over is refused (limit lowered to
    this manifest's length so the test stays small)."""
    n = len(PARTS.manifest)
    monkeypatch.setattr(spec, "MAX_MANIFEST_LEN", n)
    open_archive(write(tmp_path, BUF)).close()
    monkeypatch.setattr(spec, "MAX_MANIFEST_LEN", n - 1)
    assert f"manifest_len at offset 24 is {n}, expected 1..{n - 1}" in _open_error(tmp_path, BUF)


def test_page_count_one_less(tmp_path):
    """A page_count that skips the last record: the table then ends early and data_off disagrees."""
    text = _open_error(tmp_path, set_field(BUF, FIELD_OFFSET["page_count"], "<Q", len(PARTS.recs) - 1))
    assert "data_off" in text or "trailing bytes" in text or "manifest lists" in text


def test_data_off_one_page_too_far(tmp_path):
    """data_off aligned but 4096 past align_up(end of table), pages shifted along: only that rule breaks."""
    data_off = PARTS.header["data_off"] + 4096
    text = _open_error(tmp_path, reassemble(PARTS, data_off=data_off))
    end = PARTS.record_offset(len(PARTS.recs))
    assert text.endswith(f"data_off is {data_off}, expected align_up(end of page table = {end}) = {align(end)}")


def test_table_runs_into_data(tmp_path):
    """A page table straddling a 4096 boundary while data_off claims that (lower) boundary."""
    m = copy.deepcopy(MANIFEST)
    table_len = PARTS.record_offset(len(PARTS.recs)) - PARTS.table_off
    m["runtime"] = {"pad": ""}
    boundary = align(88 + len(canonical(m))) + 4096
    m["runtime"]["pad"] = "x" * (boundary - table_len // 2 - 88 - len(canonical(m)))
    mbytes = canonical(m)
    pt_off = 88 + len(mbytes)
    assert pt_off < boundary < pt_off + table_len
    data = assemble(mbytes, PARTS.recs, PARTS.datas, data_off=boundary)
    pos, k = pt_off, 0
    while pos + len(PARTS.recs[k].encode()) <= boundary:
        pos += len(PARTS.recs[k].encode())
        k += 1
    assert _open_error(tmp_path, data).endswith(f"page-table record {k} at offset {pos} runs into the data section "
                                                f"(data_off {boundary})")


def test_archive_hash(tmp_path):
    data = set_field(BUF, FIELD_OFFSET["archive_hash"], "<32s", bytes(32))
    assert _verify_failures(tmp_path, data) == ["archive_hash does not match blake3(manifest + page table)"]


# -- page-table records ---------------------------------------------------------------------------

def _with_rec(k: int, **changes) -> bytes:
    parts = copy.deepcopy(PARTS)
    parts.recs[k] = replace(parts.recs[k], **changes)
    return reassemble(parts)


def _rec_where(k: int, pid: str | None = None) -> str:
    pid = pid or PARTS.recs[k].id.decode()
    return f"page {pid!r} (record at offset {PARTS.record_offset(k)})"


def test_id_len_zero(tmp_path):
    data = set_field(BUF, PARTS.record_offset(3), "<H", 0)
    assert _open_error(tmp_path, data).endswith(f"page-table record 3 at offset {PARTS.record_offset(3)}: "
                                                f"id_len 0, expected 1..255")


def test_id_len_256(tmp_path):
    long_id = b"x" * 256
    text = _open_error(tmp_path, _with_rec(2, id=long_id))
    assert text.endswith(f"page-table record 2 at offset {PARTS.record_offset(2)}: id_len 256, expected 1..255")


def test_id_len_255_is_read(tmp_path):
    """255 is allowed by the table reader (the manifest then disagrees: the id names no page)."""
    text = _open_error(tmp_path, _with_rec(2, id=b"x" * 255))
    assert "id_len" not in text and "manifest says" in text


@pytest.mark.parametrize("bad", [b"token embd#0", b"token_embd\xffw#0", b"t\xc3\xa9#0", b"tok\0#0", b"a+b"])
def test_id_charset(tmp_path, bad):
    text = _open_error(tmp_path, _with_rec(1, id=bad))
    assert text.endswith(f"page-table record 1 at offset {PARTS.record_offset(1)}: id {bad!r} has characters "
                         f"outside [A-Za-z0-9._#:/-]")


def test_duplicate_id(tmp_path):
    text = _open_error(tmp_path, _with_rec(2, id=PARTS.recs[1].id))
    assert text.endswith(f"{_rec_where(2, PARTS.recs[1].id.decode())}: duplicate id")


@pytest.mark.parametrize("flags", [1, 0x80000000, 0xFFFFFFFF])
def test_flags(tmp_path, flags):
    assert _open_error(tmp_path, _with_rec(4, flags=flags)).endswith(
        f"{_rec_where(4)}: unknown flags 0x{flags:x} (v0 defines none)")


def test_stored_differs_from_raw(tmp_path):
    r = PARTS.recs[4]
    assert _open_error(tmp_path, _with_rec(4, raw=r.raw * 2)).endswith(
        f"{_rec_where(4)}: stored_size {r.stored} ≠ raw_size {r.raw * 2} (v0 stores pages raw)")


def test_size_zero(tmp_path):
    """A zero-size page appended at the end (manifest untouched: the table is read first)."""
    parts = copy.deepcopy(PARTS)
    parts.recs.append(Rec(b"empty#0", 0, 0, 0, 0, blake3.blake3(b"").digest()))
    parts.datas.append(b"")
    k = len(parts.recs) - 1
    assert _open_error(tmp_path, reassemble(parts)).endswith(
        f"page 'empty#0' (record at offset {parts.record_offset(k)}): size 0 (every page has size > 0)")


def test_offset_not_aligned(tmp_path):
    """Page 2 placed 8 bytes past its aligned slot (data moved along with it)."""
    parts = copy.deepcopy(PARTS)
    want = parts.recs[2].offset
    parts.recs[2].offset += 8
    text = _open_error(tmp_path, reassemble(parts, place=False))
    assert text.endswith(f"{_rec_where(2)}: offset {want + 8}, expected {want} (pages are back to back, each at the "
                         f"next multiple of 4096)")


def test_offset_extra_gap(tmp_path):
    """The last page one 4096 slot further than needed: aligned, but not where the layout puts it."""
    parts = copy.deepcopy(PARTS)
    k = len(parts.recs) - 1
    want = parts.recs[k].offset
    parts.recs[k].offset += 4096
    assert _open_error(tmp_path, reassemble(parts, place=False)).endswith(f"offset {want + 4096}, expected {want} "
                                                                          f"(pages are back to back, each at the "
                                                                          f"next multiple of 4096)")


def test_offsets_out_of_order(tmp_path):
    """Records keep manifest order but pages 1 and 2 swap places in the file."""
    parts = copy.deepcopy(PARTS)
    a, b = parts.recs[1], parts.recs[2]
    a.offset, b.offset = b.offset, a.offset
    text = _open_error(tmp_path, reassemble(parts, place=False))
    assert f"{_rec_where(1)}: offset {PARTS.recs[2].offset}, expected {PARTS.recs[1].offset}" in text


def test_page_past_end(tmp_path):
    parts = copy.deepcopy(PARTS)
    k = len(parts.recs) - 1
    r = parts.recs[k]
    r.stored = r.raw = r.stored + 10
    text = _open_error(tmp_path, reassemble(parts))  # data length unchanged: the record claims 10 bytes more
    assert text.endswith(f"{_rec_where(k)}: [{r.offset}, {r.offset + r.stored}) runs past the end of the file "
                         f"({SIZE} bytes)")


def test_trailing_bytes(tmp_path):
    for extra in (b"\0", b"\0" * 4096, b"junk"):
        assert _open_error(tmp_path, BUF + extra).endswith(
            f"file is {SIZE + len(extra)} bytes but the last page ends at {SIZE} (trailing bytes)")


@pytest.mark.parametrize("cut", [1, 10, SIZE - 88, SIZE - 87, SIZE - 10, SIZE - 1])
def test_truncated(tmp_path, cut):
    text = _open_error(tmp_path, BUF[:cut])
    assert "past the end" in text or "shorter than" in text or "page_count" in text or "data_off" in text


def test_empty_file(tmp_path):
    assert _open_error(tmp_path, b"").endswith("file is 0 bytes, shorter than the 88-byte header")


# -- manifest agreement with the page table ---------------------------------------------------------

def test_table_id_differs_from_manifest(tmp_path):
    text = _open_error(tmp_path, _with_rec(3, id=b"token_embd.weight#9"))
    assert text.endswith(f"page-table record at offset {PARTS.record_offset(3)} is 'token_embd.weight#9', "
                         f"manifest says {PARTS.recs[3].id.decode()!r}")


def test_table_size_differs_from_manifest(tmp_path):
    """The last page (an asset) one byte longer in the table and in the file, manifest unchanged."""
    parts = copy.deepcopy(PARTS)
    k = len(parts.recs) - 1
    parts.datas[k] += b"!"
    parts.recs[k].stored = parts.recs[k].raw = len(parts.datas[k])
    pid = parts.recs[k].id.decode()
    assert _open_error(tmp_path, reassemble(parts)).endswith(
        f"page {pid!r}: page table says {len(parts.datas[k])} bytes, manifest {len(PARTS.datas[k])}")


def test_table_checksum_differs_from_manifest(tmp_path):
    pid = PARTS.recs[5].id.decode()
    assert _open_error(tmp_path, _with_rec(5, checksum=bytes(32))).endswith(
        f"page {pid!r}: page-table checksum differs from the manifest's")


def test_table_has_extra_page(tmp_path):
    parts = copy.deepcopy(PARTS)
    parts.recs.append(Rec(b"extra#0", 0, 3, 3, 0, blake3.blake3(b"abc").digest()))
    parts.datas.append(b"abc")
    assert _open_error(tmp_path, reassemble(parts)).endswith(
        f"manifest lists {len(PARTS.recs)} pages, the page table {len(PARTS.recs) + 1}")


# -- manifest encoding -----------------------------------------------------------------------------

def _manifest_error(tmp_path, mbytes: bytes) -> str:
    return _open_error(tmp_path, with_manifest(BUF, mbytes))


def test_not_canonical(tmp_path):
    pretty = json.dumps(MANIFEST, sort_keys=True, indent=1).encode()
    at = next(i for i, (a, b) in enumerate(zip(pretty, PARTS.manifest)) if a != b)
    assert _manifest_error(tmp_path, pretty).endswith(
        f"manifest is not in canonical encoding (first difference at manifest byte {at})")
    assert at == 1


@pytest.mark.parametrize("variant", [
    lambda b: b + b"\n",  # trailing newline
    lambda b: b.replace(b'"format":"thin"', b'"format": "thin"'),
    lambda b: b.replace(b'"runtime":{}', b'"runtime":{ }'),
    lambda b: b.replace(b'"theta":10000.0', b'"theta":1e4'),
    lambda b: b.replace(b'"theta":10000.0', b'"theta":10000.00'),
    lambda b: b.replace(b'"format":"thin"', b'"format":"\\u0074hin"'),
    lambda b: b.replace(b'"layer":null', b'"layer":null ', 1),
], ids=["newline", "space", "inner_space", "exponent", "trailing_zero", "escape", "space_after"])
def test_not_canonical_variants(tmp_path, variant):
    mbytes = variant(PARTS.manifest)
    assert mbytes != PARTS.manifest and json.loads(mbytes) == json.loads(PARTS.manifest)
    at = next((i for i, (a, b) in enumerate(zip(PARTS.manifest, mbytes)) if a != b), len(PARTS.manifest))
    assert _manifest_error(tmp_path, mbytes).endswith(
        f"manifest is not in canonical encoding (first difference at manifest byte {at})")


def test_unsorted_keys(tmp_path):
    m = {k: MANIFEST[k] for k in reversed(sorted(MANIFEST))}
    mbytes = json.dumps(m, separators=(",", ":"), ensure_ascii=False).encode()
    assert "not in canonical encoding (first difference at manifest byte 2)" in _manifest_error(tmp_path, mbytes)


def test_non_ascii_must_be_raw_utf8(tmp_path):
    m = copy.deepcopy(MANIFEST)
    m["runtime"] = {"note": "café"}
    good = canonical(m)
    with open_archive(write(tmp_path, with_manifest(BUF, good))) as a:
        assert a.manifest["runtime"]["note"] == "café"
    escaped = json.dumps(m, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    assert "not in canonical encoding" in _manifest_error(tmp_path, escaped)


@pytest.mark.parametrize("key", ["format", "runtime", "theta"])
def test_duplicate_keys(tmp_path, key):
    needle = {"format": b'"format":"thin"', "runtime": b'"runtime":{}', "theta": b'"theta":10000.0'}[key]
    mbytes = PARTS.manifest.replace(needle, needle + b"," + needle, 1)
    assert _manifest_error(tmp_path, mbytes).endswith(f"a.thin: manifest: duplicate key {key!r}")


@pytest.mark.parametrize("const", ["NaN", "Infinity", "-Infinity"])
def test_nan_infinity(tmp_path, const):
    mbytes = PARTS.manifest.replace(b'"theta":10000.0', b'"theta":' + const.encode())
    assert _manifest_error(tmp_path, mbytes).endswith(
        f"manifest: {const} is not allowed (JSON numbers must be finite)")


def test_overflowing_float(tmp_path):
    mbytes = PARTS.manifest.replace(b'"theta":10000.0', b'"theta":1e999')
    text = _manifest_error(tmp_path, mbytes)
    assert "number 1e999 overflows" in text  # refused while parsing: it would have read as inf


def test_huge_integer_literal(tmp_path):
    mbytes = PARTS.manifest.replace(b'"runtime":{}', b'"runtime":{"n":' + b"9" * 5000 + b"}")
    assert "manifest: an integer of 5000 digits is out of range" in _manifest_error(tmp_path, mbytes)


def test_not_utf8(tmp_path):
    mbytes = PARTS.manifest.replace(b'"runtime":{}', b'"runtime":{"n":"\xff"}')
    at = mbytes.index(b"\xff")
    assert _manifest_error(tmp_path, mbytes).endswith(f"manifest: not UTF-8 (byte {at})")


def test_invalid_json(tmp_path):
    mbytes = PARTS.manifest[:-1] + b","
    assert "manifest: invalid JSON at line 1 column" in _manifest_error(tmp_path, mbytes)


@pytest.mark.slow
@pytest.mark.parametrize("needle", [b'"runtime":{}', b'"format":"thin"', b'"source":[]'])
def test_deep_nesting(tmp_path, needle):
    """Nesting near or past the recursion limit is a format error, never a RecursionError. The depth
    where parsing starts to fail depends on the caller's stack, so every depth around it is tried."""
    key = needle.split(b":")[0]
    limit = sys.getrecursionlimit()
    for depth in [50, *range(limit - 200, limit + 5), 100_000]:
        mbytes = PARTS.manifest.replace(needle, key + b":" + b"[" * depth + b"]" * depth, 1)
        try:
            open_archive(write(tmp_path, with_manifest(BUF, mbytes))).close()
        except ThinFormatError:
            continue
        assert needle == b'"runtime":{}', depth  # only the free-form section may hold (moderate) nesting


def test_manifest_not_object(tmp_path):
    assert "manifest is invalid (1 error): expected an object, got a list" in _manifest_error(tmp_path, b"[]")


# -- what verify checks: checksums and zero padding -------------------------------------------------

def test_corrupt_page(tmp_path):
    data = bytearray(BUF)
    r = PARTS.recs[2]
    data[r.offset + r.stored - 1] ^= 1
    assert _verify_failures(tmp_path, bytes(data)) == [
        f"page {r.id.decode()!r} at offset {r.offset}: checksum mismatch (data corrupted)"]


def test_padding_before_data(tmp_path):
    end = PARTS.record_offset(len(PARTS.recs))
    data_off = PARTS.header["data_off"]
    for pos in (end, data_off - 1):
        data = bytearray(BUF)
        data[pos] = 0x20
        assert _verify_failures(tmp_path, bytes(data)) == [f"padding [{end}, {data_off}) is not all zero bytes"]


def test_padding_between_pages(tmp_path):
    k = next(i for i, (a, b) in enumerate(zip(PARTS.recs, PARTS.recs[1:])) if b.offset > a.offset + a.stored)
    a, b = PARTS.recs[k], PARTS.recs[k + 1]
    data = bytearray(BUF)
    data[b.offset - 1] = 1
    assert _verify_failures(tmp_path, bytes(data)) == [f"padding [{a.offset + a.stored}, {b.offset}) is not all "
                                                       f"zero bytes"]


def test_verify_lists_every_failure(tmp_path):
    data = bytearray(BUF)
    r1, r2 = PARTS.recs[1], PARTS.recs[-1]
    data[r1.offset] ^= 0xFF
    data[r2.offset] ^= 0xFF
    data[PARTS.header["data_off"] - 1] = 7
    data[FIELD_OFFSET["archive_hash"]] ^= 1
    failures = _verify_failures(tmp_path, bytes(data))
    assert len(failures) == 4
    assert failures[0].startswith("archive_hash")
    assert failures[1].startswith("padding [")
    assert f"page {r1.id.decode()!r} at offset {r1.offset}" in failures[2]
    assert f"page {r2.id.decode()!r} at offset {r2.offset}" in failures[3]


@pytest.mark.slow
def test_every_single_byte_is_covered(tmp_path):
    """Flip bytes of the header, manifest, table, padding and the first page in turn (every 41st
    byte): open or verify must object every time, with a ThinFormatError or a listed failure."""
    end = PARTS.recs[1].offset
    for pos in range(0, end, 41):
        data = bytearray(BUF)
        data[pos] ^= 0x40
        try:
            with open_archive(write(tmp_path, bytes(data))) as a:
                assert not a.verify().ok, pos
        except ThinFormatError:
            pass


def test_verify_catches_rope_freqs_that_contradict_theta(tmp_path):
    """A manifest whose theta says one thing and whose rope_freqs table another is invalid: a
    runtime computing frequencies from theta would rotate differently from one reading the table."""
    from factory import make_archive_inputs, tiny_model

    from thinconv.format import open_archive, pack

    manifest, sources, _ = make_archive_inputs(tiny_model())
    pack(manifest, sources, tmp_path / "ok.thin")
    with open_archive(tmp_path / "ok.thin") as a:
        assert a.verify().ok
    manifest["model"]["rope"]["theta"] = 20000.0  # the table still holds theta = 10000
    pack(manifest, sources, tmp_path / "bad.thin")
    with open_archive(tmp_path / "bad.thin") as a:
        failures = a.verify().failures
    assert len(failures) == 1 and "rope_freqs" in failures[0] and "theta 20000.0" in failures[0]
