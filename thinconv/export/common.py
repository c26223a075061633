"""What both exporters share: the archive's recipe and RoPE layouts, rows of an archive tensor in
a chosen layout and dtype, and atomic outputs (a temp file or folder beside the target, renamed
into place; nothing is left behind on failure)."""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np

from thinconv.errors import ExportError, RecipeError
from thinconv.format import dtypes, spec
from thinconv.format.reader import Archive
from thinconv.format.temps import TempOutput
from thinconv.recipe import Recipe, load_registry

CHUNK_VALUES = 1 << 20  # values decoded at a time: memory stays flat whatever the tensor size


class Progress(Protocol):
    """What the exporters report to (the CLI's progress bar): a phase with a byte total, then bytes."""

    def start(self, phase: str, total: int) -> None: ...

    def advance(self, n: int) -> None: ...


class _NoProgress:
    def start(self, phase: str, total: int) -> None:
        pass

    def advance(self, n: int) -> None:
        pass


def no_progress() -> Progress:
    return _NoProgress()


@dataclass
class ExportResult:
    """What an export wrote: the output (a folder or a file), its files and sizes."""

    path: Path
    format: str  # "safetensors" | "gguf"
    files: list[str] = field(default_factory=list)  # names inside `path` (safetensors) or [path.name]
    size: int = 0  # bytes written, all files
    tensors: int = 0
    dtype: str = ""  # safetensors: the weights' dtype; gguf: the file type (e.g. MOSTLY_Q8_0)
    warnings: list[str] = field(default_factory=list)


def archive_recipe(archive: Archive, recipes: tuple[str | os.PathLike, ...] = ()) -> Recipe:
    """The recipe the archive was converted with (validation.converter.recipe), for the source's own
    RoPE layout and tensor rules; a user recipe is found through --recipes or $THINCONV_RECIPES."""
    name = (archive.manifest["validation"].get("converter") or {}).get("recipe")
    if not isinstance(name, str):
        raise ExportError(f"{archive.path.name}: validation.converter.recipe is missing: the source's tensor names "
                          f"and RoPE layout are unknown")
    try:
        return load_registry(recipes).get(name)
    except RecipeError as e:
        raise ExportError(f"{archive.path.name}: converted with recipe {name!r}, which is not available here ({e}); "
                          f"pass its folder with --recipes") from None


def check_untransformed(archive: Archive, recipe: Recipe) -> None:
    """A recipe transform changed some tensor's values at conversion: they cannot be given back."""
    import fnmatch

    for t in archive.manifest["tensors"]:
        role = spec.split_name(t["name"])[0]
        for glob, name in recipe.transforms:
            if fnmatch.fnmatchcase(role, glob):
                raise ExportError(f"{archive.path.name}: tensor {t['name']} was changed by transform {name!r} of "
                                  f"recipe {recipe.name!r} at conversion; its source values cannot be given back")


def rope_order(archive: Archive, name: str, want_layout: str) -> np.ndarray | None:
    """Archive rows in `want_layout` ("half" | "interleaved"): output row i is archive row order[i]
    (None: already in that layout, or the tensor's rows do not rotate)."""
    role, _ = spec.split_name(name)
    layout = archive.model["rope"]["layout"]
    if not spec.ROLE[role].rope_rows or layout == want_layout:
        return None
    from thinconv.rows import rope_row_permutation  # interleaved row i = half row perm[i] (spec §2.1)

    rows = spec.rows_and_cols(archive.tensor_info(name)["shape"])[0]
    perm = rope_row_permutation(rows, archive.model["head_dim"], archive.model["rope"]["rotary_dim"])
    return perm if want_layout == "interleaved" else np.argsort(perm)


