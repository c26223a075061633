"""Strict, zero-copy reader for SafeTensors files (no ``safetensors`` package at runtime).

Validation mirrors the reference Rust crate (``safetensors/src/tensor.rs``: ``read_metadata`` and
``Metadata::validate``): an 8-byte little-endian header length N ≤ 100 MB, a UTF-8 JSON object
header, and tensors whose ``data_offsets`` tile the data section exactly, with no gap, overlap
or trailing byte. We are stricter in two places: duplicate JSON keys are rejected (serde keeps the
last one silently) and only the dtypes numpy can view are accepted.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import ml_dtypes
import numpy as np

from thinconv import strictjson
from thinconv.errors import CheckpointError, clipped, shown
from thinconv.memory import FAULT_AROUND, drop_resident

MAX_HEADER_SIZE = 100_000_000  # same limit as the Rust crate

# SafeTensors data is little-endian by definition; ml_dtypes types have no byte-order variant.
NUMPY_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "U16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),
    "U64": np.dtype("<u8"),
    "BOOL": np.dtype(np.bool_),
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a SafeTensors file, as its header describes it."""

    name: str
    dtype: str  # SafeTensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute file offset of the first data byte
    nbytes: int
    path: Path


class SafetensorsFile:
    """An open, validated SafeTensors file mapped read-only into memory."""

    def __init__(self, path: Path, entries: dict[str, TensorEntry], metadata: dict[str, str] | None,
                 mapping: mmap.mmap | None) -> None:
        self.path = path
        self.entries = entries  # in data-offset order
        self.metadata = metadata
        self._mmap = mapping  # None for a file without data bytes (mmap cannot map 0 bytes)
        self._closed = False

    def array(self, name: str) -> np.ndarray:
        """Zero-copy read-only view of tensor ``name`` with its dtype and shape."""
        if self._closed:
            raise CheckpointError(f"{self.path.name}: file is closed, cannot read tensor {name!r}")
        entry = self.entries.get(name)
        if entry is None:
            raise CheckpointError(f"{self.path.name}: no tensor {name!r}")
        dtype = NUMPY_DTYPES[entry.dtype]
        if entry.nbytes == 0:
            # Nothing to map (and the file may hold no data bytes at all).
            empty = np.empty(entry.shape, dtype)
            empty.flags.writeable = False
            return empty
        assert self._mmap is not None  # a file with data bytes is always mapped
        flat = np.frombuffer(self._mmap, dtype=dtype, count=entry.nbytes // dtype.itemsize,
                             offset=entry.offset)
        return flat.reshape(entry.shape)

    def release(self, name: str, start: int, end: int) -> None:
        """Drop bytes [start, end) of tensor ``name`` from this process's resident memory.

        The page cache keeps them and a later read maps them back in; this only keeps RSS
        bounded while a converter streams a model much larger than a page through the mmap."""
        entry = self.entries.get(name)
        if entry is not None and self._mmap is not None and end > start:
            # Widened by the kernel's fault-around (memory.FAULT_AROUND): reading a byte maps its cached
            # neighbours too, which would otherwise stay resident past a tensor's ends. A
            # neighbour still in use is simply mapped again from the page cache.
            lo = max(0, entry.offset + start - FAULT_AROUND)
            drop_resident(self._mmap, lo, entry.offset + end + FAULT_AROUND - lo)

    def close(self) -> None:
        """Release the mapping; views already handed out keep it alive until they are freed."""
        self._closed = True
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # numpy views still export the buffer: the GC unmaps it after the last one
            self._mmap = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self.entries)} tensors)"


def open_safetensors(path: str | os.PathLike[str]) -> SafetensorsFile:
    """Open, validate and mmap a SafeTensors file; any defect raises :class:`CheckpointError`."""
    path = Path(path)
    label = path.name or str(path)
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < 8:
                what = "empty file (0 bytes)" if size == 0 else f"file is only {size} bytes"
                raise CheckpointError(f"{label}: {what}, expected an 8-byte header length"
                                      " followed by a JSON header")
            mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, expected a .safetensors file") from None
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read ({error.strerror or error})") from None
    try:
        entries, metadata = _parse_header(mapping, size, path, label)
    except BaseException:
        mapping.close()
        raise
    return SafetensorsFile(path, entries, metadata, mapping)


