"""thinconv: convert Hugging Face checkpoints into .thin archives for single-token decode runtimes.

The Python API (README, "Python API")::

    import thinconv
    summary = thinconv.convert("examples/tiny-llama", "tiny.thin", dtype="q8_0", force=True)
    with thinconv.open("tiny.thin") as a:
        a.model, a.tensor_names, a.tensor(name), a.dequantize(name, dtype="bfloat16"),
        a.tensor_pages(name), a.asset_names, a.asset_bytes("config.json"), a.verify()
        thinconv.to_torch(a, name)

`thinconv.convert` is also the name of the conversion module (thinconv/convert.py): the module
object is callable, and calling it runs :func:`thinconv.api.convert`.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from thinconv.api import convert as _convert, to_torch
from thinconv.errors import (
    CheckpointError, ConversionError, PackError, RecipeError, ThinError, ThinFormatError, UsageError,
)

if TYPE_CHECKING:
    from thinconv.format import Archive, VerifyReport, open_archive, pack, validate_manifest
    from thinconv.format.reader import TensorPage
    from thinconv.summary import ConvertSummary, KeptWider, QuantSummary

    open = open_archive  # noqa: A001

__version__ = "0.1.0"

# Imported on first use, so that `import thinconv` (the console script's first step, before its
# signal handlers are in place) costs a millisecond, not the format core's ~150 ms.
_LAZY = {"Archive": "thinconv.format", "VerifyReport": "thinconv.format", "open_archive": "thinconv.format",
         "pack": "thinconv.format", "validate_manifest": "thinconv.format", "TensorPage": "thinconv.format.reader",
         "ConvertSummary": "thinconv.summary", "KeptWider": "thinconv.summary", "QuantSummary": "thinconv.summary"}

__all__ = [
    "Archive", "CheckpointError", "ConversionError", "ConvertSummary", "KeptWider", "PackError", "QuantSummary",
    "RecipeError", "TensorPage", "ThinError", "ThinFormatError", "UsageError", "VerifyReport", "convert", "open",
    "open_archive", "pack", "to_torch", "validate_manifest", "__version__",
]


class _ConvertModule(types.ModuleType):
    """thinconv.convert: the conversion module, callable as the API's `thinconv.convert(source, out, …)`."""

    def __call__(self, source: Any, out: Any, **options: Any) -> ConvertSummary:
        return _convert(source, out, **options)

    __call__.__doc__ = _convert.__doc__


class _Package(types.ModuleType):
    """The `thinconv` package: when the import system binds the submodule `thinconv.convert` here,
    it becomes callable (so `thinconv.convert(...)` works however and whenever it was imported)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "convert" and type(value) is types.ModuleType:
            import inspect

            value.__class__ = _ConvertModule
            value.__signature__ = inspect.signature(_convert)
        super().__setattr__(name, value)


def __getattr__(name: str) -> Any:
    if name == "convert":  # imported on first use: `import thinconv` stays light (CLI start-up)
        return importlib.import_module("thinconv.convert")
    if name in _LAZY or name == "open":  # `thinconv.open(path)` mirrors the built-in on purpose
        value = getattr(importlib.import_module(_LAZY.get(name, "thinconv.format")),
                        "open_archive" if name == "open" else name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'thinconv' has no attribute {name!r}")


sys.modules[__name__].__class__ = _Package
