"""Open, read and verify .thin archives.

`open_archive` checks everything that is cheap before returning: header fields, every page-table
record (bounds, order, alignment), the manifest (strict JSON, canonical bytes, structure) and
its agreement with the page table. `Archive.verify()` adds what costs a pass over the data:
page checksums, the archive hash and zero padding. Every problem is a ThinFormatError.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import blake3

from thinconv.errors import ThinError, ThinFormatError, shown
from thinconv.format import dtypes, spec
from thinconv.format.manifest import parse_manifest, validate_manifest
from thinconv.memory import drop_resident

if TYPE_CHECKING:
    import numpy as np

VERIFY_CHUNK = 16 * 1024 * 1024
# Writers may compute the table in float32 or float64; both agree far inside this bound.
ROPE_FREQS_TOLERANCE = 1e-5


@dataclass(frozen=True)
class Header:
    manifest_len: int
    page_table_off: int
    page_count: int
    data_off: int
    archive_hash: bytes


@dataclass(frozen=True)
class PageRecord:
    id: str
    offset: int
    size: int
    flags: int
    checksum: bytes
    record_offset: int  # where this record starts in the file, for messages


@dataclass(frozen=True)
class TensorPage:
    """One page of a tensor, for a runtime that maps, streams or DMAs pages itself: the bytes
    [offset, offset + size) of the file hold rows [rows[0], rows[1]) of the tensor's
    [rows, cols] matrix (an expert tensor [E, r, c] has E·r rows); offset is a multiple of 4096."""

    id: str
    offset: int
    size: int
    rows: tuple[int, int]
    checksum: str  # BLAKE3 of the page's bytes, 64 hex digits


@dataclass
class VerifyReport:
    """What `verify()` found: an empty `failures` means the archive is valid."""

    failures: list[str] = field(default_factory=list)
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.failures


class Archive:
    """A .thin archive opened read-only over an mmap. Use as a context manager."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._name = self.path.name
        self._cow: mmap.mmap | None = None  # a private copy-on-write mapping, made on first use
        try:
            self._file = open(self.path, "rb")
        except OSError as e:
            raise ThinFormatError(f"{self.path}: cannot open ({e.strerror or e})") from None
        try:
            self.file_size = os.fstat(self._file.fileno()).st_size
            self.header = self._read_header()
            self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            self.pages = self._read_page_table()
            self._manifest_bytes = self._mm[spec.HEADER_LEN: spec.HEADER_LEN + self.header.manifest_len]
            self.manifest = self._read_manifest()
        except BaseException:
            self.close()
            raise
        self._page_index = {p.id: p for p in self.pages}
        self._tensors = {t["name"]: t for t in self.manifest["tensors"]}
        self._assets = {a["name"]: a for a in self.manifest["assets"]}

    # -- opening --

    def _fail(self, what: str) -> ThinFormatError:
        return ThinFormatError(f"{self._name}: {what}")

    def _read_header(self) -> Header:
        size = self.file_size
        if size < spec.HEADER_LEN:
            raise self._fail(f"file is {size} bytes, shorter than the {spec.HEADER_LEN}-byte header")
        raw = os.pread(self._file.fileno(), spec.HEADER_LEN, 0)
        magic, hlen, version, m_off, m_len, pt_off, count, data_off, ahash = spec.HEADER.unpack(raw)
        if magic != spec.MAGIC:
            raise self._fail(f"bad magic {magic!r} at offset 0, expected {spec.MAGIC!r} (not a THIN archive)")
        if hlen != spec.HEADER_LEN:
            raise self._fail(f"header_len at offset 8 is {hlen}, expected {spec.HEADER_LEN}")
        if version != spec.VERSION:
            raise self._fail(f"version at offset 12 is {version}; this reader supports version {spec.VERSION}")
        if m_off != spec.HEADER_LEN:
            raise self._fail(f"manifest_off at offset 16 is {m_off}, expected {spec.HEADER_LEN}")
        if not 0 < m_len <= spec.MAX_MANIFEST_LEN:
            raise self._fail(f"manifest_len at offset 24 is {m_len}, expected 1..{spec.MAX_MANIFEST_LEN}")
        if m_off + m_len > size:
            raise self._fail(f"manifest [{m_off}, {m_off + m_len}) runs past the end of the file ({size} bytes)")
        if pt_off != m_off + m_len:
            raise self._fail(f"page_table_off at offset 32 is {pt_off}, expected manifest_off + manifest_len = {m_off + m_len}")
        # Each record takes ≥ RECORD_MIN_LEN bytes and each page ≥ 1 aligned slot: bound the count
        # by the file size before allocating anything for it.
        max_pages = min((size - pt_off) // spec.RECORD_MIN_LEN, size // spec.ALIGNMENT + 1)
        if not 0 < count <= max_pages:
            raise self._fail(f"page_count at offset 40 is {count}; a {size}-byte file holds 1..{max_pages} pages")
        if data_off % spec.ALIGNMENT or not pt_off < data_off <= size:
            raise self._fail(f"data_off at offset 48 is {data_off}: must be a multiple of {spec.ALIGNMENT} in ({pt_off}, {size}]")
        return Header(m_len, pt_off, count, data_off, ahash)

    def _read_page_table(self) -> list[PageRecord]:
        mm, h = self._mm, self.header
        pos, records, seen = h.page_table_off, [], set()
        expected_offset = h.data_off
        for k in range(h.page_count):
            if pos + 2 > h.data_off:
                raise self._fail(f"page-table record {k} at offset {pos} runs into the data section (data_off {h.data_off})")
            id_len = int.from_bytes(mm[pos: pos + 2], "little")
            if not 1 <= id_len <= spec.MAX_ID_LEN:
                raise self._fail(f"page-table record {k} at offset {pos}: id_len {id_len}, expected 1..{spec.MAX_ID_LEN}")
            end = pos + 2 + id_len + spec.RECORD_TAIL.size
            if end > h.data_off:
                raise self._fail(f"page-table record {k} at offset {pos} runs into the data section (data_off {h.data_off})")
            raw_id = mm[pos + 2: pos + 2 + id_len]
            try:
                pid = raw_id.decode("utf-8")
            except UnicodeDecodeError:
                pid = ""
            if not spec.ID_PATTERN.fullmatch(pid):
                raise self._fail(f"page-table record {k} at offset {pos}: id {raw_id!r} has characters outside [A-Za-z0-9._#:/-]")
            if pid in seen:
                raise self._fail(f"page {pid!r} (record at offset {pos}): duplicate id")
            seen.add(pid)
            offset, stored, raw_size, flags, checksum = spec.RECORD_TAIL.unpack(mm[pos + 2 + id_len: end])
            where = f"page {pid!r} (record at offset {pos})"
            if flags:
                raise self._fail(f"{where}: unknown flags 0x{flags:x} (v0 defines none)")
            if stored != raw_size:
                raise self._fail(f"{where}: stored_size {stored} ≠ raw_size {raw_size} (v0 stores pages raw)")
            if stored == 0:
                raise self._fail(f"{where}: size 0 (every page has size > 0)")
            if offset != expected_offset:
                raise self._fail(f"{where}: offset {offset}, expected {expected_offset} (pages are back to back, "
                                 f"each at the next multiple of {spec.ALIGNMENT})")
            if offset + stored > self.file_size:
                raise self._fail(f"{where}: [{offset}, {offset + stored}) runs past the end of the file ({self.file_size} bytes)")
            records.append(PageRecord(pid, offset, stored, flags, checksum, pos))
            expected_offset = spec.align_up(offset + stored)
            pos = end
        if spec.align_up(pos) != h.data_off:
            raise self._fail(f"data_off is {h.data_off}, expected align_up(end of page table = {pos}) = {spec.align_up(pos)}")
        last = records[-1]
        if last.offset + last.size != self.file_size:
            raise self._fail(f"file is {self.file_size} bytes but the last page ends at {last.offset + last.size} (trailing bytes)")
        self._table_end = pos
        return records

    def _read_manifest(self) -> dict:
        m = parse_manifest(self._manifest_bytes, f"{self._name}: manifest")
        try:
            canonical = spec.canonical_json(m)
        except (ValueError, TypeError, RecursionError) as e:
            raise self._fail(f"manifest cannot be re-encoded canonically ({e})") from None
        if canonical != self._manifest_bytes:
            at = next((i for i, (a, b) in enumerate(zip(canonical, self._manifest_bytes)) if a != b),
                      min(len(canonical), len(self._manifest_bytes)))
            raise self._fail(f"manifest is not in canonical encoding (first difference at manifest byte {at})")
        validate_manifest(m).raise_if_invalid(f"{self._name}: manifest")
        declared = m["pages"]
        if len(declared) != len(self.pages):
            raise self._fail(f"manifest lists {len(declared)} pages, the page table {len(self.pages)}")
        for d, rec in zip(declared, self.pages):
            if d["id"] != rec.id:
                raise self._fail(f"page-table record at offset {rec.record_offset} is {rec.id!r}, manifest says {shown(d['id'])}")
            if d["size"] != rec.size:
                raise self._fail(f"page {rec.id!r}: page table says {rec.size} bytes, manifest {d['size']}")
            if d["checksum"] != rec.checksum.hex():
                raise self._fail(f"page {rec.id!r}: page-table checksum differs from the manifest's")
        return m

    # -- reading --

    @property
    def model(self) -> dict:
        """The manifest's `model` section: dimensions, RoPE, attention, norms… (FORMAT.md §2.1)."""
        return self.manifest["model"]

    @property
    def tensor_names(self) -> list[str]:
        """Every tensor's name, in decode order (the manifest's order)."""
        return list(self._tensors)

    @property
    def asset_names(self) -> list[str]:
        """The embedded source files (config.json, tokenizer.json, …), in manifest order."""
        return list(self._assets)

    def tensor_info(self, name: str) -> dict:
        """The manifest entry of a tensor (name, role, layer, source, shape, dtype, quant, hints, pages)."""
        try:
            return self._tensors[name]
        except KeyError:
            raise ThinFormatError(f"{self._name}: no tensor named {name!r}") from None

    def page(self, page_id: str) -> PageRecord:
        try:
            return self._page_index[page_id]
        except KeyError:
            raise ThinFormatError(f"{self._name}: no page with id {page_id!r}") from None

    def tensor_pages(self, name: str) -> list[TensorPage]:
        """A tensor's pages in row order, with their file offsets: what a runtime needs to mmap,
        pread or DMA the pages itself (see `fileno()`)."""
        rows = {p["id"]: p["rows"] for p in self.manifest["pages"] if p.get("tensor") == name}
        out = []
        for pid in self.tensor_info(name)["pages"]:
            rec = self.page(pid)
            start, end = rows[pid]
            out.append(TensorPage(pid, rec.offset, rec.size, (start, end), rec.checksum.hex()))
        return out

    def fileno(self) -> int:
        """The archive's open file descriptor (read-only), for os.pread / mmap / O_DIRECT readers."""
        return self._file.fileno()

    def page_bytes(self, page_id: str) -> memoryview:
        """The stored bytes of a page: a zero-copy, read-only view."""
        p = self.page(page_id)
        return memoryview(self._mm)[p.offset: p.offset + p.size]

    def asset_bytes(self, name: str) -> bytes:
        """An embedded source file (e.g. tokenizer.json), reassembled from its pages."""
        try:
            asset = self._assets[name]
        except KeyError:
            raise ThinFormatError(f"{self._name}: no asset named {name!r}") from None
        return b"".join(self.page_bytes(pid) for pid in asset["pages"])

    def tensor_bytes(self, name: str, *, private: bool = False) -> np.ndarray:
        """A tensor's stored bytes as uint8 [rows, row_bytes]: zero-copy when its pages are contiguous
        in the file (thinconv sizes pages so they are), a copy otherwise. Read-only, unless
        `private`: then a writable view of the archive's private copy-on-write mapping (writes
        stay in this process, seen by its other private views; the file never changes)."""
        import numpy as np  # lazy: `inspect` and `verify` never read a tensor (start-up time)

        t = self.tensor_info(name)
        n_rows, cols = spec.rows_and_cols(t["shape"])
        rb = dtypes.row_bytes(t["dtype"], cols)
        recs = [self.page(pid) for pid in t["pages"]]
        contiguous = all(b.offset == a.offset + a.size for a, b in zip(recs, recs[1:]))
        buf = self._private_map() if private else self._mm
        if contiguous:
            flat = np.frombuffer(buf, np.uint8, count=n_rows * rb, offset=recs[0].offset)
        else:
            flat = np.concatenate([np.frombuffer(buf, np.uint8, r.size, r.offset) for r in recs])
            flat.flags.writeable = private
        return flat.reshape(n_rows, rb)

    def _private_map(self) -> mmap.mmap:
        if self._cow is None:
            self._cow = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._cow

    def release(self, name: str) -> None:
        """Drop a tensor's mapped pages from this process's resident memory (the OS page cache
        keeps them; a later read maps them back). Lets a runtime stream weights through a
        bounded footprint; views of the tensor stay valid."""
        for pid in self.tensor_info(name)["pages"]:
            p = self.page(pid)
            drop_resident(self._mm, p.offset, p.size)

    def tensor(self, name: str, *, private: bool = False) -> np.ndarray:
        """A float tensor as a zero-copy, read-only numpy view of its stored bytes, in its dtype
        and shape (bf16 via ml_dtypes); block-quantized tensors come back as their raw uint8
        blocks [rows, row_bytes] (see `dequantize`). `private=True`: writable, over a private
        copy-on-write mapping (what `torch.from_numpy` needs to share the memory without a warning)."""
        t = self.tensor_info(name)
        raw = self.tensor_bytes(name, private=private)
        if dtypes.is_block(t["dtype"]):
            return raw
        return raw.view(dtypes.numpy_dtype(t["dtype"])).reshape(t["shape"])

    def dequantize(self, name: str, rows: tuple[int, int] | None = None, *, dtype: str | np.dtype = "float32"
                   ) -> np.ndarray:
        """A tensor decoded to floats in its shape, as a new writable array: float32 by default,
        or `dtype` "bfloat16" / "float16" (also "bf16", "f16", "f32", or a numpy dtype); block
        types are decoded, then rounded to nearest even. `rows` = (start, end) selects rows of
        its [rows, cols] matrix instead (an expert tensor [E, r, c] has E·r rows)."""
        t = self.tensor_info(name)
        want = _float_dtype(dtype)
        raw = self.tensor_bytes(name)
        n_rows, cols = spec.rows_and_cols(t["shape"])
        start, end = rows if rows is not None else (0, n_rows)
        if not 0 <= start <= end <= n_rows:
            raise ThinFormatError(f"{self._name}: rows {rows} are outside [0, {n_rows}) of {name!r}")
        if not dtypes.is_block(t["dtype"]):
            stored = raw[start:end].view(dtypes.numpy_dtype(t["dtype"]))
            out = stored.copy() if stored.dtype == want else stored.astype(want)
        else:
            from thinconv.format.blocks import dequantize_rows  # lazy: numpy (`inspect` start-up time)

            out = dequantize_rows(raw[start:end], t["dtype"], cols)
            if out.dtype != want:
                out = out.astype(want)
        if rows is None:
            return out.reshape(t["shape"])
        return out.reshape(end - start) if len(t["shape"]) == 1 else out.reshape(end - start, cols)

    # -- verifying --

    def verify(self, progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Check every page checksum, the archive hash and all padding; list every failure.

        Streams through the mmap and drops each chunk from this process's resident set after
        hashing it, so memory stays flat whatever the archive size."""
        report = VerifyReport()
        mm, h = self._mm, self.header
        table = mm[spec.HEADER_LEN: self._table_end]
        if blake3.blake3(table).digest() != h.archive_hash:
            report.failures.append("archive_hash does not match blake3(manifest + page table)")
        gaps = [(self._table_end, h.data_off)]
        gaps += [(a.offset + a.size, b.offset) for a, b in zip(self.pages, self.pages[1:])]
        for start, end in gaps:
            if end > start and mm[start:end].count(0) != end - start:
                report.failures.append(f"padding [{start}, {end}) is not all zero bytes")
        for rec in self.pages:
            hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
            pos, end = rec.offset, rec.offset + rec.size
            while pos < end:
                n = min(VERIFY_CHUNK, end - pos)
                hasher.update(memoryview(mm)[pos: pos + n])
                drop_resident(mm, pos, n)
                pos += n
                report.bytes_checked += n
                if progress:
                    progress(n)
            if hasher.digest() != rec.checksum:
                report.failures.append(f"page {rec.id!r} at offset {rec.offset}: checksum mismatch (data corrupted)")
        if not report.failures:
            report.failures += self._check_rope_freqs()
        return report

    def _check_rope_freqs(self) -> list[str]:
        """`rope_freqs` (and `rope_freqs_sliding`) must be the table `model.rope` implies (spec §2.2):
        a runtime that computes frequencies from theta and one that reads the tensor must rotate
        alike. A NaN anywhere in the comparison fails it."""
        names = [n for n in spec.DERIVED_ROLES if n in self._tensors]
        if not names:
            return []
        # Lazy: numpy-only RoPE math shared with the converter; numpy is not loaded until a check
        # needs it (`inspect` start-up).
        import numpy as np

        from thinconv.rope import derived_tables

        m = self.model
        try:
            with np.errstate(all="ignore"):
                tables = derived_tables(m)
        except (ThinError, ArithmeticError, ValueError, TypeError) as e:
            return [f"model.rope cannot be evaluated: {e}"]
        failures = []
        for name in names:
            want = tables.get(name)
            if want is None:
                failures.append(f"tensor {name!r} exists but model.rope implies no static table for it")
                continue
            got = self.tensor(name).astype("f8")
            with np.errstate(all="ignore"):
                rel = float(np.abs(got - want).max() / np.abs(want).max())
            if not rel <= ROPE_FREQS_TOLERANCE:  # NaN fails too
                rope = m["rope"] if name == "rope_freqs" else m["rope"]["sliding"]
                failures.append(f"tensor {name!r} differs from the inverse frequencies model.rope implies (theta "
                                f"{rope['theta']}, scaling {(rope['scaling'] or {}).get('type')}): max relative error "
                                f"{rel:.3g}")
        return failures

    # -- lifetime --

    def close(self) -> None:
        for mm in (getattr(self, "_mm", None), getattr(self, "_cow", None)):
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    pass  # numpy views still use it; the mapping goes when they do
        self._file.close()

    def __enter__(self) -> "Archive":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_archive(path: str | os.PathLike) -> Archive:
    """Open a .thin archive, checking its structure (not yet its checksums: see `Archive.verify`)."""
    return Archive(path)


_FLOAT_NAMES = {"float32": "f32", "f32": "f32", "bfloat16": "bf16", "bf16": "bf16", "float16": "f16", "f16": "f16"}


def _float_dtype(dtype) -> np.dtype:
    """The numpy dtype for `dequantize(dtype=...)`: float32, bfloat16 or float16, by name or numpy dtype."""
    import numpy as np

    name = _FLOAT_NAMES.get(dtype) if isinstance(dtype, str) else None
    if name is None and not isinstance(dtype, str):
        try:
            name = _FLOAT_NAMES.get(np.dtype(dtype).name)
        except TypeError:
            name = None
    if name is None:
        raise ThinFormatError(f"dequantize: dtype {dtype!r} is not one of float32, bfloat16, float16")
    return dtypes.numpy_dtype(name)


def truncation(path: str | os.PathLike) -> tuple[int, int, bool] | None:
    """(size, expected, exact) when `path` starts like a THIN archive but is shorter than its
    header and page table say it is: `expected` is the size they imply (`exact`), or a lower bound
    of it when the header or page table itself is cut; None otherwise. For messages that say
    "truncated" rather than only which field runs past the end."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(spec.HEADER_LEN)
            if not head or not (head.startswith(spec.MAGIC) or spec.MAGIC.startswith(head)):
                return None
            if len(head) < spec.HEADER_LEN:
                return size, spec.HEADER_LEN, False
            _, _, _, m_off, m_len, pt_off, count, data_off, _ = spec.HEADER.unpack(head)
            if not 0 < count <= 1 << 32 or pt_off != m_off + m_len:
                return None
            if data_off > size:
                return size, data_off, False
            f.seek(pt_off)
            table = f.read(data_off - pt_off)
    except OSError:
        return None
    pos, end = 0, 0
    for _ in range(count):
        if pos + 2 > len(table):
            return None
        id_len = int.from_bytes(table[pos: pos + 2], "little")
        tail = pos + 2 + id_len
        if tail + spec.RECORD_TAIL.size > len(table):
            return None
        offset, stored, *_ = spec.RECORD_TAIL.unpack(table[tail: tail + spec.RECORD_TAIL.size])
        end = max(end, offset + stored)
        pos = tail + spec.RECORD_TAIL.size
    return (size, end, True) if end > size else None
