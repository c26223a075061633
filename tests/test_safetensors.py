"""The strict mmap SafeTensors reader, against the `safetensors` library and broken headers."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from thinconv.checkpoint.safetensors import NUMPY_DTYPES, open_safetensors
from thinconv.errors import CheckpointError


def _torch_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def reference_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "w.bf16": torch.randn(5, 7, generator=gen).to(torch.bfloat16),
        "w.f16": torch.randn(3, 4, 2, generator=gen).to(torch.float16),
        "w.f32": torch.randn(11, generator=gen),
        "w.f64": torch.randn(2, 2, generator=gen).to(torch.float64),
        "w.f8e4m3": torch.randn(4, 8, generator=gen).to(torch.float8_e4m3fn),
        "w.f8e5m2": torch.randn(3, 3, generator=gen).to(torch.float8_e5m2),
        "i.i64": torch.arange(-3, 3, dtype=torch.int64),
        "i.i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "i.u8": torch.tensor([[0, 255]], dtype=torch.uint8),
        "b.bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path_factory.mktemp("ref") / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "x"})
    return path


def test_matches_safetensors_library(reference_file: Path) -> None:
    with safe_open(str(reference_file), framework="pt") as ref, open_safetensors(reference_file) as f:
        assert set(f.entries) == set(ref.keys())
        assert list(f.entries) == list(ref.offset_keys())  # entries come in data-offset order
        assert f.metadata == ref.metadata() == {"format": "pt", "note": "x"}
        for name, entry in f.entries.items():
            t = ref.get_tensor(name)
            arr = f.array(name)
            assert arr.shape == tuple(t.shape) == entry.shape
            assert arr.dtype == NUMPY_DTYPES[entry.dtype]
            assert arr.tobytes() == _torch_bytes(t)
            assert entry.nbytes == arr.nbytes and entry.path == reference_file
            with open(reference_file, "rb") as raw:  # offset is the absolute file offset
                raw.seek(entry.offset)
                assert raw.read(entry.nbytes) == arr.tobytes()
    assert {e.dtype for e in f.entries.values()} >= {"BF16", "F16", "F32", "F8_E4M3", "F8_E5M2"}


def test_values_decode_like_torch(reference_file: Path) -> None:
    with safe_open(str(reference_file), framework="pt") as ref, open_safetensors(reference_file) as f:
        for name in ("w.bf16", "w.f16", "w.f8e4m3", "w.f8e5m2"):
            np.testing.assert_array_equal(f.array(name).astype(np.float32),
                                          ref.get_tensor(name).float().numpy())


def test_arrays_are_readonly_zero_copy_views(reference_file: Path) -> None:
    with open_safetensors(reference_file) as f:
        arr = f.array("w.f32")
        base = arr
        while isinstance(base, np.ndarray):
            base = base.base
        assert isinstance(base, memoryview) and base.obj is f._mmap  # a view over the mmap
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[0] = 1.0
        assert np.shares_memory(f.array("w.f32"), arr)  # two views, one buffer: no copy
    # The mapping outlives close() while a view still uses it.
    assert arr.tobytes() == arr.copy().tobytes()
    with pytest.raises(CheckpointError, match="closed"):
        f.array("w.f32")


def test_zero_size_tensor_and_unknown_name(reference_file: Path) -> None:
    with open_safetensors(reference_file) as f:
        assert f.array("empty").shape == (0, 4)
        assert f.entries["scalar"].shape == () and f.array("scalar").item() == 2.5
        with pytest.raises(CheckpointError, match=r"model\.safetensors: no tensor 'nope'"):
            f.array("nope")


def test_file_without_tensors(tmp_path: Path) -> None:
    path = tmp_path / "none.safetensors"
    save_file({}, str(path))
    with open_safetensors(path) as f:
        assert f.entries == {} and f.metadata is None


# ---------------------------------------------------------------- broken files, built by hand

def _write(path: Path, header: object, data: bytes = b"", *, raw: bytes | None = None,
           length: int | None = None) -> Path:
    body = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)
    return path


def _f32(name: str, shape: list, offsets: list) -> dict:
    return {name: {"dtype": "F32", "shape": shape, "data_offsets": offsets}}


def _expect(path: Path, message: str) -> None:
    with pytest.raises(CheckpointError) as info:
        open_safetensors(path)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(f"{path.name}: ")
    assert re.search(message, text), text


def test_valid_hand_built_file_with_padding(tmp_path: Path) -> None:
    raw = json.dumps({**_f32("x", [3], [0, 12]), "__metadata__": {"k": "v"}}).encode() + b"   "
    path = _write(tmp_path / "ok.safetensors", None, b"\0" * 12, raw=raw)
    with open_safetensors(path) as f:
        assert f.entries["x"].offset == 8 + len(raw) and f.metadata == {"k": "v"}


BROKEN = {
    "header_past_end": (dict(header=_f32("x", [1], [0, 4]), data=b"\0" * 4, length=10_000),
                        r"header length 10000 runs past the end of the file"),
    "header_too_large": (dict(header={}, length=100_000_001),
                         r"header length 100000001 exceeds the 100000000-byte limit"),
    "not_json": (dict(header=None, raw=b"{not json"), r"header is not valid JSON"),
    "not_utf8": (dict(header=None, raw=b'{"\xff": 1}'), r"header is not valid UTF-8"),
    "not_object": (dict(header=[1, 2]), r"header is a JSON list, expected an object"),
    "bad_dtype": (dict(header={"x": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}},
                       data=b"\0"), r"tensor 'x' has dtype 'F4', expected one of F64, F32"),
    "bad_shape": (dict(header=_f32("x", [2, -1], [0, 8]), data=b"\0" * 8),
                  r"tensor 'x' has shape \[2, -1\], expected a list of non-negative integers"),
    "begin_after_end": (dict(header=_f32("x", [1], [8, 4]), data=b"\0" * 8),
                        r"tensor 'x' data_offsets \[8, 4\] begin after they end"),
    "gap": (dict(header={**_f32("a", [1], [0, 4]), **_f32("b", [1], [8, 12])}, data=b"\0" * 12),
            r"tensor 'b' data_offsets \[8, 12\] leave a gap of 4 bytes after byte 4"),
    "overlap": (dict(header={**_f32("a", [2], [0, 8]), **_f32("b", [2], [4, 12])}, data=b"\0" * 12),
                r"tensor 'b' data_offsets \[4, 12\] overlap tensor 'a', which ends at byte 8"),
    "trailing_bytes": (dict(header=_f32("x", [2], [0, 8]), data=b"\0" * 11),
                       r"3 trailing bytes after the last tensor"),
    "wrong_byte_length": (dict(header=_f32("x", [3], [0, 10]), data=b"\0" * 10),
                          r"tensor 'x' data_offsets \[0, 10\] hold 10 bytes, expected 12"
                          r" \(shape \[3\] × F32\)"),
    "duplicate_key": (dict(header=None, data=b"\0" * 4,
                           raw=b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
                               b' "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'),
                      r"header has duplicate key 'x'"),
    "truncated_data": (dict(header={**_f32("a", [2], [0, 8]), **_f32("b", [4], [8, 24])},
                            data=b"\0" * 15),
                       r"tensor 'b' data_offsets \[8, 24\] run past the end of the data section"
                       r" \(15 bytes\): file truncated\?"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_header(tmp_path: Path, case: str) -> None:
    kwargs, message = BROKEN[case]
    path = _write(tmp_path / f"{case}.safetensors", **kwargs)
    _expect(path, message)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.safetensors"
    path.write_bytes(b"")
    _expect(path, r"empty file \(0 bytes\), expected an 8-byte header length")


def test_truncated_inside_length_prefix(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x10\0\0")
    _expect(path, r"file is only 3 bytes")


def test_truncated_real_file(tmp_path: Path, reference_file: Path) -> None:
    data = reference_file.read_bytes()
    path = tmp_path / "cut.safetensors"
    path.write_bytes(data[:-5])
    _expect(path, r"run past the end of the data section")


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such file"):
        open_safetensors(tmp_path / "absent.safetensors")
    with pytest.raises(CheckpointError, match="is a directory"):
        open_safetensors(tmp_path)


def test_reference_library_rejects_what_we_reject(tmp_path: Path) -> None:
    """Our rules are the Rust crate's: every broken file (bar duplicate keys) fails there too."""
    for case, (kwargs, _) in BROKEN.items():
        if case in ("duplicate_key", "bad_dtype"):  # stricter than serde / dtypes we cannot view
            continue
        path = _write(tmp_path / f"{case}.safetensors", **kwargs)
        with pytest.raises(Exception):  # noqa: B017 - the library's own error types vary
            safe_open(str(path), framework="np")
