"""Prove an archive computes what its source computes: the archive as reference-decoder weights,
and logit comparisons (with transformers, or with the archive's probe) judged by dtype class."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from thinconv.decoder import Decoder, prefill_logits
from thinconv.errors import ConversionError, ThinError, UsageError
from thinconv.format import dtypes, spec
from thinconv.format.reader import Archive


class ArchiveProvider:
    """Reference-decoder weights straight from an archive (block types dequantized)."""

    def __init__(self, archive: Archive, release: bool = False):
        self.archive = archive
        self.model = archive.model
        self._names = set(archive.tensor_names)
        self._release = release  # drop each tensor's mapped pages once its last rows are read

    def has(self, name: str) -> bool:
        return name in self._names

    def get(self, name: str) -> np.ndarray:
        return self.archive.dequantize(name)

    def rows(self, name: str, start: int, end: int) -> np.ndarray:
        out = self.archive.dequantize(name, rows=(start, end))
        if self._release and end == self.shape(name)[0]:
            self.archive.release(name)
        return out

    def shape(self, name: str) -> list[int]:
        return self.archive.tensor_info(name)["shape"]


# ---------------------------------------------------------------- comparison

@dataclass
class PositionResult:
    position: int
    max_abs: float
    max_rel: float
    top1_match: bool
    kl: float


@dataclass
class CheckResult:
    dtype_class: str  # exact | float | q8_0 | q4
    reference: str  # "transformers" | "probe"
    positions: list[PositionResult] = field(default_factory=list)
    thresholds: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    engine: str = "decode"  # "decode" (token by token) | "prefill" (layer by layer, for big models)

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> dict:
        p = self.positions
        return {"dtype_class": self.dtype_class, "reference": self.reference, "engine": self.engine,
                "positions": len(p),
                "max_abs_diff": max(x.max_abs for x in p), "max_rel_diff": max(x.max_rel for x in p),
                "top1_agreement": sum(x.top1_match for x in p) / len(p),
                "mean_kl": sum(x.kl for x in p) / len(p), "max_kl": max(x.kl for x in p)}

    def to_json(self) -> dict:
        return {**self.summary(), "ok": self.ok, "thresholds": self.thresholds, "failures": self.failures,
                "per_position": [vars(x) for x in self.positions]}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare_logits(reference: np.ndarray, test: np.ndarray) -> list[PositionResult]:
    """Per position: max |Δ|, max |Δ| / max |reference|, top-1 agreement, KL(reference ‖ test)."""
    out = []
    lp, lq = _log_softmax(reference), _log_softmax(test)
    for i, (r, t) in enumerate(zip(reference, test)):
        diff = float(np.abs(r.astype(np.float64) - t).max())
        scale = float(np.abs(r).max()) or 1.0
        kl = float(np.sum(np.exp(lp[i]) * (lp[i] - lq[i])))
        out.append(PositionResult(i, diff, diff / scale, int(np.argmax(r)) == int(np.argmax(t)), max(kl, 0.0)))
    return out


def compare_probe(probe: dict, test: np.ndarray) -> list[PositionResult]:
    """Against a stored probe: differences over its top-k ids; KL over the top-k renormalized."""
    out = []
    for i, pos in enumerate(probe["positions"][: len(test)]):
        ids = np.array(pos["ids"])
        r = np.array(pos["logits"], np.float64)
        t = test[i][ids].astype(np.float64)
        diff = float(np.abs(r - t).max())
        scale = float(np.abs(r).max()) or 1.0
        lp, lq = _log_softmax(r), _log_softmax(t)
        kl = float(np.sum(np.exp(lp) * (lp - lq)))
        out.append(PositionResult(i, diff, diff / scale, int(np.argmax(test[i])) == int(ids[0]), max(kl, 0.0)))
    return out


THRESHOLDS = {
    "exact": {"max_rel_diff": 1e-3, "top1_agreement": 1.0},
    "float": {"max_rel_diff": 5e-2, "mean_kl": 1e-3},
    "q8_0": {"mean_kl": 1e-2},
    "q4": {"mean_kl": 1e-1},
}


def dtype_class(archive: Archive, source_dtypes: dict[str, str] | None) -> str:
    """exact (bytes as in the source, up to exact upcasts), float (lossy float cast), q8_0, q4.

    `source_dtypes` maps tensor name → THIN source dtype; without it the probe's record is used."""
    classes = set()
    probe_src = archive.manifest["validation"].get("probe", {}).get("source_dtype")
    for t in archive.manifest["tensors"]:
        if dtypes.is_block(t["dtype"]):
            classes.add(dtypes.get(t["dtype"]).check_class)
        elif len(t["shape"]) >= 2:  # matrices and [E, rows, cols] expert tensors
            src = (source_dtypes or {}).get(t["name"], probe_src)
            exact = src == t["dtype"] or (t["dtype"] == "f32" and src in ("f16", "bf16")) or \
                (t["dtype"] == "f16" and src == "f16")
            classes.add("exact" if exact else "float")
    for c in ("q4", "q8_0", "float", "exact"):
        if c in classes:
            return c
    return "exact"


