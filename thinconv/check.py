"""Prove an archive computes what its source computes: the archive as reference-decoder weights,
and logit comparisons (with transformers, or with the archive's probe) judged by dtype class.

A lossy archive (quantized, cast or transformed weights) is compared twice against a source:
*semantics* — transformers running the source's config with the archive's own (dequantized)
weights against the reference decoder on the archive, held to the exact bound whatever the
quantization, so that a wrong `model` section cannot hide in quantization noise — and
*fidelity* — the archive against the source's weights, held to the lossy bounds."""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from thinconv.checkpoint.source import Checkpoint, open_checkpoint
from thinconv.decoder import Decoder, prefill_logits
from thinconv.errors import ConversionError, ExportError, ThinError, UsageError
from thinconv.format import dtypes
from thinconv.format.reader import Archive
from thinconv.mapping import Entry, map_checkpoint
from thinconv.probe import default_tokens
from thinconv.recipe import Registry, load_registry


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
    model_differences: list[str] = field(default_factory=list)  # archive `model` vs the source's config
    model_compared: bool = False  # whether a source's config was available to compare with
    notes: list[str] = field(default_factory=list)  # what this check could not test, and why
    # A lossy archive against a source: transformers on the archive's own weights vs the reference
    # decoder, judged by the exact bound (None: not run — an exact archive, or no source; see notes).
    semantics: CheckResult | None = None

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> dict:
        p = self.positions
        if not p:
            return {"dtype_class": self.dtype_class, "reference": self.reference, "engine": self.engine,
                    "positions": 0}
        return {"dtype_class": self.dtype_class, "reference": self.reference, "engine": self.engine,
                "positions": len(p),
                "max_abs_diff": max(x.max_abs for x in p), "max_rel_diff": max(x.max_rel for x in p),
                "top1_agreement": sum(x.top1_match for x in p) / len(p),
                "mean_kl": sum(x.kl for x in p) / len(p), "max_kl": max(x.kl for x in p)}

    def to_json(self) -> dict:
        semantics = None
        if self.semantics is not None:
            sem = self.semantics
            semantics = {**sem.summary(), "ok": sem.ok, "thresholds": sem.thresholds, "failures": sem.failures,
                         "per_position": [vars(x) for x in sem.positions]}
        return {**self.summary(), "ok": self.ok, "thresholds": self.thresholds, "failures": self.failures,
                "model_compared": self.model_compared, "model_differences": self.model_differences,
                "notes": self.notes, "semantics": semantics, "per_position": [vars(x) for x in self.positions]}


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
    """exact (values as in the source, up to exact widening), float (some float values rounded or
    transformed), q8_0, q4 — from what the converter recorded (validation.quant, validation.lossy),
    and, for archives from before `lossy` existed, from each matrix's dtype against its source's
    (`source_dtypes`: tensor name → THIN source dtype; without it the probe's record)."""
    validation = archive.manifest["validation"]
    classes = {"float"} if validation.get("lossy") else set()
    probe_src = validation.get("probe", {}).get("source_dtype")
    for t in archive.manifest["tensors"]:
        if dtypes.is_block(t["dtype"]):
            classes.add(dtypes.get(t["dtype"]).check_class)
        elif len(t["shape"]) >= 2:  # matrices and [E, rows, cols] expert tensors
            src = (source_dtypes or {}).get(t["name"], probe_src)
            known = src in dtypes.BY_NAME
            classes.add("exact" if not known or dtypes.exact_cast(src, t["dtype"]) else "float")
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


