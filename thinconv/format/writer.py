"""The packer: the only code that writes .thin files, and it writes nothing it has not validated.

Pages arrive as sources (files, buffers or lazy producers) and are streamed one at a time, so
memory stays bounded by a page whatever the model size. Output goes to a temp file in the
destination folder, is fsynced, then renamed into place: any failure leaves no partial file.
"""

from __future__ import annotations

import errno
import functools
import math
import os
import stat
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Union

import blake3

from thinconv.errors import PackError
from thinconv.format import spec
from thinconv.format.manifest import validate_manifest
from thinconv.format.temps import TempOutput, remove_stale_temps


CHUNK = 8 * 1024 * 1024
_ZEROS = bytes(spec.ALIGNMENT)


class PageSource(Protocol):
    """Where a page's bytes come from. `chunks()` may be called once per pack."""

    size: int

    def chunks(self) -> Iterable[Any]: ...  # bytes-like objects (bytes, memoryview, contiguous ndarray)


def byte_view(data: Any) -> memoryview:
    """A flat read-only byte view of a bytes-like object or C-contiguous numpy array.

    numpy arrays go through a uint8 view: the buffer protocol cannot describe some dtypes
    (ml_dtypes' bfloat16 raises "cannot include dtype 'E' in a buffer")."""
    if hasattr(data, "__array_interface__") and hasattr(data, "view") and hasattr(data, "flags"):
        if not data.flags.c_contiguous:
            raise TypeError("a page buffer must be C-contiguous")
        data = data.reshape(-1).view("u1")
    return memoryview(data).cast("B")


@dataclass
class BufferPage:
    """A page held in memory (bytes, memoryview or a contiguous numpy array)."""

    data: Any

    @property
    def size(self) -> int:
        return byte_view(self.data).nbytes

    def chunks(self) -> Iterator[Any]:
        yield byte_view(self.data)


@dataclass
class FilePage:
    """A page read from a byte range of a file, in chunks."""

    path: Path
    offset: int = 0
    length: int | None = None

    @property
    def size(self) -> int:
        return self.length if self.length is not None else os.path.getsize(self.path) - self.offset

    def chunks(self) -> Iterator[bytes]:
        remaining = self.size
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            while remaining > 0:
                block = f.read(min(CHUNK, remaining))
                if not block:
                    return  # short file: the size check names the page
                remaining -= len(block)
                yield block


@dataclass
class LazyPage:
    """A page produced on demand (e.g. a converted or quantized slice of a tensor)."""

    size: int
    produce: Callable[[], Iterable[Any]]

    def chunks(self) -> Iterable[Any]:
        return self.produce()


SourceLike = Union[PageSource, bytes, bytearray, memoryview, Path]


def as_page_source(src: SourceLike) -> PageSource:
    if isinstance(src, (bytes, bytearray, memoryview)):
        return BufferPage(src)
    if isinstance(src, Path):
        return FilePage(src)
    return src


@dataclass(frozen=True)
class PackResult:
    path: Path
    size: int
    page_count: int
    archive_hash: str
    removed_temps: tuple[Path, ...] = ()  # stale temp files of `path` a killed earlier run left


@dataclass(frozen=True)
class Layout:
    """Where everything goes, computed from the manifest alone (spec §1)."""

    manifest_bytes: bytes
    page_table: bytes
    data_off: int
    offsets: list[int]
    file_size: int
    archive_hash: bytes

    def header(self, page_count: int) -> bytes:
        manifest_len = len(self.manifest_bytes)
        return spec.HEADER.pack(spec.MAGIC, spec.HEADER_LEN, spec.VERSION, spec.HEADER_LEN, manifest_len,
                                spec.HEADER_LEN + manifest_len, page_count, self.data_off, self.archive_hash)


def page_record(pid: str, offset: int, size: int, checksum: bytes) -> bytes:
    """One page-table record (v0: stored_size = raw_size, flags = 0)."""
    raw = pid.encode("utf-8")
    return len(raw).to_bytes(2, "little") + raw + spec.RECORD_TAIL.pack(offset, size, size, 0, checksum)


