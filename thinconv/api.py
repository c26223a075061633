"""The Python API's conversion and torch entry points (`thinconv.convert`, `thinconv.to_torch`).

Library imports happen inside the functions: `import thinconv` stays light (the CLI's start-up).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    import torch

    from thinconv.convert import Progress
    from thinconv.format.reader import Archive
    from thinconv.summary import ConvertSummary

PathLike = Union[str, "os.PathLike[str]"]


def convert(source: PathLike, out: PathLike, *, dtype: str = "auto", page_size: Union[int, str] = "16MiB",
            keep: Union[Mapping[str, str], Iterable[str]] = (), rope_layout: str = "half",
            recipe: Optional[str] = None, revision: Optional[str] = None, token: Optional[str] = None,
            force: bool = False, strict: bool = False, probe: bool = True,
            allow_config_keys: Iterable[str] = (), recipes: Iterable[PathLike] = (),
            progress: Optional["Progress"] = None) -> "ConvertSummary":
    """Convert a checkpoint (a local folder, or a hub repo id via the HF cache) into a .thin
    archive at `out`, as `thinconv convert` does, and return the summary `convert --json` prints.

    `dtype`: auto | bf16 | f16 | f32 | q8_0 | q4_0 | q4_1; `keep`: role glob → dtype overrides
    ({"ffn_down*": "q8_0"} or ["ffn_down*=q8_0"]); `page_size`: bytes or "16MiB"; `recipe`: force
    a recipe (default: by config.json's architectures); `recipes`: extra recipe folders; `token`
    defaults to $HF_TOKEN. Raises a `thinconv.ThinError` subclass, with a one-line message, on bad
    input; an existing `out` is only replaced with `force=True`."""
    from thinconv.convert import convert as write_archive, open_plan
    from thinconv.format.writer import check_output
    from thinconv.plan import ConvertOptions, parse_keep, parse_page_size
    from thinconv.recipe import load_registry
    from thinconv.summary import conversion_summary

    if isinstance(keep, Mapping):
        keep = [f"{glob}={kept}" for glob, kept in keep.items()]
    elif isinstance(keep, str):
        keep = [keep]
    options = ConvertOptions(dtype=dtype, page_size=parse_page_size(page_size) if isinstance(page_size, str) else page_size,
                             rope_layout=rope_layout, keep=parse_keep(list(keep)), strict=strict, probe=probe,
                             allow_config_keys=tuple(allow_config_keys))
    out = Path(out)
    check_output(out, force)  # before any download
    t0 = time.perf_counter()
    with open_plan(source, options, recipe=recipe, revision=revision, token=token,
                   registry=load_registry([Path(r) for r in recipes])) as (ckpt, plan):
        result = write_archive(ckpt, plan, out, force=force, progress=progress)
    return conversion_summary(result, plan, time.perf_counter() - t0)


_TORCH_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def to_torch(archive: "Archive", name: str, dtype: Any = None) -> "torch.Tensor":
    """Tensor `name` of an open archive as a torch tensor, without copies or warnings.

    Float tensors (f32, f16, bf16) come in their stored dtype, sharing the archive's memory
    through a private copy-on-write mapping (writable; writes never reach the file). Block-
    quantized tensors are decoded to float32. `dtype` (torch.float32 / torch.bfloat16 /
    torch.float16, or their names) decodes or casts to that dtype instead (a new tensor)."""
    import numpy as np
    import torch

    info = archive.tensor_info(name)
    if dtype is None and info["dtype"] in ("f32", "f16", "bf16"):
        arr = archive.tensor(name, private=True)
    else:
        want = "float32" if dtype is None else str(dtype).removeprefix("torch.")
        if want not in _TORCH_NAMES:
            from thinconv.errors import UsageError

            raise UsageError(f"to_torch: dtype {dtype!r} is not one of torch.float32, torch.bfloat16, torch.float16")
        arr = archive.dequantize(name, dtype=want)
    if arr.dtype.name == "bfloat16":  # numpy has no bf16: torch reads the bits
        return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(arr)
