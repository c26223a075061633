"""Mapping a checkpoint onto a recipe — before any tensor data is read: every source tensor claimed
by a rule (whole, or by row slices that tile it), ignored, or consumed (an FP8 weight's scales);
every tensor the `model` implies found with the shape its dimensions imply and one float dtype;
every config key accounted for. What `thinconv recipe check` reports and planning builds on.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from thinconv.checkpoint.source import Checkpoint
from thinconv.errors import ConversionError, listed, shown
from thinconv.format import dtypes, spec
from thinconv.modelmeta import config_keys_problem, read_model
from thinconv.recipe import Recipe

SCALE_SUFFIX = "_scale_inv"  # block-FP8 checkpoints: X.weight (F8_E4M3) and X.weight_scale_inv (F32)
_FP8_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert",
             "ignored_layers", "dequantize"}
_ENTRY = re.compile(r"(?P<name>.+)\[(?P<a>0|[1-9][0-9]*):(?P<b>0|[1-9][0-9]*)\]")


@dataclass(frozen=True)
class Entry:
    """One `source` entry: a checkpoint tensor, or rows [start, end) of it (dim 1 of a 3-D tensor)."""

    name: str
    start: int | None = None
    end: int | None = None

    @classmethod
    def parse(cls, text: str) -> "Entry":
        m = _ENTRY.fullmatch(text)
        return cls(m.group("name"), int(m.group("a")), int(m.group("b"))) if m else cls(text)


@dataclass(frozen=True)
class Fp8:
    """A block-scaled FP8 checkpoint (quantization_config.quant_method = "fp8")."""

    block: tuple[int, int]  # weight_block_size: [rows, cols]
    config: dict  # the quantization_config as read (recorded in validation.source)


@dataclass
class MappingReport:
    """How a checkpoint's tensors meet a recipe; `problems` empty means it converts."""

    model: dict
    mapped: dict[str, list[str]] = field(default_factory=dict)  # canonical → source entries
    ignored: list[str] = field(default_factory=list)
    consumed: list[str] = field(default_factory=list)  # FP8 scales, read with their weights
    tied_duplicate: str | None = None  # a source head identical to the embeddings, skipped
    unmapped: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    shape_errors: list[str] = field(default_factory=list)
    dtype_errors: list[str] = field(default_factory=list)
    config_problem: str | None = None
    fp8: Fp8 | None = None
    weights_dtype: str = "bf16"

    @property
    def problems(self) -> list[str]:
        out = [self.config_problem] if self.config_problem else []
        if self.unmapped:
            out.append(f"{len(self.unmapped)} source tensor(s) not mapped by the recipe nor ignored: "
                       f"{names_text(self.unmapped)}")
        if self.missing:
            out.append(f"{len(self.missing)} required tensor(s) missing from the checkpoint: {names_text(self.missing)}")
        dtype_errors = self.dtype_errors
        if len(dtype_errors) > 3:  # e.g. every fp8 scale of a big model on the wrong grid: the first few say it
            dtype_errors = dtype_errors[:2] + [f"{dtype_errors[2]} … and {len(dtype_errors) - 3} more tensor(s) like "
                                               f"these"]
        return out + self.unexpected + self.shape_errors + dtype_errors


def names_text(names: list[str], limit: int = 3) -> str:
    """A few names, then "and N more" (messages stay one short line)."""
    return listed(names, limit, width=160)  # an entry may name its sources: "X (from Y)"


def weights_dtype(ckpt: Checkpoint) -> str:
    """The dtype most of the checkpoint's matrices are stored in (the dtype the model runs in)."""
    counts: dict[str, int] = {}
    for e in ckpt.tensors.values():
        if len(e.shape) >= 2 and e.dtype in dtypes.SOURCE_DTYPES:
            counts[dtypes.SOURCE_DTYPES[e.dtype]] = counts.get(dtypes.SOURCE_DTYPES[e.dtype], 0) + 1
    return max(sorted(counts), key=counts.get) if counts else "f32"


