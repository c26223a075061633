"""Spec §1 byte layout: golden bytes computed by hand, and an independent re-implementation of
the layout (`assemble`) that the other format tests use to craft archives breaking one rule.

Nothing here calls the writer's layout helpers (plan_layout, page_record, Layout.header): the
expected bytes come from struct + blake3 + the spec's text, so a writer bug cannot hide itself.
"""

from __future__ import annotations

import copy
import json
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import blake3
import numpy as np
import pytest

from factory import make_archive_inputs, tiny_model
from thinconv.format import BufferPage, FilePage, LazyPage, open_archive, pack

# -- the spec, restated independently of thinconv.format.spec --------------------------------

HEADER_FMT = "<8sIIQQQQQ32s"  # magic, header_len, version, manifest_off, manifest_len, page_table_off, page_count, data_off, archive_hash
TAIL_FMT = "<QQQI32s"  # offset, stored_size, raw_size, flags, checksum
FIELDS = ("magic", "header_len", "version", "manifest_off", "manifest_len", "page_table_off", "page_count",
          "data_off", "archive_hash")
FIELD_OFFSET = {"magic": 0, "header_len": 8, "version": 12, "manifest_off": 16, "manifest_len": 24,
                "page_table_off": 32, "page_count": 40, "data_off": 48, "archive_hash": 56}


def align(n: int) -> int:
    return (n + 4095) // 4096 * 4096