def plan_layout(manifest: dict) -> Layout:
    """The byte layout a valid manifest fixes: manifest bytes, page table, offsets, archive hash."""
    try:
        mbytes = spec.canonical_json(manifest)
    except (ValueError, TypeError, RecursionError) as e:
        # validate_manifest does not look inside free-form sections (runtime, probe): NaN, a lone
        # surrogate or a non-JSON object there only shows up when encoding.
        raise PackError(f"manifest cannot be encoded as canonical JSON ({e})") from None
    if len(mbytes) > spec.MAX_MANIFEST_LEN:
        raise PackError(f"manifest is {len(mbytes)} bytes; THIN v0 allows at most {spec.MAX_MANIFEST_LEN}")
    pages = manifest["pages"]
    # Record lengths depend only on ids, so data_off is known before offsets are.
    table_len = sum(2 + len(p["id"].encode()) + spec.RECORD_TAIL.size for p in pages)
    data_off = spec.align_up(spec.HEADER_LEN + len(mbytes) + table_len)
    rel, data_len = page_offsets([p["size"] for p in pages])
    offsets, file_size = [data_off + r for r in rel], data_off + data_len
    table = b"".join(page_record(p["id"], off, p["size"], bytes.fromhex(p["checksum"])) for p, off in zip(pages, offsets))
    return Layout(mbytes, table, data_off, offsets, file_size, blake3.blake3(mbytes + table).digest())