def read_fp8(config: Mapping[str, Any]) -> Fp8 | None:
    """The checkpoint's quantization, when it has one: block FP8 is read, every other method refused."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise ConversionError(f"config.json: field 'quantization_config' must be an object, got {shown(qc)}")
    method = qc.get("quant_method")
    if method != "fp8":
        raise ConversionError(f"config.json: quantization_config.quant_method {method!r} is not supported: thinconv "
                              f"reads float checkpoints and block-scaled fp8 only (dequantize it first)")
    unknown = sorted(set(qc) - _FP8_KEYS)
    if unknown:
        raise ConversionError(f"config.json: quantization_config.{unknown[0]} is not understood for fp8")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ConversionError(f"config.json: quantization_config.fmt {qc.get('fmt')!r}: only e4m3 is supported")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ConversionError(f"config.json: quantization_config.activation_scheme {qc.get('activation_scheme')!r}: "
                              f"only dynamic (no stored activation scales) is supported")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(
            isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= 1 << 20 for b in block)):
        raise ConversionError(f"config.json: quantization_config.weight_block_size must be [rows, cols] of positive "
                              f"integers, got {shown(block)}")
    return Fp8((block[0], block[1]), dict(qc))


def map_checkpoint(ckpt: Checkpoint, recipe: Recipe, rope_layout: str = "half", *, compare_tied_head: bool = True,
                   allowed_keys: tuple[str, ...] = ()) -> MappingReport:
    """Map every source tensor through the recipe and check names, flags, shapes and dtypes.

    `compare_tied_head` also compares a head shipped by a tied model with the embeddings, which
    reads both tensors; planning leaves that to `convert` (see `tied_head_problem`)."""
    fp8 = read_fp8(ckpt.config)
    wdtype = weights_dtype(ckpt)
    model, keys = read_model(ckpt.config, ckpt.generation_config, architecture=recipe.name, rules=recipe.metadata,
                             rope_layout=rope_layout, family=recipe.family, weights_dtype=wdtype,
                             allowed_keys=allowed_keys, check_keys=False, consumed=("quantization_config",),
                             max_layers=len(ckpt.tensors),
                             max_elements=max((math.prod(e.shape) for e in ckpt.tensors.values()), default=0))
    report = MappingReport(model, fp8=fp8, weights_dtype=wdtype)
    report.config_problem = config_keys_problem(ckpt.config, keys, recipe.name)
    claims = _claim_wanted(ckpt, recipe, report)
    _account_sources(ckpt, recipe, report, claims)
    _check_claims(ckpt, report, claims)
    for canonical, entries in report.mapped.items():
        _check_shape(ckpt, model, canonical, [Entry.parse(e) for e in entries], report)
        _check_dtype(ckpt, canonical, [Entry.parse(e).name for e in entries], report)
    if compare_tied_head:
        problem = tied_head_problem(ckpt, report)
        if problem:
            report.unexpected.append(problem)
    return report


def _claim_wanted(ckpt: Checkpoint, recipe: Recipe, report: MappingReport) -> dict[str, list[tuple[str, Entry]]]:
    """Resolve each tensor the model needs to the first rule alternative whose tensors all exist;
    returns source tensor → [(canonical, entry)] for every claim."""
    claims: dict[str, list[tuple[str, Entry]]] = {}
    for canonical in spec.tensor_names(report.model):
        if spec.split_name(canonical)[0] in spec.DERIVED_ROLES:
            continue  # computed from the model, not read
        alternatives = recipe.alternatives_for(canonical, report.model)
        if alternatives is None:
            report.missing.append(f"{canonical} (the recipe has no rule for role {spec.split_name(canonical)[0]})")
            continue
        chosen = next((alt for alt in alternatives if all(Entry.parse(e).name in ckpt.tensors for e in alt)), None)
        if chosen is None:
            lacking = [e for e in alternatives[0] if Entry.parse(e).name not in ckpt.tensors]
            report.missing.append(f"{canonical} (from {names_text([Entry.parse(e).name for e in lacking], 4)})")
            continue
        report.mapped[canonical] = chosen
        for e in chosen:
            entry = Entry.parse(e)
            claims.setdefault(entry.name, []).append((canonical, entry))
    return claims


def _account_sources(ckpt: Checkpoint, recipe: Recipe, report: MappingReport, claims: dict) -> None:
    """Every source tensor not claimed: ignored, an FP8 scale, a tied head, or a problem."""
    model = report.model
    beyond: list[str] = []
    for source in sorted(ckpt.tensors):
        if source in claims:
            continue
        base = source[: -len(SCALE_SUFFIX)] if source.endswith(SCALE_SUFFIX) else None
        if base is not None and report.fp8 is not None and base in ckpt.tensors:
            report.consumed.append(source)
            continue
        if recipe.is_ignored(source):
            report.ignored.append(source)
            continue
        hits = recipe.match_source(source)
        if not hits:
            report.unmapped.append(source)
            continue
        canonical = hits[0]
        role, layer = spec.split_name(canonical)
        if canonical == "output.weight" and model["tie_word_embeddings"]:
            report.tied_duplicate = source
        elif layer is not None and layer >= model["num_layers"]:
            report.unexpected.append(f"source tensor {source} is for layer {layer}, but config.json has "
                                     f"num_hidden_layers = {model['num_layers']}")
        elif canonical not in report.mapped and canonical in spec.tensor_names(model):
            continue  # the tensor is reported missing (some of its other sources are)
        elif canonical in report.mapped and spec.ROLE[role].experts and recipe.expert_index(source) is not None:
            beyond.append(source)  # an expert the config does not count
        elif canonical in report.mapped or canonical not in spec.tensor_names(model):
            why = spec.ROLE[role].absent_because if canonical not in report.mapped else "another layout is in use"
            report.unexpected.append(f"source tensor {source} maps to {canonical}, which config.json rules out ({why})")
    if beyond:
        n = model["moe"]["num_experts"]
        report.unexpected.append(f"{len(beyond)} source tensor(s) are experts beyond the {n} that config.json gives "
                                 f"(moe.num_experts): {names_text(sorted(beyond, key=_natural), 4)}")


def _natural(name: str) -> list:
    """Sort key: numbers in names compare as numbers (experts.10 after experts.9)."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _check_claims(ckpt: Checkpoint, report: MappingReport, claims: dict) -> None:
    """A source tensor is read whole by one tensor, or by row slices that tile it exactly."""
    for source, uses in sorted(claims.items()):
        if len(uses) == 1 and uses[0][1].start is None:
            continue
        whole = [c for c, e in uses if e.start is None]
        if whole:
            others = sorted({c for c, _ in uses} - {whole[0]}) or [whole[0]]
            report.unexpected.append(f"source tensor {source} is claimed by two rules: {whole[0]} and {others[0]} "
                                     f"(slice it with rows = … to share it)")
            continue
        shape = ckpt.tensors[source].shape
        n = shape[1] if len(shape) == 3 else shape[0]
        spans = sorted((e.start, e.end, c) for c, e in uses)
        cursor = 0
        for a, b, c in spans:
            if a != cursor:
                what = f"rows [{cursor}, {a}) are read by no rule" if a > cursor else f"rows [{a}, {min(b, cursor)}) are " \
                                                                                    f"read twice (by {c})"
                report.unexpected.append(f"source tensor {source}: {what}")
                break
            cursor = b
        else:
            if cursor < n:  # (slices reaching past the end are reported by the shape check)
                report.unexpected.append(f"source tensor {source}: rows [{cursor}, {n}) are read by no rule "
                                         f"(it has {n})")