def canonical(m) -> bytes:
    return json.dumps(m, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


@dataclass
class Rec:
    """One page-table record, field by field."""

    id: bytes
    offset: int
    stored: int
    raw: int
    flags: int
    checksum: bytes

    def encode(self) -> bytes:
        return struct.pack("<H", len(self.id)) + self.id + struct.pack(TAIL_FMT, self.offset, self.stored, self.raw,
                                                                         self.flags, self.checksum)


@dataclass
class Parts:
    header: dict
    manifest: bytes
    recs: list[Rec]
    datas: list[bytes]

    @property
    def table_off(self) -> int:
        return 88 + len(self.manifest)

    def record_offset(self, k: int) -> int:
        return self.table_off + sum(len(r.encode()) for r in self.recs[:k])


def parse(buf: bytes) -> Parts:
    """Split a (valid) archive into its parts, trusting the header."""
    header = dict(zip(FIELDS, struct.unpack_from(HEADER_FMT, buf, 0)))
    manifest = buf[88: 88 + header["manifest_len"]]
    pos, recs = header["page_table_off"], []
    for _ in range(header["page_count"]):
        (n,) = struct.unpack_from("<H", buf, pos)
        rid = buf[pos + 2: pos + 2 + n]
        recs.append(Rec(rid, *struct.unpack_from(TAIL_FMT, buf, pos + 2 + n)))
        pos += 2 + n + struct.calcsize(TAIL_FMT)
    return Parts(header, manifest, recs, [buf[r.offset: r.offset + r.stored] for r in recs])


def assemble(manifest: bytes, recs: list[Rec], datas: list[bytes], *, place: bool = True, **header) -> bytes:
    """Lay out an archive as spec §1 says. place=True puts page k at data_off / align_up(end of k-1)
    and sizes records from their data; header=… overrides computed header fields (data_off too)."""
    recs = [replace(r) for r in recs]
    table_len = sum(len(r.encode()) for r in recs)
    pt_off = 88 + len(manifest)
    data_off = header.pop("data_off", align(pt_off + table_len))
    if place:
        cursor = data_off
        for r, d in zip(recs, datas):
            r.offset = cursor
            cursor = align(cursor + len(d))
    table = b"".join(r.encode() for r in recs)
    end = max([r.offset + len(d) for r, d in zip(recs, datas)] + [pt_off + len(table)])
    body = bytearray(end)
    body[88: pt_off] = manifest
    body[pt_off: pt_off + len(table)] = table
    for r, d in zip(recs, datas):
        body[r.offset: r.offset + len(d)] = d
    fields = {"magic": b"THINv0\0\0", "header_len": 88, "version": 0, "manifest_off": 88,
              "manifest_len": len(manifest), "page_table_off": pt_off, "page_count": len(recs),
              "data_off": data_off, "archive_hash": blake3.blake3(manifest + table).digest()}
    fields.update(header)
    body[:88] = struct.pack(HEADER_FMT, *(fields[f] for f in FIELDS))
    return bytes(body)


def reassemble(parts: Parts, *, place: bool = True, **header) -> bytes:
    return assemble(parts.manifest, parts.recs, parts.datas, place=place, **header)


def with_manifest(buf: bytes, manifest) -> bytes:
    """The same archive with another manifest (object → canonical bytes), lengths and hash fixed up."""
    p = parse(buf)
    return assemble(manifest if isinstance(manifest, bytes) else canonical(manifest), p.recs, p.datas)


def set_field(buf: bytes, offset: int, fmt: str, value) -> bytes:
    out = bytearray(buf)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def from_inputs(manifest: dict, sources: dict) -> bytes:
    """An archive for factory inputs, laid out by `assemble` alone (no writer code)."""
    recs = [Rec(p["id"].encode(), 0, p["size"], p["size"], 0, bytes.fromhex(p["checksum"])) for p in manifest["pages"]]
    return assemble(canonical(manifest), recs, [bytes(sources[p["id"]]) for p in manifest["pages"]])


def write(tmp: Path, data: bytes, name: str = "a.thin") -> Path:
    path = tmp / name
    path.write_bytes(data)
    return path


def base_archive(**kw) -> tuple[bytes, dict, dict, dict]:
    """(bytes, manifest, sources, arrays) of a tiny valid archive built by `assemble`."""
    manifest, sources, arrays = make_archive_inputs(**kw)
    return from_inputs(manifest, sources), manifest, sources, arrays


# -- golden bytes -------------------------------------------------------------------------------

def test_golden_header_and_records(tmp_path):
    manifest, sources, _ = make_archive_inputs(tiny_model(), dtype="f32", page_size=4096)
    out = tmp_path / "g.thin"
    result = pack(manifest, sources, out)
    buf = out.read_bytes()

    mbytes = canonical(manifest)
    pages = manifest["pages"]
    ids = [p["id"].encode() for p in pages]
    # Each record is 2 (id_len) + id + 8 + 8 + 8 + 4 + 32 bytes.
    table_len = sum(2 + len(i) + 60 for i in ids)
    data_off = -(-(88 + len(mbytes) + table_len) // 4096) * 4096
    offsets, cursor = [], data_off
    for p in pages:
        offsets.append(cursor)
        cursor = -(-(cursor + p["size"]) // 4096) * 4096
    table = b"".join(struct.pack("<H", len(i)) + i + struct.pack("<QQQI32s", off, p["size"], p["size"], 0,
                                                                   bytes.fromhex(p["checksum"]))
                     for i, p, off in zip(ids, pages, offsets))
    ahash = blake3.blake3(mbytes + table).digest()

    # Header, field by field, as literal little-endian bytes.
    assert buf[0:8] == b"THINv0\x00\x00"
    assert buf[8:12] == b"\x58\x00\x00\x00"  # header_len 88
    assert buf[12:16] == b"\x00\x00\x00\x00"  # version 0
    assert buf[16:24] == b"\x58" + b"\x00" * 7  # manifest_off 88
    assert buf[24:32] == len(mbytes).to_bytes(8, "little")
    assert buf[32:40] == (88 + len(mbytes)).to_bytes(8, "little")
    assert buf[40:48] == len(pages).to_bytes(8, "little")
    assert buf[48:56] == data_off.to_bytes(8, "little")
    assert buf[56:88] == ahash
    assert result.archive_hash == ahash.hex() and result.page_count == len(pages)

    # The manifest, then the first record spelled out: id_len, id, offset, stored, raw, flags, checksum.
    assert buf[88: 88 + len(mbytes)] == mbytes and not mbytes.endswith(b"\n")
    first = pages[0]
    assert first["id"] == "rope_freqs#0" and first["size"] == 8  # rotary_dim 4 → 2 f32
    rec0 = (b"\x0c\x00" + b"rope_freqs#0" + data_off.to_bytes(8, "little") + b"\x08" + b"\x00" * 7
            + b"\x08" + b"\x00" * 7 + b"\x00" * 4 + blake3.blake3(bytes(sources["rope_freqs#0"])).digest())
    pt = 88 + len(mbytes)
    assert buf[pt: pt + len(rec0)] == rec0
    assert buf[pt: pt + table_len] == table

    # Zero padding up to data_off, pages at their offsets with zeros between, no trailing bytes.
    assert buf[pt + table_len: data_off] == bytes(data_off - pt - table_len)
    for p, off, nxt in zip(pages, offsets, offsets[1:] + [None]):
        assert buf[off: off + p["size"]] == bytes(sources[p["id"]])
        if nxt is not None:
            assert buf[off + p["size"]: nxt] == bytes(nxt - off - p["size"])
    assert len(buf) == offsets[-1] + pages[-1]["size"] == result.size


@pytest.mark.parametrize("dtype,page_size,kw", [
    ("f32", 4096, {}),
    ("f16", 64, {}),
    ("bf16", 100, {"tie_word_embeddings": True}),
    ("bf16", 4096, {"hidden_size": 64, "vocab_size": 512, "head_dim": 32, "rope": {
        "theta": 1e6, "rotary_dim": 32, "layout": "half", "scaling": {"type": "dynamic", "factor": 2.0},
        "attention_factor": 1.0}}),
])
def test_independent_layout_reproduces_packer(tmp_path, dtype, page_size, kw):
    manifest, sources, _ = make_archive_inputs(tiny_model(**kw), dtype=dtype, page_size=page_size,
                                               assets={"config.json": b"{}" * 3000, "tokenizer.json": b"[1]"})
    pack(manifest, sources, tmp_path / "x.thin")
    assert (tmp_path / "x.thin").read_bytes() == from_inputs(manifest, sources)


def test_source_kinds_give_identical_bytes(tmp_path):
    manifest, sources, arrays = make_archive_inputs(dtype="bf16", page_size=64)
    pack(manifest, sources, tmp_path / "bytes.thin")
    files = {}
    for pid, data in sources.items():
        f = tmp_path / "src" / pid
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(data)
        files[pid] = f
    pack(manifest, {pid: FilePage(f) for pid, f in files.items()}, tmp_path / "file.thin")
    pack(manifest, {pid: Path(f) for pid, f in files.items()}, tmp_path / "path.thin")
    pack(manifest, {pid: LazyPage(len(d), lambda d=d: [d[:3], memoryview(d)[3:]]) for pid, d in sources.items()},
         tmp_path / "lazy.thin")
    # numpy arrays as buffers, bf16 included (the buffer protocol cannot describe bf16 itself)
    by_page = {}
    for p in manifest["pages"]:
        if "tensor" in p:
            s, e = p["rows"]
            by_page[p["id"]] = BufferPage(np.ascontiguousarray(arrays[p["tensor"]][s:e]))
        else:
            by_page[p["id"]] = BufferPage(bytearray(sources[p["id"]]))
    pack(manifest, by_page, tmp_path / "arrays.thin")
    want = (tmp_path / "bytes.thin").read_bytes()
    for name in ("file", "path", "lazy", "arrays"):
        assert (tmp_path / f"{name}.thin").read_bytes() == want, name


def test_crafter_round_trips_a_packed_archive(tmp_path):
    buf, manifest, sources, _ = base_archive(page_size=64)
    assert reassemble(parse(buf)) == buf
    assert with_manifest(buf, copy.deepcopy(manifest)) == buf
    with open_archive(write(tmp_path, buf)) as a:
        assert a.verify().ok
