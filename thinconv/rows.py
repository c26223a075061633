"""Row readers: output rows of one planned tensor, read from the checkpoint's mmapped tensors in
their source dtype (concatenated sources, the interleaved-RoPE row permutation, recipe transforms).

Shared by the converter, which writes the rows, and the probe, which decodes with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from thinconv.checkpoint.source import Checkpoint
from thinconv.errors import ConversionError
from thinconv.mapping import SCALE_SUFFIX, Entry
from thinconv.plan import TensorPlan
from thinconv.transforms import get_transform


def rope_row_permutation(rows: int, head_dim: int, rotary_dim: int) -> np.ndarray:
    """Source row for each output row under the interleaved layout (spec §2.1): within each head,
    new row 2i = old row i, new row 2i+1 = old row i + rotary_dim/2; other rows stay."""
    half = rotary_dim // 2
    within = np.arange(head_dim)
    within[0:rotary_dim:2] = np.arange(half)
    within[1:rotary_dim:2] = np.arange(half) + half
    heads = rows // head_dim
    return (np.arange(heads)[:, None] * head_dim + within[None, :]).reshape(-1)


@dataclass
class _Segment:
    """Consecutive output rows taken from rows [start, end) of one 2-D (or 1-D) view of a source tensor."""

    name: str  # the checkpoint tensor
    view: np.ndarray  # its matrix, or expert e's matrix of a 3-D tensor
    start: int
    end: int
    byte_offset: int  # where `view` starts inside the tensor's bytes (expert e of a 3-D tensor)
    scale: np.ndarray | None = None  # fp8: the tensor's block scales [ceil(R/br), ceil(C/bc)]
    block: tuple[int, int] = (0, 0)

    @property
    def n(self) -> int:
        return self.end - self.start

    def read(self, a: int, b: int) -> np.ndarray:
        """Rows [a, b) of this segment (0-based within it), dequantized when fp8."""
        rows = self.view[self.start + a: self.start + b]
        if self.scale is None:
            return rows
        br, bc = self.block
        r0 = self.start + a
        scales = self.scale[np.arange(r0, r0 + rows.shape[0]) // br]  # [n, ceil(C / bc)]
        # weight × scale per 128×128 (br×bc) block, in f32: what transformers and llama.cpp compute
        return rows.astype(np.float32) * np.repeat(scales, bc, axis=1)[:, : rows.shape[1]]

    def byte_range(self, a: int, b: int) -> tuple[int, int]:
        row = self.view.nbytes // max(self.view.shape[0], 1)
        return self.byte_offset + (self.start + a) * row, self.byte_offset + (self.start + b) * row


def _segments(ckpt: Checkpoint, tp: TensorPlan) -> list[_Segment]:
    """The output rows of a planned tensor as segments of its source entries, in order: 2-D (1-D)
    entries one after another; 3-D entries [E, r, c] (sliced along dim 1) expert by expert."""
    entries = [Entry.parse(e) for e in tp.sources]
    arrays = [ckpt.array(e.name) for e in entries]
    scales = [ckpt.array(e.name + SCALE_SUFFIX) if tp.fp8_block and ckpt.tensors[e.name].dtype == "F8_E4M3" else None
              for e in entries]
    if all(a.ndim == 3 for a in arrays):
        out = []
        for expert in range(arrays[0].shape[0]):
            for e, a in zip(entries, arrays):
                start, end = (e.start, e.end) if e.start is not None else (0, a.shape[1])
                out.append(_Segment(e.name, a[expert], start, end, expert * a[expert].nbytes))
        return out
    out = []
    for e, a, sc in zip(entries, arrays, scales):
        view = a.reshape(-1) if len(tp.shape) == 1 else a
        start, end = (e.start, e.end) if e.start is not None else (0, view.shape[0])
        out.append(_Segment(e.name, view, start, end, 0, sc, tp.fp8_block or (0, 0)))
    return out


class TensorSource:
    """Reads output rows [start, end) of one planned tensor from the checkpoint (an expert tensor
    [E, r, c] counts rows of its [E·r, c] matrix), in source dtype (fp8 with scales: f32)."""

    def __init__(self, ckpt: Checkpoint, tp: TensorPlan, model: dict, recipe_path: str):
        self.tp, self.model, self.ckpt = tp, model, ckpt
        self.segments = _segments(ckpt, tp)
        self.offsets = np.cumsum([0] + [seg.n for seg in self.segments])
        self.perm = None
        if tp.permute_rope is not None:
            perm = rope_row_permutation(tp.rows, model["head_dim"], model["rope"]["rotary_dim"])
            self.perm = perm if tp.permute_rope == "interleave" else np.argsort(perm)
        self.transform = get_transform(tp.transform, f"{recipe_path}: transforms") if tp.transform else None

    def rows(self, start: int, end: int) -> np.ndarray:
        if self.perm is None:
            return self._transformed(start, end)
        # The permutation moves rows only within a head, so the source span [lo, hi) is at most a
        # head wider than the page. The transform sees it in source order with its source row
        # numbers (as documented); the permutation applies to its result, as to any source.
        idx = self.perm[start:end]
        lo, hi = int(idx.min()), int(idx.max()) + 1
        return self._transformed(lo, hi)[idx - lo]

    def _transformed(self, start: int, end: int) -> np.ndarray:
        out = self._range(start, end)
        if self.transform is not None:
            out = self.transform(out, name=self.tp.name, start=start, end=end, model=self.model)
            if out.shape[0] != end - start or list(out.shape[1:]) != self.tp.shape[1:][-1:]:
                raise ConversionError(f"transform {self.tp.transform!r} changed the shape of {self.tp.name} rows "
                                      f"[{start}, {end})")
        return out

    def _overlaps(self, start: int, end: int):
        """(segment, a, b): the segments output rows [start, end) touch, with their rows [a, b)."""
        first = max(0, int(np.searchsorted(self.offsets, start, side="right")) - 1)
        for k in range(first, len(self.segments)):
            off = int(self.offsets[k])
            if off >= end:
                return
            seg = self.segments[k]
            a, b = max(start, off) - off, min(end, off + seg.n) - off
            if a < b:
                yield seg, a, b

    def release(self, start: int, end: int) -> None:
        """Drop the source bytes behind output rows [start, end) from resident memory."""
        if self.perm is not None:
            idx = self.perm[start:end]
            start, end = int(idx.min()), int(idx.max()) + 1
        for seg, a, b in self._overlaps(start, end):
            lo, hi = seg.byte_range(a, b)
            self.ckpt.release(seg.name, lo, hi)

    def _range(self, start: int, end: int) -> np.ndarray:
        pieces = [seg.read(a, b) for seg, a, b in self._overlaps(start, end)]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