def _check_shape(ckpt: Checkpoint, model: dict, canonical: str, entries: list[Entry], report: MappingReport) -> None:
    role, _ = spec.split_name(canonical)
    want = spec.expected_shape(model, role)
    shapes = [list(ckpt.tensors[e.name].shape) for e in entries]
    got = stacked_shape(shapes, entries, len(want))
    if got != want and len(want) == 3 and len(entries) > 1 and len({tuple(s) for s in shapes}) > 1 and \
            all(len(s) == 2 and e.start is None for s, e in zip(shapes, entries)):
        # per-expert tensors that do not stack: name the odd ones out, not every expert's shape
        common = max(shapes, key=shapes.count)
        odd = [(e.name, s) for e, s in zip(entries, shapes) if s != common]
        report.shape_errors.append(
            f"experts of unequal shape in {canonical}: "
            + ", ".join(f"{n} is {s}" for n, s in odd[:3]) + (f", … ({len(odd)} in all)" if len(odd) > 3 else "")
            + f", the other {len(shapes) - len(odd)} are {common} (config.json implies {want}: {spec.dims_text(model, role)})")
        return
    if got != want and len(got) == 1 and isinstance(got[0], str):  # a slice outside its tensor
        report.shape_errors.append(f"tensor {canonical}: {got[0]}, but config.json implies {want} "
                                   f"({spec.dims_text(model, role)})")
        return
    if got != want:
        names = ", ".join(e.name + (f"[{e.start}:{e.end}]" if e.start is not None else "") for e in entries[:4])
        names += f", … ({len(entries)} entries)" if len(entries) > 4 else ""
        report.shape_errors.append(f"tensor {names} ({canonical}) has shape {got}, but config.json implies {want} "
                                   f"({spec.dims_text(model, role)})")