def transformers_logits(source_root, tokens: list[int], vocab: int | None = None, *, label: str | None = None
                        ) -> np.ndarray:
    """The source model's logits under transformers (float32, CPU, eager attention); `vocab`, when
    given, is the archive's vocabulary size, which the source must share. Errors name `label`
    (default: the folder)."""
    try:  # optional dependencies (thinconv[check]), and heavy: imported only when asked for
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise UsageError("`thinconv check --against` needs torch and transformers: "
                         "pip install 'thinconv[check]'") from None
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    label = label or str(source_root)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(source_root), dtype=torch.float32, attn_implementation="eager")
    except Exception as e:  # transformers raises anything (ValueError, KeyError, its own validation errors)
        raise ConversionError(f"{label}: transformers cannot load this checkpoint ({_first_line(e)})") from None
    model.eval()
    # Another model's checkpoint would fail deep inside torch (ids out of range) or in the comparison.
    rows = model.get_input_embeddings().num_embeddings
    if vocab is not None and rows != vocab:
        raise ConversionError(f"{label}: the source has {rows} token embeddings but the archive's vocab_size is "
                              f"{vocab}; is --against the archive's source?")
    try:
        with torch.no_grad():
            out = model(torch.tensor([tokens]), use_cache=False).logits[0]
    except Exception as e:
        raise ConversionError(f"{label}: transformers cannot run this checkpoint ({_first_line(e)})") from None
    return out.float().numpy()


def archive_weights_logits(archive: Archive, source: Checkpoint, tokens: list[int],
                           registry: Registry | None = None) -> np.ndarray:
    """transformers' logits for the *source's* config.json with the *archive's* weights (dequantized,
    under their source names, RoPE rows in the source's layout: `thinconv export --to safetensors`
    into a temporary folder). ExportError when the weights cannot be given back (a recipe
    transform changed them)."""
    from thinconv.export.to_safetensors import export_safetensors

    name = (archive.manifest["validation"].get("converter") or {}).get("recipe")
    registry = registry if registry is not None else load_registry([])
    recipe = registry.recipes.get(name) if isinstance(name, str) else None
    if recipe is None:
        raise ExportError(f"{archive.path.name} does not record a recipe available here ({name!r})")
    config = {k: v for k, v in source.config.items() if k != "quantization_config"}  # the weights are dequantized
    with tempfile.TemporaryDirectory(prefix="thinconv-check-") as tmp:
        folder = Path(tmp) / "weights"
        export_safetensors(archive, folder, recipe=recipe)
        (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
        return transformers_logits(folder, tokens, archive.model["vocab_size"],
                                   label=f"{source.root} (config) with {archive.path.name}'s weights")


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


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


CHECK_CAP = 256  # positions `check` decodes at most by default (windows, RoPE switch points)


def source_model(archive: Archive, ckpt: Checkpoint, registry: Registry | None = None) -> dict:
    """The `model` section thinconv derives from `ckpt`'s config with the archive's recipe and options."""
    conv = archive.manifest["validation"].get("converter") or {}
    opts = conv.get("options") or {}
    registry = registry if registry is not None else load_registry([])
    name = conv.get("recipe")
    if name is not None and name not in registry.recipes:
        raise UsageError(f"{archive.path.name} was converted with recipe {name!r}, which is not available here; pass "
                         f"its folder with --recipes")
    recipe = registry.select(ckpt.config, name, str(ckpt.root))
    report = map_checkpoint(ckpt, recipe, opts.get("rope_layout") or archive.model["rope"]["layout"],
                            compare_tied_head=False, allowed_keys=tuple(opts.get("allow_config_keys") or ()))
    if report.problems:
        raise ConversionError(f"{ckpt.root}: does not convert with recipe {recipe.name}: {report.problems[0]}")
    return report.model


def model_differences(archive: Any, source: Any, path: str = "model") -> list[str]:
    """Every key where the archive's `model` differs from the source's, with both values."""
    if isinstance(archive, dict) and isinstance(source, dict):
        out = []
        for k in sorted(set(archive) | set(source)):
            a, s = archive.get(k, _ABSENT), source.get(k, _ABSENT)
            out += model_differences(a, s, f"{path}.{k}")
        return out
    if archive == source and type(archive) is type(source) or _same_number(archive, source):
        return []
    return [f"{path}: archive {_show(archive)}, source {_show(source)}"]


_ABSENT = object()


def _same_number(a: Any, b: Any) -> bool:
    return all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)) and a == b


