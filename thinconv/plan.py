"""Planning: from a checkpoint and a recipe (mapped by `thinconv.mapping`) to every tensor, dtype,
shape and page — before any tensor data is read."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from thinconv.checkpoint.source import Checkpoint, SourceFile
from thinconv.errors import ConversionError, UsageError, listed
from thinconv.format import dtypes, schema, spec
from thinconv.format.writer import split_bytes, split_rows
from thinconv.mapping import MappingReport, map_checkpoint
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
    allow_config_keys: tuple[str, ...] = ()  # config keys the user takes responsibility for (--allow-config-key)

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
            if not any(fnmatch.fnmatchcase(r, glob) for r in spec.MATRIX_ROLES if not spec.ROLE[r].f32):
                raise UsageError(f"--keep {glob}={dtype}: {glob!r} matches only 1-D roles, which are always f32 "
                                 f"(matrix roles: {', '.join(r for r in spec.MATRIX_ROLES if not spec.ROLE[r].f32)})")

    def record(self) -> dict:
        """validation.converter.options: every option that shapes the archive's bytes."""
        out = {"dtype": self.dtype, "page_size": self.page_size, "rope_layout": self.rope_layout,
               "keep": [[glob, dtype] for glob, dtype in self.keep], "strict": self.strict, "probe": self.probe}
        if self.allow_config_keys:  # only when used: archives without it keep their bytes
            out["allow_config_keys"] = sorted(self.allow_config_keys)
        return out


@dataclass
class TensorPlan:
    name: str
    role: str
    layer: int | None
    sources: list[str]  # source entries (NAME or NAME[a:b]), concatenated / stacked; [] for derived tensors
    shape: list[int]
    source_dtype: str  # THIN name of the source dtype (f32 for derived tensors)
    dtype: str
    pages: list[tuple[int, int]]
    row_bytes: int
    permute_rope: str | None = None  # "interleave" / "deinterleave" the rotary rows (source and archive layouts differ)
    transform: str | None = None
    note: str | None = None  # why a requested dtype was not applied
    fp8_block: tuple[int, int] | None = None  # block-scaled fp8 source: values are weight × scale, in f32

    @property
    def quant(self) -> dict | None:
        if not dtypes.is_block(self.dtype):
            return None
        # An f64 source reaches the quantizer rounded to f32 (as in any f64 → f32 conversion), a
        # block-scaled fp8 one as weight × scale in f32, and quant.source_dtype only names dtypes that
        # upcast exactly (dtypes.QUANT_SOURCE_DTYPES).
        exact = dtypes.get(self.source_dtype).exact_f32 and self.fp8_block is None
        source = self.source_dtype if exact else "f32"
        return {"scheme": self.dtype, "block_size": dtypes.BLOCK_SIZE, "block_bytes": dtypes.get(self.dtype).nbytes,
                "source_dtype": source}

    @property
    def lossy(self) -> str | None:
        """What the converter changed in this tensor's values, when not an exact copy or widening
        (block quantization is recorded on its own, in validation.quant)."""
        if dtypes.is_block(self.dtype) or not self.sources:
            return None
        if self.transform:
            return f"transform {self.transform}"
        if self.fp8_block is not None and self.dtype != "f32":
            return f"fp8 × block scale → {self.dtype}"
        return None if dtypes.exact_cast(self.source_dtype, self.dtype) else f"cast {self.source_dtype} → {self.dtype}"

    @property
    def hints(self) -> dict:
        if len(self.shape) == 1:
            return {"placement": "device", "access": "elementwise"}
        if self.role == "token_embd.weight":
            return {"placement": "host", "access": "gather"}
        return {"placement": "device", "access": "matmul"}

    @property
    def rows(self) -> int:
        """Rows of the [rows, cols] matrix its pages tile (an expert tensor [E, r, c] has E·r)."""
        return spec.rows_and_cols(self.shape)[0]

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass
class AssetPlan:
    file: SourceFile
    pages: list[tuple[int, int]]

    @property
    def media_type(self) -> str:
        return next((t for ext, t in ASSET_MEDIA_TYPES.items() if self.file.name.endswith(ext)), "application/octet-stream")


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


