"""Decoding block-quantized rows (spec §3): the values a q8_0 / q4_0 / q4_1 block stands for.

The format core's half of the block types — what a reader needs. The quantizer, the writing
half, is `thinconv.quant`. Matches gguf-py's dequantizers (tested).
"""

from __future__ import annotations

import numpy as np

from thinconv.format import dtypes

BLOCK_SIZE = dtypes.BLOCK_SIZE
_F32 = np.float32


def dequantize_rows(data: np.ndarray | bytes | memoryview, scheme: str, cols: int) -> np.ndarray:
    """Decode block-quantized rows of ``cols`` values to f32 [rows, cols] (same as gguf-py)."""
    if scheme not in _DEQUANTIZERS:
        raise ValueError(f"unknown quantization scheme {scheme!r}; expected one of {sorted(_DEQUANTIZERS)}")
    bb = dtypes.get(scheme).nbytes
    if cols <= 0 or cols % BLOCK_SIZE:
        raise ValueError(f"dequantize_rows: cols ({cols}) must be a positive multiple of {BLOCK_SIZE}")
    raw = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8).reshape(-1)
    row_bytes = cols // BLOCK_SIZE * bb
    if raw.size % row_bytes:
        raise ValueError(f"dequantize_rows: {raw.size} bytes is not a whole number of {scheme} rows of {cols} values")
    blocks = raw.reshape(-1, bb)
    return _DEQUANTIZERS[scheme](blocks, blocks[:, 0:2].view(np.float16).astype(_F32)).reshape(-1, cols)


def _dequant_q8_0(blocks: np.ndarray, d: np.ndarray) -> np.ndarray:
    y = blocks[:, 2:].view(np.int8).astype(_F32)
    y *= d
    return y


def _nibbles(blocks: np.ndarray) -> np.ndarray:
    """The 32 4-bit quants of each q4 block, as f32 (low nibbles first)."""
    qs = blocks[:, -16:]
    y = np.empty((blocks.shape[0], BLOCK_SIZE), _F32)
    np.bitwise_and(qs, np.uint8(15), out=y[:, :16], casting="unsafe")
    np.right_shift(qs, np.uint8(4), out=y[:, 16:], casting="unsafe")
    return y


def _dequant_q4_0(blocks: np.ndarray, d: np.ndarray) -> np.ndarray:
    y = _nibbles(blocks)
    y -= _F32(8)
    y *= d
    return y


def _dequant_q4_1(blocks: np.ndarray, d: np.ndarray) -> np.ndarray:
    y = _nibbles(blocks)
    y *= d
    y += blocks[:, 2:4].view(np.float16).astype(_F32)
    return y


_DEQUANTIZERS = {"q8_0": _dequant_q8_0, "q4_0": _dequant_q4_0, "q4_1": _dequant_q4_1}