def check_output(out: Path, force: bool, reads: Iterable[Path] = ()) -> None:
    """Refuse an output that cannot or must not be written, before any work: it exists without
    `force`; it is not a regular file (a folder, a device such as /dev/null, a FIFO); it is — or
    resolves through symlinks or hard links to — one of the files this command `reads`; its folder
    is missing or read-only. The writer replaces `out` itself, never a symlink's target."""
    if os.path.lexists(out):
        if not force:
            raise PackError(f"{out} already exists (use --force to overwrite)")
        try:
            st = os.stat(out)
        except OSError:
            st = None  # a dangling symlink: replaced by the archive
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise PackError(f"{out} is a directory")
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise PackError(f"{out} is not a regular file; the output must be a regular file or absent")
        for path in reads:
            try:
                same = os.path.samefile(out, path)
            except OSError:
                continue
            if same:
                raise PackError(f"{out} is {path}, which this command reads; write the output elsewhere")
    folder = out.parent
    if not folder.is_dir():
        raise PackError(f"output folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise PackError(f"output folder {folder} is not writable")


def pack(manifest: dict, page_sources: Mapping[str, SourceLike], out_path: str | os.PathLike, *,
         force: bool = False, progress: Callable[[int], None] | None = None) -> PackResult:
    """Validate `manifest`, check every page source against it, and write the archive atomically.

    `page_sources` maps page id → source. Sizes are checked before anything is written; each
    page's blake3 is checked while it streams into the temp file, and a mismatch aborts the
    whole write. `progress(n)` is called with the bytes written since the last call.
    """
    out = Path(out_path)
    report = validate_manifest(manifest)
    report.raise_if_invalid("manifest", PackError)
    sources = {pid: as_page_source(s) for pid, s in page_sources.items()}
    check_output(out, force, [s.path for s in sources.values() if isinstance(s, FilePage)])
    declared = {p["id"]: p for p in manifest["pages"]}
    for pid in declared:
        if pid not in sources:
            raise PackError(f"page {pid!r}: no source given")
    extra = sorted(set(sources) - set(declared))
    if extra:
        raise PackError(f"page source {extra[0]!r} is not declared in the manifest" +
                        (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    for pid, p in declared.items():
        try:
            size = sources[pid].size
        except OSError as e:
            raise PackError(f"page {pid!r}: cannot read its source: {e.strerror or e}") from None
        except (TypeError, ValueError) as e:
            raise PackError(f"page {pid!r}: source is not a usable buffer ({e})") from None
        if size != p["size"]:
            raise PackError(f"page {pid!r}: source holds {size} bytes, manifest declares {p['size']}")
    layout = plan_layout(manifest)
    stale = _write_atomically(out, force, lambda f: _write_archive(f, manifest, layout, sources, progress))
    return PackResult(out, layout.file_size, len(declared), layout.archive_hash.hex(), tuple(stale))


def _write_archive(f, manifest: dict, layout: Layout, sources: dict[str, PageSource],
                   progress: Callable[[int], None] | None) -> None:
    pages = manifest["pages"]
    f.write(layout.header(len(pages)))
    f.write(layout.manifest_bytes)
    f.write(layout.page_table)
    pos = spec.HEADER_LEN + len(layout.manifest_bytes) + len(layout.page_table)
    for p, off in zip(pages, layout.offsets):
        _write_zeros(f, off - pos)
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        written = 0
        for chunk in sources[p["id"]].chunks():
            try:
                view = byte_view(chunk)
            except (TypeError, ValueError) as e:
                raise PackError(f"page {p['id']!r}: source produced a chunk that is not contiguous bytes ({e})") from None
            if written + view.nbytes > p["size"]:
                raise PackError(f"page {p['id']!r}: source produced more than the declared {p['size']} bytes")
            hasher.update(view)
            f.write(view)
            written += view.nbytes
            if progress:
                progress(view.nbytes)
        if written != p["size"]:
            raise PackError(f"page {p['id']!r}: source produced {written} bytes, manifest declares {p['size']}")
        if hasher.hexdigest() != p["checksum"]:
            raise PackError(f"page {p['id']!r}: blake3 {hasher.hexdigest()} does not match the declared checksum {p['checksum']}")
        pos = off + written


def _write_zeros(f, n: int) -> None:
    while n > 0:
        k = min(n, len(_ZEROS))
        f.write(_ZEROS[:k])
        n -= k


def _write_atomically(out: Path, force: bool, write: Callable[[Any], None],
                      check: Callable[[Path], None] | None = None) -> list[Path]:
    """Write through a temp file in out's folder; fsync; `check(temp path)`; rename. Nothing is left
    behind on failure. The temp stays flock()ed until it is renamed or removed. Temp files of `out`
    that a killed earlier run left are removed first; returns them."""
    folder = out.parent
    stale = remove_stale_temps(out)
    temp, lock = TempOutput(out), None
    try:
        try:
            fd = temp.create()
        except OSError as e:
            raise PackError(f"cannot write in {folder}: {e.strerror or e}") from None
        tmp = temp.path
        lock = os.dup(fd)  # the flock lives as long as this descriptor: until the end
        with os.fdopen(fd, "wb", buffering=1024 * 1024) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if check is not None:
            check(tmp)
        os.chmod(tmp, 0o644)
        if force:
            os.replace(tmp, out)
        else:
            _link_no_clobber(tmp, out)
        _fsync_dir(folder)
    except BaseException as e:
        temp.remove()
        if isinstance(e, FileExistsError):
            raise PackError(f"{out} already exists (use --force to overwrite)") from None
        if isinstance(e, OSError):
            what = "disk full" if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else (e.strerror or str(e))
            raise PackError(f"writing {out} failed ({what}); no partial file was left") from None
        raise
    finally:
        if lock is not None:
            os.close(lock)
    return stale


def _link_no_clobber(tmp: Path, out: Path) -> None:
    """Move tmp to out unless out exists; link() makes the check and the move one atomic step."""
    try:
        os.link(tmp, out)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        # A filesystem without hard links (FAT, some FUSE): check, then rename (a narrow race).
        if out.exists():
            raise FileExistsError(errno.EEXIST, "exists", str(out)) from None
        os.replace(tmp, out)
        return
    tmp.unlink()


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename itself is done
    finally:
        os.close(fd)


write_atomically = _write_atomically


# ---------------------------------------------------------------- streaming writes

def page_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Page offsets relative to data_off, and the data region's length (spec §1: each page starts
    at the next 4096 multiple). They do not depend on the manifest, so pages can be written before
    it is known; only data_off (itself a 4096 multiple) moves the whole region."""
    offsets, cursor = [], 0
    for size in sizes:
        offsets.append(cursor)
        cursor = spec.align_up(cursor + size)
    return offsets, (offsets[-1] + sizes[-1]) if sizes else 0


def head_bytes(manifest: dict) -> tuple[Layout, bytes]:
    """Validate `manifest` and return its layout and the bytes before data_off that carry content
    (header, manifest, page table); the rest up to data_off is zeros."""
    validate_manifest(manifest).raise_if_invalid("manifest", PackError)
    layout = plan_layout(manifest)
    return layout, layout.header(len(manifest["pages"])) + layout.manifest_bytes + layout.page_table


_seek_lock = threading.Lock()


def _pwrite_by_seek(fd: int, data: memoryview, offset: int) -> int:
    with _seek_lock:  # platforms without pwrite (Windows): seek + write, one thread at a time
        os.lseek(fd, offset, os.SEEK_SET)
        return os.write(fd, data)


def _pread_by_seek(fd: int, n: int, offset: int) -> bytes:
    with _seek_lock:
        os.lseek(fd, offset, os.SEEK_SET)
        return os.read(fd, n)


_pwrite = getattr(os, "pwrite", _pwrite_by_seek)
_pread = getattr(os, "pread", _pread_by_seek)


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write all of `data` at `offset` (a regular file may take a write in parts); safe to call
    from several threads on one fd."""
    view = byte_view(data)
    while view.nbytes:
        n = _pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        view, offset = view[n:], offset + n


_FALLOC_FL_COLLAPSE_RANGE, _FALLOC_FL_INSERT_RANGE = 0x08, 0x20
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing [offset, offset + length) to disk now, without waiting
    (Linux sync_file_range); elsewhere a no-op. The final fsync then has little left to do."""
    fn = _libc_function("sync_file_range")
    if fn is not None:
        fn(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # advisory: an error only means no head start


@functools.lru_cache(maxsize=None)
def _libc_function(name: str):
    """A libc function taking (int, int64, int64, int) or (int, int, int64, int64), or None."""
    import ctypes  # lazy: only Linux has these calls (and only streamed writes use them)
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fn = getattr(libc, name + "64", None) or getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = {"sync_file_range": [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint],
                   "fallocate": [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]}[name]
    return fn


def move_data(fd: int, old_off: int, new_off: int, end: int) -> str:
    """Move the file's bytes [old_off, end) to start at new_off, leaving zeros before them.

    Used when a streamed data region was laid out at an estimated data_off and the finished
    manifest puts it elsewhere (by whole 4096-byte steps). Linux ext4 and XFS do it in the file's
    extent map (fallocate collapse/insert range: no data copied); elsewhere the bytes are copied
    in 8 MiB steps. Returns "none", "fallocate" or "copy"."""
    delta = new_off - old_off
    if delta == 0:
        return "none"
    try:
        if delta < 0:
            _fallocate(fd, _FALLOC_FL_COLLAPSE_RANGE, new_off, -delta)
        else:
            _fallocate(fd, _FALLOC_FL_INSERT_RANGE, old_off, delta)
        return "fallocate"
    except OSError:
        pass  # unsupported here (filesystem, block size, OS): copy instead
    length = end - old_off
    starts = range(0, length, CHUNK)
    for start in (reversed(starts) if delta > 0 else starts):  # memmove order: never read a clobbered byte
        block = _pread(fd, min(CHUNK, length - start), old_off + start)
        pwrite_all(fd, block, new_off + start)
    if delta > 0:
        _write_zeros_at(fd, old_off, delta)
    else:
        os.ftruncate(fd, end + delta)
    return "copy"


def _write_zeros_at(fd: int, offset: int, n: int) -> None:
    while n > 0:
        k = min(n, CHUNK)
        pwrite_all(fd, bytes(k), offset)
        offset, n = offset + k, n - k


def _fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    import ctypes  # lazy: as in _libc_function

    fn = _libc_function("fallocate")
    if fn is None:
        raise OSError(errno.ENOTSUP, "fallocate is not available")
    if fn(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def split_rows(n_rows: int, row_bytes: int, page_size: int) -> list[tuple[int, int]]:
    """Split a tensor's rows into pages of at most `page_size` bytes (whole rows, ≥ 1 per page).

    Rows per page are rounded down to a multiple that makes every full page a multiple of the
    alignment, so consecutive pages of a tensor sit back to back with no padding: readers can
    then map a whole multi-page tensor as one zero-copy array."""
    rows = max(1, page_size // row_bytes)
    step = spec.ALIGNMENT // math.gcd(row_bytes, spec.ALIGNMENT)
    if rows >= step:
        rows -= rows % step
    return [(s, min(s + rows, n_rows)) for s in range(0, n_rows, rows)]


def split_bytes(size: int, page_size: int) -> list[tuple[int, int]]:
    """Byte ranges of an asset split at the page size (an empty asset has no pages)."""
    return [(s, min(s + page_size, size)) for s in range(0, size, page_size)]
