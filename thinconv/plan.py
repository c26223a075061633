"""Planning: from a checkpoint and a recipe to every tensor, dtype, shape and page — before any
tensor data is read. `map_checkpoint` is also what `thinconv recipe check` reports."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from thinconv.checkpoint.source import Checkpoint, SourceFile
from thinconv.errors import ConversionError, UsageError
from thinconv.format import dtypes, schema, spec
from thinconv.format.writer import split_bytes, split_rows
from thinconv.modelmeta import read_model_metadata
from thinconv.recipe import Recipe
from thinconv.transforms import get_transform

DEFAULT_PAGE_SIZE = 16 * 1024 * 1024
OUTPUT_DTYPES = dtypes.OUTPUT_CHOICES
ROPE_LAYOUTS = schema.BY_PATH["rope.layout"].choices
ASSET_MEDIA_TYPES = {".json": "application/json", ".model": "application/octet-stream", ".jinja": "text/plain"}


def parse_page_size(text: str) -> int:
    """'16MiB', '16M', '4096' → bytes (the --page-size syntax, shared by the CLI and batch jobs)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise UsageError(f"--page-size {text!r}: expected a byte count like 16MiB, 4M or 65536")
    return int(m.group(1)) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[m.group(2).upper()]


def parse_keep(values: list[str]) -> tuple[tuple[str, str], ...]:
    """["ROLE_GLOB=DTYPE", …] → ((glob, dtype), …) (the --keep syntax; ConvertOptions checks the values)."""
    out = []
    for v in values:
        glob, sep, dtype = v.partition("=")
        if not sep or not glob.strip() or not dtype.strip():
            raise UsageError(f"--keep {v!r}: expected ROLE_GLOB=DTYPE, e.g. 'ffn_down*=q8_0' "
                             f"(DTYPE: {', '.join(OUTPUT_DTYPES[1:])})")
        out.append((glob.strip(), dtype.strip()))
    return tuple(out)


@dataclass(frozen=True)
class ConvertOptions:
    dtype: str = "auto"
    page_size: int = DEFAULT_PAGE_SIZE
    rope_layout: str = "half"
    keep: tuple[tuple[str, str], ...] = ()  # (role glob, dtype), later wins
    strict: bool = False
    probe: bool = True  # store validation.probe (reference logits computed from the source)

    def __post_init__(self) -> None:
        if self.dtype not in OUTPUT_DTYPES:
            raise UsageError(f"--dtype {self.dtype!r} is not one of {', '.join(OUTPUT_DTYPES)}")
        if self.rope_layout not in ROPE_LAYOUTS:
            raise UsageError(f"--rope-layout {self.rope_layout!r} is not one of {', '.join(ROPE_LAYOUTS)}")
        if self.page_size < spec.ALIGNMENT:
            raise UsageError(f"--page-size {self.page_size} is below the minimum of {spec.ALIGNMENT} bytes")
        for glob, dtype in self.keep:
            if dtype not in OUTPUT_DTYPES[1:]:
                raise UsageError(f"--keep {glob}={dtype}: dtype must be one of {', '.join(OUTPUT_DTYPES[1:])}")
            if not any(fnmatch.fnmatchcase(r, glob) for r in spec.ROLES):
                raise UsageError(f"--keep {glob}={dtype}: {glob!r} matches no role ({', '.join(spec.ROLES)})")
            if not any(fnmatch.fnmatchcase(r, glob) for r in spec.MATRIX_ROLES):
                raise UsageError(f"--keep {glob}={dtype}: {glob!r} matches only 1-D roles, which are always f32 "
                                 f"(matrix roles: {', '.join(spec.MATRIX_ROLES)})")

    def record(self) -> dict:
        """validation.converter.options: every option that shapes the archive's bytes."""
        return {"dtype": self.dtype, "page_size": self.page_size, "rope_layout": self.rope_layout,
                "keep": [[glob, dtype] for glob, dtype in self.keep], "strict": self.strict, "probe": self.probe}


@dataclass
class TensorPlan:
    name: str
    role: str
    layer: int | None
    sources: list[str]  # concatenated along dim 0; [] for rope_freqs
    shape: list[int]
    source_dtype: str  # THIN name of the source dtype (f32 for derived tensors)
    dtype: str
    pages: list[tuple[int, int]]
    row_bytes: int
    permute_rope: bool = False
    transform: str | None = None
    note: str | None = None  # why a requested dtype was not applied

    @property
    def quant(self) -> dict | None:
        if not dtypes.is_block(self.dtype):
            return None
        # An f64 source reaches the quantizer rounded to f32 (as in any f64 → f32 conversion), and
        # quant.source_dtype only names dtypes that upcast exactly (dtypes.QUANT_SOURCE_DTYPES).
        source = self.source_dtype if dtypes.get(self.source_dtype).exact_f32 else "f32"
        return {"scheme": self.dtype, "block_size": dtypes.BLOCK_SIZE, "block_bytes": dtypes.get(self.dtype).nbytes,
                "source_dtype": source}

    @property
    def hints(self) -> dict:
        if len(self.shape) == 1:
            return {"placement": "device", "access": "elementwise"}
        if self.role == "token_embd.weight":
            return {"placement": "host", "access": "gather"}
        return {"placement": "device", "access": "matmul"}

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes


@dataclass
class AssetPlan:
    file: SourceFile
    pages: list[tuple[int, int]]

    @property
    def media_type(self) -> str:
        return next((t for ext, t in ASSET_MEDIA_TYPES.items() if self.file.name.endswith(ext)), "application/octet-stream")


@dataclass
class MappingReport:
    """How a checkpoint's tensors meet a recipe; `problems` empty means it converts."""

    model: dict
    mapped: dict[str, list[str]] = field(default_factory=dict)  # canonical → source names
    ignored: list[str] = field(default_factory=list)
    tied_duplicate: str | None = None  # a source head identical to the embeddings, skipped
    unmapped: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    shape_errors: list[str] = field(default_factory=list)
    dtype_errors: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        out = []
        if self.unmapped:
            out.append(f"{len(self.unmapped)} source tensor(s) not mapped by the recipe nor ignored: "
                       f"{_names(self.unmapped)}")
        if self.missing:
            out.append(f"{len(self.missing)} required tensor(s) missing from the checkpoint: {_names(self.missing)}")
        return out + self.unexpected + self.shape_errors + self.dtype_errors


def _names(names: list[str], limit: int = 12) -> str:
    return ", ".join(names[:limit]) + (f", … ({len(names) - limit} more)" if len(names) > limit else "")


@dataclass
class Plan:
    recipe: Recipe
    model: dict
    options: ConvertOptions
    tensors: list[TensorPlan]
    assets: list[AssetPlan]
    mapping: MappingReport

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors) + sum(a.file.size for a in self.assets)

    @property
    def page_count(self) -> int:
        return sum(len(t.pages) for t in self.tensors) + sum(len(a.pages) for a in self.assets)

    def describe(self) -> dict:
        """The plan as JSON-ready data (`--dry-run --json`)."""
        return {
            "recipe": self.recipe.name,
            "model": self.model,
            "options": {"dtype": self.options.dtype, "page_size": self.options.page_size,
                        "rope_layout": self.options.rope_layout, "keep": [f"{g}={d}" for g, d in self.options.keep]},
            "tensors": [{"name": t.name, "role": t.role, "source": t.sources, "shape": t.shape,
                         "source_dtype": t.source_dtype, "dtype": t.dtype, "bytes": t.nbytes, "pages": len(t.pages),
                         **({"note": t.note} if t.note else {})} for t in self.tensors],
            "assets": [{"name": a.file.name, "size": a.file.size, "pages": len(a.pages)} for a in self.assets],
            "ignored": self.mapping.ignored + ([self.mapping.tied_duplicate] if self.mapping.tied_duplicate else []),
            "page_count": self.page_count,
            "bytes": self.total_bytes,
        }


def map_checkpoint(ckpt: Checkpoint, recipe: Recipe, rope_layout: str = "half", *,
                   compare_tied_head: bool = True) -> MappingReport:
    """Map every source tensor through the recipe and check names, flags, shapes and dtypes.

    `compare_tied_head` also compares a head shipped by a tied model with the embeddings, which
    reads both tensors; planning leaves that to `convert` (see `tied_head_problem`)."""
    model = read_model_metadata(ckpt.config, ckpt.generation_config, architecture=recipe.name,
                                rules=recipe.metadata, rope_layout=rope_layout)
    report = MappingReport(model)
    wanted = set(spec.tensor_names(model)) - {"rope_freqs"}
    found: dict[str, list[str]] = {}  # canonical → the source tensors that map onto it
    for source in sorted(ckpt.tensors):
        canonical = recipe.match_source(source)
        if canonical is None:
            (report.ignored if recipe.is_ignored(source) else report.unmapped).append(source)
            continue
        found.setdefault(canonical, []).append(source)
    for canonical, hits in found.items():
        role, layer = spec.split_name(canonical)
        expected = recipe.sources_for(canonical) or []
        sources = [s for s in expected if s in hits]  # in the recipe's order: concatenated in that order
        if canonical in wanted:
            if len(sources) == len(expected):
                report.mapped[canonical] = sources
            continue
        if canonical == "output.weight" and model["tie_word_embeddings"]:
            report.tied_duplicate = (sources or hits)[0]
            continue
        if layer is not None and layer >= model["num_layers"]:
            why = f"is for layer {layer}, but config.json has num_hidden_layers = {model['num_layers']}"
        else:
            why = f"maps to {canonical}, which config.json rules out ({spec.ROLE[role].absent_because})"
        report.unexpected.extend(f"source tensor {s} {why}" for s in hits)
    for canonical in spec.tensor_names(model):
        if canonical == "rope_freqs" or canonical in report.mapped:
            continue
        expected = recipe.sources_for(canonical)
        lacking = [s for s in (expected or []) if s not in found.get(canonical, [])]
        report.missing.append(f"{canonical} (from {', '.join(lacking)})" if lacking else
                              f"{canonical} (the recipe has no rule for role {spec.split_name(canonical)[0]})")
    for canonical, sources in report.mapped.items():
        _check_shape_and_dtype(ckpt, model, canonical, sources, report)
    if compare_tied_head:
        problem = tied_head_problem(ckpt, report)
        if problem:
            report.unexpected.append(problem)
    return report