class TensorRows:
    """Rows of one archive tensor's [rows, cols] matrix, reordered by `order` (see `rope_order`):
    as stored (uint8 [n, row_bytes]) or decoded to a float dtype ([n, cols])."""

    def __init__(self, archive: Archive, name: str, order: np.ndarray | None = None):
        self.archive, self.name, self.order = archive, name, order
        self.info = archive.tensor_info(name)
        self.dtype = self.info["dtype"]
        self.rows, self.cols = spec.rows_and_cols(self.info["shape"])

    @property
    def chunk_rows(self) -> int:
        return max(1, CHUNK_VALUES // self.cols)

    def stored(self, a: int, b: int) -> np.ndarray:
        raw = self.archive.tensor_bytes(self.name)
        return raw[a:b] if self.order is None else raw[self.order[a:b]]

    def floats(self, a: int, b: int, dtype: str) -> np.ndarray:
        """Rows [a, b) as `dtype` (f32 / f16 / bf16): the stored values when the dtypes agree, else
        decoded to f32 (exact) and rounded to nearest even."""
        raw = self.stored(a, b)
        if dtypes.is_block(self.dtype):
            from thinconv.format.blocks import dequantize_rows

            values = dequantize_rows(raw, self.dtype, self.cols)
        else:
            values = raw.view(dtypes.numpy_dtype(self.dtype)).reshape(b - a, self.cols)
            if self.dtype == dtype:
                return values
        return cast(values, dtype)

    def release(self) -> None:
        self.archive.release(self.name)


def cast(values: np.ndarray, dtype: str) -> np.ndarray:
    """Float values as `dtype`, rounded to nearest even (bf16 as ml_dtypes and ggml round it)."""
    from thinconv.casts import BF16, f32_to_bf16

    f32 = values.astype(np.float32, copy=False)
    if dtype == "f32":
        return f32
    if dtype == "f16":
        with np.errstate(over="ignore"):
            return f32.astype(np.float16)
    out = np.empty(f32.shape, BF16)
    f32_to_bf16(np.ascontiguousarray(f32), out)
    return out


def exact_in(values: np.ndarray, dtype: str) -> bool:
    """Every value survives a round trip through `dtype` unchanged (NaN included)."""
    f32 = values.astype(np.float32, copy=False)
    back = cast(f32, dtype).astype(np.float32)
    return bool(np.array_equal(back.view(np.uint32), f32.view(np.uint32)))


# ---------------------------------------------------------------- atomic outputs

def check_free(out: Path, force: bool, *, folder: bool) -> None:
    """Fail before any work when `out` may not be written: an existing file (or non-empty folder)
    without `force`, a file where a folder is wanted (or the reverse), or a missing parent folder."""
    parent = out.parent
    if not parent.is_dir():
        raise ExportError(f"{parent}: no such folder (create it first)")
    if not out.exists() and not out.is_symlink():
        return
    if folder:
        if not out.is_dir():
            raise ExportError(f"{out} exists and is not a folder")
        if any(out.iterdir()) and not force:
            raise ExportError(f"{out} is not empty (use --force to replace it)")
    else:
        if out.is_dir():
            raise ExportError(f"{out} is a folder (give the .gguf file to write)")
        if not force:
            raise ExportError(f"{out} already exists (use --force to overwrite)")


def _fail_write(out: Path, e: OSError) -> ExportError:
    what = "disk full" if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else (e.strerror or str(e))
    return ExportError(f"writing {out} failed ({what}); nothing was left behind")


def fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_folder(dest: Path, force: bool) -> Iterator[Path]:
    """Yield a temp folder beside `dest` to fill; on success it replaces `dest` (absent or empty,
    or anything with `force`) in one rename. On failure nothing is left behind and a previous
    `dest` is untouched."""
    check_free(dest, force, folder=True)
    parent = dest.parent
    temp, aside = TempOutput(dest), TempOutput(dest, ".old")  # named before they exist: see TempOutput
    old = None
    try:
        try:
            tmp = temp.create_folder()
        except OSError as e:
            raise ExportError(f"cannot write in {parent}: {e.strerror or e}") from None
        yield tmp
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(tmp)
        os.chmod(tmp, 0o755)
        if dest.exists():
            # Move the old folder aside first: until the new one is in place, nothing is lost.
            old = aside.create_folder()
            os.replace(dest, old / "d")
        os.replace(tmp, dest)
        fsync_dir(parent)
    except BaseException as e:
        temp.remove()
        if old is not None and (old / "d").exists() and not dest.exists():
            os.replace(old / "d", dest)  # put the previous folder back
        aside.remove()
        if isinstance(e, OSError):
            raise _fail_write(dest, e) from None
        raise
    aside.remove()


@contextlib.contextmanager
def atomic_file(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temp file path beside `out` to write (and fsync); on success it is renamed to `out`
    (which must not exist unless `force`). On failure nothing is left behind."""
    check_free(out, force, folder=False)
    parent = out.parent
    temp, lock = TempOutput(out), None
    try:
        try:
            lock = temp.create()  # held (flock) until the end: not a stale temp to any cleaner
        except OSError as e:
            raise ExportError(f"cannot write in {parent}: {e.strerror or e}") from None
        tmp = temp.path
        yield tmp
        os.chmod(tmp, 0o644)
        if force:
            os.replace(tmp, out)
        else:
            try:
                os.link(tmp, out)  # fails if `out` appeared meanwhile: never clobber without force
            except FileExistsError:
                raise ExportError(f"{out} already exists (use --force to overwrite)") from None
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                    raise
                os.replace(tmp, out)  # a filesystem without hard links
            tmp.unlink(missing_ok=True)
        fsync_dir(parent)
    except BaseException as e:
        temp.remove()
        if isinstance(e, OSError):
            raise _fail_write(out, e) from None
        raise
    finally:
        if lock is not None:
            os.close(lock)