def _parse_header(buf: mmap.mmap, size: int, path: Path,
                  label: str) -> tuple[dict[str, TensorEntry], dict[str, str] | None]:
    n = int.from_bytes(buf[:8], "little")
    if n > MAX_HEADER_SIZE:
        raise CheckpointError(f"{label}: header length {n} exceeds the {MAX_HEADER_SIZE}-byte limit"
                              " (not a safetensors file?)")
    if 8 + n > size:
        raise CheckpointError(f"{label}: header length {n} runs past the end of the file"
                              f" ({size} bytes; truncated or not a safetensors file?)")
    header = _load_json(buf[8:8 + n], label)
    data_start, data_len = 8 + n, size - 8 - n

    metadata = header.pop("__metadata__", None)  # JSON null means "absent", as in serde
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(f"{label}: __metadata__ must be an object of string values")

    raw = [_tensor_info(name, info, label) for name, info in header.items()]
    raw.sort(key=lambda t: (t[3], t[4], t[0]))  # by data_offsets, as the Rust crate does
    entries: dict[str, TensorEntry] = {}
    cursor, previous = 0, None
    for name, dtype, shape, begin, end in raw:
        where = f"{label}: tensor {name!r} data_offsets [{begin}, {end}]"
        if begin > cursor:
            raise CheckpointError(f"{where} leave a gap of {begin - cursor} bytes after byte {cursor}"
                                  " of the data section, expected contiguous tensors")
        if begin < cursor:
            raise CheckpointError(f"{where} overlap tensor {previous!r}, which ends at byte {cursor}")
        expected = _nbytes(shape, NUMPY_DTYPES[dtype].itemsize, 2**64)
        if expected is None:
            raise CheckpointError(f"{label}: tensor {name!r} has shape {_json_short(list(shape))}: 2^64 bytes of "
                                  f"{dtype} or more, beyond any file")
        if end - begin != expected:
            raise CheckpointError(f"{where} hold {end - begin} bytes, expected {expected}"
                                  f" (shape {list(shape)} × {dtype})")
        if end > data_len:
            raise CheckpointError(f"{where} run past the end of the data section ({data_len} bytes):"
                                  " file truncated?")
        entries[name] = TensorEntry(name, dtype, shape, data_start + begin, end - begin, path)
        cursor, previous = end, name
    if cursor != data_len:
        raise CheckpointError(f"{label}: {data_len - cursor} trailing bytes after the last tensor"
                              f" (tensors end at byte {cursor} of a {data_len}-byte data section)")
    return entries, metadata


def _load_json(raw: bytes, label: str) -> dict:
    """Decode the header: strict UTF-8, strict JSON (no NaN, no duplicate keys), an object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{label}: header is not valid UTF-8 (byte {error.start})") from None
    try:
        header = json.loads(text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant,
                            **strictjson.HOOKS)
    except _DuplicateKey as error:
        raise CheckpointError(f"{label}: header has duplicate key {error.args[0]!r}") from None
    except ValueError as error:  # JSONDecodeError and _reject_constant
        raise CheckpointError(f"{label}: header is not valid JSON ({error})") from None
    except RecursionError:
        raise CheckpointError(f"{label}: header is not valid JSON (nested too deeply)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{label}: header is a JSON {type(header).__name__}, expected an object")
    return header


class _DuplicateKey(Exception):
    pass


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


def _is_count(value: object) -> bool:
    # bool is an int subclass in Python; JSON true/false is not a size.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor_info(name: str, info: object,
                 label: str) -> tuple[str, str, tuple[int, ...], int, int]:
    """Check one header entry; extra keys are ignored, as serde does."""
    where = f"{label}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where} is a JSON {type(info).__name__}, expected an object"
                              " with dtype, shape and data_offsets")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in info:
            raise CheckpointError(f"{where} has no {key!r}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in NUMPY_DTYPES:
        raise CheckpointError(f"{where} has dtype {shown(dtype)}, expected one of "
                              + ", ".join(NUMPY_DTYPES))
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{where} has shape {_json_short(shape)}, expected a list of"
                              " non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise CheckpointError(f"{where} has data_offsets {_json_short(offsets)}, expected"
                              " [begin, end] with non-negative integers")
    begin, end = offsets
    if begin > end:
        raise CheckpointError(f"{where} data_offsets [{begin}, {end}] begin after they end")
    return name, dtype, tuple(shape), begin, end


def _json_short(value: object, limit: int = 60) -> str:
    """A header value as JSON, cut to `limit` characters (messages stay one short line)."""
    return clipped(json.dumps(value), limit)


def _nbytes(shape, itemsize: int, limit: int) -> int | None:
    """Bytes of a tensor of `shape`, or None past `limit`: a hostile shape of many 20-digit
    dimensions is not multiplied out (nor printed) in full."""
    if 0 in shape:
        return 0
    n = itemsize
    for d in shape:
        n *= d
        if n > limit:
            return None
    return n
