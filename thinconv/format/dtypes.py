"""Every dtype thinconv knows, in one table: the archive's (spec §2.2, §3) and the sources' own.

Adding a dtype is one row here plus the code that produces it (a cast in `thinconv.casts`, a
quantizer scheme in `thinconv.quant`). Everything else — the manifest validator, row sizes, the
reader's numpy views, the converter's output choices, safetensors dtype codes, CLI help — reads
this table. No third-party imports: numpy types are resolved on first use (`numpy_dtype`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

BLOCK_SIZE = 32  # values per quantization block (spec §3)


@dataclass(frozen=True)
class DType:
    name: str  # the THIN name, e.g. "bf16", "q8_0", "f8_e4m3"
    kind: str  # "float": one value per element | "block": BLOCK_SIZE values per block (spec §3)
    nbytes: int  # bytes per element (float) or per block (block)
    archive: bool  # may be a tensor's dtype in an archive
    exact_f32: bool = False  # every value upcasts exactly to f32: may be a quant.source_dtype
    safetensors: str | None = None  # the safetensors dtype code of a source tensor of this dtype
    numpy: str | None = None  # numpy / ml_dtypes type of one element (float kinds)
    check_class: str | None = None  # `thinconv check`'s bound class for block types

    @property
    def block_size(self) -> int:
        return BLOCK_SIZE if self.kind == "block" else 1

    def row_bytes(self, cols: int) -> int:
        """Bytes in one row of `cols` values (a 1-D tensor's "row" is one value)."""
        return cols // self.block_size * self.nbytes


TABLE: tuple[DType, ...] = (
    DType("f32", "float", 4, archive=True, exact_f32=True, safetensors="F32", numpy="<f4"),
    DType("f16", "float", 2, archive=True, exact_f32=True, safetensors="F16", numpy="<f2"),
    DType("bf16", "float", 2, archive=True, exact_f32=True, safetensors="BF16", numpy="bfloat16"),
    DType("q8_0", "block", 34, archive=True, check_class="q8_0"),
    DType("q4_0", "block", 18, archive=True, check_class="q4"),
    DType("q4_1", "block", 20, archive=True, check_class="q4"),
    # Source-only: read from checkpoints, never stored as such.
    DType("f64", "float", 8, archive=False, safetensors="F64", numpy="<f8"),
    DType("f8_e4m3", "float", 1, archive=False, exact_f32=True, safetensors="F8_E4M3", numpy="float8_e4m3fn"),
    DType("f8_e5m2", "float", 1, archive=False, exact_f32=True, safetensors="F8_E5M2", numpy="float8_e5m2"),
)
BY_NAME: dict[str, DType] = {d.name: d for d in TABLE}

ARCHIVE_DTYPES = tuple(d.name for d in TABLE if d.archive)
FLOAT_DTYPES = tuple(d.name for d in TABLE if d.archive and d.kind == "float")
BLOCK_DTYPES = tuple(d.name for d in TABLE if d.kind == "block")
# What a block-quantized tensor may have come from (quant.source_dtype): dtypes that upcast exactly.
QUANT_SOURCE_DTYPES = tuple(d.name for d in TABLE if d.exact_f32)
# Source weights: safetensors code → THIN name (only float tensors are weights).
SOURCE_DTYPES = {d.safetensors: d.name for d in TABLE if d.safetensors}
# `--dtype` choices: bf16 first, the common one.
OUTPUT_CHOICES = ("auto", *reversed(FLOAT_DTYPES), *BLOCK_DTYPES)


def get(name: str) -> DType:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}") from None


def is_block(name: str) -> bool:
    return name in BLOCK_DTYPES


def exact_cast(source: str, target: str) -> bool:
    """Whether every value of dtype `source` is exactly representable in `target`: the same dtype,
    a widening to f32, or an f8 value (which every archive float dtype holds)."""
    return source == target or (target == "f32" and get(source).exact_f32) or source in ("f8_e4m3", "f8_e5m2")


def row_bytes(name: str, cols: int) -> int:
    """Bytes in one row of `cols` values of archive dtype `name`."""
    return get(name).row_bytes(cols)


@functools.cache
def numpy_dtype(name: str):
    """The numpy dtype of one element of float dtype `name` (ml_dtypes for bf16 and f8). numpy
    loads on the first tensor read, not at import: `inspect` and `verify` never need it."""
    import ml_dtypes
    import numpy as np

    code = get(name).numpy
    if code is None:
        raise ValueError(f"dtype {name!r} has no numpy element type (a block type)")
    return np.dtype(code) if code.startswith("<") else np.dtype(getattr(ml_dtypes, code))
