"""The probe (validation.probe): the reference decoder's top-k logits on the source weights, computed
at conversion so that `thinconv check` can later test an archive without its source.

Shared by the converter (which follows its page stream with it) and `check` (which compares).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from thinconv.decoder import prefill_logits
from thinconv.rope import derived_tables
from thinconv.rows import TensorSource

PROBE_TOKENS = 8
PROBE_TOP_K = 8


class SourceProvider:
    """Reference-decoder weights from the source checkpoint through its recipe plan, in HF's
    "half" RoPE layout whatever layout the archive will hold."""

    def __init__(self, ckpt, plan, wait=None):
        layout = plan.recipe.metadata.rope_source_layout
        self.model = {**plan.model, "rope": {**plan.model["rope"], "layout": layout}}
        self._derived = derived_tables(self.model)
        # the same row reader the converter uses, without the interleave permutation
        self._sources = {t.name: TensorSource(ckpt, replace(t, permute_rope=None), self.model, plan.recipe.path)
                         for t in plan.tensors if t.sources}
        self._wait = wait  # wait(name, end): the converter's StreamGate, when following its stream

    def has(self, name: str) -> bool:
        return name in self._sources or name in self._derived

    def get(self, name: str) -> np.ndarray:
        if name in self._derived:
            return self._derived[name]
        return self.rows(name, 0, self._sources[name].tp.rows).reshape(self.shape(name))

    def rows(self, name: str, start: int, end: int) -> np.ndarray:
        source = self._sources[name]
        if self._wait is not None:
            self._wait(name, end)
        out = np.asarray(source.rows(start, end), dtype=np.float32).reshape(end - start, *source.tp.shape[1:][-1:])
        source.release(start, end)  # keep the mmap's resident pages bounded
        return out

    def shape(self, name: str) -> list[int]:
        return self._sources[name].tp.shape


def default_tokens(model: dict, n: int | None = None) -> list[int]:
    """A fixed, spread-out token sequence; longer than any sliding window so the window is exercised."""
    window = model["attention"]["sliding_window"]
    if n is None:
        n = max(16, window + 8) if window else 16
    n = min(n, model["max_position_embeddings"])
    vocab = model["vocab_size"]
    bos = model["special_tokens"]["bos"]
    body = [(7919 * i + 104729) % vocab for i in range(n)]
    return ([bos] + body[: n - 1]) if bos is not None else body


def conversion_probe(ckpt, plan, wait=None) -> tuple[dict | None, str | None]:
    """The probe for `plan`, computed from the source weights; (None, reason) when skipped.

    `wait(name, end)` is called before rows [.., end) of a tensor are read (see StreamGate)."""
    counts: dict[str, int] = {}
    for t in plan.tensors:
        if len(t.shape) == 2:
            counts[t.source_dtype] = counts.get(t.source_dtype, 0) + 1
    with np.errstate(all="ignore"):  # non-finite weights are reported by the conversion itself
        probe = make_probe(SourceProvider(ckpt, plan, wait))
    if not all(math.isfinite(v) for pos in probe["positions"] for v in pos["logits"]):
        return None, "probe skipped: the source weights give non-finite logits (see the NaN/Inf warnings)"
    probe["source_dtype"] = max(sorted(counts), key=counts.get)
    return probe, None


def make_probe(provider, tokens: list[int] | None = None, top_k: int = PROBE_TOP_K) -> dict:
    """validation.probe: the reference decoder's top-k logits per position, from `provider`."""
    tokens = tokens if tokens is not None else default_tokens(provider.model, PROBE_TOKENS)
    # Streams the weights (bounded memory on big models); float64, then float32, so the stored
    # values are the same on any host.
    logits = prefill_logits(provider, tokens, dtype=np.float64).astype(np.float32)
    positions = []
    for row in logits:
        ids = np.argsort(-row, kind="stable")[:top_k]
        positions.append({"ids": [int(i) for i in ids], "logits": [float(row[i]) for i in ids]})
    return {"tokens": [int(t) for t in tokens], "top_k": top_k, "positions": positions}