def stacked_shape(shapes: list[list[int]], entries: list[Entry], rank: int) -> list:
    """The shape the source entries make, concatenated as the spec says (rows of 2-D / 1-D entries
    along dim 0, stacked into [E, rows, cols] for an expert tensor; rows of dim 1 of 3-D entries,
    per expert); a single unsliced entry keeps its own shape (so a message shows it as is). A 1-D
    tensor reads unsliced 2-D entries row-major, flattened (addendum §2: Cohere's [heads, head_dim]
    q/k norm weights), as the row reader does."""
    if rank == 1 and all(e.start is None for e in entries) and {len(s) for s in shapes} <= {1, 2} and \
            any(len(s) == 2 for s in shapes):
        return [sum(math.prod(s) for s in shapes)]
    if len(entries) == 1 and entries[0].start is None:
        return shapes[0]
    for s, e in zip(shapes, entries):
        axis = 1 if len(s) == 3 else 0
        if e.start is not None and (len(s) == 0 or e.end > s[axis]):
            return [f"{e.name}[{e.start}:{e.end}] is outside its shape {s}"]
    ranks = {len(s) for s in shapes}
    if ranks == {3}:  # fused expert tensors, sliced along dim 1
        if len({s[0] for s in shapes}) != 1 or len({s[2] for s in shapes}) != 1:
            return shapes
        rows = sum((e.end - e.start) if e.start is not None else s[1] for s, e in zip(shapes, entries))
        return [shapes[0][0], rows, shapes[0][2]]
    if len(ranks) != 1 or len({tuple(s[1:]) for s in shapes}) != 1:
        return shapes
    rows = [(e.end - e.start) if e.start is not None else s[0] for s, e in zip(shapes, entries)]
    if rank == 3:  # per-expert tensors stacked: E entries of [rows, cols]
        return [len(shapes), rows[0], shapes[0][1]] if len(set(rows)) == 1 else shapes
    return [sum(rows), *shapes[0][1:]]


def _check_dtype(ckpt: Checkpoint, canonical: str, names: list[str], report: MappingReport) -> None:
    codes = {ckpt.tensors[n].dtype for n in names}
    if len(codes) > 1 or next(iter(codes)) not in dtypes.SOURCE_DTYPES:
        report.dtype_errors.append(f"tensor {', '.join(names[:4])} ({canonical}) has dtype {'/'.join(sorted(codes))}; "
                                   f"expected one float dtype ({', '.join(dtypes.SOURCE_DTYPES)})")
        return
    if codes != {"F8_E4M3"} or report.fp8 is None:
        return
    br, bc = report.fp8.block
    for n in names:
        shape, scale = ckpt.tensors[n].shape, ckpt.tensors.get(n + SCALE_SUFFIX)
        if len(shape) != 2:
            report.dtype_errors.append(f"tensor {n} ({canonical}): fp8 weights of {len(shape)} dimensions are not "
                                       f"supported (2-D [rows, cols] only)")
        elif scale is None:
            report.dtype_errors.append(f"tensor {n} ({canonical}) is fp8 but {n}{SCALE_SUFFIX} (its block scales) is "
                                       f"missing")
        elif list(scale.shape) != [math.ceil(shape[0] / br), math.ceil(shape[1] / bc)] or scale.dtype != "F32":
            report.dtype_errors.append(
                f"tensor {n}{SCALE_SUFFIX} is {scale.dtype} {list(scale.shape)}, expected F32 "
                f"[{math.ceil(shape[0] / br)}, {math.ceil(shape[1] / bc)}] (blocks of {br}×{bc} over {list(shape)})")


def tied_head_problem(ckpt: Checkpoint, report: MappingReport) -> str | None:
    """A tied model may still ship lm_head.weight; it must then equal the embeddings (reads both)."""
    head = report.tied_duplicate
    embd_sources = report.mapped.get("token_embd.weight")
    if not head or not embd_sources or len(embd_sources) != 1:
        return None
    a, b = ckpt.array(head), ckpt.array(embd_sources[0])
    same = a.shape == b.shape and a.dtype == b.dtype
    row = a.nbytes // max(a.shape[0], 1)
    for s in range(0, a.shape[0] if same else 0, 4096):  # in slices, releasing each: RSS stays flat
        same = bool((a[s:s + 4096].view("u1") == b[s:s + 4096].view("u1")).all())
        for name in (head, embd_sources[0]):
            ckpt.release(name, s * row, (s + 4096) * row)
        if not same:
            break
    if same:
        return None
    return (f"config.json ties the output head to the embeddings (tie_word_embeddings), but "
            f"{head} differs from {embd_sources[0]}")
