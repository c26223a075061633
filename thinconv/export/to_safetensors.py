"""Export an archive back to a Hugging Face folder: config.json, generation_config.json and the
tokenizer files from the archive's assets, and the weights as safetensors under their *source*
names (the manifest's `source` entries).

* Fused source tensors come back whole: an entry NAME[a:b] is rows a..b of NAME (dim 1 of a 3-D
  tensor), so Phi-3's qkv_proj or a fused MoE gate_up_proj is re-assembled from the archive
  tensors holding its slices; per-expert sources ({E} in the recipe) are split back into one
  tensor per expert.
* RoPE rows are put back in the source's own layout (the recipe's rope_source_layout) when the
  archive's differs.
* dtype "auto" keeps every value exactly: float tensors as stored, block-quantized ones
  dequantized to f32, and the 1-D tensors (f32 in every archive) in the weights' dtype when that
  is exact (the MoE routers too). "bf16" / "f16" / "f32" cast everything (round to nearest even). config.json's
  dtype key follows the weights; an fp8 source's quantization_config is dropped (the weights
  written are dequantized).
* The safetensors files are written here, one tensor at a time in row chunks (the `safetensors`
  package's writer needs every tensor in memory at once): 8-byte header length, JSON header,
  data. Shards of at most `max_shard_size` bytes with model.safetensors.index.json when there is
  more than one, as save_pretrained names them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from thinconv.errors import ExportError
from thinconv.export.common import (ExportResult, Progress, TensorRows, archive_recipe, atomic_folder,
                                    check_untransformed, exact_in, no_progress, rope_order)
from thinconv.format import dtypes, spec
from thinconv.format.reader import Archive, open_archive
from thinconv.mapping import Entry
from thinconv.recipe import EXPERT, Recipe

EXPORT_DTYPES = ("auto", "bf16", "f16", "f32")
DEFAULT_MAX_SHARD_SIZE = 5 * 1000**3  # the Hub's usual 5 GB shards
TOKENIZER_ASSETS = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "chat_template.jinja")
_ST_CODE = {"f32": "F32", "f16": "F16", "bf16": "BF16"}
_TORCH_NAME = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


@dataclass
class Piece:
    """Rows [arch_row, arch_row + n) of archive tensor `tensor` (in the source's RoPE layout) are
    rows [row, row + n) of a source tensor (of expert `expert`'s matrix when it is 3-D)."""

    tensor: str
    arch_row: int
    row: int
    n: int
    expert: int | None = None


@dataclass
class SourceTensor:
    """One tensor of the exported checkpoint, and where its rows are in the archive."""

    name: str
    cols: int
    ndim: int  # 1, 2 or 3 (a fused expert tensor [E, rows, cols])
    experts: int = 0
    pieces: list[Piece] = field(default_factory=list)
    dtype: str = "f32"

    @property
    def rows(self) -> int:
        """Rows of the (per-expert) matrix: its slices tile it, so the largest end is its size."""
        return max(p.row + p.n for p in self.pieces)

    @property
    def shape(self) -> list[int]:
        if self.ndim == 1:
            return [self.rows]
        if self.ndim == 3:
            return [self.experts, self.rows, self.cols]
        return [self.rows, self.cols]

    @property
    def nbytes(self) -> int:
        n = dtypes.get(self.dtype).nbytes
        for d in self.shape:
            n *= d
        return n

    def ordered(self) -> list[Piece]:
        """Pieces in file order, checked to tile every (per-expert) matrix exactly once."""
        pieces = sorted(self.pieces, key=lambda p: (p.expert or 0, p.row))
        for e in range(max(self.experts, 1)):
            pos = 0
            for p in (q for q in pieces if (q.expert or 0) == e):
                if p.row != pos:
                    raise ExportError(f"source tensor {self.name}: rows [{min(pos, p.row)}, {max(pos, p.row)}) "
                                      f"{'are not in' if p.row > pos else 'appear twice in'} the archive")
                pos += p.n
        return pieces


def source_tensors(archive: Archive, recipe: Recipe) -> list[SourceTensor]:
    """Every source tensor the archive holds, in the order they first appear, with its pieces."""
    model = archive.model
    out: dict[str, SourceTensor] = {}

    def target(name: str, cols: int, ndim: int, experts: int = 0) -> SourceTensor:
        st = out.setdefault(name, SourceTensor(name, cols, ndim, experts))
        if (st.cols, st.ndim, st.experts) != (cols, ndim, experts):
            raise ExportError(f"source tensor {name}: the archive tensors holding it disagree on its shape")
        return st

    for t in archive.manifest["tensors"]:
        if not t["source"]:
            continue  # derived (rope_freqs)
        name, shape = t["name"], t["shape"]
        entries = [Entry.parse(s) for s in t["source"]]
        rows, cols = spec.rows_and_cols(shape)
        if len(shape) == 3:
            n_exp, r, c = shape
            if _stacked(recipe, model, t, entries):
                if len(entries) != n_exp or any(e.start is not None for e in entries):
                    raise ExportError(f"{t['name']}: {len(entries)} per-expert sources for {n_exp} experts")
                for k, e in enumerate(entries):
                    target(e.name, c, 2).pieces.append(Piece(name, k * r, 0, r))
                continue
            spans = _spans(t, entries, r)
            for expert in range(n_exp):
                off = expert * r
                for e, (a, b) in zip(entries, spans):
                    target(e.name, c, 3, n_exp).pieces.append(Piece(name, off, a, b - a, expert))
                    off += b - a
            continue
        off = 0
        for e, (a, b) in zip(entries, _spans(t, entries, rows)):
            target(e.name, cols, len(shape)).pieces.append(Piece(name, off, a, b - a))
            off += b - a
    return list(out.values())


def _spans(t: dict, entries: list[Entry], rows: int) -> list[tuple[int, int]]:
    """The source rows each entry contributes ([a, b)); a whole entry's size is what the slices
    leave (the archive does not record source shapes)."""
    whole = [e for e in entries if e.start is None]
    if len(whole) > 1:
        raise ExportError(f"{t['name']}: sources {', '.join(e.name for e in whole)} are concatenated whole; the "
                          f"archive does not record their sizes, so they cannot be split back")
    rest = rows - sum(e.end - e.start for e in entries if e.start is not None)
    spans = [(e.start, e.end) if e.start is not None else (0, rest) for e in entries]
    if rest < 0 or (not whole and rest):
        raise ExportError(f"{t['name']}: its source slices do not add up to its {rows} rows")
    return spans


def _stacked(recipe: Recipe, model: dict, t: dict, entries: list[Entry]) -> bool:
    """A 3-D archive tensor read from one 2-D source per expert ({E} in the recipe), rather than
    from 3-D (fused) source tensors."""
    rule = recipe.rule_for(t["name"])
    if rule is not None:
        layer = spec.split_name(t["name"])[1]
        for alt in rule.alternatives:
            try:
                names = alt.names(layer, model, recipe.path)
            except Exception:  # noqa: BLE001 - an alternative the model cannot evaluate did not match
                continue
            if names == t["source"]:
                return any(EXPERT in p for p in alt.patterns)
    return len(entries) == t["shape"][0] > 1 and all(e.start is None for e in entries)


def _choose_dtypes(archive: Archive, sts: list[SourceTensor], dtype: str) -> str:
    """Each source tensor's dtype; returns the weights' dtype (config.json's `dtype`)."""
    if dtype != "auto":
        for st in sts:
            st.dtype = dtype
        return dtype
    def f32_by_format(t: dict) -> bool:  # norms, biases and the MoE routers are always f32 in an archive
        return len(t["shape"]) == 1 or spec.ROLE[spec.split_name(t["name"])[0]].f32

    counts: dict[str, int] = {}
    for t in archive.manifest["tensors"]:
        if not f32_by_format(t) and t["dtype"] in dtypes.FLOAT_DTYPES:
            counts[t["dtype"]] = counts.get(t["dtype"], 0) + 1
    weights = max(sorted(counts), key=counts.get) if counts else "f32"
    natural: dict[str, str] = {}
    for t in archive.manifest["tensors"]:
        if dtypes.is_block(t["dtype"]):
            natural[t["name"]] = "f32"  # dequantized values are exact in f32 only
        elif f32_by_format(t) and t["source"] and weights != "f32":
            # A bf16 checkpoint's norms (stored in f32 by the format) come back in bf16.
            natural[t["name"]] = weights if exact_in(archive.tensor(t["name"]), weights) else "f32"
        else:
            natural[t["name"]] = t["dtype"]
    for st in sts:
        kinds = {natural[p.tensor] for p in st.pieces}
        st.dtype = kinds.pop() if len(kinds) == 1 else "f32"
    return weights


def _shards(sts: list[SourceTensor], max_shard_size: int) -> list[list[SourceTensor]]:
    shards: list[list[SourceTensor]] = [[]]
    size = 0
    for st in sts:
        if shards[-1] and size + st.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(st)
        size += st.nbytes
    return shards


def _header(shard: list[SourceTensor]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for st in shard:
        header[st.name] = {"dtype": _ST_CODE[st.dtype], "shape": st.shape, "data_offsets": [off, off + st.nbytes]}
        off += st.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it


def _write_tensor(f, archive: Archive, st: SourceTensor, orders: dict[str, np.ndarray | None],
                  progress: Progress) -> None:
    for p in st.ordered():
        rows = TensorRows(archive, p.tensor, orders[p.tensor])
        step = rows.chunk_rows
        for a in range(p.arch_row, p.arch_row + p.n, step):
            b = min(a + step, p.arch_row + p.n)
            chunk = np.ascontiguousarray(rows.floats(a, b, st.dtype))
            f.write(chunk.reshape(-1).view(np.uint8))
            progress.advance(chunk.nbytes)
        rows.release()


def _config(archive: Archive, weights: str) -> bytes:
    """config.json as the source had it, but for the dtype the weights now have and an fp8
    source's quantization_config (the weights written are dequantized)."""
    raw = archive.asset_bytes("config.json")
    try:
        config = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ExportError(f"{archive.path.name}: asset config.json is not valid JSON ({e})") from None
    changed = False
    for key in ("dtype", "torch_dtype"):
        if key in config and config[key] != _TORCH_NAME[weights]:
            config[key] = _TORCH_NAME[weights]
            changed = True
    if "quantization_config" in config:
        del config["quantization_config"]
        changed = True
    return (json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8") if changed else raw


def _generation_config(archive: Archive) -> bytes:
    """The source's generation_config.json, or one with the model's special tokens."""
    if any(a["name"] == "generation_config.json" for a in archive.manifest["assets"]):
        return archive.asset_bytes("generation_config.json")
    st = archive.model["special_tokens"]
    eos = st["eos"][0] if len(st["eos"]) == 1 else st["eos"]
    gen = {k: v for k, v in (("bos_token_id", st["bos"]), ("eos_token_id", eos or None), ("pad_token_id", st["pad"]))
           if v is not None}
    return (json.dumps(gen, indent=2, sort_keys=True) + "\n").encode("utf-8")


def export_safetensors(archive: Archive | str | os.PathLike, dest: str | os.PathLike, *, dtype: str = "auto",
                       force: bool = False, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
                       recipes: tuple[str | os.PathLike, ...] = (), progress: Progress | None = None,
                       recipe: Recipe | None = None) -> ExportResult:
    """Write `archive` as a Hugging Face checkpoint folder at `dest` (see the module docstring).
    `dest` must be absent or empty unless `force`; it is filled through a temp folder and renamed.
    `recipe`, when given, is the archive's recipe already loaded (else found by name in `recipes`)."""
    if not isinstance(archive, Archive):
        with open_archive(archive) as a:
            return export_safetensors(a, dest, dtype=dtype, force=force, max_shard_size=max_shard_size,
                                      recipes=recipes, progress=progress, recipe=recipe)
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"--dtype {dtype!r}: expected one of {', '.join(EXPORT_DTYPES)}")
    if max_shard_size < 1:
        raise ExportError(f"--max-shard-size {max_shard_size}: expected a positive size")
    progress = progress or no_progress()
    dest = Path(dest)
    recipe = recipe if recipe is not None else archive_recipe(archive, recipes)
    check_untransformed(archive, recipe)
    source_layout = recipe.metadata.rope_source_layout
    sts = source_tensors(archive, recipe)
    for st in sts:
        st.ordered()  # every source tensor tiles: fail before writing
    weights = _choose_dtypes(archive, sts, dtype)
    orders = {t["name"]: rope_order(archive, t["name"], source_layout) for t in archive.manifest["tensors"]}
    shards = _shards(sts, max_shard_size)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    result = ExportResult(dest, "safetensors", tensors=len(sts), dtype=weights)
    progress.start("exporting", sum(st.nbytes for st in sts))
    with atomic_folder(dest, force) as tmp:
        files: dict[str, bytes] = {"config.json": _config(archive, weights),
                                   "generation_config.json": _generation_config(archive)}
        for asset in archive.manifest["assets"]:
            if asset["name"] in TOKENIZER_ASSETS:
                files[asset["name"]] = archive.asset_bytes(asset["name"])
        for fname, data in files.items():
            (tmp / fname).write_bytes(data)
        for fname, shard in zip(names, shards):
            with open(tmp / fname, "wb", buffering=1024 * 1024) as f:
                header = _header(shard)
                f.write(len(header).to_bytes(8, "little"))
                f.write(header)
                for st in shard:
                    _write_tensor(f, archive, st, orders, progress)
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(st.nbytes for st in sts)},
                     "weight_map": {st.name: fname for fname, shard in zip(names, shards) for st in shard}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n",
                                                              encoding="utf-8")
        result.files = sorted(p.name for p in tmp.iterdir())
        result.size = sum((tmp / n).stat().st_size for n in result.files)
    return result
