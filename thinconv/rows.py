"""Row readers: output rows of one planned tensor, read from the checkpoint's mmapped tensors in
their source dtype (concatenated sources, the interleaved-RoPE row permutation, recipe transforms).

Shared by the converter, which writes the rows, and the probe, which decodes with them.
"""

from __future__ import annotations

import numpy as np

from thinconv.checkpoint.source import Checkpoint
from thinconv.errors import ConversionError
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


class TensorSource:
    """Reads output rows [start, end) of one planned tensor from the checkpoint, in source dtype."""

    def __init__(self, ckpt: Checkpoint, tp: TensorPlan, model: dict, recipe_path: str):
        self.tp, self.model, self.ckpt = tp, model, ckpt
        self.arrays = [ckpt.array(s) for s in tp.sources]
        if len(tp.shape) == 1:
            self.arrays = [a.reshape(-1) for a in self.arrays]
        self.offsets = np.cumsum([0] + [a.shape[0] for a in self.arrays])
        self.perm = rope_row_permutation(tp.shape[0], model["head_dim"], model["rope"]["rotary_dim"]) \
            if tp.permute_rope else None
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
            if out.shape[0] != end - start or list(out.shape[1:]) != self.tp.shape[1:]:
                raise ConversionError(f"transform {self.tp.transform!r} changed the shape of {self.tp.name} rows "
                                      f"[{start}, {end})")
        return out

    def release(self, start: int, end: int) -> None:
        """Drop the source bytes behind output rows [start, end) from resident memory."""
        if self.perm is not None:
            idx = self.perm[start:end]
            start, end = int(idx.min()), int(idx.max()) + 1
        for name, a, off in zip(self.tp.sources, self.arrays, self.offsets):
            s, e = max(start, off), min(end, off + a.shape[0])
            if s < e:
                row = a.nbytes // max(a.shape[0], 1)
                self.ckpt.release(name, (s - off) * row, (e - off) * row)

    def _range(self, start: int, end: int) -> np.ndarray:
        pieces = []
        for a, off in zip(self.arrays, self.offsets):
            s, e = max(start, off), min(end, off + a.shape[0])
            if s < e:
                pieces.append(a[s - off: e - off])
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