def plan_conversion(ckpt: Checkpoint, recipe: Recipe, options: ConvertOptions) -> Plan:
    """Every output tensor with its dtype and pages, or a ConversionError naming what does not fit.
    Reads no tensor data (nor does `--dry-run`): the tied-head comparison is left to `convert`."""
    report = map_checkpoint(ckpt, recipe, options.rope_layout, compare_tied_head=False,
                            allowed_keys=options.allow_config_keys)
    if report.problems:
        raise ConversionError(f"{ckpt.root}: " + listed(report.problems, 3, "; ", None))
    model = report.model
    tensors = []
    for name in spec.tensor_names(model):
        role, layer = spec.split_name(name)
        shape = spec.expected_shape(model, role)
        fp8 = None
        if role in spec.DERIVED_ROLES:
            source_dtype, sources = "f32", []
        else:
            sources = report.mapped[name]
            code = ckpt.tensors[sources[0].split("[", 1)[0]].dtype
            source_dtype = dtypes.SOURCE_DTYPES[code]
            fp8 = report.fp8.block if report.fp8 is not None and code == "F8_E4M3" else None
        dtype, note = _choose_dtype(recipe, options, model, role, shape, source_dtype)
        rb = dtypes.row_bytes(dtype, shape[-1] if len(shape) >= 2 else 1)
        transform = next((t for g, t in reversed(recipe.transforms) if fnmatch.fnmatchcase(role, g)), None)
        if transform:
            get_transform(transform, f"{recipe.path}: transforms")
        tensors.append(TensorPlan(name, role, layer, sources, shape, source_dtype, dtype, _pages(shape, rb, options),
                                  rb, permute_rope=_rope_permutation(recipe, options, role),
                                  transform=transform, note=note, fp8_block=fp8))
    assets = []
    for f in ckpt.asset_files():
        if f.size > spec.MAX_ASSET_SIZE:
            raise ConversionError(f"{f.path}: {f.size} bytes, beyond the {spec.MAX_ASSET_SIZE // 2**30} GiB an "
                                  f"embedded file may have (FORMAT.md §2.6)")
        assets.append(AssetPlan(f, split_bytes(f.size, options.page_size)))
    return Plan(recipe, model, options, tensors, assets, report)


def _rope_permutation(recipe: Recipe, options: ConvertOptions, role: str) -> str | None:
    """How a role's rows move when the archive's RoPE layout (--rope-layout) is not the source's own."""
    source = recipe.metadata.rope_source_layout
    if not spec.ROLE[role].rope_rows or options.rope_layout == source:
        return None
    return "interleave" if options.rope_layout == "interleaved" else "deinterleave"


def _pages(shape: list[int], row_bytes: int, options: ConvertOptions) -> list[tuple[int, int]]:
    """A tensor's pages as row ranges: one page for 1-D tensors; whole rows up to the page size for
    matrices; for an expert tensor [E, r, c] the same within each expert, so that no page holds rows
    of two experts (addendum §4)."""
    if len(shape) == 1:
        return [(0, shape[0])]
    if len(shape) == 2:
        return split_rows(shape[0], row_bytes, options.page_size)
    per_expert = split_rows(shape[1], row_bytes, options.page_size)
    return [(e * shape[1] + a, e * shape[1] + b) for e in range(shape[0]) for a, b in per_expert]


def _choose_dtype(recipe: Recipe, options: ConvertOptions, model: dict, role: str, shape: list[int],
                  source_dtype: str) -> tuple[str, str | None]:
    """The output dtype of one tensor, and a note when a requested block type could not apply."""
    if len(shape) == 1 or spec.ROLE[role].f32:
        return "f32", None  # norms, biases and the MoE routers stay f32
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
    if dtypes.is_block(dtype) and shape[-1] % dtypes.BLOCK_SIZE:
        return natural, f"{shape[-1]} cols is not a multiple of {dtypes.BLOCK_SIZE}: kept {natural} instead of {dtype}"
    return dtype, None