def _show(v: Any) -> str:
    if v is _ABSENT:
        return "absent"
    text = json.dumps(v)
    return text if len(text) <= 80 else text[:77] + "..."


def check_length(models: list[dict], steps: int | None = None) -> tuple[int, list[str]]:
    """How many positions to decode so that every window and RoPE switch point the models declare
    acts (up to CHECK_CAP, and the model's context), and what that leaves untested."""
    needed, reasons = needed_positions(models)
    want = max(16, needed)
    # The context bounds the sequence, except under dynamic RoPE, which exists to run past it.
    dynamic = any((m["rope"]["scaling"] or {}).get("type") == "dynamic" for m in models)
    limit = CHECK_CAP if dynamic else min(CHECK_CAP, min(m["max_position_embeddings"] for m in models))
    if steps is not None:
        return steps, ([f"--steps {steps} is shorter than what acts ({', '.join(reasons)})"] if steps < needed
                       else [])
    if want <= limit:
        return want, []
    return limit, [f"{', '.join(reasons)} not exercised: decoding stops at {limit} positions (the cap is "
                   f"{CHECK_CAP}; --steps N decodes more); the value itself was compared with the source's config"]


def needed_positions(models: list[dict]) -> tuple[int, list[str]]:
    """Positions a sequence needs for every window and RoPE switch point of `models` to act (0: none)."""
    want, reasons = 0, []
    for m in models:
        window = m["attention"]["sliding_window"]
        if window:
            want = max(want, window + 8)
            reasons.append(f"sliding window {window}")
        scaling = m["rope"]["scaling"] or {}
        if scaling.get("type") == "longrope":
            switch = scaling.get("original_max_position_embeddings", m["max_position_embeddings"])
            want = max(want, int(switch) + 8)
            reasons.append(f"longrope switch at {switch}")
        elif scaling.get("type") == "dynamic":
            want = max(want, m["max_position_embeddings"] + 8)
            reasons.append(f"dynamic RoPE from {m['max_position_embeddings']}")
    return want, reasons


def run_check(archive: Archive, tokens: list[int] | None = None, against: Checkpoint | None = None, *,
              steps: int | None = None, strict_q4: bool = False, registry: Registry | None = None) -> CheckResult:
    """Check `archive`: its `model` section against the one its source's config implies (with
    `against`, or a source found in the local HF cache), then its logits against transformers on
    `against` or against its own probe. `tokens` default to a sequence long enough for every
    window and RoPE switch point (see check_length)."""
    probe = archive.manifest["validation"].get("probe")
    if against is None:  # usage errors first, before the (slow) decode
        if not probe:
            raise UsageError(f"{archive.path.name} has no validation.probe (converted with --no-probe?); "
                             "use --against SRC")
        if tokens is not None and tokens != probe["tokens"][:len(tokens)]:
            raise UsageError("comparing against the probe uses the probe's own tokens; drop --prompt/--tokens or "
                             "use --against SRC")
    if tokens is not None and not tokens:  # e.g. a --prompt that its tokenizer encodes to nothing
        raise UsageError("no tokens to compare: give a --prompt that encodes to at least one token, or --tokens")
    source = against if against is not None else _cached_source(archive)
    reference = "transformers" if against is not None else "probe"
    result = CheckResult(dtype_class(archive, _source_dtypes(archive, source)), reference)
    if source is not None:
        result.model_compared = True
        result.model_differences = model_differences(archive.model, source_model(archive, source, registry))
        if result.model_differences:
            n = len(result.model_differences)
            result.failures.append(f"the model section differs from the one the source's config implies ({n} key"
                                   f"{'s' * (n > 1)}): " + "; ".join(result.model_differences[:3]))
    else:
        result.notes.append("the model section was not compared with the source's config (give --against SRC)")
    if against is None:
        n = len(probe["tokens"]) if steps is None else min(steps, len(probe["tokens"]))
        tokens = tokens or probe["tokens"][:n]
        if len(probe["tokens"]) < needed_positions([archive.model])[0]:
            result.notes.append(f"the probe covers {len(probe['tokens'])} positions: a window or RoPE switch beyond "
                                f"them is not exercised (give --against SRC)")
    elif tokens is None:
        models = [archive.model, source_model(archive, against, registry)]
        n, untested = check_length(models, steps)
        result.notes += untested
        tokens = default_tokens(archive.model, n, within_context=False)  # check_length bounded n
    try:
        # The probe holds the logits of its whole sequence, run in one pass: a prefix (--steps) is
        # compared on the same pass (a sequence-dependent RoPE, e.g. longrope, depends on its length).
        logits, result.engine = archive_logits(archive, tokens if against is not None else probe["tokens"])
        logits = logits[:len(tokens)]
    except ThinError as e:
        if not result.model_differences:
            raise
        result.notes.append(f"the archive could not be decoded: {e}")  # the differences are the verdict
        return result
    if against is not None:
        reference_logits = transformers_logits(against.root, tokens, archive.model["vocab_size"])
        result.positions = compare_logits(reference_logits, logits)
        if result.dtype_class != "exact":
            result.semantics = _semantics(archive, against, tokens, logits, registry, result)
    else:
        result.positions = compare_probe(probe, logits)
        if result.dtype_class != "exact":
            result.notes.append(f"a {result.dtype_class} archive against its probe: fidelity only; its semantics "
                                f"(the exact bound on its own weights) are compared with --against SRC")
    return judge(result, strict_q4)