def judge(result: CheckResult, strict_q4: bool = False) -> CheckResult:
    s = result.summary()
    limits = dict(THRESHOLDS[result.dtype_class])
    if result.dtype_class == "q4" and not strict_q4:
        limits = {}
    result.thresholds = limits
    for key, bound in limits.items():
        value = s[key]
        bad = value < bound if key == "top1_agreement" else value > bound
        if bad:
            result.failures.append(f"{key} = {value:.6g}, {'below' if key == 'top1_agreement' else 'above'} the "
                                   f"{result.dtype_class} bound {bound:g}")
    return result


def transformers_logits(source_root, tokens: list[int], vocab: int | None = None) -> np.ndarray:
    """The source model's logits under transformers (float32, CPU, eager attention); `vocab`, when
    given, is the archive's vocabulary size, which the source must share."""
    try:  # optional dependencies (thinconv[check]), and heavy: imported only when asked for
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise UsageError("`thinconv check --against` needs torch and transformers: "
                         "pip install 'thinconv[check]'") from None
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(str(source_root), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    # Another model's checkpoint would fail deep inside torch (ids out of range) or in the comparison.
    rows = model.get_input_embeddings().num_embeddings
    if vocab is not None and rows != vocab:
        raise ConversionError(f"{source_root}: the source has {rows} token embeddings but the archive's vocab_size is "
                              f"{vocab}; is --against the archive's source?")
    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=False).logits[0]
    return out.float().numpy()


def archive_tokenizer(archive: Archive):
    """The embedded tokenizer.json as a `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer  # lazy: only `run` and `check --prompt` need it (start-up time)

    try:
        data = archive.asset_bytes("tokenizer.json")
    except ThinError:
        raise UsageError(f"{archive.path.name} embeds no tokenizer.json; pass --tokens instead of --prompt") from None
    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises plain Exceptions
        raise ConversionError(f"{archive.path.name}: embedded tokenizer.json does not load ({e})") from None


def parse_tokens(text: str, vocab: int) -> list[int]:
    try:
        tokens = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UsageError(f"--tokens {text!r}: expected comma-separated token ids, e.g. 1,2,3") from None
    bad = [t for t in tokens if not 0 <= t < vocab]
    if not tokens or bad:
        raise UsageError(f"--tokens: ids must lie in [0, {vocab}), got {bad or 'none'}")
    return tokens


def run_check(archive: Archive, tokens: list[int], against: Any | None = None, strict_q4: bool = False) -> CheckResult:
    """Decode `tokens` on the archive and compare with transformers on `against` (a Checkpoint),
    or with the archive's own probe when `against` is None."""
    if not tokens:  # e.g. a --prompt that its tokenizer encodes to nothing
        raise UsageError("no tokens to compare: give a --prompt that encodes to at least one token, or --tokens")
    probe = archive.manifest["validation"].get("probe")
    if against is None:  # usage errors first, before the (slow) decode
        if not probe:
            raise UsageError(f"{archive.path.name} has no validation.probe (converted with --no-probe?); "
                             "use --against SRC")
        if tokens != probe["tokens"][:len(tokens)]:
            raise UsageError("comparing against the probe uses the probe's own tokens; drop --prompt/--tokens or "
                             "use --against SRC")
    logits, engine = archive_logits(archive, tokens)
    if against is not None:
        source_dtypes = {}
        for t in archive.manifest["tensors"]:
            if t["source"] and all(s in against.tensors for s in t["source"]):
                source_dtypes[t["name"]] = dtypes.SOURCE_DTYPES.get(against.tensors[t["source"][0]].dtype, "?")
        reference = transformers_logits(against.root, tokens, archive.model["vocab_size"])
        result = CheckResult(dtype_class(archive, source_dtypes), "transformers", compare_logits(reference, logits))
    else:
        result = CheckResult(dtype_class(archive, None), "probe", compare_probe(probe, logits))
    result.engine = engine
    return judge(result, strict_q4)


def archive_logits(archive: Archive, tokens: list[int], memory_budget: int | None = None) -> tuple[np.ndarray, str]:
    """The reference decoder's logits on the archive, and how they were computed.

    Token by token with a KV cache ("decode") when the model's float32 weights fit in a quarter of
    this machine's memory; otherwise layer by layer with the weights streamed ("prefill": same
    model, bounded memory), so a big archive can still be checked against its probe."""
    m = archive.model
    need = 4 * sum(math.prod(t["shape"]) for t in archive.manifest["tensors"])
    if memory_budget is None:
        memory_budget = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    if need <= memory_budget:
        return Decoder(ArchiveProvider(archive)).logits_for(tokens), "decode"
    if not spec.rope_freqs_present(m):
        raise ConversionError("the reference decoder needs a rope_freqs table (static RoPE scaling)")
    return prefill_logits(ArchiveProvider(archive, release=True), tokens), "prefill"