def _check_shape_and_dtype(ckpt: Checkpoint, model: dict, canonical: str, sources: list[str], report: MappingReport) -> None:
    role, _ = spec.split_name(canonical)
    want = spec.expected_shape(model, role)
    entries = [ckpt.tensors[s] for s in sources]
    shapes = [list(e.shape) for e in entries]
    if any(len(s) != len(want) or s[1:] != want[1:] for s in shapes):
        got = shapes[0] if len(shapes) == 1 else shapes
    else:
        got = [sum(s[0] for s in shapes), *want[1:]]
    if got != want:
        why = spec.dims_text(model, role)
        report.shape_errors.append(f"tensor {', '.join(sources)} ({canonical}) has shape {got}, but config.json "
                                   f"implies {want} ({why})")
    codes = {e.dtype for e in entries}
    if len(codes) > 1 or next(iter(codes)) not in dtypes.SOURCE_DTYPES:
        report.dtype_errors.append(f"tensor {', '.join(sources)} ({canonical}) has dtype {'/'.join(sorted(codes))}; "
                                   f"expected one float dtype ({', '.join(dtypes.SOURCE_DTYPES)})")


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


def plan_conversion(ckpt: Checkpoint, recipe: Recipe, options: ConvertOptions) -> Plan:
    """Every output tensor with its dtype and pages, or a ConversionError naming what does not fit.
    Reads no tensor data (nor does `--dry-run`): the tied-head comparison is left to `convert`."""
    report = map_checkpoint(ckpt, recipe, options.rope_layout, compare_tied_head=False)
    if report.problems:
        raise ConversionError(f"{ckpt.root}: " + "; ".join(report.problems))
    model = report.model
    tensors = []
    for name in spec.tensor_names(model):
        role, layer = spec.split_name(name)
        shape = spec.expected_shape(model, role)
        if name == "rope_freqs":
            source_dtype, sources = "f32", []
        else:
            sources = report.mapped[name]
            source_dtype = dtypes.SOURCE_DTYPES[ckpt.tensors[sources[0]].dtype]
        dtype, note = _choose_dtype(recipe, options, model, role, shape, source_dtype)
        cols = shape[1] if len(shape) == 2 else 1
        rb = dtypes.row_bytes(dtype, cols)
        pages = [(0, shape[0])] if len(shape) == 1 else split_rows(shape[0], rb, options.page_size)
        transform = next((t for g, t in reversed(recipe.transforms) if fnmatch.fnmatchcase(role, g)), None)
        if transform:
            get_transform(transform, f"{recipe.path}: transforms")
        tensors.append(TensorPlan(name, role, layer, sources, shape, source_dtype, dtype, pages, rb,
                                  permute_rope=options.rope_layout == "interleaved" and spec.ROLE[role].rope_rows,
                                  transform=transform, note=note))
    assets = [AssetPlan(f, split_bytes(f.size, options.page_size)) for f in ckpt.asset_files()]
    return Plan(recipe, model, options, tensors, assets, report)


def _choose_dtype(recipe: Recipe, options: ConvertOptions, model: dict, role: str, shape: list[int],
                  source_dtype: str) -> tuple[str, str | None]:
    """The output dtype of one tensor, and a note when a requested block type could not apply."""
    if len(shape) == 1:
        return "f32", None
    natural = source_dtype if source_dtype in dtypes.FLOAT_DTYPES else ("f32" if source_dtype == "f64" else "bf16")
    dtype = options.dtype if options.dtype != "auto" else natural
    if dtypes.is_block(dtype):
        head = "output.weight" if not model["tie_word_embeddings"] else "token_embd.weight"
        if not recipe.is_quantizable(role):
            dtype = natural
        elif role == head and dtype in ("q4_0", "q4_1"):
            dtype = "q8_0"  # the output head is the most sensitive tensor
    # A recipe's block-type default (e.g. ffn_down = q8_0) refines a quantized conversion; it must
    # not quantize one the user asked for in floats. The user's own --keep always applies.
    recipe_keep = [(g, k) for g, k in recipe.keep if dtypes.is_block(options.dtype) or not dtypes.is_block(k)]
    for glob, kept in (*recipe_keep, *options.keep):
        if fnmatch.fnmatchcase(role, glob):
            dtype = kept
    if dtypes.is_block(dtype) and shape[1] % dtypes.BLOCK_SIZE:
        return natural, f"{shape[1]} cols is not a multiple of {dtypes.BLOCK_SIZE}: kept {natural} instead of {dtype}"
    return dtype, None