SEMANTICS_REFERENCE = "transformers on the archive's weights"


def _semantics(archive: Archive, source: Checkpoint, tokens: list[int], logits: np.ndarray,
               registry: Registry | None, result: CheckResult) -> CheckResult | None:
    """The reference decoder's `logits` against transformers running the source's config with the
    archive's own weights: the same weights on both sides, so the exact bound applies whatever the
    quantization. Its failures join `result`'s; None (with a note) when the weights cannot be given
    to transformers."""
    try:
        hf = archive_weights_logits(archive, source, tokens, registry)
    except ExportError as e:
        result.notes.append(f"semantics not compared ({e}): the archive is judged by fidelity alone")
        return None
    sem = judge(CheckResult("exact", SEMANTICS_REFERENCE, compare_logits(hf, logits), engine=result.engine))
    result.failures += [f"semantics: {f}" for f in sem.failures]
    return sem


def _cached_source(archive: Archive) -> Checkpoint | None:
    """The archive's hub source, when its snapshot is in the local HF cache (read offline); else None."""
    src = archive.manifest["validation"].get("source") or {}
    if not src.get("repo_id") or not src.get("commit"):
        return None
    try:
        return open_checkpoint(src["repo_id"], revision=src.get("revision"), commit=src["commit"], local_only=True,
                               token=os.environ.get("HF_TOKEN"))
    except ThinError:
        return None


def _source_dtypes(archive: Archive, source: Checkpoint | None) -> dict[str, str] | None:
    if source is None:
        return None
    out = {}
    for t in archive.manifest["tensors"]:
        names = [Entry.parse(e).name for e in t["source"]]
        if names and all(n in source.tensors for n in names):
            out[t["name"]] = dtypes.SOURCE_DTYPES.get(source.tensors[names[0]].dtype, "?")
    return out


def archive_logits(archive: Archive, tokens: list[int], memory_budget: int | None = None) -> tuple[np.ndarray, str]:
    """The reference decoder's logits on the archive, and how they were computed.

    Token by token with a KV cache ("decode") when the model's float32 weights fit in a quarter of
    this machine's memory; otherwise layer by layer with the weights streamed ("prefill": same
    model, bounded memory), so a big archive can still be checked against its probe."""
    need = 4 * sum(math.prod(t["shape"]) for t in archive.manifest["tensors"])
    if memory_budget is None:
        memory_budget = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    if need <= memory_budget:
        return Decoder(ArchiveProvider(archive)).logits_for(tokens), "decode"
    return prefill_logits(ArchiveProvider(archive, release=True), tokens), "prefill"
