"""Property tests: damaged archives are rejected with ThinFormatError or a verify failure — never
another exception, never a hang (hypothesis deadline), never a large allocation (tracemalloc)."""

from __future__ import annotations

import copy
import json
import os
import struct
import tempfile
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from test_format_layout import FIELD_OFFSET, base_archive, canonical, parse, with_manifest
from thinconv.errors import ThinFormatError
from thinconv.format import open_archive, validate_manifest

BUF, MANIFEST, _, _ = base_archive(page_size=128)
PARTS = parse(BUF)
SIZE = len(BUF)
DATA_OFF = PARTS.header["data_off"]
_TMPDIR = tempfile.TemporaryDirectory(prefix="thin-fuzz-")  # removed when the interpreter exits
TMP = Path(_TMPDIR.name)
PEAK_LIMIT = 2 * 1024 * 1024  # the archive is ~60 KiB; nothing may allocate by what a field claims

# (offset, struct format) of every integer field: header, then each record's id_len/offset/stored/raw/flags.
FIELDS = [(FIELD_OFFSET[f], fmt) for f, fmt in (("header_len", "<I"), ("version", "<I"), ("manifest_off", "<Q"),
                                                 ("manifest_len", "<Q"), ("page_table_off", "<Q"),
                                                 ("page_count", "<Q"), ("data_off", "<Q"))]
for k, r in enumerate(PARTS.recs):
    at = PARTS.record_offset(k)
    tail = at + 2 + len(r.id)
    FIELDS += [(at, "<H"), (tail, "<Q"), (tail + 8, "<Q"), (tail + 16, "<Q"), (tail + 24, "<I")]

# THIN_FUZZ_EXAMPLES=5000 explores further with random seeds; by default runs are short and repeatable.
_DEEP = int(os.environ.get("THIN_FUZZ_EXAMPLES", "0"))
SETTINGS = settings(max_examples=_DEEP or 150, deadline=1000, derandomize=not _DEEP, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


pytestmark = pytest.mark.slow  # thousands of fuzz cases

def _interesting(bits: int) -> st.SearchStrategy[int]:
    top = 2**bits - 1
    specials = [0, 1, 2, 87, 88, 89, 4095, 4096, 4097, SIZE - 1, SIZE, SIZE + 1, DATA_OFF, 64 * 2**20,
                64 * 2**20 + 1, top, top - 1, 2 ** (bits - 1)]
    return st.one_of(st.sampled_from([v for v in specials if v <= top]), st.integers(0, top))


def _rejected(data: bytes) -> None:
    """Open and verify `data`: it must be refused, within a small memory budget."""
    path = TMP / "f.thin"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        try:
            archive = open_archive(path)
        except ThinFormatError as e:
            assert "\n" not in str(e)
            return
        with archive:
            report = archive.verify()
        assert not report.ok, "a damaged archive passed open and verify"
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < PEAK_LIMIT, f"peak {peak} bytes"


@SETTINGS
@given(st.integers(0, SIZE - 1))
def test_truncation(n):
    _rejected(BUF[:n])


@SETTINGS
@given(st.lists(st.tuples(st.one_of(st.integers(0, DATA_OFF - 1), st.integers(0, SIZE - 1)), st.integers(0, 7)),
                min_size=1, max_size=3))
def test_bit_flips(flips):
    data = bytearray(BUF)
    for pos, bit in flips:
        data[pos] ^= 1 << bit
    assume(bytes(data) != BUF)
    _rejected(bytes(data))


@SETTINGS
@given(st.data())
def test_field_overwrite(data):
    offset, fmt = data.draw(st.sampled_from(FIELDS))
    value = data.draw(_interesting(8 * struct.calcsize(fmt)))
    out = bytearray(BUF)
    struct.pack_into(fmt, out, offset, value)
    assume(bytes(out) != BUF)
    _rejected(bytes(out))


@SETTINGS
@given(st.integers(0, SIZE - 1), st.binary(min_size=1, max_size=64))
def test_overwrite_span(pos, junk):
    out = bytearray(BUF)
    out[pos: pos + len(junk)] = junk
    assume(bytes(out[:SIZE]) != BUF)
    _rejected(bytes(out[:SIZE]))


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False,
                                                                                           allow_infinity=False)
                    | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                 max_size=3),
                    max_leaves=8)


def _nodes(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _nodes(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _nodes(v, path + (i,))


NODES = [p for p in _nodes(MANIFEST) if p]


@SETTINGS
@given(st.sampled_from(NODES), JSON, st.booleans())
def test_manifest_value_replaced(path, value, delete):
    """Any node replaced by any JSON value (or deleted), manifest re-encoded and the archive fixed up:
    validate_manifest reports, the reader raises ThinFormatError or opens — nothing else."""
    m = copy.deepcopy(MANIFEST)
    obj = m
    for k in path[:-1]:
        obj = obj[k]
    if delete:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value
    validate_manifest(m)
    path_ = TMP / "m.thin"
    path_.write_bytes(with_manifest(BUF, canonical(m)))
    try:
        open_archive(path_).close()
    except ThinFormatError:
        pass


@SETTINGS
@given(st.integers(0, len(PARTS.manifest) - 1), st.binary(min_size=1, max_size=4))
def test_manifest_bytes_damaged_with_fixed_hash(pos, junk):
    """Manifest bytes damaged but lengths and archive hash fixed up: only parse/canonical/validation
    can catch it (or the damage is harmless and the archive is valid)."""
    mbytes = PARTS.manifest[:pos] + junk + PARTS.manifest[pos + len(junk):]
    path = TMP / "j.thin"
    path.write_bytes(with_manifest(BUF, mbytes))
    try:
        with open_archive(path) as a:
            assert a.verify().ok
            assert json.loads(mbytes) == a.manifest
    except ThinFormatError:
        pass
